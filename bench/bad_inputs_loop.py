"""Run one bad input many times: a MoE checkpoint with one expert tensor of the wrong shape under
``parallel.ep=2`` (``reshard generate --nproc 2``), which once left a rank waiting in a collective
while its peer had refused it. Each run must end with one ``error:`` line naming the tensor and
exit status 2 within ``--timeout`` seconds; prints each run's outcome and the counts.

    python bench/bad_inputs_loop.py --runs 20 [--timeout 120] [--keep DIR] [--checkpoint DIR]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

TENSOR = "model.layers.1.mlp.experts.2.up_proj.weight"  # the expert tensor cut to 31 rows
ROWS = 31


def misshapen_expert_checkpoint(path: Path) -> Path:
    """A tiny Qwen3-MoE checkpoint (8 experts, EP2: 4 a rank) at ``path`` whose ``TENSOR`` holds
    ``ROWS`` rows instead of the model's 48."""
    from safetensors.torch import load_file, save_file

    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint("qwen3_moe", path, seed=0)
    weights = load_file(path / "model.safetensors")
    weights[TENSOR] = weights[TENSOR][:ROWS].contiguous()  # (31, 64), the model's (48, 64)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@dataclass(frozen=True)
class Outcome:
    """How one run ended: ``refused`` (one error line naming the tensor, exit 2), ``hung`` (killed
    at the timeout), or ``other`` (anything else; ``lines`` says what)."""

    kind: str
    returncode: int | None
    seconds: float
    lines: tuple[str, ...]


def run_once(checkpoint: Path, run_dir: Path, timeout: float) -> Outcome:
    """``reshard generate --nproc 2 model.path=checkpoint parallel.ep=2`` once, classified."""
    cmd = [sys.executable, "-m", "reshard.recipes.cli", "generate", "--nproc", "2"]
    cmd += [f"model.path={checkpoint}", "parallel.ep=2", f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and its ranks
        out, _ = proc.communicate()
        return Outcome("hung", None, time.monotonic() - start, tuple(out.splitlines()))
    lines = tuple(line for line in out.splitlines() if line.strip())
    refused = proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and TENSOR in lines[0]
    return Outcome("refused" if refused else "other", proc.returncode, time.monotonic() - start, lines)


def main(argv: list[str] | None = None) -> Counter:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="how many runs (default 20)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take before it counts as hung")
    p.add_argument("--keep", type=Path, help="build the checkpoint and run directories here (default: a temp dir)")
    p.add_argument("--checkpoint", type=Path, help="one misshapen_expert_checkpoint made before: used, none built")
    args = p.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    checkpoint = args.checkpoint or misshapen_expert_checkpoint(root / "checkpoint")
    counts: Counter = Counter()
    for i in range(args.runs):
        outcome = run_once(checkpoint, root / f"run{i}", args.timeout)
        counts[outcome.kind] += 1
        last = outcome.lines[-1] if outcome.lines else ""
        ended = f"exit {outcome.returncode}, {outcome.seconds:.1f} s"
        print(f"run {i + 1}/{args.runs}: {outcome.kind} ({ended}) {last[:160]}", flush=True)
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.runs} runs: {counts['refused']} refused in one line (exit 2), {counts['hung']} hung "
        f"(> {args.timeout:.0f} s), {counts['other']} other"
    )
    print(f"rerun: python bench/bad_inputs_loop.py --runs {args.runs} --timeout {args.timeout:g}")
    return counts


if __name__ == "__main__":
    sys.exit(0 if set(main()) <= {"refused"} else 1)
