"""A GRPO-shaped rollout with the prefix cache on and off: prompts of 256-512 tokens, ``n``
samples each, 16-64 new tokens, one process, a paged cache (the tiny Llama widened to a model
whose prefill costs something on this CPU).

    python bench/prefix_cache.py [--prompts 8] [--n 8] [--new-tokens 32] [--repeats 3] [--small]
    torchrun --standalone --nproc-per-node 2 bench/prefix_cache.py --shift-sp 2 [--threshold 64]
    torchrun --standalone --nproc-per-node 2 bench/prefix_cache.py --dejavu
    torchrun --standalone --nproc-per-node 2 bench/prefix_cache.py --pp

``--shift-sp``: Shift parallelism over the torchrun ranks (Ulysses SP of that degree x TP of the
rest, steps of more than ``--threshold`` tokens in SP mode, the others full TP), one paged cache
for both modes. ``--dejavu``: DejaVu over the torchrun ranks (one prompt rank, the others
tokens, each side an engine group; contiguous caches), an engine built for each run (two at
once would share their streams' keys); ``streamed``: prompt positions streamed to the token side.
``--pp``: a pipeline of the torchrun ranks, micro-batches in flight; besides the paged cache on and
off, a third row runs contiguous slots (a pipeline's default cache before 2026-11-30).

Each figure is the median over ``--repeats`` runs, on and off interleaved; the tokens of both
are checked equal. ``prefill s``: the seconds of steps that fed prompt tokens (prefill and mixed
steps, decode tokens riding in them included); ``computed``: prompt tokens computed over prompt
tokens asked. Run it in a session of its own (``setsid``) on a quiet machine: this kernel shares
CPU between sessions.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, bench_checkpoint, fill_sizes, med, parser, rerun_command

DEFAULTS = {
    "prompts": 8,
    "n": 8,
    "new_tokens": 32,
    "repeats": 3,
    "hidden": 256,
    "intermediate": 688,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 4096,
}
SMALL = {**DEFAULTS, "prompts": 2, "n": 4, "new_tokens": 8, "repeats": 1}
BLOCK = 16
CONTIGUOUS = "contig"  # --pp's third row: contiguous slots


def _requests(args) -> list:
    """``n`` seeded samples (temperature 0.8) of each prompt; prompts of 256-512 tokens."""
    from reshard.parallel import Request, SamplingParams

    g = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(args.prompts):
        prompt = torch.randint(3, args.vocab, (int(torch.randint(256, 513, (1,), generator=g)),), generator=g)
        for j in range(args.n):
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, seed=j, ignore_eos=True)
            requests.append(Request(len(requests), prompt.tolist(), params))
    return requests


def _run(engine, requests) -> tuple[float, float, float, list, int]:
    """(seconds, prefill seconds, prompt tokens computed / asked, tokens, prompt positions streamed:
    DejaVu's, else 0) of one ``generate`` (this rank's group's figures)."""
    s = engine.stats
    before, computed = s.prefill_seconds + s.mixed_seconds, s.prompt_tokens_computed
    t0 = time.perf_counter()
    tokens = [c.output_ids for c in engine.generate(requests)]
    seconds = time.perf_counter() - t0
    asked = sum(len(r.prompt_ids) for r in requests)
    streamed = sum(getattr(g, "streamed_tokens", 0) for g in engine.group_stats)
    prefill = s.prefill_seconds + s.mixed_seconds - before
    return seconds, prefill, (s.prompt_tokens_computed - computed) / asked, tokens, streamed


def _dejavu_run(args, config: dict, on: bool, requests) -> tuple:
    """:func:`_run` on a DejaVu engine built for it (prefix caching ``on``), closed after."""
    from reshard.parallel import EngineConfig
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 1})
    config = {k: v for k, v in config.items() if k not in ("kv_block_size", "kv_tokens")}
    engine = strategy.build(str(bench_checkpoint(args, "prefix")), EngineConfig(**config, prefix_caching=on))
    with engine:
        return _run(engine, requests)


