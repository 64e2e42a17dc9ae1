"""``reshard``: the command line (installed as a console script, as torchtune's ``tune run`` wraps torchrun).

    reshard generate [--nproc N] [hydra overrides]    the main job on N ranks (default 1)
    reshard generate --nnodes M --node-rank R --master-addr A --nproc N   one job on M machines (M x N ranks)
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
import difflib
import json
import logging
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.recipes.exits import (
    EXIT_INTERRUPTED,
    EXIT_USER,
    LAUNCHED_ENV,
    finished_so_far,
    freeze_heap,
    signal_name,
    story_lines,
)

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
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status; Ctrl-C at any moment is one line and status 130 (once the
    ranks run, :func:`launch` says how many requests finished)."""
    freeze_heap()
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("interrupted: before any rank started (nothing ran)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str]) -> int:
    args, overrides = parse(argv)
    try:
        run_dir, overrides = _run_dir(overrides)
        cfg = check(args.job, overrides, args.nproc * args.nnodes)
        requests = total_requests(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER
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

    @staticmethod
    def of(args: argparse.Namespace) -> Nodes:
        return Nodes(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port)

    def rendezvous(self) -> dict:
        """``LaunchConfig``'s rendezvous keys."""
        if self.nnodes == 1:
            return dict(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}")
        return dict(
            rdzv_backend="static",
            rdzv_endpoint=f"{self.master_addr}:{self.master_port}",
            rdzv_configs={"rank": self.node_rank},
        )


# ---- before any rank starts -------------------------------------------------------------------
def check(job: str, overrides: Sequence[str], nproc: int) -> Any:
    """The job's config dataclass, checked as the ranks will check it (layouts and kills against
    ``nproc`` ranks too); ``ValueError`` with one line naming the key otherwise."""
    from reshard.recipes import schema
    from reshard.recipes.launch import collective_timeout

    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a key=value override")
    collective_timeout()  # the environment's timeout, as every rank reads it
    try:
        cfg = schema.compose(job, overrides)
    except ValueError as e:
        raise ValueError(str(e) + did_you_mean(job, str(e), overrides)) from None
    if job in ("generate", "serve"):
        cfg.fault.check_world(nproc)
        cfg.parallel.layouts(nproc)
        _check_model_path(cfg.model.path)
        _check_cache_dir(cfg.model.cache_dir)
    if job == "rollout":
        from reshard.parallel.strategies.rollout import RankSplit, rollout_dims, rollout_strategy

        r = cfg.rollout
        split = RankSplit.of(nproc, r.colocated, r.train_ranks)
        rollout_dims(rollout_strategy(r.layout, tp=r.tp, sp=r.sp), split.rollout)
        _check_task(cfg.train)
    return cfg


def _check_task(train) -> None:
    """A ``train.reward`` that does not import, prompts that are not there: refused here (the ranks tokenize)."""
    from reshard.recipes.rl_task import load_reward, load_rows

    if train.reward is not None:
        load_reward(train.reward)
    if train.prompts_file is not None and not Path(train.prompts_file).is_file():
        raise ValueError(f"train.prompts_file {train.prompts_file!r} is not a file")
    if train.prompts_dataset is not None:
        load_rows(train.prompts_dataset, train.prompts_split)


def _check_cache_dir(cache_dir: str | None) -> None:
    """``ValueError`` for a ``model.cache_dir`` the ranks could not write (the built-in checkpoint
    is made there)."""
    if cache_dir is None:
        return
    existing = next(p for p in (Path(cache_dir).expanduser(), *Path(cache_dir).expanduser().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"model.cache_dir {cache_dir!r} cannot be written ({str(existing)!r} is not a writable directory)"
        )


def _check_model_path(path: str | None) -> None:
    """``ValueError`` for a ``model.path`` that names a local directory (``/``, ``.``, ``~``)
    which is not a checkpoint: missing, without ``config.json``, or one that is not JSON. (A hub
    id, ``org/name``, resolves on the ranks.)"""
    if path is None or not str(path).startswith(("/", ".", "~")):
        return
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"model.path {path!r} is not a directory (a checkpoint directory or a hub id org/name)")
    config = directory / "config.json"
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"model.path {path!r} has no config.json: not an HF checkpoint directory") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path {path!r}: its config.json is not JSON ({e})") from None


def did_you_mean(job: str, message: str, overrides: Sequence[str]) -> str:
    """`` (did you mean 'engine.max_batch_size'?)`` when ``message`` refuses a key that is close to
    one the job has; else ``""``."""
    key = message.split(":", 1)[0]
    if "not in" not in message:
        return ""
    keys = all_keys(job, overrides)
    if "." not in key:  # a top-level name: the sections and keys at the top
        keys = sorted({k.split(".", 1)[0] for k in keys})
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def all_keys(job: str, overrides: Sequence[str]) -> list[str]:
    """Every full key of the job's config (with the ``parallel=`` strategy the overrides chose)."""
    return [k for k, _ in flat_defaults(job, overrides)]


def flat_defaults(job: str, overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """``(full key, default)`` of the job's config, depth first."""
    import dataclasses

    from reshard.recipes import schema

    groups = [o for o in overrides if o.split("=", 1)[0] == "parallel"]
    cfg = schema.compose(job, groups)

    def walk(node: Any, path: str) -> list[tuple[str, Any]]:
        if not dataclasses.is_dataclass(node):
            return [(path, node)]
        return [kv for f in dataclasses.fields(node) for kv in walk(getattr(node, f.name), f"{path}{f.name}.")]

    return [(k.rstrip("."), v) for k, v in walk(cfg, "")]


def keys_lines(job: str, overrides: Sequence[str]) -> list[str]:
    """One line per key: ``engine.max_batch_size = 8``."""
    return [f"{key} = {json.dumps(value, default=repr)}" for key, value in flat_defaults(job, overrides)]


def total_requests(cfg: Any) -> int | None:
    """How many requests a generate job runs (``None`` for jobs without requests); a prompts file
    that does not exist or is not UTF-8 is a ``ValueError`` naming it."""
    from reshard.recipes.prompts import _prompt_lines

    w = getattr(cfg, "workload", None)
    if w is None or not hasattr(w, "num_requests"):
        return None
    if w.prompts_file is None:
        return w.num_requests * cfg.generation.n
    path = Path(w.prompts_file)
    if path.is_dir():
        raise ValueError(f"workload.prompts_file {str(path)!r} is a directory; give a JSONL file")
    if not path.is_file():
        raise ValueError(f"workload.prompts_file {str(path)!r} does not exist")
    return len(_prompt_lines(path)) * cfg.generation.n


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

    _quiet("torch.distributed.elastic")  # our lines, not the agent's
    env = {LAUNCHED_ENV: "1"} | ({"OMP_NUM_THREADS": "1"} if nodes.nproc > 1 else {})
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
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
    print_story(run_dir)
    return 0


def serve(overrides: Sequence[str], nodes: Nodes, run_dir: Path, max_restarts: int = 0) -> int:
    """``reshard serve``: :func:`launch` on a thread of its own (torch's agent installs no signal
    handlers off the main thread), so that SIGTERM and Ctrl-C here go to rank 0's process, named
    in ``server.json``: SIGTERM drains the server (the job then ends, exit 0), Ctrl-C interrupts."""
    import signal
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


def failed(e: Exception, run_dir: Path) -> int:
    """The exit status of a job whose ranks failed: 2 when a rank reported a user error (its line is
    printed already), else 1 with a line naming the first rank that failed, how, and where the
    requests that finished before it are."""
    codes = {rank: f.exitcode for rank, f in getattr(e, "failures", {}).items()}
    if EXIT_USER in codes.values():
        return EXIT_USER
    rank, code = min(codes.items()) if codes else (None, None)
    how = f"killed by {signal_name(code)}" if code is not None and code < 0 else f"exit status {code}, see above"
    done, finished = finished_so_far(run_dir)
    kept = f"; {done} finished requests kept in {finished.resolve()}" if done else ""
    print(f"error: rank {rank} failed ({how}){kept}", file=sys.stderr, flush=True)
    return 1


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
