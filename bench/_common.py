"""What the benchmarks share: argument plumbing and the rerun command, medians, a sampler of how
busy the machine is, the seeded checkpoint, scalar reductions over ranks."""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import threading


# ---- arguments and the command that reruns a bench ---------------------------------------------------
def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (an argparse type)."""
    return [int(x) for x in text.split(",") if x]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A bench's parser, described by the first line of its module docstring."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)


def add_sizes(p: argparse.ArgumentParser, defaults: dict, small: dict | None = None) -> None:
    """One ``--key`` per entry of ``defaults`` (a list is a comma list) and, with ``small``,
    ``--small``; flags left unset are filled by :func:`fill_sizes` from the chosen set."""
    for key, value in defaults.items():
        kind = ints if isinstance(value, list) else type(value)
        p.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None, help=f"default {value}")
    if small is not None:
        p.add_argument("--small", action="store_true", help=f"a quick check: {small}")


def fill_sizes(args: argparse.Namespace, defaults: dict, small: dict | None = None) -> argparse.Namespace:
    """Unset size flags take the ``--small`` set's value if given, else the default."""
    base = small if small is not None and getattr(args, "small", False) else defaults
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def launcher(script: str, world: int | None = None, *, one_thread: bool = True) -> str:
    """How a bench is launched: ``torchrun`` over ``world`` ranks, or plain ``python`` (``None``)."""
    env = "OMP_NUM_THREADS=1 " if one_thread else ""
    if world is None:
        return f"{env}python bench/{script}"
    return f"{env}torchrun --standalone --nproc-per-node {world} bench/{script}"


def rerun_command(script: str, world: int | None = None, *, one_thread: bool = True, argv=None) -> str:
    """The command that reruns this bench exactly: its launcher and the flags it was given."""
    flags = sys.argv[1:] if argv is None else list(argv)
    return " ".join([launcher(script, world, one_thread=one_thread), *map(shlex.quote, flags)])


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


class LoadSampler:
    """Rank 0: every 2 s, Python processes outside this job and the 1-min load average."""

    def __init__(self, own_pids: set[int]) -> None:
        self.own = own_pids
        self.others = []
        self.load = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["ps", "-eo", "pid,pcpu,args"], capture_output=True, text=True).stdout
                n = 0
                for line in out.splitlines()[1:]:
                    pid, pcpu, cmd = line.split(None, 2)
                    if int(pid) not in self.own and "python" in cmd and float(pcpu) > 5:
                        n += 1
                self.others.append(n)
                self.load.append(os.getloadavg()[0])
            except Exception:
                pass
            self._stop.wait(2.0)

    def summary(self) -> str:
        self._stop.set()
        if not self.others:
            return "no samples"
        return (
            f"other python processes above 5% CPU: min {min(self.others)}, median {med(self.others):.0f}, "
            f"max {max(self.others)} ({len(self.others)} samples every 2 s); 1-min load average "
            f"{min(self.load):.1f}-{max(self.load):.1f} on {os.cpu_count()} cores"
        )


def bench_checkpoint(args, prefix: str):
    """A seeded Llama of the sizes in ``args`` (built once by rank 0, cached by name)."""
    import torch.distributed as dist

    from reshard.parallel.model.tiny_models import cached_checkpoint

    name, overrides = llama_sizes(args, prefix)
    if dist.get_rank() == 0:
        cached_checkpoint(name, overrides)
    dist.barrier()
    return cached_checkpoint(name, overrides)


def llama_sizes(args, prefix: str) -> tuple[str, dict]:
    """The cache name and config overrides of a seeded Llama of the sizes in ``args``."""
    overrides = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
    }
    name = (
        f"{prefix}-llama-h{args.hidden}-i{args.intermediate}-l{args.layers}-a{args.heads}"
        f"-kv{args.kv_heads}-v{args.vocab}-seed0-v1"
    )
    return name, overrides


def reduce_scalar(x: float, op=None) -> float:
    """``x`` reduced over every rank (max by default)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
    return t.item()