def _engines(args, config: dict) -> dict:
    """Cache on and off: one process's engine, or Shift's over the torchrun ranks."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize
    from reshard.parallel.strategies.shift import parallelize_shift, shift_engine

    path = str(bench_checkpoint(args, "prefix"))
    if args.dejavu:
        return {}  # (one per run: _dejavu_run)
    if args.pp:
        from reshard.parallel.model.pipeline import parallelize_pipeline

        world = dist.get_world_size()
        model = parallelize_pipeline(path, ParallelDims(pp=world, world_size=world))
        config = {**config, "num_microbatches": world}
        contiguous = {k: v for k, v in config.items() if k not in ("kv_block_size", "kv_tokens")}
        engines = {on: Engine(model, EngineConfig(**config, prefix_caching=on)) for on in (True, False)}
        return {**engines, CONTIGUOUS: Engine(model, EngineConfig(**contiguous))}
    if args.shift_sp is None:
        model = parallelize(path)
        return {on: Engine(model, EngineConfig(**config, prefix_caching=on)) for on in (True, False)}
    world = dist.get_world_size()
    model = parallelize_shift(path, ParallelDims(sp=args.shift_sp, tp=world // args.shift_sp, world_size=world))
    return {
        on: shift_engine(model, EngineConfig(**config, prefix_caching=on), threshold=args.threshold)
        for on in (True, False)
    }


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    p.add_argument("--shift-sp", type=int, default=None, help="Shift parallelism, this SP degree (under torchrun)")
    p.add_argument("--threshold", type=int, default=64, help="Shift: steps of more tokens run SP")
    p.add_argument("--dejavu", action="store_true", help="DejaVu over the torchrun ranks (1 prompt rank)")
    p.add_argument("--pp", action="store_true", help="a pipeline of the torchrun ranks, in flight")
    args = fill_sizes(p.parse_args(argv), DEFAULTS, SMALL)
    import torch.distributed as dist

    one_process = args.shift_sp is None and not args.dejavu and not args.pp
    torch.set_num_threads(2 if one_process else 1)
    if one_process:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    requests = _requests(args)
    longest = max(len(r.prompt_ids) for r in requests) + args.new_tokens
    slots = min(len(requests), 32)
    config = dict(max_batch_size=slots, max_seq_len=longest, kv_block_size=BLOCK, kv_tokens=slots * longest)
    engines = _engines(args, config)
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    world = None if one_process else dist.get_world_size()
    say(f"# {rerun_command('prefix_cache.py', world, one_thread=False, argv=argv)}")
    cache = "contiguous slots" if args.dejavu else f"blocks of {BLOCK}"
    say(f"# {len(requests)} requests ({args.prompts} prompts x n={args.n}), {slots} slots, {cache}")
    kinds = [True, False] + ([CONTIGUOUS] if args.pp else [])
    runs: dict = {on: [] for on in kinds}
    for _ in range(args.repeats):
        for on in kinds:
            if args.dejavu:
                runs[on].append(_dejavu_run(args, config, on, requests))
                continue
            engines[on].reset_prefix_cache()  # every run computes its prompts from scratch
            runs[on].append(_run(engines[on], requests))
    assert all(runs[on][0][3] == runs[True][0][3] for on in kinds), "the prefix cache changed the tokens"
    new = len(requests) * args.new_tokens
    say(f"{'cache':>6} {'tokens/s':>9} {'seconds':>8} {'prefill s':>10} {'computed':>9} {'streamed':>9}")
    for on in kinds:
        seconds, prefill, computed = med([r[0] for r in runs[on]]), med([r[1] for r in runs[on]]), runs[on][0][2]
        name = on if on == CONTIGUOUS else "on" if on else "off"
        say(f"{name:>6} {new / seconds:>9.1f} {seconds:>8.2f} {prefill:>10.2f} {computed:>9.1%} {runs[on][0][4]:>9}")
    speedup = med([r[0] for r in runs[False]]) / med([r[0] for r in runs[True]])
    say(f"on/off: {speedup:.2f}x tokens/s", flush=True)
    if args.pp:
        say(f"on/contiguous: {med([r[0] for r in runs[CONTIGUOUS]]) / med([r[0] for r in runs[True]]):.2f}x tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
