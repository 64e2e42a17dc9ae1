"""Multi-rank test harness: pools of real gloo processes, reused across tests.

``run(world_size, fn, *args)`` runs ``fn(*args)`` on every rank of a pool of ``world_size``
processes (one pool per world size, created on first use) and returns the per-rank
results in rank order. ``fn`` must be importable (a module-level function). A failure on any rank
raises with that rank's traceback, a rank whose process is gone with its exit code (at once: its
peers would wait for it); a job that does not finish within ``timeout`` seconds (a hung
collective) raises ``TimeoutError``. After a timeout or any failure other than a ``ValueError`` on
the failing ranks, the pool is killed and the next job gets a fresh one, so one broken test never
poisons the next; so is a pool whose ranks made more than :data:`GROUPS_KEPT` process groups.

A pool's processes are forked from multiprocessing's fork server, which imported :data:`PRELOAD`
once: a spawned process imported torch and the library anew, seconds of CPU each (a session
starts some twenty). Each starts with the environment of the process that made its pool, as a
spawned one would.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

from reshard.parallel.fault.fork_server import frozen_preload

JOB_TIMEOUT = float(os.environ.get("RESHARD_TEST_JOB_TIMEOUT", "180"))
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
DEATH_POLL_S = 0.5  # how often a job's wait looks for a rank whose process is gone
# a pool whose ranks made more process groups than this is retired after its job (the next job
# gets fresh processes): gloo keeps three threads per group, and they are not idle. A test pool
# held 275 groups after six test files, each rank then burning 15% of a core with nothing to run,
# which slowed every later test. (Destroying a job's groups instead is not safe: DTensor caches
# sharding by mesh equality, so an equal mesh of the next job would be handed the dead groups.)
GROUPS_KEPT = 48
# the test models' Hugging Face modules (a rank builds its model from them: a second or two of
# imports, once per process otherwise)
FAMILIES = [f"transformers.models.{f}.modeling_{f}" for f in ("llama", "qwen2", "qwen3", "mistral")]
# imported with the collector paused, then frozen (as a supervised rank's server does)
PRELOAD = list(frozen_preload(["torch", "torch.distributed", "transformers", "reshard.parallel", *FAMILIES]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, env: dict[str, str], tasks, results) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack to stderr

    os.environ.clear()  # the fork server's, from when it started: the pool's maker's instead
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    while True:
        job = tasks.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            value, ok = fn(*args, **kwargs), True
        except BaseException:
            value, ok = traceback.format_exc(), False
        results.put((rank, ok, value, dist.get_pg_count()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # (no effect once the server runs)
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.healthy = True
        self.groups = 0  # the most process groups a rank of the pool has made
        port, env = _free_port(), dict(os.environ)
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, env, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, {}
        for _ in range(self.world_size):
            rank, ok, value, groups = self._next(timeout or JOB_TIMEOUT, fn)
            self.groups = max(self.groups, groups)
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors:
            self.healthy = all(_last_line(tb).startswith("ValueError") for tb in errors.values())
            raise RuntimeError(
                f"{fn.__name__} failed on ranks {sorted(errors)}:\n"
                + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return out

    def _next(self, timeout: float, fn):
        """The next rank's result; ``RuntimeError`` as soon as a rank's process is gone (its peers
        would wait for it until ``timeout``), ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(queue.Empty):
                return self.results.get(timeout=max(0.0, min(DEATH_POLL_S, deadline - time.monotonic())))
            dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
            if dead:
                self.healthy = False
                raise RuntimeError(f"{fn.__name__}: rank(s) {sorted(dead)} exited (exit codes {dead}) before finishing")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{fn.__name__} did not finish on {self.world_size} ranks within {timeout:.0f} s (hung collective?)"
                )

    def alive(self) -> bool:
        return self.healthy and all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_POOLS: dict[int, WorkerPool] = {}


def run(world_size: int, fn, *args, timeout: float | None = None, fresh: bool = False, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; returns results in rank order.
    ``fresh``: in a new pool (processes that ran no earlier test)."""
    pool = _POOLS.get(world_size)
    if pool is not None and (fresh or pool.groups > GROUPS_KEPT):
        _POOLS.pop(world_size)
        pool.shutdown()
        pool = None
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = WorkerPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except BaseException:
        if not pool.healthy or not isinstance(sys.exc_info()[1], RuntimeError):
            _POOLS.pop(world_size, None)  # a rank may be stuck in, or broken by, a collective
            pool.shutdown()
        raise


def _last_line(tb: str) -> str:
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def retire(world_size: int) -> None:
    """End the pool of ``world_size`` (the next job gets fresh processes): after a job that leaves
    process-wide state behind (a framework's singletons, global seeds)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.shutdown()


@atexit.register
def shutdown_all() -> None:
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
