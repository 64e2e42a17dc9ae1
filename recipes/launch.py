"""What every recipe shares: the process group (torchrun or alone), a deadline on collectives,
Hydra under torchrun (one run dir, written by rank 0) and a failure reported as one line, by the
rank that failed first (the others' tracebacks go to the run directory's ``ranks.log``)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from reshard.mesh import end_groups
from reshard.recipes.exits import (  # noqa: F401 (public here too)
    EXIT_INTERRUPTED,
    EXIT_USER,
    FINISHED,
    LAUNCHED_ENV,
    AfterImport,
    append_ranks_log,
    finished_so_far,
    freeze_heap,
)

if TYPE_CHECKING:
    from reshard.parallel.fault.fork_server import NodeShare

TIMEOUT_ENV = "RESHARD_COLLECTIVE_TIMEOUT"  # seconds any collective may wait (default 600)
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun's agent reads a failed rank's exception
FAILED_KEY = "reshard/failed"  # in the process group's store: how many ranks of the job have failed
# the first rank to raise waits this long for a stop before it says its error: a stop means the
# launcher saw a peer end first (killed, crashed: a rank that raised nothing, whose death cut this
# rank's collective short); it comes within the agent's poll (0.1 s)
ROOT_GRACE_S = 1.0
STOP_WAIT_S = 30.0  # a rank cut short by another's failure waits this long for the launcher to stop it


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait before the job fails (``$RESHARD_COLLECTIVE_TIMEOUT`` s,
    default 600) instead of gloo's 30 minutes; set before the process group exists."""
    raw = os.environ.get(TIMEOUT_ENV, "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_distributed(fork_server: Sequence[str] | None = None) -> None:
    """Join torchrun's process group (NCCL with CUDA, else gloo); alone, a 1-rank group.
    ``fork_server`` (a supervised rank's modules to preload): fork the rank's fork server first,
    while the rank has no threads of its own (:func:`reshard.parallel.fault.fork_server.fork_server`)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    share = handout = None
    if fork_server is not None:  # (with the environment its children read set)
        share = _node_share()
        handout = _fork_server(fork_server, share)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kw = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
        kw = dict(store=_attempt_store(), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=collective_timeout(), **kw)
    if share is not None:  # every rank joined: the node's first hands its server to the others
        from reshard.parallel.fault.fork_server import attach, hand_out

        timeout = collective_timeout().total_seconds()
        if share.first:
            hand_out(handout, share, timeout)
        else:
            attach(share, timeout)
    if dist.get_world_size() > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))


def _fork_server(preload: Sequence[str], share: NodeShare | None) -> socket.socket | None:
    """Fork this rank's fork server with ``preload`` (a supervised rank's modules), before its
    process group starts threads; where the node's ranks share one (``share``), only the first
    forks it, and the listener it hands it out at comes back. Rank 0 loads the tokenizer itself
    (the outputs' text, a server's prompts): it imports the preload (transformers) before the
    fork, and its server inherits it."""
    from reshard.parallel.fault.fork_server import fork_node_server, fork_server

    here = os.environ["RANK"] == "0"
    if share is None:
        fork_server(preload, here)
        return None
    return fork_node_server(preload, here, share) if share.first else None


def _node_share() -> NodeShare | None:
    """How this node's ranks share one fork server: torchrun's local ranks are its agent's
    children (the agent's pid, with the attempt, names where the first hands it out), on Linux
    (an abstract socket name). None for a rank alone on its node."""
    from reshard.parallel.fault.fork_server import NodeShare
    from reshard.parallel.fault.restart import restart_count

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks < 2 or not sys.platform.startswith("linux"):
        return None
    address = f"\0reshard-fork-server-{os.getppid()}-{restart_count()}"
    return NodeShare(address, ranks, first=os.environ["LOCAL_RANK"] == "0")


def _attempt_store() -> dist.Store:
    """The agent's store, keys of this attempt only: a group restarted by ``--max-restarts`` would
    otherwise read the previous attempt's addresses and fail to connect (``../shared/NOTES.md``)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=collective_timeout()
    )
    return dist.PrefixStore(f"reshard/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def hydra_rank_overrides(argv: list[str]) -> list[str]:
    """All ranks share rank 0's run dir; only rank 0 lets Hydra write files or logs."""
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        stamp = [datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")]
        dist.broadcast_object_list(stamp, src=0)
        extra.append(f"hydra.run.dir={stamp[0]}")
    if dist.get_rank() != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    return extra


def first_failure() -> bool:
    """Whether this rank is the first of its job to fail: counted in the process group's store (the
    rendezvous store every rank shares, so nothing is left on disk). Alone, or with the store gone
    (its launcher ended), True."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return True
    try:
        return dist.distributed_c10d._get_default_store().add(FAILED_KEY, 1) == 1
    except RuntimeError:  # (torch's DistError is one)
        return True


class _WholeErrorFile(ErrorHandler):
    """torchrun's error file, written whole or not at all: a fault-tolerant rank may leave
    (``os._exit`` from its heartbeat thread) while its main thread records the error its peer's
    death raised, and torchrun's agent fails on a half-written file instead of restarting."""

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            return super().record_exception(e)
        os.environ[ERROR_FILE_ENV] = f"{file}.{os.getpid()}.tmp"
        try:
            super().record_exception(e)
        finally:
            os.environ[ERROR_FILE_ENV] = file
        os.replace(f"{file}.{os.getpid()}.tmp", file)


def _supervised_preload(overrides: Sequence[str]) -> tuple[str, ...] | None:
    """What a supervised rank's fork server preloads (the rank forks it before its process group),
    or None where the overrides set no ``fault.migrate``. A guess from the command line: a server
    forked in vain ends with the rank, one not forked is started by multiprocessing when asked."""
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    if given.get("fault.migrate", "null") in ("null", ""):
        return None
    from reshard.recipes.supervised import fork_server_preload

    return fork_server_preload(overrides)


def hydra_main(config_name: str, run: Callable[..., Any], *, drains: bool = False) -> None:
    """Run ``run(config dataclass, run dir)`` under ``@hydra.main`` on every rank of the job. A user
    error (a ``ValueError``, or a config that Hydra refuses) is one line on stderr and exit status 2;
    another exception one line naming it and where its traceback is, exit status 1 (:func:`_failed`:
    only the rank that failed first says it). ``drains`` (a server): SIGTERM to rank 0, which the
    launcher forwards it to, sets the event passed as ``run``'s third argument instead of
    interrupting (the job drains and ends itself); on another rank it is the launcher stopping the
    job, and Ctrl-C interrupts, as in every job."""
    from torch.distributed.elastic.multiprocessing.errors import record

    stops = _Stops(drains)
    main = _hydra_entry(config_name, run, stops)
    # under torchrun, its failure report names this rank's exception (not "error_file: <N/A>")
    record(lambda: _rank_job(main, stops), error_handler=_WholeErrorFile())()


@dataclasses.dataclass
class _Stops:
    """What a rank's SIGINT / SIGTERM handler (:meth:`handle`) has seen. ``stopping``: set before
    the KeyboardInterrupt a stop raises; ``terminated``: SIGTERM, the launcher stopping the job (a
    peer failed, or Ctrl-C); ``failing``: this rank handles a failure (a stop then only sets
    ``stopping``); ``drain``: a server's SIGTERM on rank 0 (``drains``); ``after_import``: a stop
    that lands in an import raises once it is done."""

    drains: bool
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    terminated: threading.Event = dataclasses.field(default_factory=threading.Event)
    failing: threading.Event = dataclasses.field(default_factory=threading.Event)
    drain: threading.Event = dataclasses.field(default_factory=threading.Event)
    after_import: AfterImport = dataclasses.field(default_factory=AfterImport)

    def install(self) -> None:
        """Handle Ctrl-C and a launcher stopping the ranks."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.failing.is_set():  # on its way out already: the stop is the launcher's, ending the job
            self.stopping.set()
            return
        if self.drains and signum == signal.SIGTERM and os.environ.get("RANK", "0") == "0":
            self.drain.set()
            return
        self.stopping.set()
        if signum == signal.SIGTERM:
            self.terminated.set()
        if self.after_import.defer(signum, frame):  # (an import cut short says more than the one line)
            return
        raise KeyboardInterrupt  # unwinds through every finally (shared memory, threads), on SIGTERM too


def _hydra_entry(config_name: str, run: Callable[..., Any], stops: _Stops) -> Callable[[], None]:
    """``run`` under ``@hydra.main`` (config ``conf/<config_name>.yaml``): a stop or an exception
    it raises leaves through :class:`SystemExit` with the rank's exit status."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from reshard.recipes import schema

    @hydra.main(version_base=None, config_path="../conf", config_name=config_name)
    def _main(cfg: DictConfig) -> None:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            run(schema.to_dataclass(cfg), run_dir, *([stops.drain] if stops.drains else []))
        except KeyboardInterrupt as stop:
            _stopped(stop, run_dir, stops.stopping, stops.failing, by_launcher=stops.terminated.is_set())
        except Exception as e:
            _raised(e, run_dir, stops)

    return _main


def _raised(e: Exception, run_dir: Path, stops: _Stops) -> NoReturn:
    """The job raised ``e`` (called in its ``except`` block): a user error (``ValueError``) is one
    line, another a line and its traceback in ``ranks.log``; a collective cut short by a peer that
    stopped first is the same interruption."""
    if stops.stopping.is_set():
        _interrupted(run_dir)
    stops.failing.set()
    if isinstance(e, ValueError):  # a user error: one line, not a traceback per rank
        raise SystemExit(_user_error(str(e), stops.stopping)) from None
    raise SystemExit(_failed(e, run_dir, stops.stopping)) from None


def _rank_job(main: Callable[[], None], stops: _Stops) -> None:
    """This rank's part of the job: its process group, Hydra's composition and ``main``; a
    failing rank leaves with its exit status, skipping the C++ teardown."""
    from reshard.recipes import schema

    freeze_heap()
    overrides = sys.argv[1:]
    schema.register(overrides)
    stops.install()
    sys.unraisablehook = functools.partial(_quiet_interrupt, sys.unraisablehook)
    init_distributed(fork_server=_supervised_preload(overrides))
    sys.argv += hydra_rank_overrides(overrides)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # composition errors come here, not Hydra's report per rank
    code = _exit_code(main, stops, overrides)
    if code:  # cleaned up already; skip the C++ teardown (a collective cut short, a backend's thread
        sys.stdout.flush()  # still alive: "terminate called without an active exception")
        sys.stderr.flush()
        os._exit(code)


def _exit_code(main: Callable[[], None], stops: _Stops, overrides: list[str]) -> int:
    """Run ``main``; the rank's exit status (0: the job ended well). The process groups end here
    whatever happened."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from reshard.recipes import schema

    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        if stops.stopping.is_set():  # a stop landing in Hydra's composition, which OmegaConf wraps: not a user error
            return EXIT_INTERRUPTED
        stops.failing.set()
        return _user_error(schema.one_line(e, schema.overrides_given(overrides)), stops.stopping)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)  # (a message: 1)
    finally:
        end_groups()
    return 0


def _user_error(message: str, stopped: threading.Event) -> int:
    """The exit status of a rank whose job raised a user error: the job's first failure prints
    ``error: <message>`` (2); a later one says nothing and leaves once stopped (:func:`_later`)."""
    if not first_failure():
        return _later(stopped)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER


def _failed(e: Exception, run_dir: Path, stopped: threading.Event) -> int:
    """The exit status of a rank whose job raised ``e`` (called in its ``except`` block): its
    traceback goes to the run directory's ``ranks.log``. The job's first failure prints one line
    naming it and the log (1) and records it for torchrun's report; a rank cut short by another's
    failure says nothing (:func:`_later`) -- a later failure, or the first to raise when the
    launcher stops it within :data:`ROOT_GRACE_S` (a peer ended before it without raising)."""
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    first = first_failure() and not _stopped_within(ROOT_GRACE_S, stopped)
    how = "failed first" if first else "stopped after another rank failed"
    log = append_ranks_log(run_dir, f"rank {rank} (pid {os.getpid()}): {how}", traceback.format_exc())
    if not first:
        return _later(stopped)
    _WholeErrorFile().record_exception(e)
    said = (str(e).strip().splitlines() or [type(e).__name__])[0]
    said = said if ranks == 1 or said.startswith(f"rank {rank}: ") else f"rank {rank}: {said}"
    print(f"error: {said} ({type(e).__name__}; its traceback in {log})", file=sys.stderr, flush=True)
    return 1


def _later(stopped: threading.Event) -> int:
    """A rank that failed after another: exit status 130 (stopped) once the launcher stops the job
    (or after :data:`STOP_WAIT_S`), so that the launcher sees the first failure end first."""
    _stopped_within(STOP_WAIT_S, stopped)
    return EXIT_INTERRUPTED


def _stopped_within(seconds: float, stopped: threading.Event) -> bool:
    """Whether ``stopped`` is set within ``seconds`` (at once alone: no launcher stops a lone rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return stopped.is_set()
    deadline = time.monotonic() + seconds
    while not stopped.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)  # (SIGTERM's handler, run between two sleeps, sets it)
    return stopped.is_set()


def _quiet_interrupt(default: Callable, unraisable) -> None:
    """``_stop``'s KeyboardInterrupt landing where Python cannot raise it (a ``__del__`` run by the
    garbage collector) is the interruption already under way: not printed as "Exception ignored"."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        default(unraisable)


def _stopped(
    stop: KeyboardInterrupt, run_dir: Path, stopping: threading.Event, failing: threading.Event, *, by_launcher: bool
) -> NoReturn:
    """A stop interrupted the job (called in its ``except`` block): exit 130 with no traceback
    (:func:`_interrupted`), unless the launcher's SIGTERM (``by_launcher``) came while this rank's
    own error unwound through ``finally`` blocks (a collective cut short by a peer's death): that
    error's traceback is kept in ``ranks.log`` as a later failure's (:func:`_failed`)."""
    raising = stop.__context__
    while raising is not None and not isinstance(raising, Exception):
        raising = raising.__context__
    if raising is None or not by_launcher:
        _interrupted(run_dir)
    failing.set()
    raise SystemExit(_failed(raising, run_dir, stopping)) from None


def _interrupted(run_dir: Path) -> None:
    """Ctrl-C (or SIGTERM): exit 130 with no traceback; run alone or under torchrun, rank 0 says
    where the finished requests are (under ``reshard``'s launcher, the launcher says it)."""
    if LAUNCHED_ENV not in os.environ and dist.is_initialized() and dist.get_rank() == 0:
        done, finished = finished_so_far(run_dir)
        where = f", kept in {finished.resolve()}" if done else ""
        print(f"interrupted: {done} requests finished{where}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED) from None
