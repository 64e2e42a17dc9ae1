"""``reshard``: the command line (installed as a console script, as torchtune's ``tune run`` wraps torchrun).

    reshard generate [--nproc N] [hydra overrides]    the main job on N ranks (default 1)
    reshard generate --nnodes M --node-rank R --master-addr A --nproc N   one job on M machines (M x N ranks)
                     [--master-port P] [--rdzv-timeout S]   (each node runs it; S: how long to wait for all)
    reshard rollout  [--nproc N] [hydra overrides]    the RL rollout loop
    reshard serve    [--nproc N] [--host H] [--port P] [overrides]   an OpenAI-compatible server (SIGTERM drains)
    reshard plan     [hydra overrides]                the cost model's ranking (one process)
    reshard generate --keys                           every key with its default
    reshard generate --check [--nproc N] [overrides]  check the config for N ranks, run nothing

The config is composed and checked here, in one process, before any rank starts (a typo fails in
about a second, once, with "did you mean" where a close key exists). The ranks are launched with
torch.distributed's launcher API (what torchrun runs) into one run directory made here, whatever
the restarts; every way the job ends is one or two lines of ours: a user error (its line, exit
2), Ctrl-C (how many requests finished and where they are, exit 130), a failure the job recovered
from (what died and how it came back, exit 0), a failure it could not recover from (exit 1). A
run that fails leaves no empty run directory. ``torchrun -m reshard.recipes.<job>`` keeps working.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import gc
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from reshard.recipes.exits import (
    EXIT_INTERRUPTED,
    EXIT_USER,
    LAUNCHED_ENV,
    LAUNCHER_PID_ENV,
    AfterImport,
    failed,
    finished_so_far,
    freeze_heap,
    story_lines,
)
from reshard.recipes.preflight import check, check_writable, keys_lines, total_requests

RANKED_JOBS = ("generate", "rollout", "serve")
JOBS = (*RANKED_JOBS, "plan")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(the launcher's own options, the Hydra overrides)``."""
    p = argparse.ArgumentParser(prog="reshard", description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("job", choices=JOBS, help="what to run")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (generate, rollout; default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="machines of the job, each runs this command (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, reachable from every node")
    p.add_argument("--master-port", type=int, default=29500, help="a free port on node 0 (default 29500)")
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="--nnodes > 1: how long a node waits for the others (and node 0) to start before it fails "
        "with one line naming the missing nodes (default 300)",
    )
    p.add_argument("--host", help="serve: the address to listen on (serve.host, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="serve: the port (serve.port, default 8000; 0: any free one)")
    p.add_argument("--keys", action="store_true", help="print every config key with its default, one per line")
    p.add_argument("--check", action="store_true", help="check the config for --nproc ranks and exit (runs nothing)")
    p.add_argument("--max-restarts", type=int, default=0, help="whole-job restarts by torchrun, from scratch")
    args, overrides = p.parse_known_args(argv)
    if (args.host is not None or args.port is not None) and args.job != "serve":
        p.error(f"--host and --port are reshard serve's, not {args.job}'s")
    given = {"serve.host": args.host, "serve.port": args.port}
    overrides += [f"{k}={v}" for k, v in given.items() if v is not None]
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        p.error(f"unrecognized option {unknown[0]!r} (Hydra overrides are key=value)")
    if args.nproc < 1 or (args.job == "plan" and args.nproc != 1):
        p.error(f"--nproc must be >= 1 (and 1 for plan), got {args.nproc}")
    if args.nnodes < 1 or (args.job == "plan" and args.nnodes != 1):
        p.error(f"--nnodes must be >= 1 (and 1 for plan), got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    if not 0 < args.master_port < 65536:
        p.error(f"--master-port must be a port number in 1..65535, got {args.master_port}")
    if not 0 < args.rdzv_timeout < float("inf"):
        p.error(f"--rdzv-timeout must be a positive number of seconds, got {args.rdzv_timeout:g}")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status; Ctrl-C at any moment is one line and status 130 (once the
    ranks run, :func:`launch` says how many requests finished)."""
    freeze_heap()
    gc.disable()  # the checks' imports (torch, the library) without the collector: resumed once done
    seen, previous = _note_interrupts()
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BaseException as e:
        if not (isinstance(e, KeyboardInterrupt) or seen):
            raise
        print("interrupted: before any rank started (nothing ran)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        gc.enable()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _note_interrupts() -> tuple[list[int], Any]:
    """SIGINT raises ``KeyboardInterrupt``, as Python's own handler does, and is noted in the list
    returned (with the handler it replaced): an import that a Ctrl-C cuts short can fail with
    another error, which is still the interrupt (numpy's half-made module raised a
    ``RecursionError`` once). Nothing changes off the main thread or where SIGINT is handled
    otherwise or ignored."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return seen, None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return seen, None

    after_import = AfterImport()  # (a Ctrl-C within an import: raised once it is done)

    def note(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        if not after_import.defer(signum, frame):
            raise KeyboardInterrupt

    return seen, signal.signal(signal.SIGINT, note)


def _main(argv: Sequence[str]) -> int:
    args, overrides = parse(argv)
    try:
        run_dir, overrides = _run_dir(overrides)
        cfg = check(args.job, overrides, args.nproc * args.nnodes)
        requests = total_requests(cfg)
        if not (args.keys or args.check):  # (--check: the config alone; directories and ports are tried at run)
            check_writable(f"hydra.run.dir {str(run_dir)!r}", run_dir)
            Nodes.of(args).check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER
    freeze_heap()  # the checks' imports, frozen (seconds of CPU before any rank starts, on one core)
    if args.keys:
        print("\n".join(keys_lines(args.job, overrides)))
        return 0
    if args.check:
        print(f"ok: the {args.job} config checks for {args.nproc} rank(s)")
        return 0
    overrides = [*overrides, f"hydra.run.dir={run_dir}"]
    if args.job == "plan":
        return run_in_process(args.job, overrides, run_dir)
    if args.job == "serve":
        return serve(overrides, Nodes.of(args), run_dir, args.max_restarts)
    return launch(args.job, overrides, Nodes.of(args), run_dir, requests, args.max_restarts)


def _run_dir(overrides: Sequence[str]) -> tuple[Path, list[str]]:
    """The job's run directory (the user's ``hydra.run.dir``, else :func:`new_run_dir`) and the
    overrides without it (the launcher adds it back, once); a sweep key is refused by name."""
    sweep = next((o for o in overrides if o.lstrip("+~").startswith(("hydra.sweep.", "hydra.mode="))), None)
    if sweep is not None:
        raise ValueError(f"{sweep.split('=')[0]}: reshard runs one job per launch (no sweeps); set hydra.run.dir")
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra.run.dir=")]
    rest = [o for o in overrides if not o.lstrip("+").startswith("hydra.run.dir=")]
    if given and not given[-1]:
        raise ValueError("hydra.run.dir is empty: name a directory (or leave it out for outputs/<date>/<time>)")
    return (Path(given[-1]) if given else new_run_dir()), rest


@dataclass(frozen=True)
class Nodes:
    """The machines of a job (``--nnodes``): each runs the launcher with its ``--node-rank``; one
    machine rendezvouses on a free local port, several on node 0's ``--master-addr:--master-port``
    (torchrun's static rendezvous)."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_timeout: float = 300.0  # seconds a node waits for the others (--rdzv-timeout)

    @staticmethod
    def of(args: argparse.Namespace) -> Nodes:
        return Nodes(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_timeout)

    def check(self) -> None:
        """``ValueError`` (one line) for a ``--master-addr`` that does not resolve and, on node 0,
        a ``--master-port`` that cannot be listened on here: both tried, before anything starts.
        One machine rendezvouses on a free local port: nothing to check."""
        if self.nnodes == 1:
            return
        try:
            socket.getaddrinfo(self.master_addr, self.master_port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"--master-addr {self.master_addr!r} does not resolve ({e.strerror})") from None
        if self.node_rank == 0:
            _check_port(self.master_port)

    def rendezvous(self) -> dict:
        """``LaunchConfig``'s rendezvous keys; several nodes: :mod:`reshard.recipes.rendezvous`'s."""
        if self.nnodes == 1:
            return dict(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}")
        from reshard.recipes.rendezvous import BACKEND, register

        register()
        return dict(
            rdzv_backend=BACKEND,
            rdzv_endpoint=f"{self.master_addr}:{self.master_port}",
            rdzv_configs={"rank": self.node_rank, "timeout": self.rdzv_timeout},
        )


def _check_port(port: int) -> None:
    """``ValueError`` unless ``port`` can be bound on every address here, as node 0's store binds it
    (with ``SO_REUSEADDR``, as the store does: a finished job's connections in TIME_WAIT are no conflict)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            how = "is in use on this machine" if e.errno == errno.EADDRINUSE else "cannot be listened on here"
            raise ValueError(
                f"--master-port {port} {how} ({e.strerror}); node 0 hosts the rendezvous there: "
                f"stop what holds it or choose another port on every node"
            ) from None


def new_run_dir() -> Path:
    """``outputs/<date>/<time>``, with a suffix when a job started in the same second has it."""
    base = Path(datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S"))
    path, k = base, 1
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return path


# ---- the job ------------------------------------------------------------------------------------
def run_in_process(job: str, overrides: Sequence[str], run_dir: Path) -> int:
    """A one-process job (``plan``) run here, its exit status returned."""
    import importlib

    sys.argv = [f"reshard {job}", *overrides]
    try:
        importlib.import_module(f"reshard.recipes.{job}").main()
    except SystemExit as e:
        return _remove_if_empty(run_dir, e.code if isinstance(e.code, int) else 1)
    return 0


def launch(
    job: str, overrides: Sequence[str], nodes: Nodes, run_dir: Path, requests: int | None, max_restarts: int = 0
) -> int:
    """Start this node's ``nodes.nproc`` ranks of ``python -m reshard.recipes.<job>``
    (torch.distributed's elastic launcher, as torchrun does) and report how they ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from reshard.recipes.rank import BLOCKED_START
    from reshard.recipes.rendezvous import NodesMissing

    _quiet("torch.distributed.elastic")  # our lines, not the agent's
    env = {LAUNCHED_ENV: "1"} | ({"OMP_NUM_THREADS": "1"} if nodes.nproc > 1 else {})
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # (the ranks' parent: each ends if it is gone)
    config = LaunchConfig(
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=nodes.nproc,
        run_id=str(uuid.uuid4()) if nodes.nnodes == 1 else "reshard",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        **nodes.rendezvous(),
    )
    try:
        elastic_launch(config, sys.executable)("-S", "-c", BLOCKED_START, job, *overrides)
    except (KeyboardInterrupt, SignalException):
        print(interrupted_line(run_dir, requests), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except ChildFailedError as e:
        return _remove_if_empty(run_dir, failed(e, run_dir))
    except NodesMissing as e:  # no rank started
        print(f"error: {e}", file=sys.stderr, flush=True)
        return _remove_if_empty(run_dir, 1)
    print_story(run_dir)
    return 0


def serve(overrides: Sequence[str], nodes: Nodes, run_dir: Path, max_restarts: int = 0) -> int:
    """``reshard serve``: :func:`launch` on a thread of its own (torch's agent installs no signal
    handlers off the main thread), so that SIGTERM and Ctrl-C here go to rank 0's process, named
    in ``server.json``: SIGTERM drains the server (the job then ends, exit 0), Ctrl-C interrupts."""
    import time

    from reshard.background import Background

    caught: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: caught.append(signum))
    job = Background(lambda: launch("serve", overrides, nodes, run_dir, None, max_restarts), "reshard-agent", "serve")
    sent = 0
    while not job.done():
        time.sleep(0.05)
        pid = _server_pid(run_dir) if sent < len(caught) else None
        for signum in caught[sent:] if pid else ():
            os.kill(pid, signum)
            sent += 1
    return job.result()


def _server_pid(run_dir: Path) -> int | None:
    path = run_dir / "server.json"
    try:
        return json.loads(path.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _quiet(prefix: str) -> None:
    """Silence every logger under ``prefix`` (torch's set their own levels, so the parent's is not enough)."""
    for name in [prefix, *logging.Logger.manager.loggerDict]:
        if name.startswith(prefix):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupted_line(run_dir: Path, requests: int | None) -> str:
    """``interrupted: 12 of 32 requests finished, kept in .../finished.jsonl``."""
    done, finished = finished_so_far(run_dir)
    of = f" of {requests}" if requests is not None else ""
    where = f", kept in {finished.resolve()}" if done else ""
    _remove_if_empty(run_dir, 0)
    return f"interrupted: {done}{of} requests finished{where}"


def print_story(run_dir: Path) -> None:
    """After a job that succeeded: one line per failure it recovered from (from ``summary.json``)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    for line in story_lines(summary):
        print(line, flush=True)


def _remove_if_empty(run_dir: Path, code: int) -> int:
    """``code``, after removing ``run_dir`` when it holds nothing but Hydra's ``.hydra`` and empty
    files (Hydra's log), and then its empty parents under ``outputs/``."""
    if run_dir.is_dir() and all(p.name == ".hydra" or _empty_file(p) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)
        parents = (run_dir.parent, run_dir.parent.parent) if run_dir.parts[:1] == ("outputs",) else ()
        for d in parents:  # outputs/<date>/, ours (a hydra.run.dir the user named keeps its parents)
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return code


def _empty_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == 0


def entry() -> None:
    """The ``reshard`` console script: :func:`main`'s status as the process's. An interrupted run
    leaves with ``os._exit`` once its line is out: the interpreter's teardown after a Ctrl-C
    caught during start-up imports was seen (once in about 20 clean-clone runs) to end the process
    by SIGINT instead of with status 130."""
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
