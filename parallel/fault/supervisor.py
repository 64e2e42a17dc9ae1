"""Supervised ranks: the process torchrun watches stays alive when its rank's engine dies.

Under ``fault.migrate`` every torchrun worker is a :class:`Supervisor`: it runs the rank's engine
as a child process and, when the child dies (killed, crashed), records the failure in the job's
store and starts another child in the next *generation* of its engine group. torchrun sees no
failure (``TORCHELASTIC_RESTART_COUNT`` stays 0) and the other groups never stop. The ranks of a
group restart together: one member's death moves the group's generation on in the store and
every member's supervisor replaces its child (a tensor-parallel shard is useless without the
dead rank's). A child's process group is its group's own, named by the generation
(:func:`group_store_prefix`), so a new generation never meets the old one's connections.

The store keys (under the job's ``reshard/isolated/`` prefix): ``gen/<group>`` (the group's
generation), ``failures`` (a counter) and ``failure/<k>`` (a :class:`Failure`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

POLL_S = 0.05  # how often a supervisor looks at its child and its group's generation
PEER_GRACE_S = 1.0  # a child that raised is a peer's casualty if its group moves on within this


@dataclass(frozen=True)
class ChildSpec:
    """What a child engine process is: ``rank`` of the job, in engine ``group`` (over
    ``members``), at ``generation`` (0: the first; each failure of the group adds one)."""

    rank: int
    group: int
    members: tuple[int, ...]
    generation: int

    @property
    def endpoint(self) -> str:
        """The router's name for this incarnation of the group."""
        return f"{self.group}.{self.generation}"


@dataclass(frozen=True)
class Failure:
    """A child that died: its rank, group and generation, its exit code (negative: the signal)
    and when its supervisor saw it (``time.time()``)."""

    rank: int
    group: int
    generation: int
    exitcode: int
    seen_at: float
    hung: bool = False  # killed by its supervisor: its group's heartbeat went silent


def group_store_prefix(spec: ChildSpec) -> str:
    """The store prefix of ``spec``'s process groups: one per (group, generation)."""
    return f"reshard/isolated/pg/group{spec.group}/gen{spec.generation}"


