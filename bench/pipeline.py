"""Pipelines that stay full: PP over every rank (in flight vs drained) against DP replicas.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/pipeline.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/pipeline.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/pipeline.py --small

A seeded Llama of ``--hidden``/``--layers``/... (built once into the cache dir) generates
``--new-tokens`` greedy tokens (EOS ignored) for each of ``--requests`` short prompts
(``--prompt-lens``): a decode-heavy workload. On the same ``W`` ranks, side by side:

* ``dp-groups``: every rank a replica (``--batch`` KV slots), each its own engine group;
* ``pp-drain``: one pipeline of ``W`` stages, ``W`` micro-batches of ``--batch`` slots, every step
  drains the pipeline (the loop before in-flight micro-batches);
* ``pp-inflight``: the same pipeline with micro-batches in flight across steps;
* ``pp-inflight-balanced``: in flight, with fewer layers on the last stage, which also runs the LM
  head and sampling (:func:`balanced_stages`);
* ``pp-inflight-paged``: in flight on a paged cache (blocks of 16) of ``--kv-tokens`` tokens
  (default: what the contiguous slots hold): a sequence takes blocks as its tokens need them and
  the newest request is preempted when they run out (the preemptions are printed).

Every layout holds ``W * --batch`` sequences at once and every rank computes ``1/W`` of the
model's FLOPs per token, so a full pipeline would match the replicas. Per layout: output tokens/s
over the wall time of ``generate`` (median of ``--repeats``), its ratio to ``dp-groups`` and each
rank's idle fraction (1 - seconds in its forward bodies / wall time; a pipeline rank is a stage).
Measure on a quiet machine: under load every layout looks alike.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from _common import add_sizes, bench_checkpoint, fill_sizes, med, parser, rerun_command

SIZES = {
    "hidden": 512,
    "intermediate": 1536,
    "layers": 8,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 8000,
    "requests": 32,
    "new_tokens": 64,
    "batch": 4,
    "prompt_lens": [8, 32],
    "repeats": 3,
    "seed": 0,
}
SMALL = {**SIZES, "hidden": 128, "intermediate": 256, "layers": 4, "vocab": 1024, "requests": 8, "new_tokens": 16}
LAYOUTS = ("dp-groups", "pp-drain", "pp-inflight", "pp-inflight-balanced", "pp-inflight-paged")


def _requests(args):
    from reshard.parallel import Request, SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_lens
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = [torch.randint(3, args.vocab, (n,), generator=gen).tolist() for n in lengths]
    return [Request(i, p, params) for i, p in enumerate(prompts)]


def _engine(path: str, layout: str, args):
    """``layout``'s engine over every rank (each holds ``W * batch`` sequences at once)."""
    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize
    from reshard.parallel.model.pipeline import balanced_stages, parallelize_pipeline

    world = dist.get_world_size()
    max_len = args.prompt_lens[1] + args.new_tokens
    if layout == "dp-groups":
        model = parallelize(path, ParallelDims.from_world(dp=world))
        return Engine(model, EngineConfig(max_batch_size=args.batch, max_seq_len=max_len))
    stages = None
    if layout.endswith("-balanced"):
        from transformers import AutoConfig

        stages = balanced_stages(AutoConfig.from_pretrained(path), world)
    model = parallelize_pipeline(path, ParallelDims(pp=world, world_size=world, stages=stages))
    pipeline = layout.removeprefix("pp-").removesuffix("-balanced").removesuffix("-paged")
    paged = dict(kv_block_size=16, kv_tokens=args.kv_tokens) if layout.endswith("-paged") else {}
    config = EngineConfig(
        max_batch_size=world * args.batch, max_seq_len=max_len, num_microbatches=world, pipeline=pipeline, **paged
    )
    return Engine(model, config)


def _run(engine, requests) -> dict:
    """One ``generate``: wall seconds, output tokens/s, this rank's idle fraction, the tokens."""
    dist.barrier()
    busy0 = engine.runner.busy_seconds
    t0 = time.perf_counter()
    completions = engine.generate(requests)
    seconds = time.perf_counter() - t0
    busy = engine.runner.busy_seconds - busy0
    tokens = sum(len(c.output_ids) for c in completions)
    return {"seconds": seconds, "tok_s": tokens / seconds, "idle": 1 - busy / seconds, "tokens": completions}


def _idle_by_rank(idle: float) -> list[float]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, idle)
    return everyone


def main() -> None:
    p = parser(__doc__)
    add_sizes(p, SIZES, SMALL)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {LAYOUTS}")
    p.add_argument("--kv-tokens", type=int, default=None, help="pp-inflight-paged's cache (default: the slots')")
    args = fill_sizes(p.parse_args(), SIZES, SMALL)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    path = str(bench_checkpoint(args, "pipeline"))
    requests = _requests(args)
    layouts = [x for x in args.layouts.split(",") if x]
    table = {}
    for layout in layouts:
        engine = _engine(path, layout, args)
        _run(engine, requests[: 2 * dist.get_world_size()])  # warm-up
        runs = [_run(engine, requests) for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]  # the median run
        table[layout] = {**best, "idle": _idle_by_rank(best["idle"]), "tok_s": med([r["tok_s"] for r in runs])}
        table[layout]["preemptions"] = engine.stats.preemptions
    outputs = [[c.output_ids for c in table[x]["tokens"]] for x in layouts]
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        base = table.get("dp-groups", table[layouts[0]])
        print(f"\n-- {world} ranks, {args.requests} requests x {args.new_tokens} tokens, prompts {args.prompt_lens}")
        print(f"same tokens in every layout: {all(o == outputs[0] for o in outputs)}")
        for layout in layouts:
            r = table[layout]
            idle = " ".join(f"{x:.2f}" for x in r["idle"])
            ratio = r["tok_s"] / base["tok_s"]
            print(f"{layout:21s} {r['tok_s']:8.1f} tok/s  {ratio:5.2f}x dp-groups  idle by rank/stage: {idle}")
            if layout.endswith("-paged"):
                print(f"{'':21s} preemptions over its {args.repeats + 1} runs: {r['preemptions']}")
        if "pp-drain" in table and "pp-inflight" in table:
            print(f"in flight vs drained: {table['pp-inflight']['tok_s'] / table['pp-drain']['tok_s']:.2f}x")
        print(f"\ncommand: {rerun_command('pipeline.py', world)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
