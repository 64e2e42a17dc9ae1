"""Run the errors that once ended badly many times, each in fresh processes: a weight sync given a
tensor step (every rank, or only the trainer's rank 0: an optimizer's step), and generating while a
background sync writes the weights. Each run is 2 gloo ranks of ``reshard.LLM(tp=2)`` started as
torchrun starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``; one process per rank, so
each rank's own ending is seen). A run is clean when every rank exits with status 1, its last line
is the case's error (the same line on every rank), nothing says ``terminate called`` and nothing
is left in /dev/shm; a hang is a rank still running at ``--timeout``; an abort is a rank killed by
a signal (SIGABRT) or ending in ``terminate called``, or an exit status other than 1.

    python bench/error_exits.py [--runs 20] [--timeout 120] [--cases step_tensor,generate_during_sync]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

WORLD = 2
STEP_ERROR = "ValueError: step must be an int, got Tensor tensor(3)"
CASES = {  # case -> the last line every rank must end with (its start)
    "step_tensor": f"{STEP_ERROR} (ranks 0, 1)",
    "step_tensor_on_rank0": f"{STEP_ERROR} (rank 0)",
    "generate_during_sync": "RuntimeError: the weights are half-synced: step 3 is being written",
}


# ---- one rank of a run -----------------------------------------------------------------------------
def rank_main(case: str, checkpoint: str) -> None:
    """One rank of ``case`` (started with torchrun's environment): an ``LLM`` over both ranks, a
    sync from an HF module into it, then the mistake. Never returns normally."""
    import torch
    from transformers import AutoModelForCausalLM

    import reshard
    from reshard.parallel.model.weight_sync import model_sync

    torch.set_num_threads(1)
    llm = reshard.LLM(checkpoint, tp=WORLD)
    trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)  # the trainer's copy
    sync = model_sync(trained, llm.engine.model)
    rank = int(os.environ["RANK"])
    if case == "step_tensor":
        sync.sync(torch.tensor(3))
    elif case == "step_tensor_on_rank0":  # the trainer's rank passes its optimizer's step (a tensor)
        sync.sync(torch.tensor(3) if rank == 0 else 3)
    elif case == "generate_during_sync":
        sync.start(3)
        llm.generate([[5, 6, 7]])
    raise AssertionError(f"case {case!r} raised nothing")


# ---- a run: both ranks, classified ---------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """What one run's ranks did: exit statuses (``None``: killed at the timeout), their stderr,
    and the /dev/shm entries the run left behind."""

    returncodes: list[int | None]
    stderrs: list[str]
    left: set[str]

    def last_lines(self) -> list[str]:
        """Each rank's last non-blank stderr line, without torch's ``[rankN]: `` prefix."""
        return [last_line(err, rank) for rank, err in enumerate(self.stderrs)]


@dataclass(frozen=True)
class Outcome:
    """How one run ended: ``clean``, ``hang``, ``abort`` or ``wrong`` (another last line, exit 0, or
    something left in /dev/shm); ``detail`` says what, for anything but clean."""

    kind: str
    detail: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_entries() -> set[str]:
    """/dev/shm's entries (Python multiprocessing's semaphores aside)."""
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if not p.name.startswith("sem.mp-")} if root.is_dir() else set()


def last_line(stderr: str, rank: int) -> str:
    """The last non-blank line of a rank's stderr, without torch's ``[rankN]: `` prefix."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1].removeprefix(f"[rank{rank}]: ") if lines else ""


def run_once(case: str, checkpoint: str, timeout: float) -> Run:
    """``case`` on ``WORLD`` fresh rank processes (each killed if still running at ``timeout`` s)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD))
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before = shm_entries()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", case, "--checkpoint", checkpoint],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(WORLD)
    ]
    deadline, stderrs, codes = time.monotonic() + timeout, [], []
    for proc in procs:
        try:
            stderrs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[1])
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            proc.kill()
            stderrs.append(proc.communicate()[1])
            codes.append(None)
    return Run(codes, stderrs, shm_entries() - before)


def classify(case: str, run: Run) -> Outcome:
    """The run's :class:`Outcome` against ``CASES[case]``, the line every rank must end with."""
    hung = [rank for rank, code in enumerate(run.returncodes) if code is None]
    if hung:
        return Outcome("hang", f"ranks {hung} still running at the timeout")
    lines = run.last_lines()
    for rank, (code, err) in enumerate(zip(run.returncodes, run.stderrs)):
        if code not in (0, 1) or "terminate called" in err:
            return Outcome("abort", f"rank {rank}: exit {code}, {lines[rank][:120]!r}")
    for rank, (code, line) in enumerate(zip(run.returncodes, lines)):
        if code == 0 or not line.startswith(CASES[case]):
            return Outcome("wrong", f"rank {rank}: exit {code}, {line[:160]!r}")
    if len(set(lines)) > 1:
        return Outcome("wrong", f"the ranks ended with different lines: {lines}")
    if run.left:
        return Outcome("wrong", f"left in /dev/shm: {sorted(run.left)[:4]}")
    return Outcome("clean")


# ---- the loop --------------------------------------------------------------------------------------
def tiny_checkpoint(root: Path) -> str:
    """The seeded tiny Llama the tests use, saved under ``root``."""
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint("llama", root / "llama", seed=0))


def run_case(case: str, checkpoint: str, runs: int, timeout: float) -> Counter:
    """``case`` ``runs`` times; prints each run that was not clean, then the case's counts."""
    counts: Counter = Counter()
    for i in range(runs):
        outcome = classify(case, run_once(case, checkpoint, timeout))
        counts[outcome.kind] += 1
        if outcome.kind != "clean":
            print(f"  {case} run {i + 1}: {outcome.kind}: {outcome.detail}", flush=True)
    print(
        f"{case}: {runs} runs, {counts['clean']} clean one-line errors, {counts['hang']} hangs, "
        f"{counts['abort']} aborts, {counts['wrong']} wrong",
        flush=True,
    )
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per case (default 20)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    p.add_argument("--rank", choices=sorted(CASES), help=argparse.SUPPRESS)  # a rank of a run
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.rank, args.checkpoint)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {list(CASES)}")
    with tempfile.TemporaryDirectory(prefix="error-exits-") as root:
        checkpoint = tiny_checkpoint(Path(root))
        totals = [run_case(case, checkpoint, args.runs, args.timeout) for case in cases]
    print(f"rerun: python bench/error_exits.py --runs {args.runs} --timeout {args.timeout:g} --cases {','.join(cases)}")
    return 0 if all(set(t) <= {"clean"} for t in totals) else 1


if __name__ == "__main__":
    sys.exit(main())
