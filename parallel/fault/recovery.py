"""Recovery after a rank dies: KV replicated around the ring, a token journal, replay.

While generating, every rank's KV is mirrored on its ring successor (:class:`RingReplication`)
into a shared-memory file, whose acknowledged step is kept beside it, and rank 0 appends every
step's agreed tokens to a journal in the same directory. All of it plugs into the engine's events:
``step_ready`` (failure injection), ``step_end`` / ``idle`` (the ring), ``step_agreed`` (journal,
acknowledgements, the KV restore after the replay) and ``known_tokens`` (the replay: the engine
computes nothing for a step whose tokens the journal supplies and skips its KV moves).

When a rank is killed (or hangs and the heartbeats declare it dead), torchrun tears the job down
and starts every rank again (``--max-restarts``); the new ranks reload the weights, replay the
journal up to the lowest step every mirror acknowledged without compute, restore each rank's KV
from the mirror its successor kept, and recompute at most ``replicate_every`` steps (the ring
sends that many steps' entries per message). On one machine the mirrors
live in shared memory so a whole-job restart keeps them; across machines they would live in the
successor's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from reshard.kv import KVCache, KVSpec
from reshard.mesh import device_type
from reshard.parallel.engine import Engine
from reshard.parallel.fault.heartbeat import Heartbeat
from reshard.parallel.fault.inject import die
from reshard.parallel.fault.restart import job_store
from reshard.parallel.fault.ring import RingReplication
from reshard.shm import job_directory, map_file, remove_directory
from reshard.shm import remove_orphans as _remove_orphans

JOB_PREFIX = "reshard-ft-"  # a job's shared-memory directory: JOB_PREFIX + run_id


def shared_cache(spec: KVSpec, path: Path) -> KVCache:
    """A KV cache whose K/V live in the shared-memory file ``path`` (kept when the process dies;
    an existing file's contents are kept)."""
    return KVCache(spec, storage=map_file(path, spec.bytes))


class FaultTolerance:
    """Ring replication, journal and recovery for ``engine``.

    The replicated cache is the decode runner's (the only runner's for TP and pipelines); runners
    sharing it (Shift's two modes) stream into the same mirror. A runner with a cache of its own
    is covered only when its KV reaches the decode cache through one of the engine's
    ``host_tiers``, which move into the job's shared-memory directory (Seesaw's prefill: prompts
    go to the CPU tier, then are swapped into the decode cache, where the ring streams them whole).

    ``run_id``: names the shared-memory directory of the job's mirrors, acknowledgements and
    journal (the same in every attempt); ``kill_at``: ``(rank, step)`` SIGKILLs that rank before
    that step of this attempt (fault injection; a step the recovery replays is a failure during
    recovery), or with ``hang`` stops it there for good, heartbeats included; ``attempt`` /
    ``max_restarts``: torchrun's counts (after the last attempt a failure ends the job: the files
    go and :meth:`on_failure` says so, adding ``on_last_failure``); ``replicate_every``: steps
    whose KV entries the ring sends in one message (a failure recomputes at most that many).
    Collective: every rank builds it, on its main thread: it installs its own SIGTERM handler
    there and restores the one it replaced (a launcher's) when it ends, by :meth:`close`, by
    :meth:`abandon` or leaving a ``with`` block (which keeps the files after a failure: the next
    attempt recovers from them).
    """

    def __init__(
        self,
        engine: Engine,
        run_id: str,
        *,
        kill_at: tuple[int, int] | None = None,
        hang: bool = False,
        attempt: int = 0,
        max_restarts: int = 0,
        heartbeat_s: float = 1.0,
        on_last_failure: str = "",
        replicate_every: int = 1,
    ) -> None:
        if replicate_every < 1:
            raise ValueError(f"replicate_every must be >= 1 (steps per message), got {replicate_every}")
        self.rank, self.attempt = dist.get_rank(), attempt
        layout = _replicated_layout(engine)
        if self.rank == 0 and attempt == 0:
            remove_orphans()
        dist.barrier()
        # owned by torchrun's agent: the job lives while it does
        self.shm = job_directory(JOB_PREFIX + run_id, owner=os.getppid())
        self.journal = self.shm / "journal.jsonl"
        for name, tier in engine.host_tiers.items():  # a restarted job finds the prompts they held
            tier.remap(self.shm / f"kv-tier-{name}")
        self.cache = engine.runners[layout].kv
        self.ring = RingReplication(
            engine,
            layout=layout,
            mirror_at=lambda spec, source: shared_cache(spec, self._mirror(source)),
            replicate_every=replicate_every,
        )
        self.kill_at, self.hang = kill_at, hang
        self.last_attempt, self.on_last_failure = attempt >= max_restarts, on_last_failure
        self.recovered_from = 0
        self.recomputed_steps = 0
        self._streamed: list[int] = []  # engine step index of every step this attempt computed
        self._ack_step = -1  # the step the ack file names (written when it changes)
        self._replay: list[list[int]] = []  # the journal's tokens of the first steps of this attempt
        engine.events.on("known_tokens", self._known)
        engine.events.on("step_ready", self._maybe_die)
        engine.events.on("step_agreed", self._record)
        self.heartbeat = Heartbeat(
            job_store(attempt), self.rank, dist.get_world_size(), period=heartbeat_s, on_dead=self._declare_dead
        )
        # torchrun stops the survivors of a failed rank with SIGTERM, maybe before they reach a
        # collective that fails: that is when they learn of it
        self._replaced_sigterm = signal.signal(signal.SIGTERM, self._terminated)
        self._sigterm_restored = False

    def _mirror(self, source: int) -> Path:
        return self.shm / f"mirror-of-{source}"

    def _ack_file(self, source: int) -> Path:
        return self.shm / f"ack-of-{source}"

    # ---- while generating ---------------------------------------------------------------------
    def _known(self, index: int, step) -> list[int] | None:
        """The journal's tokens of a step the recovery replays (None: the step computes)."""
        return self._replay[index] if index < len(self._replay) else None

    def _maybe_die(self, index: int, step) -> None:
        if self.kill_at is not None and self.kill_at == (self.rank, index):
            (self.shm / f"killed-at-{self.attempt}").write_text(repr(time.time()))
            if self.hang:
                self.heartbeat.stop()  # silent from here on, like a process stuck in a kernel
                threading.Event().wait()  # until torchrun terminates it
            die()

    def _record(self, index: int, step, tokens: list[int]) -> None:
        """Journal the step's tokens (rank 0) and the mirror's acknowledged step (every rank)."""
        if index < self.recovered_from:  # replayed: journalled and mirrored already
            if index == self.recovered_from - 1:
                self._restore()
            return
        if self.rank == 0:
            with open(self.journal, "a") as f:
                f.write(json.dumps({"step": index, "tokens": tokens}) + "\n")
        ring = self.ring
        if ring.stream.steps > len(self._streamed):  # the ring took part in this step
            self._streamed.append(index)
        else:  # a step that leaves the replicated cache alone (Seesaw's prefill): what is gathered leaves now
            ring.drain()
        assert ring.stream.steps == len(self._streamed), (ring.stream.steps, self._streamed)
        acked = self._last_in_mirror(index, ring.landed)
        if acked != self._ack_step:
            self._ack_step = acked
            self._ack_file(ring.source).write_text(str(acked))

    def _last_in_mirror(self, index: int, landed: int) -> int:
        """The last step (up to ``index``) whose KV entries are all in the mirror: the one before
        the first of the ring's steps whose message has not landed (``landed``: the ring's steps
        that have), or ``index`` when all have (steps the ring skips leave the cache alone)."""
        return index if landed == len(self._streamed) else self._streamed[landed] - 1

    # ---- after a restart ------------------------------------------------------------------------
    def recover(self) -> int:
        """Queue the journal's tokens up to the lowest step every mirror acknowledged and, once
        those steps are replayed, restore this rank's KV from its successor's mirror; returns
        that step (0: nothing to recover)."""
        steps = self._journal()
        acked = torch.tensor([self._acked(self.rank)], dtype=torch.long, device=device_type())
        dist.all_reduce(acked, op=dist.ReduceOp.MIN)
        resume = max(min(len(steps), int(acked.item()) + 1), 0)
        dist.barrier()  # every rank has read the journal before rank 0 trims it
        if self.rank == 0:
            self.journal.write_text(
                "".join(json.dumps({"step": i, "tokens": t}) + "\n" for i, t in enumerate(steps[:resume]))
            )
        self._replay = steps[:resume]
        self.recovered_from, self.recomputed_steps = resume, len(steps) - resume
        return resume

    def _restore(self) -> None:
        """The cache as the mirror holds it (after the last replayed step: a policy's replayed
        swaps and transitions leave the cache as they find it, so nothing overwrites this)."""
        if not self.cache.allocated:  # released (Seesaw between phases): no sequence holds KV in it
            return
        mine = shared_cache(self.cache.spec, self._mirror(self.rank))
        for dst, src in zip(self.cache.k + self.cache.v, mine.k + mine.v):
            dst.copy_(src)

    def killed_at(self) -> float | None:
        """When the previous attempt's injected kill fired."""
        return self._time(f"killed-at-{self.attempt - 1}")

    def detected_by(self) -> dict | None:
        """How the first survivor of the previous attempt noticed the failure (:meth:`on_failure`'s
        ``how`` and ``silent_checks``); None: no survivor recorded it."""
        path = self.shm / f"detected-by-{self.attempt - 1}"
        if not path.exists():
            return None
        how, checks = json.loads(path.read_text())
        return {"how": how, "silent_checks": checks}

    def detected_after(self) -> float | None:
        """Seconds from the injected kill to the first survivor noticing (heartbeat or a failed
        collective), from the previous attempt's records."""
        killed, detected = self.killed_at(), self._time(f"detected-at-{self.attempt - 1}")
        return None if killed is None or detected is None else detected - killed

    def on_failure(self, cause: str, *, how: str = "collective", silent_checks: int | None = None) -> None:
        """This rank saw a peer fail (``cause``: in words; ``how``: ``"collective"`` (one failed),
        ``"heartbeat"`` (a peer declared dead after ``silent_checks`` checks that found its
        counter still) or ``"torchrun"`` (the agent stopped this rank)): record when and how (the
        first survivor per attempt) and say, once per attempt, what comes next. After the last
        attempt the job's files are removed: no later attempt would read them."""
        path = self.shm / f"detected-at-{self.attempt}"
        if not path.exists():
            with contextlib.suppress(OSError):  # another survivor of the last attempt removed the files
                path.write_text(repr(time.time()))
                (self.shm / f"detected-by-{self.attempt}").write_text(json.dumps([how, silent_checks]))
        first = self._claim(f"reported-{self.attempt}")
        if self.last_attempt:
            remove_directory(self.shm)
            next_ = f"it was the last attempt torchrun allows, the job ends. {self.on_last_failure}"
        else:
            next_ = "torchrun restarts the job and recovery resumes from the ring's KV mirrors"
        if first:
            print(f"reshard: {cause} in attempt {self.attempt}: {next_}".rstrip(), file=sys.stderr, flush=True)

    def _claim(self, name: str) -> bool:
        """True for the first rank of the node to claim ``name`` (the store may have died with a rank)."""
        try:
            os.close(os.open(self.shm / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except OSError:  # claimed, or the files are gone: another survivor reported
            return False

    def _terminated(self, signum: int, frame) -> None:
        self.on_failure(f"torchrun stopped rank {self.rank} (another rank failed)", how="torchrun")
        os._exit(128 + signum)

    def _declare_dead(self, rank: int, silent: float) -> None:
        checks = _silent_checks(self.heartbeat.events, rank)
        self.on_failure(f"rank {rank} silent for {silent:.1f} s, declared dead", how="heartbeat", silent_checks=checks)
        os._exit(3)  # leave the job: no survivor waits in a collective for a rank that hangs

    def _time(self, name: str) -> float | None:
        path = self.shm / name
        return float(path.read_text()) if path.exists() else None

    def _journal(self) -> list[list[int]]:
        if not self.journal.exists():
            return []
        lines = [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]
        return [entry["tokens"] for entry in lines]

    def _acked(self, source: int) -> int:
        path = self._ack_file(source)
        return int(path.read_text()) if path.exists() else -1

    def abandon(self) -> None:
        """The job was interrupted (Ctrl-C, SIGTERM from a launcher): no attempt will recover from
        the mirrors, so stop the threads and remove the shared-memory files (every rank; no collective)."""
        self.heartbeat.stop()
        self._restore_sigterm()
        remove_directory(self.shm)

    def close(self) -> None:
        """After a successful run: remove the shared-memory files (collective)."""
        self.heartbeat.stop()
        self.ring.close()
        dist.barrier()
        self._restore_sigterm()
        if self.rank == 0:
            remove_directory(self.shm)

    def _restore_sigterm(self) -> None:
        """Give SIGTERM back to the handler this object replaced (once)."""
        if not self._sigterm_restored:
            # None: a handler installed outside Python, which Python cannot reinstall
            replaced = signal.SIG_DFL if self._replaced_sigterm is None else self._replaced_sigterm
            signal.signal(signal.SIGTERM, replaced)
            self._sigterm_restored = True

    def __enter__(self) -> FaultTolerance:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """No error: :meth:`close`; Ctrl-C or a launcher's SIGTERM: :meth:`abandon`; another
        error (a peer died mid-collective): the heartbeats and the handler go, the files stay for
        the next attempt (the ring is not drained: its peer may be the one that died)."""
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.abandon()
        else:
            self.heartbeat.stop()
            self._restore_sigterm()


def remove_orphans(root: Path | None = None) -> list[Path]:
    """Remove the directories of jobs whose torchrun agent is gone (a job killed from outside
    never reaches its own clean-up); returns them. ``root``: default the shared-memory root."""
    return _remove_orphans(JOB_PREFIX, root)


def _replicated_layout(engine: Engine) -> str:
    """The layout whose cache is replicated: the decode runner's (the only one for TP and
    pipelines); ``ValueError`` for a paged cache or a runner with KV of its own that nothing covers."""
    runners = engine.runners
    name = "decode" if "decode" in runners else next(iter(runners))
    runner = runners[name]
    uncovered = sorted(n for n, r in runners.items() if r.kv is not runner.kv and n not in engine.host_tiers)
    if uncovered:
        raise ValueError(
            f"fault tolerance replicates the {name!r} runner's KV cache; runners {uncovered} "
            f"keep KV of their own that nothing replicates"
        )
    if runner.kv.spec.paged:
        raise ValueError(
            f"fault tolerance needs a contiguous KV cache; the {name!r} runner's is paged "
            f"(kv_block_size={runner.kv.spec.block_size}): drop engine.kv_block_size"
        )
    return name


def _silent_checks(events, rank: int) -> int:
    """The checks, up to and including the one that declared ``rank`` dead, that found its counter
    where it was (the :class:`Heartbeat` records after its last ``beat``)."""
    mine = [kind for kind, r, _ in list(events) if r == rank]
    last_beat = max((i for i, kind in enumerate(mine) if kind == "beat"), default=-1)
    return len(mine) - 1 - last_beat
