"""Ring replication's cost on failure-free decode, in one process group: the same requests
decoded without replication and with it, packing on the step's thread or on the streamer's
thread (the default), one message every ``k`` steps for each ``k`` of ``--every``
(``fault.replicate_every``), variants round-robin.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/replication_cost.py [--repeats 3] [--every 1 4 8]

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

from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize
from reshard.parallel.fault.ring import RingReplication
from reshard.parallel.model.tiny_models import builtin_checkpoint

REPO = Path(__file__).resolve().parents[1]

NONE = ("no replication", 0, False)


def variants(every: list[int]) -> list[tuple[str, int, bool]]:
    """(name, replicate_every, packing on the streamer's thread) of every variant; 0: none."""
    out = [NONE]
    for k in every:
        out += [
            (f"every {k}, packing on the step's thread", k, False),
            (f"every {k}, on the streamer's thread", k, True),
        ]
    return out


def measure(path, variant: tuple[str, int, bool], requests: list[Request]) -> dict:
    _, every, background = variant
    engine = Engine(parallelize(path), EngineConfig(max_batch_size=len(requests), max_seq_len=512))
    ring = TimedRing(engine, background=background, replicate_every=every) if every else None
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
    p.add_argument("--every", type=int, nargs="+", default=[1, 4, 8], help="replicate_every values")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    path = builtin_checkpoint()
    g = torch.Generator().manual_seed(0)
    requests = [
        Request(i, torch.randint(3, 4000, (32,), generator=g).tolist(), SamplingParams(max_new_tokens=args.new_tokens))
        for i in range(args.requests)
    ]
    rows = {v: [] for v in variants(args.every)}
    for _ in range(args.repeats):
        for v in rows:
            rows[v].append(measure(path, v, requests))
    if dist.get_rank() == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args, rows: dict) -> None:
    med = {v[0]: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in rows.items()}
    base = med[NONE[0]]
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
