"""Seesaw benchmark: end-to-end throughput of static layouts vs Seesaw's prefill -> decode re-sharding.

Run from the repo root on 4 ranks:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/seesaw.py

Model: the built-in tiny Llama (``builtin_checkpoint()``: 4 layers, hidden 256, 8 heads, 4 KV heads,
fp32). Engines, all on the same 4 ranks, each with ``--slots`` KV slots per model replica:

- static TP4: ``Engine`` on ``parallelize(tp=4)``.
- static PP4 and D2P2: the engine over pipeline stages (2 micro-batches); with dp=2 the loop
  alternates the requests over the two replicas.
- Seesaw P4->T4 and D2P2->T4: ``seesaw_engine`` (transition-minimizing scheduler, ``weights=move``)
  with a CPU KV tier of ``--tier-share`` x the workload's prompt tokens, so it must go back and
  forth several times.

Workloads (seeded, greedy, no stop tokens so every request generates its full output):
``long-in``: long prompts, short outputs (the paper's arXiv-summarization shape) and
``balanced``: equal prompt and output lengths. Throughput = (prompt + generated tokens) / wall
seconds of one ``generate`` call over the whole workload. Each engine runs one warm-up, then
``--repeats`` timed runs round-robin with the others; medians are reported. For Seesaw the share
of wall time spent in weight re-sharding and in swap waits on the main thread is reported too.
CPU timings are not GPU timings: on CPU, compute dominates and collectives are cheap relative to
GPU ratios, so the ranking of layouts can differ from the paper's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import parser, rerun_command

from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
from reshard.parallel.model.pipeline import parallelize_pipeline
from reshard.parallel.model.tiny_models import builtin_checkpoint
from reshard.parallel.strategies.seesaw import LayoutSwitch, seesaw_engine

REPO = Path(__file__).resolve().parent.parent

WORKLOADS = {"long-in": (320, 16), "balanced": (96, 96)}  # (prompt tokens, new tokens)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--slots", type=int, default=8, help="KV slots (max batch) per model replica")
    p.add_argument(
        "--tier-share", type=float, default=0.35, help="CPU KV tier capacity as a share of the workload's prompt tokens"
    )
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args()


def requests(n: int, prompt_len: int, new_tokens: int, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [Request(i, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params) for i in range(n)]


class Static:
    """A static layout: one engine; its loop splits the requests over the dp replicas."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, reqs: list[Request]) -> dict:
        self.engine.generate(reqs)
        return {}


class Seesaw:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, reqs: list[Request]) -> dict:
        before = _counters(self.engine.stats)
        self.engine.generate(reqs)
        after = _counters(self.engine.stats)
        return {k: after[k] - before[k] for k in after}


def _counters(s) -> dict:
    return {"transitions": s.transitions, "reshard_s": s.reshard_seconds, "swap_s": s.swap_seconds}


def build(path: Path, world: int, slots: int, tier_tokens: int) -> dict:
    dims = lambda **d: ParallelDims(**d, world_size=world)  # noqa: E731
    kw = dict(max_batch_size=slots, max_seq_len=512)
    tp4 = dims(tp=4)
    pp4 = dims(pp=4)
    d2p2 = dims(dp=2, pp=2)
    piped = EngineConfig(num_microbatches=2, **kw)
    engines = {
        "static TP4": Static(Engine(parallelize(path, tp4), EngineConfig(**kw))),
        "static PP4": Static(Engine(parallelize_pipeline(path, pp4), piped)),
        "static D2P2": Static(Engine(parallelize_pipeline(path, d2p2), piped)),
    }
    for name, pre in (("seesaw P4->T4", pp4), ("seesaw D2P2->T4", d2p2)):
        switch = LayoutSwitch(path, pre, tp4, weights="move")
        engines[name] = Seesaw(seesaw_engine(switch, EngineConfig(**kw), cpu_kv_budget=tier_tokens))
    return engines


def timed(runner, reqs: list[Request]) -> tuple[float, dict]:
    dist.barrier()
    t0 = time.perf_counter()
    extra = runner.run(reqs)
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank (or replica) ends the run
    return wall.item(), extra


def bench_workload(name: str, args, path: Path, vocab: int, world: int) -> list[dict]:
    prompt_len, new_tokens = WORKLOADS[name]
    reqs = requests(args.requests, prompt_len, new_tokens, vocab)
    tier = max(int(args.tier_share * args.requests * prompt_len), prompt_len)
    engines = build(path, world, args.slots, tier)
    for runner in engines.values():  # warm-up
        timed(runner, reqs)
    samples: dict[str, list] = {k: [] for k in engines}
    for _ in range(args.repeats):
        for key, runner in engines.items():
            samples[key].append(timed(runner, reqs))
    tokens = args.requests * (prompt_len + new_tokens)
    rows = []
    for key, runs in samples.items():
        wall = statistics.median(w for w, _ in runs)
        extra = {k: statistics.median(e[k] for _, e in runs) for k in runs[0][1]}  # rank 0's counters
        rows.append({"workload": name, "engine": key, "wall_s": wall, "tok_s": tokens / wall, **extra})
    for runner in engines.values():
        if isinstance(runner, Seesaw):
            runner.engine.close()
    return rows


def report(rows: list[dict], args, tier_share: float) -> None:
    print(
        f"\ncommand: {rerun_command('seesaw.py', dist.get_world_size())}\n"
        f"requests={args.requests}, slots={args.slots}, tier={tier_share} x prompt tokens, "
        f"repeats={args.repeats} (medians)\n"
    )
    print(
        f"{'workload':9} {'engine':17} {'wall s':>7} {'tok/s':>8} {'/best static':>12} "
        f"{'trans':>5} {'reshard%':>8} {'swap%':>6}"
    )
    for wl in WORKLOADS:
        mine = [r for r in rows if r["workload"] == wl]
        best = max(r["tok_s"] for r in mine if r["engine"].startswith("static"))
        for r in mine:
            extra = ""
            if "transitions" in r:
                extra = (
                    f" {r['transitions']:5.0f} {100 * r['reshard_s'] / r['wall_s']:7.1f}% "
                    f"{100 * r['swap_s'] / r['wall_s']:5.1f}%"
                )
            print(f"{wl:9} {r['engine']:17} {r['wall_s']:7.2f} {r['tok_s']:8.1f} {r['tok_s'] / best:12.2f}{extra}")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world != 4:
        raise SystemExit(f"bench/seesaw.py needs 4 ranks, got {world}")
    if dist.get_rank() == 0:
        builtin_checkpoint()
    dist.barrier()
    path = builtin_checkpoint()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rows = [r for wl in WORKLOADS for r in bench_workload(wl, args, path, vocab, world)]
    if dist.get_rank() == 0:
        report(rows, args, args.tier_share)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