class Supervisor:
    """Runs ``target(spec, *args)`` in a child process for this ``rank`` of engine ``group``
    (``members``: its ranks) and replaces it when it dies, up to ``max_respawns`` times.

    ``store``: the job's store (the supervisors' and children's control plane); once ``done()``, a
    child that is not ``ready`` yet is not needed and is stopped. :meth:`run`
    returns once the child exits with status 0; a child that dies moves the group's generation
    on (the first member to see it); a member whose group moved on kills its own child and starts
    one in the new generation. SIGINT/SIGTERM stop the child and end the supervisor (nothing is
    respawned). ``silent(spec)``: seconds since the child's group last showed life (None: not
    yet); a child silent for more than ``hung_after`` seconds is killed as hung (a death like
    any other). ``failures``: the deaths this supervisor saw.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        group: int,
        members: tuple[int, ...],
        target: Callable,
        args: tuple = (),
        *,
        max_respawns: int = 3,
        warm_spare: bool = True,
        ready: Callable[[ChildSpec], bool] | None = None,
        warm: tuple[str, ...] = (),
        log: Callable[[dict], None] | None = None,
        done: Callable[[], bool] | None = None,
        silent: Callable[[ChildSpec], float | None] | None = None,
        hung_after: float = float("inf"),
    ) -> None:
        self.store, self.rank, self.group, self.members = store, rank, group, tuple(members)
        self.target, self.args, self.max_respawns = target, args, max_respawns
        self.warm_spare, self.ready, self.warm = warm_spare, ready or (lambda spec: True), warm
        self._spare: _Spare | None = None
        self.log = log or (lambda event: None)
        self.done = done or (lambda: False)
        self.silent, self.hung_after, self._hung = silent or (lambda spec: None), hung_after, False
        self.served = False  # some child of this rank became ready
        self.failures: list[Failure] = []
        self.respawns = 0
        self._stopping = False
        self._child: mp.process.BaseProcess | None = None
        store.compare_set(self._gen_key, "", "0")  # the first member to get here starts the count

    @property
    def _gen_key(self) -> str:
        return f"gen/{self.group}"

    def generation(self) -> int:
        """The group's current generation, as the store holds it."""
        return int(self.store.get(self._gen_key))

    def run(self, stop_on: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        """Run children until one exits with status 0 (``RuntimeError`` after ``max_respawns``
        replacements; ``KeyboardInterrupt`` / ``SystemExit`` on the ``stop_on`` signals). Their
        handlers are installed here, on the calling (main) thread, and the ones they replaced are
        back when it returns or raises (a server leaves SIGTERM to its drain)."""
        previous = {s: signal.signal(s, self._stop) for s in stop_on}
        try:
            generation = self.generation()
            while True:
                code = self._run_child(ChildSpec(self.rank, self.group, self.members, generation))
                if code == 0:
                    return
                if not self.served and code is not None:  # a start-up error, not a failure to recover from
                    raise RuntimeError(
                        f"rank {self.rank}: its engine failed before it could serve (exit code {code}; its "
                        "error is printed above); nothing is respawned"
                    )
                generation = self._next_generation(generation, code)
        finally:
            for s, handler in previous.items():  # None: installed outside Python, not reinstallable
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            self._kill(spare=True)

    def _run_child(self, spec: ChildSpec) -> int | None:
        """Start ``spec``'s child (in the warm spare if there is one) and wait: its exit code, or
        None when the group moved on without it (it was killed here). Once the child is
        ``ready``, a spare is started for the next generation (``warm_spare``)."""
        spare, self._spare = self._spare or _Spare(f"reshard-rank{self.rank}", self.warm), None
        self._child = spare.assign(self.target, spec, self.args)
        self._event("started", spec, warm=spare.warmed_at is not None)  # warm: imports were done
        ready = False
        while True:
            self._child.join(POLL_S)
            if self._stopping:
                raise KeyboardInterrupt
            code = self._child.exitcode
            if code is not None and self.ready(spec):  # it served, if only for a moment
                self.served = True
            if code is not None and not self._after_peer(code, spec):
                self._event("exited", spec, code=code)
                return code
            if self.generation() > spec.generation:
                self._kill()
                self._event("replaced", spec)
                return None
            if not ready and self.ready(spec):
                ready = self.served = True
                self._event("ready", spec)
            if ready and self._is_hung(spec):
                return self._child.exitcode
            if not ready and self.done():  # the job finished while this child was starting
                self._kill()
                self._event("not needed", spec)
                return 0
            if self.warm_spare and self._spare is None and ready:
                self._spare = _Spare(f"reshard-spare{self.rank}", self.warm)
                self._event("spare", spec, spare=self._spare.process.pid)

    def _is_hung(self, spec: ChildSpec) -> bool:
        """Kill the child if its group has been silent too long (whether it was)."""
        silent = None if self.done() else self.silent(spec)  # (a finishing child beats no more)
        if silent is None or silent <= self.hung_after:
            return False
        self._kill()
        self._hung = True
        self._event("hung", spec, silent_s=round(silent, 3), code=self._child.exitcode)
        return True

    def _after_peer(self, code: int, spec: ChildSpec) -> bool:
        """Whether a child that raised (``code > 0``) did so because a peer of its group died:
        the group's generation moves on within ``PEER_GRACE_S`` (a killed child, ``code < 0``, is
        a failure of its own)."""
        deadline = time.monotonic() + PEER_GRACE_S
        while code > 0 and time.monotonic() < deadline:
            if self.generation() > spec.generation:
                return True
            time.sleep(POLL_S)
        return False

    def _event(self, what: str, spec: ChildSpec, **extra) -> None:
        self.log(
            {
                "t": time.time(),
                "event": what,
                "rank": self.rank,
                "endpoint": spec.endpoint,
                "pid": self._child.pid,
                **extra,
            }
        )

    def _next_generation(self, generation: int, code: int | None) -> int:
        """After a child ended without success: record its death (``code`` not None), move the
        group's generation on (once per generation, whichever member gets there first) and
        return the generation to start next."""
        if code is not None:
            failure = Failure(self.rank, self.group, generation, code, time.time(), hung=self._hung)
            self._hung = False
            self.failures.append(failure)
            k = self.store.add("failures", 1) - 1
            self.store.set(f"failure/{k}", pickle.dumps(failure))
            self.store.compare_set(self._gen_key, str(generation), str(generation + 1))
        self.respawns += 1
        if self.respawns > self.max_respawns:
            raise RuntimeError(
                f"rank {self.rank}: engine group {self.group} failed {self.respawns} times, more than "
                f"fault.max_respawns ({self.max_respawns}); last exit code {code}"
            )
        return self.generation()

    def _stop(self, signum: int, frame) -> None:
        self._stopping = True
        self._kill(spare=True)

    def _kill(self, *, spare: bool = False) -> None:
        """Kill the child (and the spare, ``spare``) if alive."""
        for child in (self._child, self._spare.process if spare and self._spare else None):
            if child is not None and child.exitcode is None:
                child.kill()
                child.join()


class _Spare:
    """A child process started ahead of need: it imports ``warm`` (modules) and waits for its
    work, so a respawn skips the imports (seconds of a child's start)."""

    def __init__(self, name: str, warm: tuple[str, ...]) -> None:
        ctx = _context(warm)
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_spare_main, args=(theirs, warm), name=name, daemon=True)
        self.process.start()
        self.started_at = time.time()
        self.warmed_at: float | None = None  # set when it is handed work after its imports
        theirs.close()

    def assign(self, target: Callable, spec: ChildSpec, args: tuple) -> mp.process.BaseProcess:
        """Run ``target(spec, *args)`` in it; returns its process."""
        if self.conn.poll():  # its imports are done
            self.warmed_at = float(self.conn.recv())
        self.conn.send((target, spec, args))
        self.conn.close()
        return self.process


