"""Online serving: latency and throughput against the arrival rate, engine groups vs lockstep.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/online.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/online.py --rates 2,4,8 --png bench/online

A seeded Llama of ``--hidden``/``--layers``/... (built once into the cache dir) serves
``--requests`` seeded requests, prompts uniform over ``--prompt-lens``, ``--new-tokens`` greedy
tokens each (EOS ignored; ``--budgets LO,HI``: uniform over that range, as in ``bench/generate.py
--workload realistic``), arriving as a seeded Poisson process at each rate of ``--rates``
(requests/s; ``0``: all at once, offline). For each rate, each layout of ``--layouts`` on the same
ranks, side by side:

* ``tp``: tensor parallel over every rank, one group;
* ``dp-groups``: every rank a replica, each its own engine group fed by the router;
* ``dp-lockstep``: every rank a replica, all replicas in every step (the loop before engine groups);
* ``shift``: Shift parallelism, SP ``--sp`` x TP for big steps, TP over every rank for small ones;
* ``dejavu``: prompts on the first ``--prompt-ranks`` ranks, tokens on the rest, each rank its own
  engine group (the sides run at the same time; prompt KV streams layer by layer);
* ``dejavu-lockstep``: the same sides stepping together in one loop (one prompt and one token side).

Offline (rate 0), with ``dp-groups`` measured: each replica's prefill seconds ``P`` and decode
seconds ``D`` give the throughput perfect overlap allows a disaggregated run on the same ranks,
``(P + D) / (2 max(P, D))`` of the replicas' (prompt and token sides of equal size), and each
``dejavu`` run's share of that bound.

Per run: throughput (requests/s and output tokens/s over the wall time of ``generate``) and the
p50/p90/p99 of time to first token (TTFT), time per output token (TPOT) and normalized latency
(seconds per generated token, DejaVu's metric). Ratios are against ``dp-lockstep`` at the same
rate. ``--png PREFIX`` writes one plot per metric (``PREFIX-<metric>.png``). Measure on a quiet
machine: under load a multi-rank job gets about one core and every layout looks alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import add_sizes, bench_checkpoint, fill_sizes, ints, parser, rerun_command

SIZES = {
    "hidden": 256,
    "intermediate": 768,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 8000,
    "requests": 32,
    "new_tokens": 20,
    "batch": 8,
    "rates": [0, 4, 16],
    "prompt_lens": [64, 256],
    "seed": 0,
}
SMALL = {**SIZES, "hidden": 64, "intermediate": 128, "layers": 2, "vocab": 512, "requests": 8, "rates": [0, 8]}
LAYOUTS = ("tp", "dp-groups", "dp-lockstep", "shift", "dejavu", "dejavu-lockstep")
DEFAULT_LAYOUTS = ("tp", "dp-groups", "dp-lockstep", "dejavu")
METRICS = ("ttft", "tpot", "normalized")


def _requests(args, rate: float):
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine.workload import poisson_arrivals

    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_lens
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=gen).tolist() for n in lengths]
    arrivals = poisson_arrivals(args.requests, rate, args.seed) if rate > 0 else [0.0] * args.requests
    budgets = torch.randint(args.budgets[0], args.budgets[1] + 1, (args.requests,), generator=gen).tolist()
    return [
        Request(i, p, SamplingParams(max_new_tokens=b, ignore_eos=True), arrival=a)
        for i, (p, b, a) in enumerate(zip(prompts, budgets, arrivals))
    ]


def _engine(path: str, layout: str, args):
    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize

    world = dist.get_world_size()
    if layout in ("shift", "dejavu", "dejavu-lockstep"):
        return _strategy_engine(path, layout, args)
    dims = ParallelDims.from_world(tp=world) if layout == "tp" else ParallelDims.from_world(dp=world)
    replicas = "lockstep" if layout == "dp-lockstep" else "groups"
    max_len = args.prompt_lens[1] + args.budgets[1]
    return Engine(
        parallelize(path, dims), EngineConfig(max_batch_size=args.batch, max_seq_len=max_len, replicas=replicas)
    )


def _strategy_engine(path: str, layout: str, args):
    from reshard.parallel.engine import EngineConfig
    from reshard.recipes.schema import strategy_config

    if layout == "shift":
        keys = {"strategy": "shift", "sp": args.sp}
    else:
        n = args.prompt_ranks or dist.get_world_size() // 2
        keys = {"strategy": "dejavu", "prompt_ranks": n}
        if layout == "dejavu":  # one group per rank on each side (lockstep: one TP group per side)
            keys.update(prompt={"dp": n}, token={"dp": dist.get_world_size() - n})
    replicas = "lockstep" if layout == "dejavu-lockstep" else "groups"
    config = EngineConfig(
        max_batch_size=args.batch, max_seq_len=args.prompt_lens[1] + args.budgets[1], replicas=replicas
    )
    return strategy_config(keys).build(path, config)


def _phase_seconds(engine) -> tuple[float, float]:
    """Mean prefill and decode seconds per engine group (one group: its own)."""
    stats = engine.group_stats or [engine.stats]
    return (sum(s.prefill_seconds for s in stats) / len(stats), sum(s.decode_seconds for s in stats) / len(stats))


def _overlap_lines(table: dict, layouts: list[str]) -> list[str]:
    """Offline: the disaggregated bound from the replicas' phase times, and each DejaVu run's share."""
    if ("dp-groups", 0) not in table:
        return []
    P, D = table["dp-groups", 0]["phases"]
    bound = (P + D) / (2 * max(P, D))
    lines = [f"dp-groups per replica: prefill P {P:.3f} s, decode D {D:.3f} s; perfect overlap allows {bound:.2f}x"]
    base = table["dp-groups", 0]["output_tokens_per_s"]
    for layout in (x for x in layouts if x.startswith("dejavu")):
        ratio = table[layout, 0]["output_tokens_per_s"] / base
        lines.append(f"{layout}: {ratio:.2f}x dp-groups = {ratio / bound:.2f} of perfect overlap")
    return lines


def _run(engine, requests) -> dict:
    from reshard.parallel.engine.metrics import latency_summary

    dist.barrier()
    t0 = time.perf_counter()
    completions = engine.generate(requests)
    seconds = time.perf_counter() - t0
    assert all(len(c.output_ids) == r.sampling.max_new_tokens for c, r in zip(completions, requests))
    return {
        "seconds": seconds,
        "tokens": [c.output_ids for c in completions],
        "phases": _phase_seconds(engine),
        **latency_summary(completions, seconds),
    }


def _line(layout: str, rate: float, r: dict, base: dict) -> str:
    figures = "  ".join(
        f"{m} {r[m]['p50'] * 1e3:7.1f}/{r[m]['p90'] * 1e3:7.1f}/{r[m]['p99'] * 1e3:7.1f}" for m in METRICS
    )
    ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    return (
        f"{layout:15s} rate {rate:5.1f}/s  {r['requests_per_s']:6.2f} req/s {r['output_tokens_per_s']:8.1f} tok/s "
        f"({ratio:4.2f}x lockstep)  {figures}  (ms p50/p90/p99)"
    )


def _plot(prefix: str, table: dict, args) -> None:
    """One PNG per metric: p50 latency (log scale) or throughput against the arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({rate for _, rate in table})
    workload = (
        f"{args.requests} requests, prompts {args.prompt_lens[0]}-{args.prompt_lens[1]}, "
        f"{args.budgets[0]}-{args.budgets[1]} new tokens, hidden {args.hidden} x {args.layers} layers"
    )
    for metric in (*METRICS, "output_tokens_per_s"):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for layout in (x for x in LAYOUTS if any((x, rate) in table for rate in rates)):
            points = [(rate, table[layout, rate]) for rate in rates if (layout, rate) in table]
            values = [r[metric] if metric == "output_tokens_per_s" else r[metric]["p50"] for _, r in points]
            ax.plot([rate for rate, _ in points], values, marker="o", label=layout)
        unit = "tokens/s" if metric == "output_tokens_per_s" else "s, p50, log scale"
        if metric != "output_tokens_per_s":
            ax.set_yscale("log")
        ax.set(xlabel="arrival rate (requests/s; 0 = all at once)", ylabel=f"{metric} [{unit}]")
        title = f"{metric} vs arrival rate, {dist.get_world_size()} gloo ranks on 2 CPU cores\n{workload}"
        ax.set_title(title, fontsize=8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{prefix}-{metric}.png", dpi=100)
        plt.close(fig)


def main() -> None:
    p = parser(__doc__)
    add_sizes(p, SIZES, SMALL)
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma list of {LAYOUTS}")
    p.add_argument("--prompt-ranks", type=int, default=None, help="dejavu: prompt side ranks (default: half)")
    p.add_argument("--sp", type=int, default=2, help="shift: Ulysses degree")
    p.add_argument("--budgets", type=ints, default=None, help="new tokens uniform over LO,HI (default: --new-tokens)")
    p.add_argument("--png", default=None, help="write PREFIX-<metric>.png plots")
    p.add_argument("--json", default=None, help="write the figures to this file (bench/serve.py reads them)")
    args = fill_sizes(p.parse_args(), SIZES, SMALL)
    args.budgets = args.budgets or [args.new_tokens, args.new_tokens]
    dist.init_process_group("gloo")
    path = str(bench_checkpoint(args, "online"))
    layouts = [x for x in args.layouts.split(",") if x]
    table = {}
    for rate in args.rates:
        requests = _requests(args, rate)
        for layout in layouts:
            engine = _engine(path, layout, args)
            with engine:
                _run(engine, requests[:2])  # warm-up
                engine.stats = type(engine.stats)()  # count the measured run alone
                table[layout, rate] = _run(engine, requests)
        same = all(table[x, rate]["tokens"] == table[layouts[0], rate]["tokens"] for x in layouts)
        if dist.get_rank() == 0:
            base = table.get(("dp-lockstep", rate), table[layouts[0], rate])
            print(f"\n-- rate {rate}/s: {args.requests} requests, same tokens in every layout: {same}", flush=True)
            for layout in layouts:
                print(_line(layout, rate, table[layout, rate], base), flush=True)
    if dist.get_rank() == 0:
        print("\n".join(["", *_overlap_lines(table, layouts)]), flush=True)
        if args.png:
            _plot(args.png, table, args)
        if args.json:
            keep = ("tokens", "phases", "units")
            figures = {
                x: {r: {k: v for k, v in f.items() if k not in keep} for (y, r), f in table.items() if y == x}
                for x in layouts
            }
            Path(args.json).write_text(json.dumps(figures))
        print(f"\ncommand: {rerun_command('online.py', dist.get_world_size())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
