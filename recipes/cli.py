"""``reshard``: the command line (installed as a console script, as torchtune's ``tune run`` wraps torchrun).

    reshard generate [--nproc N] [hydra overrides]    the main job on N ranks (default 1)
    reshard rollout  [--nproc N] [hydra overrides]    the RL rollout loop
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
from pathlib import Path
from typing import Any

from reshard.recipes.launch import EXIT_INTERRUPTED, EXIT_USER, finished_so_far

RANKED_JOBS = ("generate", "rollout")
JOBS = (*RANKED_JOBS, "plan")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(the launcher's own options, the Hydra overrides)``."""
    p = argparse.ArgumentParser(prog="reshard", description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("job", choices=JOBS, help="what to run")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (generate, rollout; default 1)")
    p.add_argument("--keys", action="store_true", help="print every config key with its default, one per line")
    p.add_argument("--check", action="store_true", help="check the config for --nproc ranks and exit (runs nothing)")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="whole-job restarts by torchrun, each from scratch (default 0)"
    )
    args, overrides = p.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        p.error(f"unrecognized option {unknown[0]!r} (Hydra overrides are key=value)")
    if args.nproc < 1 or (args.job == "plan" and args.nproc != 1):
        p.error(f"--nproc must be >= 1 (and 1 for plan), got {args.nproc}")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = check(args.job, overrides, args.nproc)
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
    run_dir = new_run_dir()
    overrides = [*overrides, f"hydra.run.dir={run_dir}"]
    if args.job == "plan":
        return run_in_process(args.job, overrides, run_dir)
    return launch(args.job, overrides, args.nproc, run_dir, requests, args.max_restarts)


# ---- before any rank starts -------------------------------------------------------------------
def check(job: str, overrides: Sequence[str], nproc: int) -> Any:
    """The job's config dataclass, checked as the ranks will check it (layouts and kills against
    ``nproc`` ranks too); ``ValueError`` with one line naming the key otherwise."""
    from reshard.recipes import schema

    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a key=value override")
    try:
        cfg = schema.compose(job, overrides)
    except ValueError as e:
        raise ValueError(str(e) + did_you_mean(job, str(e), overrides)) from None
    if job == "generate":
        cfg.fault.check_world(nproc)
        cfg.parallel.layouts(nproc)
    return cfg


def did_you_mean(job: str, message: str, overrides: Sequence[str]) -> str:
    """`` (did you mean 'engine.max_batch_size'?)`` when ``message`` refuses a key that is close to
    one the job has; else ``""``."""
    key = message.split(":", 1)[0]
    if "not in" not in message or ("." not in key and key not in _given_keys(overrides)):
        return ""
    close = difflib.get_close_matches(key, all_keys(job, overrides), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _given_keys(overrides: Sequence[str]) -> list[str]:
    return [o.lstrip("+~").split("=", 1)[0] for o in overrides]


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
    job: str, overrides: Sequence[str], nproc: int, run_dir: Path, requests: int | None, max_restarts: int = 0
) -> int:
    """Start ``nproc`` ranks of ``python -m reshard.recipes.<job>`` (torch.distributed's elastic
    launcher, as torchrun does) and report how they ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from reshard.recipes.launch import LAUNCHED_ENV

    _quiet("torch.distributed.elastic")  # our lines, not the agent's
    env = {LAUNCHED_ENV: "1"} | ({"OMP_NUM_THREADS": "1"} if nproc > 1 else {})
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", f"reshard.recipes.{job}", *overrides)
    except (KeyboardInterrupt, SignalException):
        print(interrupted_line(run_dir, requests), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except ChildFailedError as e:
        return _remove_if_empty(run_dir, failed(e, run_dir))
    print_story(run_dir)
    return 0


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
    how = f"killed by {_signal_name(code)}" if code is not None and code < 0 else f"exit status {code}, see above"
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


def story_lines(summary: dict) -> list[str]:
    """What died and how the job came back, one line each: supervised deaths (``fault`` of a
    ``fault.migrate`` run) and whole-job restarts (torchrun's, each from scratch)."""
    lines, fault = [], summary.get("fault", {})
    for d in fault.get("deaths", []):
        how = "hung, killed" if d.get("hung") else _signal_name(d.get("exitcode"))
        moved = _moved(d)
        back = (
            ""
            if d.get("rejoined_s") is None
            else f"; its group served again {d['rejoined_s'] - d['seen_s']:.1f} s later{_weights(fault, d)}"
        )
        lines.append(f"recovered: rank {d.get('rank')} died ({how}) at {d.get('died_s') or 0:.1f} s; {moved}{back}")
    if summary.get("failures", 0) and "fault" not in summary:
        lines.append(f"recovered: {summary['failures']} whole-job restart(s) after a rank failed, each from scratch")
    return lines


def _weights(fault: dict, death: dict) -> str:
    """`` with group 0's weights`` when the dead rank's next generation took them from a live replica."""
    if "endpoint" not in death:
        return ""
    generation = int(death["endpoint"].split(".")[1]) + 1
    source = fault.get("weights_from", {}).get(str(death.get("rank")), {}).get(str(generation))
    return f" with group {source[0].split('.')[0]}'s weights" if source and source[0] != "checkpoint" else ""


def _moved(death: dict) -> str:
    adopted, redone = len(death.get("adopted") or []), death.get("reprefilled_tokens") or 0
    again = sum(a[-1] for a in death.get("adopted") or [])
    if adopted:
        own = (death.get("adopted_by") or "").split(".")[0] == death.get("endpoint", "").split(".")[0]
        by = "its group's next generation (its supervisors kept their KV)" if own else "another group"
        return f"{adopted} request(s) adopted with their KV by {by}, {again} token(s) computed again"
    if redone:
        return f"{len(death.get('resumed') or [])} request(s) prefilled again on live groups ({redone} tokens)"
    return f"{len(death.get('resumed') or [])} request(s) waited for its respawn"


def _signal_name(code: int | None) -> str:
    import signal

    if code is None or code >= 0:
        return f"exit status {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _remove_if_empty(run_dir: Path, code: int) -> int:
    """``code``, after removing ``run_dir`` when it holds nothing but Hydra's ``.hydra`` and empty
    files (Hydra's log), and then its empty parents under ``outputs/``."""
    if run_dir.is_dir() and all(p.name == ".hydra" or _empty_file(p) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)
        for d in (run_dir.parent, run_dir.parent.parent):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return code


def _empty_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == 0


if __name__ == "__main__":
    sys.exit(main())