def _context(warm: tuple[str, ...]) -> mp.context.BaseContext:
    """How children start: forked from this process's fork server, which imported the main
    module and ``warm`` once (a spawned child imports torch anew: seconds of CPU each). The
    server is this process's child with no threads of its own; it exits when this process does
    and its children die with it (:func:`_die_with_parent`)."""
    ctx = mp.get_context("forkserver")
    # (no effect once the server runs); last, the module that freezes what the server imported
    ctx.set_forkserver_preload(["__main__", *warm, "reshard.parallel.fault.frozen"])
    return ctx


def _spare_main(conn, warm: tuple[str, ...]) -> None:
    """A spare's entry: die with the supervisor, import ``warm``, then run the work it is sent."""
    import importlib

    _die_with_parent()
    # this process's entry point: Ctrl-C ends it at once, no traceback (the supervisor does the stopping)
    replaced = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        for module in warm:
            importlib.import_module(module)
        with contextlib.suppress(BrokenPipeError):  # the supervisor sent the work already and hung up
            conn.send(time.time())
        try:
            target, spec, args = conn.recv()
        except EOFError:  # the supervisor ended without using it
            return
        conn.close()
        _child_main(target, spec, args)
    finally:  # (a child's end is os._exit: only a spare that was not used gets here)
        signal.signal(signal.SIGINT, signal.SIG_DFL if replaced is None else replaced)


def failures(store: dist.Store) -> list[Failure]:
    """Every child death recorded in the job's ``store`` so far, in the order recorded."""
    count = store.add("failures", 0)
    return [pickle.loads(store.get(f"failure/{k}")) for k in range(count)]


def _child_main(target: Callable, spec: ChildSpec, args: tuple) -> None:
    """Run ``target``; an exception is a traceback and exit status 1 (not a hang). SIGUSR1 prints
    every thread's stack (a child that seems stuck)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        target(spec, *args)
        code = 0
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # the handler it replaced is back
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: threads blocked on links to dead peers stay where they are


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``; Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
