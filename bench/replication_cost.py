"""Ring replication's cost on failure-free decode, in one process group: the same requests
decoded without replication, with it packing on the step's thread, and with it packing on the
streamer's thread (the default), variants round-robin.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/replication_cost.py [--repeats 3]

Per variant: wall ms per decode step, time inside the ``step_end`` hook per step, CPU seconds of
the process (all threads) and context switches per step, medians over the repeats (rank 0's).
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import parser, rerun_command

from reshard.parallel import Engine, Request, SamplingParams, parallelize
from reshard.parallel.fault.ring import RingReplication
from reshard.parallel.model.tiny_models import builtin_checkpoint

REPO = Path(__file__).resolve().parents[1]

VARIANTS = (
    "no replication",
    "replication, packing on the step's thread",
    "replication, packing on the streamer's thread",
)


def measure(path, variant: str, requests: list[Request]) -> dict:
    engine = Engine(parallelize(path), max_batch_size=len(requests), max_seq_len=512)
    ring = TimedRing(engine, background=variant == VARIANTS[2]) if variant != VARIANTS[0] else None
    engine.generate(requests[:2])  # warm-up
    warm_steps = engine.stats.decode_steps
    if ring is not None:
        ring.seconds = 0.0
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    engine.generate(requests)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    if ring is not None:
        ring.close()
    steps = engine.stats.decode_steps - warm_steps
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    switches = after.ru_nvcsw - before.ru_nvcsw + after.ru_nivcsw - before.ru_nivcsw
    return {
        "ms_per_step": 1e3 * wall / steps,
        "hook_ms": 1e3 * (ring.seconds if ring is not None else 0.0) / steps,
        "cpu_s": cpu,
        "switches_per_step": switches / steps,
    }


class TimedRing(RingReplication):
    """The ring with the time spent in its ``step_end`` listener counted."""

    seconds = 0.0

    def step_end(self, step, seqs) -> None:
        t0 = time.perf_counter()
        super().step_end(step, seqs)
        self.seconds += time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    path = builtin_checkpoint()
    g = torch.Generator().manual_seed(0)
    requests = [
        Request(i, torch.randint(3, 4000, (32,), generator=g).tolist(), SamplingParams(max_new_tokens=args.new_tokens))
        for i in range(args.requests)
    ]
    rows = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            rows[v].append(measure(path, v, requests))
    if dist.get_rank() == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args, rows: dict) -> None:
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in rows.items()}
    base = med[VARIANTS[0]]
    print(
        f"\nbuilt-in tiny Llama, TP{dist.get_world_size()}, {args.requests} requests x {args.new_tokens} new "
        f"tokens, greedy; median of {args.repeats}, variants round-robin\n"
    )
    print("| variant | ms/step | vs none | hook ms/step | CPU s | vs none | context switches/step |")
    print("|---|---|---|---|---|---|---|")
    for v, m in med.items():
        print(
            f"| {v} | {m['ms_per_step']:.2f} | {m['ms_per_step'] / base['ms_per_step']:.3f} | {m['hook_ms']:.2f} | "
            f"{m['cpu_s']:.2f} | {m['cpu_s'] / base['cpu_s']:.2f} | {m['switches_per_step']:.0f} |"
        )
    print(f"\ncommand: {rerun_command('replication_cost.py', dist.get_world_size())}")


if __name__ == "__main__":
    main()
