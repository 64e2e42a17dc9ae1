"""Where a layout's requests hold their KV: :class:`SlotPool`, the free slots and (paged) free
blocks of every data-parallel replica, the same books on every rank so every rank admits alike."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from reshard.kv import KVCache
from reshard.parallel.engine.request import EngineStats, Request, Sequence


class SlotPool:
    """Free KV slots (and, paged, free blocks) of every data-parallel replica of one layout (the
    same on every rank, so every rank admits alike).

    Slots are handed out alternating over the replicas, so replicas stay balanced. With a paged
    cache a sequence also takes the blocks for all its tokens (prompt + ``max_new_tokens``) at
    admission, so it never runs out mid-generation, and gives them back when it finishes; with
    ``grows`` (a scheduler that preempts) it takes its prompt's blocks at admission and one more
    block as its tokens reach it (:meth:`grow`), as vLLM's block manager does.
    """

    def __init__(
        self,
        slots_per_replica: int,
        replicas: int,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        stats: EngineStats | None = None,
        grows: bool = False,
    ) -> None:
        self.per = slots_per_replica
        self.block_size = block_size
        self.stats = stats
        self.free = [
            g * slots_per_replica + i for i in reversed(range(slots_per_replica)) for g in reversed(range(replicas))
        ]
        self.num_blocks = num_blocks
        self.free_blocks = [list(reversed(range(num_blocks))) for _ in range(replicas)] if num_blocks else None
        self.grows = grows and self.free_blocks is not None

    def __len__(self) -> int:
        return len(self.free)

    def blocks_needed(self, request: Request) -> int:
        """Blocks a request takes at admission: its prompt's (growing), else its whole sequence's."""
        tokens = len(request.prompt_ids) + (0 if self.grows else request.sampling.max_new_tokens)
        return -(-tokens // self.block_size) if self.block_size else 0

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for ``seq``'s first ``tokens`` positions, taken from its replica's free blocks;
        False (nothing taken) where too few are free."""
        more = -(-tokens // self.block_size) - len(seq.blocks)
        pool = self.free_blocks[seq.replica]
        if more > len(pool):
            return False
        seq.blocks += [pool.pop() for _ in range(max(more, 0))]
        if self.stats is not None and more > 0:
            self.stats.kv_blocks_allocated += more
            self.stats.kv_blocks_peak = max(self.stats.kv_blocks_peak, self.num_blocks - len(pool))
        return True

    def can_take(self, request: Request, within: range | None = None) -> bool:
        """A free slot (in ``within``, slots of the first replica, if given), and on its replica
        enough free blocks for the whole sequence."""
        i = self._next_free(within)
        if i is None:
            return False
        return self.free_blocks is None or len(self.free_blocks[self.free[i] // self.per]) >= self.blocks_needed(
            request
        )

    def _next_free(self, within: range | None) -> int | None:
        """Index into :attr:`free` of the slot :meth:`take` hands out next (None: none)."""
        if within is None:
            return len(self.free) - 1 if self.free else None
        return next((i for i in reversed(range(len(self.free))) if self.free[i] in within), None)

    def take(self, seq: Sequence, within: range | None = None) -> None:
        i = self._next_free(within)
        assert i is not None, f"no free slot in {within}"
        seq.replica, seq.slot = divmod(self.free.pop(i), self.per)
        if self.free_blocks is not None:
            pool = self.free_blocks[seq.replica]
            seq.blocks = [pool.pop() for _ in range(self.blocks_needed(seq.request))]
            if self.stats is not None:
                self.stats.kv_blocks_allocated += len(seq.blocks)
                self.stats.kv_blocks_peak = max(self.stats.kv_blocks_peak, self.num_blocks - len(pool))

    def room(self, max_seq_len: int) -> tuple[int, int]:
        """(free slots, free KV tokens) of the first replica: a contiguous slot holds
        ``max_seq_len`` tokens; a paged replica has its free blocks."""
        if self.free_blocks is None:
            return len(self.free), len(self.free) * max_seq_len
        return len(self.free), len(self.free_blocks[0]) * self.block_size

    def give(self, seq: Sequence) -> None:
        self.free.append(seq.replica * self.per + seq.slot)
        if self.free_blocks is not None:
            self.free_blocks[seq.replica].extend(reversed(seq.blocks))
            if self.stats is not None:
                self.stats.kv_blocks_freed += len(seq.blocks)
            seq.blocks = []


def check_fits(requests: Seq[Request], kv: KVCache) -> None:
    """``ValueError`` for a request whose KV could never fit in one replica's paged cache ``kv``."""
    spec = kv.spec
    for r in requests if spec.paged else ():
        tokens = len(r.prompt_ids) + r.sampling.max_new_tokens
        if spec.blocks_for(tokens) > spec.num_blocks:
            raise ValueError(
                f"request {r.id}: prompt length ({len(r.prompt_ids)}) + max_new_tokens "
                f"({r.sampling.max_new_tokens}) = {tokens} KV tokens needs "
                f"{spec.blocks_for(tokens)} blocks of {spec.block_size} but the paged cache "
                f"holds {spec.num_blocks} ({spec.capacity_tokens} tokens)"
            )
