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
from pathlib import Path

import torch.distributed as dist

from reshard.parallel.fault.fork_server import FromParent, frozen_preload

POLL_S = 0.05  # how often a supervisor looks at its child and its group's generation
PEER_GRACE_S = 1.0  # a child that raised is a peer's casualty if its group moves on within this
REPLACED_GRACE_S = 0.25  # a child whose group moved on may end on its own within this before it is killed


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

    A child's traceback (an exception ended it) comes to its supervisor, which appends it to
    ``recovered_log`` (the run directory's log of ranks' tracebacks; stderr without one), whether
    the group goes on without that child (a peer's casualty, a death it respawns) or the supervisor
    gives up (a start-up error, more than ``max_respawns`` deaths): then its ``RuntimeError``
    names the child's error in one line.
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
        recovered_log: Path | None = None,
    ) -> None:
        self.store, self.rank, self.group, self.members = store, rank, group, tuple(members)
        self.target, self.args, self.max_respawns = target, args, max_respawns
        self.warm_spare, self.ready, self.warm = warm_spare, ready or (lambda spec: True), warm
        self._spare: _Spare | None = None
        self.log = log or (lambda event: None)
        self.done = done or (lambda: False)
        self.silent, self.hung_after, self._hung = silent or (lambda spec: None), hung_after, False
        self.recovered_log = recovered_log
        self.served = False  # some child of this rank became ready
        self.failures: list[Failure] = []
        self.respawns = 0
        self._stopping = False
        self._child: mp.process.BaseProcess | None = None
        self._running: _Spare | None = None  # the process self._child runs in, and its pipe
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
                spec = ChildSpec(self.rank, self.group, self.members, generation)
                code = self._run_child(spec)
                said = self._running.close()
                if code == 0:
                    return
                if not self.served and code is not None:  # a start-up error, not a failure to recover from
                    where = self._keep(spec, said, f"failed before it could serve (exit code {code})")
                    raise RuntimeError(
                        f"rank {self.rank}: its engine failed before it could serve ({_how(code, said, where)}); "
                        "nothing is respawned"
                    )
                if self.respawns >= self.max_respawns:
                    self._give_up(spec, code, said)
                generation = self._next_generation(generation, code)
                how = "replaced after its group's peer died" if code is None else f"died (exit code {code}), respawned"
                self._keep(spec, said, how)
        finally:
            for s, handler in previous.items():  # None: installed outside Python, not reinstallable
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            self._kill(spare=True)
            if self._running is not None:
                self._running.close()

    def _run_child(self, spec: ChildSpec) -> int | None:
        """Start ``spec``'s child (in the warm spare if there is one) and wait: its exit code, or
        None when the group moved on without it (it was killed here). Once the child is
        ``ready``, a spare is started for the next generation (``warm_spare``)."""
        spare, self._spare = self._spare or _Spare(f"reshard-rank{self.rank}", self.warm), None
        self._running, self._child = spare, spare.assign(self.target, spec, self.args)
        self._event("started", spec, warm=spare.warmed_at is not None)  # warm: imports were done
        ready = False
        while True:
            self._child.join(POLL_S)
            spare.listen()  # (a child sending a long traceback waits for it)
            if self._stopping:
                raise KeyboardInterrupt
            code = self._child.exitcode
            if code is not None and self.ready(spec):  # it served, if only for a moment
                self.served = True
            if code is not None and not self._after_peer(code, spec):
                self._event("exited", spec, code=code)
                return code
            if self.generation() > spec.generation:
                self._await_end(spare, REPLACED_GRACE_S)  # a peer's casualty is raising: its traceback comes
                self._kill()
                self._event("replaced", spec, code=self._child.exitcode)  # (1: it raised; -9: killed here)
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

    def _await_end(self, spare: _Spare, seconds: float) -> None:
        """Wait up to ``seconds`` for the child to exit, taking what it says meanwhile
        (``KeyboardInterrupt`` on a stop signal, as :meth:`_run_child`)."""
        deadline = time.monotonic() + seconds
        while self._child.exitcode is None and time.monotonic() < deadline:
            self._child.join(POLL_S)
            spare.listen()
            if self._stopping:
                raise KeyboardInterrupt

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

    def _keep(self, spec: ChildSpec, said: str, how: str) -> str:
        """What ``spec``'s child said on its way out (its traceback), to :attr:`recovered_log` under
        a line naming it and ``how`` it ended (stderr without a log); returns where it went: ``in
        ranks.log`` or ``above`` ("" when it said nothing)."""
        if not said:
            return ""
        if self.recovered_log is None:
            _print(said)
            return "above"
        head = f"--- rank {self.rank}, engine group {spec.endpoint} (pid {self._child.pid}): {how}\n"
        fd = os.open(self.recovered_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (head + said).encode())  # one write: the other ranks' entries do not cut into it
        finally:
            os.close(fd)
        return f"in {self.recovered_log.name}"

    def _give_up(self, spec: ChildSpec, code: int | None, said: str) -> None:
        """Record the child's end like any death, keep what it said and raise the ``RuntimeError``
        that ends this rank: its group may not be respawned again (``max_respawns``). A child
        stopped after a peer's death (``code`` None) raises :data:`PEER_GRACE_S` later, so that the
        rank whose engine died is the job's first failure."""
        self._next_generation(spec.generation, code, respawn=False)
        where = self._keep(spec, said, "its group may not be respawned again")
        if code is None:
            time.sleep(PEER_GRACE_S)
            ended = "its engine was stopped after a peer's engine died"
        else:
            ended = f"last {_how(code, said, where)}"
        raise RuntimeError(
            f"rank {self.rank}: engine group {self.group} failed {self.respawns + 1} times, more than "
            f"fault.max_respawns ({self.max_respawns}); {ended}"
        )

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

    def _next_generation(self, generation: int, code: int | None, *, respawn: bool = True) -> int:
        """After a child ended without success: record its death (``code`` not None), move the
        group's generation on (once per generation, whichever member gets there first) and
        return the generation to start next (``respawn``: one respawn more is counted)."""
        if code is not None:
            failure = Failure(self.rank, self.group, generation, code, time.time(), hung=self._hung)
            self._hung = False
            self.failures.append(failure)
            k = self.store.add("failures", 1) - 1
            self.store.set(f"failure/{k}", pickle.dumps(failure))
            self.store.compare_set(self._gen_key, str(generation), str(generation + 1))
        self.respawns += respawn
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
    work, so a respawn skips the imports (seconds of a child's start). Its pipe stays open while
    it works: its traceback comes back that way (:meth:`listen`)."""

    def __init__(self, name: str, warm: tuple[str, ...]) -> None:
        ctx = _context(warm)
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_spare_main, args=(theirs, warm, FromParent()), name=name, daemon=True)
        self.process.start()
        self.started_at = time.time()
        self.warmed_at: float | None = None  # set when it is handed work after its imports
        self.said = ""  # the traceback its work ended with, as far as it came
        theirs.close()

    def assign(self, target: Callable, spec: ChildSpec, args: tuple) -> mp.process.BaseProcess:
        """Run ``target(spec, *args)`` in it; returns its process."""
        if self.conn.poll():  # its imports are done
            self.warmed_at = float(self.conn.recv())
        self.conn.send((target, spec, args))
        return self.process

    def listen(self) -> None:
        """Take what the child sent so far (its traceback; its imports' time, sent after the work
        came, is dropped)."""
        with contextlib.suppress(EOFError, OSError):  # it ended, or was killed mid-message
            while self.conn.poll():
                message = self.conn.recv()
                self.said += message if isinstance(message, str) else ""

    def close(self) -> str:
        """Close the pipe once the child ended (or was killed); returns what it said."""
        self.listen()
        self.conn.close()
        return self.said


def _context(warm: tuple[str, ...]) -> mp.context.BaseContext:
    """How children start: forked from this process's fork server, which imported the main
    module and ``warm`` once (a spawned child imports torch anew: seconds of CPU each). The
    server is a child with no threads of its own of this process or of the first local rank of
    its node, forked before the process group where the launcher could
    (:mod:`reshard.parallel.fault.fork_server`: then the preload below is the server's already);
    it exits when every process that holds its alive pipe (the node's ranks, their children) has,
    and its children die with it (:func:`_die_with_parent`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *frozen_preload(warm)])  # (no effect once the server runs)
    return ctx


def _spare_main(conn, warm: tuple[str, ...], parent: FromParent) -> None:
    """A spare's entry: the supervisor's environment and output (its fork server may be another
    rank's), die with the server, import ``warm``, then run the work it is sent."""
    import importlib

    parent.apply()
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
        _child_main(target, spec, args, conn)
    finally:  # (a child's end is os._exit: only a spare that was not used gets here)
        signal.signal(signal.SIGINT, signal.SIG_DFL if replaced is None else replaced)


def failures(store: dist.Store) -> list[Failure]:
    """Every child death recorded in the job's ``store`` so far, in the order recorded."""
    count = store.add("failures", 0)
    return [pickle.loads(store.get(f"failure/{k}")) for k in range(count)]


def _child_main(target: Callable, spec: ChildSpec, args: tuple, conn) -> None:
    """Run ``target``; an exception is a traceback, sent to the supervisor over ``conn`` (which
    decides where it goes; stderr when it is gone), and exit status 1 (not a hang). SIGUSR1
    prints every thread's stack on stderr (a child that seems stuck)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        target(spec, *args)
        code = 0
    except SystemExit:
        raise
    except BaseException:
        import traceback

        said = traceback.format_exc()
        try:
            conn.send(said)
        except OSError:  # the supervisor is gone
            _print(said)
        code = 1
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # the handler it replaced is back
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: threads blocked on links to dead peers stay where they are


def _how(code: int, said: str, where: str) -> str:
    """``exit code 1: ValueError: ...; its traceback in ranks.log`` (a child that raised; ``where``
    its traceback went), or ``exit code -9 (SIGKILL)``: how a child ended, in a few words."""
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    last = said.strip().splitlines()[-1] if said.strip() else ""
    return f"exit code {code}" + (f": {last}; its traceback {where}" if last else "")


def _print(said: str) -> None:
    """``said`` (a child's traceback) on stderr."""
    sys.stderr.write(said)
    sys.stderr.flush()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``; Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
