"""What the benchmarks share: medians and a sampler of how busy the machine is."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


class LoadSampler:
    """Rank 0: every 2 s, Python processes outside this job and the 1-min load average."""

    def __init__(self, own_pids: set[int]) -> None:
        self.own, self.others, self.load = own_pids, [], []
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
    if dist.get_rank() == 0:
        cached_checkpoint(name, overrides)
    dist.barrier()
    return cached_checkpoint(name, overrides)


def reduce_scalar(x: float, op=None) -> float:
    """``x`` reduced over every rank (max by default)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
    return t.item()
