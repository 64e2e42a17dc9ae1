"""What every recipe shares: the process group (torchrun or alone), a deadline on collectives,
Hydra under torchrun (one run dir, written by rank 0) and user errors reported as one line."""

from __future__ import annotations

import datetime
import functools
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from reshard.recipes.exits import (  # noqa: F401 (public here too)
    EXIT_INTERRUPTED,
    EXIT_USER,
    FINISHED,
    LAUNCHED_ENV,
    finished_so_far,
    freeze_heap,
)

TIMEOUT_ENV = "RESHARD_COLLECTIVE_TIMEOUT"  # seconds any collective may wait (default 600)
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun's agent reads a failed rank's exception


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


def init_distributed() -> None:
    """Join torchrun's process group (NCCL with CUDA, else gloo); alone, a 1-rank group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kw = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
        kw = dict(store=_attempt_store(), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=collective_timeout(), **kw)
    if dist.get_world_size() > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))


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


def report_once(message: str) -> None:
    """Print ``message`` on stderr from the first rank of the job that gets here; the other ranks,
    which usually found the same error, stay quiet. Counted in the process group's store, so
    nothing is left on disk."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank shares
        if store.add("reshard/user-error", 1) > 1:
            return
    print(message, file=sys.stderr, flush=True)


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


def hydra_main(config_name: str, run: Callable[..., Any], *, drains: bool = False) -> None:
    """Run ``run(config dataclass, run dir)`` under ``@hydra.main`` on every rank of the job. A user
    error (a ``ValueError``, or a config that Hydra refuses) is one line on stderr and exit status 2.
    ``drains`` (a server): SIGTERM sets the event passed as ``run``'s third argument instead of
    interrupting (the job drains and ends itself); Ctrl-C interrupts as in every job."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException
    from torch.distributed.elastic.multiprocessing.errors import record

    from reshard.recipes import schema

    stopping = threading.Event()  # set by SIGINT / SIGTERM before the KeyboardInterrupt they raise

    drain = threading.Event()  # drains: set by SIGTERM

    def _stop(signum: int, frame: object) -> None:
        if drains and signum == signal.SIGTERM:
            drain.set()
            return
        stopping.set()
        raise KeyboardInterrupt  # unwinds through every finally (shared memory, threads), on SIGTERM too

    @hydra.main(version_base=None, config_path="../conf", config_name=config_name)
    def _main(cfg: DictConfig) -> None:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            run(schema.to_dataclass(cfg), run_dir, *([drain] if drains else []))
        except ValueError as e:  # a user error: one line, not a traceback per rank
            _user_error(str(e))
        except KeyboardInterrupt:
            _interrupted(run_dir)
        except Exception:  # a collective cut short by a peer that stopped first: the same interruption
            if stopping.is_set():
                _interrupted(run_dir)
            raise

    # under torchrun, its failure report names this rank's exception (not "error_file: <N/A>")
    @functools.partial(record, error_handler=_WholeErrorFile())
    def _job() -> None:
        freeze_heap()
        overrides = sys.argv[1:]
        schema.register(overrides)
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or a launcher stopping the ranks
            signal.signal(signum, _stop)
        sys.unraisablehook = functools.partial(_quiet_interrupt, sys.unraisablehook)
        init_distributed()
        sys.argv += hydra_rank_overrides(overrides)
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # composition errors come here, not Hydra's report per rank
        interrupted = False
        try:
            _main()
        except (HydraException, OmegaConfBaseException) as e:
            _user_error(schema.one_line(e, schema.overrides_given(overrides)))
        except KeyboardInterrupt:
            interrupted = True
        except SystemExit as e:
            interrupted = e.code == EXIT_INTERRUPTED
            if not interrupted:
                raise
        finally:
            dist.destroy_process_group()
        if interrupted:  # cleaned up above; skip the C++ teardown's report of the collective cut short
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)

    _job()


def _quiet_interrupt(default: Callable, unraisable) -> None:
    """``_stop``'s KeyboardInterrupt landing where Python cannot raise it (a ``__del__`` run by the
    garbage collector) is the interruption already under way: not printed as "Exception ignored"."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        default(unraisable)


def _interrupted(run_dir: Path) -> None:
    """Ctrl-C (or SIGTERM): exit 130 with no traceback; run alone or under torchrun, rank 0 says
    where the finished requests are (under ``reshard``'s launcher, the launcher says it)."""
    if LAUNCHED_ENV not in os.environ and dist.is_initialized() and dist.get_rank() == 0:
        done, finished = finished_so_far(run_dir)
        where = f", kept in {finished.resolve()}" if done else ""
        print(f"interrupted: {done} requests finished{where}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED) from None


def _user_error(message: str) -> None:
    report_once(f"error: {message}")
    raise SystemExit(EXIT_USER) from None
