"""Recovery after a rank dies: KV replicated around the ring, a token journal, replay.

While generating, every rank's KV is mirrored on its ring successor (:class:`RingReplication`)
into a shared-memory file, whose acknowledged step is kept beside it, and rank 0 appends every
step's agreed tokens to a journal in the run directory. When a rank is killed, torchrun tears the
job down and starts every rank again (``--max-restarts``); the new ranks reload the weights,
restore each rank's KV from the mirror its successor kept, and resume from the lowest step every
mirror acknowledged: the steps before it are replayed from the journal without compute (their KV
is back), at most one step is recomputed. On one machine the mirrors live in shared memory so a
whole-job restart keeps them; across machines they would live in the successor's memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from reshard.kv import KVCache

from .engine import Engine
from .replication import RingReplication


def shared_cache(spec, path: Path) -> KVCache:
    """A KV cache whose K/V live in the shared-memory file ``path`` (kept when the process dies;
    an existing file's contents are kept)."""
    cache = KVCache(dataclasses.replace(spec), device="cpu")
    per = spec.bytes // (2 * spec.num_layers)  # one layer's K (or V) in bytes
    pool = torch.from_file(str(path), shared=True, size=spec.bytes, dtype=torch.uint8)
    views = [pool[i * per:(i + 1) * per].view(spec.dtype).view(spec.shape) for i in range(2 * spec.num_layers)]
    cache.k, cache.v = views[:spec.num_layers], views[spec.num_layers:]
    return cache


class FaultTolerance:
    """Ring replication, journal and recovery for ``engine`` (one TP replica, contiguous KV).

    ``run_id``: names the shared-memory directory of the job's mirrors, acknowledgements and
    journal (the same in every attempt); ``kill_at``: ``(rank, step)`` SIGKILLs that rank before
    that step on the first attempt (fault injection). Collective: every rank builds it.
    """

    def __init__(self, engine: Engine, run_id: str, *, kill_at: tuple[int, int] | None = None,
                 attempt: int = 0) -> None:
        runner = engine.runner
        if runner.kv.spec.paged or len(engine.runners) != 1:
            raise ValueError("fault tolerance runs one layout with contiguous KV slots (parallel=tp, no kv_block_size)")
        self.engine, self.rank, self.attempt = engine, dist.get_rank(), attempt
        self.shm = Path("/dev/shm") / f"reshard-ft-{run_id}"
        self.shm.mkdir(exist_ok=True)
        self.journal = self.shm / "journal.jsonl"
        self.ring = RingReplication(runner, mirror_at=lambda spec, source: shared_cache(spec, self._mirror(source)))
        self.kill_at = kill_at if attempt == 0 else None
        self.recovered_from, self.recomputed_steps, self._streamed = 0, 0, []
        engine.pre_step_hooks.append(self._maybe_die)
        engine.post_step_hooks.append(self._record)

    def _mirror(self, source: int) -> Path:
        return self.shm / f"mirror-of-{source}"

    def _ack_file(self, source: int) -> Path:
        return self.shm / f"ack-of-{source}"

    # ---- while generating ---------------------------------------------------------------------
    def _maybe_die(self, index: int, step) -> None:
        if self.kill_at is not None and self.kill_at == (self.rank, index):
            (self.shm / "killed-at").write_text(repr(time.time()))
            _die()

    def _record(self, index: int, step, tokens: list[int]) -> None:
        """Journal the step's tokens (rank 0) and the mirror's acknowledged step (every rank)."""
        if index < self.recovered_from:  # replayed: journalled and mirrored already
            return
        if self.rank == 0:
            with open(self.journal, "a") as f:
                f.write(json.dumps({"step": index, "tokens": tokens}) + "\n")
        self._streamed.append(index)
        if len(self._streamed) >= 2:  # this step's step_end drained the previous step's jobs
            self._ack_file(self.ring.source).write_text(str(self._streamed[-2]))

    # ---- after a restart ------------------------------------------------------------------------
    def recover(self) -> int:
        """Restore this rank's KV from its successor's mirror and queue the journal's tokens up
        to the lowest step every mirror acknowledged; returns that step (0: nothing to recover)."""
        steps = self._journal()
        acked = torch.tensor([self._acked(self.rank)], dtype=torch.long)
        dist.all_reduce(acked, op=dist.ReduceOp.MIN)
        resume = max(min(len(steps), int(acked.item()) + 1), 0)
        if resume:
            mine = shared_cache(self.engine.kv.spec, self._mirror(self.rank))
            for dst, src in zip(self.engine.kv.k + self.engine.kv.v, mine.k + mine.v):
                dst.copy_(src)
        dist.barrier()  # every rank has read the journal before rank 0 trims it
        if self.rank == 0:
            self.journal.write_text("".join(json.dumps({"step": i, "tokens": t}) + "\n"
                                            for i, t in enumerate(steps[:resume])))
        self.engine.replay.extend(steps[:resume])
        self.recovered_from, self.recomputed_steps = resume, len(steps) - resume
        return resume

    def killed_at(self) -> float | None:
        path = self.shm / "killed-at"
        return float(path.read_text()) if path.exists() else None

    def _journal(self) -> list[list[int]]:
        if not self.journal.exists():
            return []
        lines = [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]
        return [entry["tokens"] for entry in lines]

    def _acked(self, source: int) -> int:
        path = self._ack_file(source)
        return int(path.read_text()) if path.exists() else -1

    def close(self) -> None:
        """After a successful run: remove the shared-memory files."""
        self.ring.close()
        dist.barrier()
        if self.rank == 0:
            for path in self.shm.iterdir():
                path.unlink(missing_ok=True)
            self.shm.rmdir()


def inject_kill(kill_at: tuple[int, int]):
    """A pre-step hook that SIGKILLs rank ``kill_at[0]`` before step ``kill_at[1]``."""
    def hook(index: int, step) -> None:
        if (dist.get_rank(), index) == tuple(kill_at):
            _die()
    return hook


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # fault injection: no cleanup, as a crash


def restart_count() -> int:
    """Which attempt of the job this is (torchrun counts restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
