"""Where a layout's requests hold their KV: :class:`SlotPool`, the free slots and (paged) free
blocks of every data-parallel replica, the same books on every rank so every rank admits alike."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from reshard.kv import KVCache
from reshard.parallel.engine.prefix import WAIT, PrefixCache
from reshard.parallel.engine.request import EngineStats, Request, Sequence


class SlotPool:
    """Free KV slots (and, paged, free blocks) of every data-parallel replica of one layout (the
    same on every rank, so every rank admits alike).

    Slots are handed out alternating over the replicas, so replicas stay balanced. With a paged
    cache a sequence also takes the blocks for all its tokens (prompt + ``max_new_tokens``) at
    admission, so it never runs out mid-generation, and gives them back when it finishes; with
    ``grows`` (a scheduler that preempts) it takes its prompt's blocks at admission and one more
    block as its tokens reach it (:meth:`grow`), as vLLM's block manager does. With ``prefix``
    (paged) full blocks are cached by the tokens they hold and shared
    (:class:`reshard.parallel.engine.prefix.PrefixCache`).
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
        prefix: bool = False,
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
        self.prefix = PrefixCache(self.free_blocks, block_size) if prefix and self.free_blocks is not None else None
        self.slots = slots_per_replica * replicas

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
        if more <= 0:  # (most steps: the last block has room)
            return True
        if more > self.available(seq.replica):
            return False
        seq.blocks += self._new_blocks(seq.replica, more)
        return True

    def can_take(self, request: Request, within: range | None = None) -> bool:
        """A free slot (in ``within``, slots of the first replica, if given), and on its replica
        enough free blocks for the whole sequence (less the cached blocks it shares)."""
        i = self._next_free(within, request)
        if i is None:
            return False
        if self.free_blocks is None:
            return True
        replica = self.free[i] // self.per
        shared = self._shared(request, replica, self._keys(request))
        shared = [] if shared == WAIT else shared  # (it waits for them: take says so)
        return self.available(replica, shared) >= self.blocks_needed(request) - len(shared)

    def _next_free(self, within: range | None, request: Request | None = None) -> int | None:
        """Index into :attr:`free` of the slot :meth:`take` hands out next (None: none): the last
        free one (in ``within``: slots of the first replica, if given); with a prefix cache over
        several replicas, the last free one of the replica holding most of ``request``'s prompt
        (cached, or being computed: it waits there), as the router places requests over groups."""
        free = [i for i in reversed(range(len(self.free))) if within is None or self.free[i] in within]
        if not free or request is None or self.prefix is None or len(self.free_blocks) == 1:
            return free[0] if free else None
        keys, held = self._keys(request), {}
        for replica in {self.free[i] // self.per for i in free}:
            shared = self._shared(request, replica, keys)
            held[replica] = len(keys) + 1 if shared == WAIT else len(shared)
        return max(free, key=lambda i: held[self.free[i] // self.per])  # (ties: the usual order)

    def take(self, seq: Sequence, within: range | None = None) -> int:
        """A slot (and, paged, the blocks) for ``seq``; returns how many of its prompt's tokens
        cached blocks hold (its KV from there on is computed), or :data:`WAIT` (the slot only:
        give it back) where the blocks it would share are still being computed."""
        i = self._next_free(within, seq.request)
        assert i is not None, f"no free slot in {within}"
        seq.replica, seq.slot = divmod(self.free.pop(i), self.per)
        if self.free_blocks is None:
            return 0
        keys = self._keys(seq.request)
        shared = self._shared(seq.request, seq.replica, keys)
        if shared == WAIT:
            return WAIT
        if self.prefix is not None:
            self.prefix.hold(seq.replica, shared)
            self._count(seq.replica, len(shared))
        seq.blocks = shared + self._new_blocks(seq.replica, self.blocks_needed(seq.request) - len(shared))
        for j in range(len(shared), len(keys)):  # the prompt's full blocks it computes: shared once computed
            self.prefix.key(seq.replica, seq.blocks[j], keys[j], pending=True)
        seq.block_keys = keys
        if self.stats is not None and self.prefix is not None:
            self.stats.prefix_cache_queries += seq.prompt_len
            self.stats.prefix_cache_hits += len(shared) * self.block_size
        return len(shared) * self.block_size

    def unask(self, seq: Sequence) -> None:
        """``seq``'s admission is undone before it ran (it is admitted again later): its prefix-cache
        query is not counted twice, nor the hits it gives back."""
        if self.stats is not None and self.prefix is not None:
            self.stats.prefix_cache_queries -= seq.prompt_len
            self.stats.prefix_cache_hits -= seq.num_computed_tokens

    def computed(self, seq: Sequence, before: int) -> None:
        """``seq``'s KV is computed up to its ``num_computed_tokens`` (from ``before``): its full
        blocks there may be shared; blocks its decode filled are cached too."""
        if self.prefix is None:
            return
        bs, full = self.block_size, seq.num_computed_tokens // self.block_size
        if full == before // bs:  # (most decode steps: no block filled)
            return
        self.prefix.computed(seq.replica, seq.blocks[before // bs : full])
        keys = seq.block_keys
        if full > len(keys):
            tokens = [*seq.request.prompt_ids, *seq.output]
            new = self.prefix.chain(tokens, full - len(keys), keys[-1] if keys else None, first=len(keys))
            for j, key in enumerate(new, start=len(keys)):
                self.prefix.key(seq.replica, seq.blocks[j], key, pending=False)
            keys += new

    def shares_pending(self, request: Request) -> bool:
        """Whether ``request`` would share cached blocks still being computed (it waits for them)."""
        i = self._next_free(None, request)
        replica = 0 if i is None else self.free[i] // self.per
        return self.prefix is not None and self._shared(request, replica, self._keys(request)) == WAIT

    def reset_prefix(self, version: int) -> None:
        """Cached KV is of other weights (``version``) or overwritten: none is shared any more."""
        if self.prefix is not None:
            self.prefix.reset(version)

    def idle(self) -> bool:
        """Whether no sequence holds a slot or a block (a pool a new call may go on with)."""
        if len(self.free) != self.slots:
            return False
        replicas = range(len(self.free_blocks or ()))
        return all(self.available(r) == self.num_blocks for r in replicas)

    def _keys(self, request: Request) -> list[int]:
        """Keys of the request's full prompt blocks (none without a prefix cache)."""
        if self.prefix is None:
            return []
        return self.prefix.chain(request.prompt_ids, len(request.prompt_ids) // self.block_size)

    def _shared(self, request: Request, replica: int, keys: list[int]) -> list[int] | int:
        """Cached blocks the request shares (never its last prompt token's: it is computed, for
        its logits; none where its KV comes from elsewhere)."""
        if self.prefix is None or request.kv_source:
            return []
        return self.prefix.match(replica, keys[: (len(request.prompt_ids) - 1) // self.block_size])

    def available(self, replica: int, shared: list[int] = ()) -> int:
        """Blocks of ``replica`` a sequence may take: free ones and cached idle ones (less ``shared``)."""
        if self.prefix is None:
            return len(self.free_blocks[replica])
        return self.prefix.available(replica, shared)

    def _new_blocks(self, replica: int, count: int) -> list[int]:
        """``count`` blocks of ``replica`` a sequence takes (a cached idle one evicted where none is free)."""
        pool = self.free_blocks[replica]
        blocks = [pool.pop() if self.prefix is None else self.prefix.take(replica) for _ in range(max(count, 0))]
        self._count(replica, len(blocks))
        return blocks

    def _count(self, replica: int, taken: int) -> None:
        """Blocks sequences took (shared ones too) and the most in use at once in one replica."""
        if self.stats is None or not taken:
            return
        self.stats.kv_blocks_allocated += taken
        self.stats.kv_blocks_peak = max(self.stats.kv_blocks_peak, self.num_blocks - self.available(replica))

    def room(self, max_seq_len: int) -> tuple[int, int]:
        """(free slots, free KV tokens) of the first replica: a contiguous slot holds
        ``max_seq_len`` tokens; a paged replica has its free blocks."""
        if self.free_blocks is None:
            return len(self.free), len(self.free) * max_seq_len
        return len(self.free), self.available(0) * self.block_size  # (cached idle blocks are room too)

    def give(self, seq: Sequence) -> None:
        self.free.append(seq.replica * self.per + seq.slot)
        if self.free_blocks is None:
            return
        if self.prefix is None:
            self.free_blocks[seq.replica].extend(reversed(seq.blocks))
        else:
            self.prefix.release(seq.replica, seq.blocks[::-1])
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
