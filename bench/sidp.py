"""SiDP benchmark (issue 13): FFN owner pool (WaS / CaS / auto) against replicated DP and an
FSDP-style all-gather baseline.

Run from the repo root:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/sidp.py
    (options: --hidden 768 --intermediate 3072 --layers 8 --heads 12 --kv-heads 4 --vocab 8000
     --sizes 1,2,4,8,16,32 --prompt-len 16 --new-tokens 12 --repeats 2 --sections sweep,kv,e2e;
     --small for a quick check on a 4-layer, hidden-256 model)

Model: a seeded Llama checkpoint built once with ``parallel.tiny_models.cached_checkpoint`` (fp32,
defaults: hidden 768, MLP 3072, 8 layers, 12 query / 4 KV heads, vocab 8000). Every rank is one
data-parallel replica (G = world size).

Variants (every one runs the same requests in the same run):

- ``dp``: replicated DP, ``parallel.Engine(parallelize(path, ParallelDims(dp=G, world_size=G)))``;
  every rank holds every weight.
- ``was`` / ``cas`` / ``auto``: SiDP (``parallel/sidp.py``). Layer j's FFN is owned by rank
  j % G; non-owners fetch it into cache slots (WaS), or ship activations to the owner (CaS).
- ``allgather``: an FSDP-style baseline written in this file (``AllGatherFFN``). Every FFN weight
  is split into G row chunks, one per rank (per-rank FFN bytes = SiDP's). A ``layer_before`` listener
  all-gathers the layer's full gate/up/down weights (``dist.all_gather``) on the compute thread,
  with no prefetch. A ``layer_after`` listener frees them again. Same bytes moved per step as WaS,
  with no overlap.

Sections:

1. ``sweep``: decode step time vs batch size per replica b. Each variant gets an engine with
   ``max_batch_size = b`` (decode runs every slot of the cache, so b is the FFN's row count per
   replica). There are G*b requests of ``--prompt-len`` random tokens and ``--new-tokens`` greedy
   tokens (one prefill, then ``new_tokens - 1`` full-batch decode steps). Step time =
   ``engine.stats.decode_seconds / decode_steps`` of one ``generate``, max over ranks. One warm-up
   per variant, then ``--repeats`` runs round-robin over the variants; medians. Reported: the
   crossover b* (the smallest swept b where WaS is faster than CaS) and what
   ``parallel.sidp.profile_threshold(fetcher)`` (the library's built-in sweep) returns.
2. ``kv``: KV capacity at equal memory per rank. The budget is M = replicated DP weight bytes + the
   DP engine's KV bytes. SiDP holds M - (its weight bytes + slot bytes) of KV. Measured from this
   run's allocations (storage bytes of the parameters, the store's ``spec.bytes``). The summary's
   ``kv_tokens_gained`` is checked by allocating a store that much bigger. A Llama-3-8B-shaped model
   (bf16) is computed analytically with the same formulas (``kv_bytes_per_token``, default slots
   ``max(prefetch_depth, G-1)``).
3. ``e2e``: an offline workload with a long tail: most requests short, a few long, so replicas go
   idle (dummy steps) at the end. Compared: auto vs WaS-only vs replicated DP (also CaS-only).
   Metric: generated tokens / wall second (max over ranks). One warm-up, then ``--e2e-repeats``
   runs per variant round-robin; medians. auto's b*: ``--threshold``, else the sweep's crossover,
   else what ``profile_threshold`` returned; 8 (the strategy's default) when the sweep section does
   not run. The SiDP engines are built with ``make_strategy(...)
   .build`` and a paged KV cache. The summary's mode_steps / mode_switches / dummy_steps /
   max_concurrent_readers are printed.

Rank 0 samples the machine every 2 s: Python processes outside the job above 5% CPU, and the 1-min
load average. The machine is a shared 2-core VM.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    LoadSampler,
    add_sizes,
    bench_checkpoint,
    fill_sizes,
    ints,
    med,
    parser,
    reduce_scalar,
    rerun_command,
)

from reshard.kv import KVCache
from reshard.kv.cache import KVSpec
from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
from reshard.parallel.engine import make_strategy
from reshard.parallel.strategies.sidp import kv_bytes_per_token, profile_threshold, sidp_engine

REPO = Path(__file__).resolve().parent.parent

MIB, GIB = 2**20, 2**30
DEFAULTS = {"hidden": 768, "intermediate": 3072, "layers": 8, "heads": 12, "kv_heads": 4, "vocab": 8000}
SMALL = {"hidden": 256, "intermediate": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096}
SECTIONS = ("sweep", "kv", "e2e")
SWEEP_VARIANTS = ("dp", "was", "cas", "allgather")


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    p.add_argument("--sizes", type=ints, help="batch sizes per replica (default 1,2,4,8,16,32)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per (variant, b) in the sweep")
    p.add_argument("--slots", type=int, default=None, help="SiDP cache slots (default max(2, G-1))")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="b* for auto in e2e (default: the sweep's crossover, else profile_threshold's; "
        "without the sweep section: 8, the strategy's default)",
    )
    p.add_argument("--e2e-requests", type=int, default=40)
    p.add_argument("--e2e-batch", type=int, default=8, help="max_batch_size per replica in e2e")
    p.add_argument("--e2e-repeats", type=int, default=1)
    p.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS))
    args = fill_sizes(p.parse_args(), DEFAULTS, SMALL)
    if args.sizes is None:
        args.sizes = [1, 4] if args.small else [1, 2, 4, 8, 16, 32]
    if args.small:
        args.e2e_requests = min(args.e2e_requests, 12)
    bad = sorted(set(args.sections) - set(SECTIONS))
    if bad:
        p.error(f"unknown sections {bad}; known {list(SECTIONS)}")
    return args


def checkpoint(args: argparse.Namespace) -> Path:
    return bench_checkpoint(args, "bench-sidp")


# ---- measuring -----------------------------------------------------------------------------------
def gen(engine: Engine, reqs) -> dict:
    """One ``generate``: decode s/step (max over ranks), wall s (max over ranks), outputs."""
    s = engine.stats
    d0, n0 = s.decode_seconds, s.decode_steps
    dist.barrier()
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - t0
    steps = s.decode_steps - n0
    return {
        "step": reduce_scalar((s.decode_seconds - d0) / max(steps, 1)),
        "steps": steps,
        "wall": reduce_scalar(wall),
        "outputs": [c.output_ids for c in out],
        "tokens": sum(len(c.output_ids) for c in out),
    }


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# ---- the FSDP-style baseline ---------------------------------------------------------------------
def _local(p) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p.data


class AllGatherFFN:
    """FSDP-style baseline (this bench only): every FFN weight of ``model`` (a replicated DP model)
    is split into G row chunks, rank g keeping chunk g; the full weight's storage is freed. Before
    each layer (a ``layer_before`` listener) the layer's three weights are all-gathered into their
    storage on the compute thread, with no prefetch; after it (``layer_after``) they are freed.
    Per-rank FFN bytes = 1/G of the FFN, like SiDP's owner pool (no slots)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.G, self.rank = dist.get_world_size(), dist.get_rank()
        self.full = {}
        self.shards = {}
        self.nbytes = {}
        self.gathered_bytes = 0
        for i, layer in enumerate(model.model.layers):
            ws = [
                _local(layer.mlp.gate_proj.weight),
                _local(layer.mlp.up_proj.weight),
                _local(layer.mlp.down_proj.weight),
            ]
            for w in ws:
                assert w.shape[0] % self.G == 0 and w.is_contiguous(), w.shape
                assert w.untyped_storage().nbytes() == w.numel() * w.element_size(), "a weight shares storage"
            self.full[i] = ws
            self.shards[i] = [w.chunk(self.G, 0)[self.rank].clone() for w in ws]
            self.nbytes[i] = [w.untyped_storage().nbytes() for w in ws]
            for w in ws:
                w.untyped_storage().resize_(0)

    def ffn_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for ss in self.shards.values() for s in ss)

    def attach(self, engine, layout: str) -> None:
        engine.events.on("layer_before", self.before, layout=layout)
        engine.events.on("layer_after", self.after, layout=layout)

    def before(self, i, h, ctx):
        for w, shard, n in zip(self.full[i], self.shards[i], self.nbytes[i]):
            w.untyped_storage().resize_(n)
            dist.all_gather(list(w.chunk(self.G, 0)), shard)
            self.gathered_bytes += n * (self.G - 1) // self.G
        return None

    def after(self, i, h, ctx):
        for w in self.full[i]:
            w.untyped_storage().resize_(0)
        return None


# ---- section 1: decode step time vs batch size ----------------------------------------------------
def sweep_requests(args, world: int, b: int) -> list[Request]:
    g = torch.Generator().manual_seed(b)
    return [
        Request(
            i,
            torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist(),
            SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True),
        )
        for i in range(world * b)
    ]


def section_sweep(path: Path, args, models: dict, log) -> dict:
    world = dist.get_world_size()
    fetcher = models["fetcher"]
    t0 = time.perf_counter()
    profiled = profile_threshold(fetcher)
    profile_s = reduce_scalar(time.perf_counter() - t0)
    log(f"profile_threshold -> {profiled} ({profile_s:.1f}s)")
    seq_len = args.prompt_len + args.new_tokens
    rows = {}
    for b in args.sizes:
        config = EngineConfig(max_batch_size=b, max_seq_len=seq_len)
        engines = {
            "dp": Engine(models["dp"], config),
            "was": sidp_engine(models["sidp"], models["pools"], config, mode="was"),
            "cas": sidp_engine(models["sidp"], models["pools"], config, mode="cas"),
            "allgather": Engine(models["ag"], config),
        }
        models["ag_ffn"].attach(engines["allgather"], "main")
        reqs = sweep_requests(args, world, b)
        r = {v: {"step": [], "fetch": 0, "wait": 0.0, "steps": 0} for v in engines}
        for v, e in engines.items():  # warm-up: outputs and steps
            out = gen(e, reqs)
            r[v]["outputs"], r[v]["steps_per_run"] = out["outputs"], out["steps"]
        for _ in range(args.repeats):
            for v, e in engines.items():
                fetched, waited = fetcher.counters.fetch_bytes, fetcher.pool.counters.wait_seconds
                c0 = (fetched, waited, models["ag_ffn"].gathered_bytes)
                out = gen(e, reqs)
                r[v]["step"].append(out["step"])
                r[v]["steps"] += out["steps"]
                if v == "was":
                    r[v]["fetch"] += fetcher.counters.fetch_bytes - c0[0]
                    r[v]["wait"] += reduce_scalar(fetcher.pool.counters.wait_seconds - c0[1])
                if v == "allgather":
                    r[v]["fetch"] += models["ag_ffn"].gathered_bytes - c0[2]
        for v in engines:
            r[v]["same"] = r[v]["outputs"] == r["dp"]["outputs"]
            r[v]["median"] = med(r[v]["step"])
        rows[b] = r
        log(f"sweep b={b}: " + ", ".join(f"{v} {1e3 * r[v]['median']:.1f} ms" for v in engines))
        del engines
    crossover = next((b for b in args.sizes if rows[b]["was"]["median"] < rows[b]["cas"]["median"]), None)
    return {"rows": rows, "profiled": profiled, "profile_s": profile_s, "crossover": crossover}


def format_sweep(res: dict, args) -> list[str]:
    lines = [
        "| b per replica | DP ms/step | WaS ms/step | CaS ms/step | all-gather ms/step | WaS/DP | CaS/DP "
        "| all-gather/DP | WaS/CaS | all-gather/WaS | WaS fetch MiB/step/rank | WaS slot wait ms/step "
        "| all-gather MiB/step/rank | same tokens as DP (WaS, CaS, all-gather) |",
        "|" + "---|" * 14,
    ]
    for b, r in res["rows"].items():
        dp, was, cas, ag = (r[v]["median"] for v in SWEEP_VARIANTS)
        steps_was = max(r["was"]["steps"], 1)
        # per decode step: the fetches of prefill steps are included (1 per generate), small next to decode
        same = ", ".join("yes" if r[v]["same"] else "NO" for v in ("was", "cas", "allgather"))
        lines.append(
            f"| {b} | {1e3 * dp:.1f} | {1e3 * was:.1f} | {1e3 * cas:.1f} | {1e3 * ag:.1f} "
            f"| {was / dp:.2f} | {cas / dp:.2f} | {ag / dp:.2f} | {was / cas:.2f} | {ag / was:.2f} "
            f"| {r['was']['fetch'] / steps_was / MIB:.1f} | {1e3 * r['was']['wait'] / steps_was:.1f} "
            f"| {r['allgather']['fetch'] / max(r['allgather']['steps'], 1) / MIB:.1f} | {same} |"
        )
    return lines


# ---- section 2: KV capacity at equal memory -----------------------------------------------------------
def section_kv(path: Path, args, models: dict, log) -> dict:
    """The bench model, measured: DP vs SiDP per-rank weight bytes, and KV at M = DP weights + KV."""
    world = dist.get_world_size()
    seq_len = args.prompt_len + args.new_tokens
    block, tokens = 16, 4096
    config = EngineConfig(max_batch_size=8, max_seq_len=seq_len, kv_block_size=block, kv_tokens=tokens)
    strategy = models["strategy"]
    engine = sidp_engine(models["sidp"], models["pools"], config, mode="was")
    dp_engine = Engine(models["dp"], config)
    s = strategy.summary(engine)
    spec = engine.kv.spec
    per_token = kv_bytes_per_token(spec)
    dp_weights = reduce_scalar(storage_bytes(models["dp"].parameters()))
    # the pooled MLPs left the module tree: the pool holds the owned FFN weights
    sidp_weights = reduce_scalar(storage_bytes(models["sidp"].parameters()) + models["fetcher"].pool.ffn_bytes())
    slots = s["slot_bytes"]
    budget = dp_weights + dp_engine.kv.spec.bytes  # equal memory per rank
    gained = s["kv_tokens_gained"]
    bigger = KVCache(dataclasses.replace(spec, num_blocks=spec.num_blocks + gained // spec.block_size))
    grown = bigger.spec.bytes - spec.bytes
    del bigger
    measured_sidp_kv = budget - sidp_weights - slots
    out = {
        "G": world,
        "per_token": per_token,
        "dp_weights": dp_weights,
        "sidp_weights": sidp_weights,
        "slots": slots,
        "budget": budget,
        "dp_kv": dp_engine.kv.spec.bytes,
        "dp_tokens": spec.capacity_tokens,
        "sidp_tokens_measured": int(measured_sidp_kv // per_token),
        "summary": s,
        "grown": grown,
        "ffn_repl": s["ffn_bytes_replicated"],
        "ffn_rank": s["ffn_bytes_per_rank"],
        "ag_ffn": reduce_scalar(models["ag_ffn"].ffn_bytes()),
    }
    log(f"kv: gained {gained} tokens (summary); measured {out['sidp_tokens_measured'] - out['dp_tokens']}")
    return out


LLAMA3_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)


def llama3_8b_rows(prefetch_depth: int, mem_gib=(24, 40, 80), groups=(2, 4, 8)) -> list[dict]:
    """Analytic: Llama-3-8B shapes in bf16, untied embeddings; KV via ``kv_bytes_per_token`` of a
    spec holding every KV head (one replica per rank); default slots max(prefetch_depth, G - 1)."""
    c, e = LLAMA3_8B, 2
    d = c["hidden"]
    i = c["intermediate"]
    L = c["layers"]
    ffn_layer = 3 * d * i * e
    attn_layer = (d * c["heads"] * c["head_dim"] * 2 + d * c["kv_heads"] * c["head_dim"] * 2) * e + 2 * d * e
    weights = L * (ffn_layer + attn_layer) + 2 * c["vocab"] * d * e + d * e
    spec = KVSpec(
        num_layers=L, num_slots=1, num_heads=c["kv_heads"], max_seq_len=1, head_dim=c["head_dim"], dtype=torch.bfloat16
    )
    per_token = kv_bytes_per_token(spec)
    rows = []
    for G in groups:
        owned = -(-L // G)  # round-robin: rank 0 owns the most layers
        slots = max(prefetch_depth, G - 1)
        freed = L * ffn_layer - owned * ffn_layer - slots * ffn_layer
        for m in mem_gib:
            budget = m * GIB - weights
            dp_tokens = budget // per_token
            rows.append(
                {
                    "G": G,
                    "mem": m,
                    "weights": weights,
                    "ffn": L * ffn_layer,
                    "owned": owned,
                    "slots": slots,
                    "sidp_weights": weights - L * ffn_layer + owned * ffn_layer + slots * ffn_layer,
                    "per_token": per_token,
                    "dp_tokens": dp_tokens,
                    "gained": max(freed, 0) // per_token,
                    "freed": freed,
                }
            )
    return rows


def format_kv(res: dict, args, prefetch_depth: int) -> list[str]:
    s = res["summary"]
    lines = [
        f"Bench model, G={res['G']}, measured on rank allocations (max over ranks), fp32, "
        f"{res['per_token']} KV bytes/token (`kv_bytes_per_token`). Budget M = DP weights + DP KV store "
        f"= {res['budget'] / MIB:.1f} MiB per rank.",
        "",
        "| | DP (replicated) | SiDP | SiDP - DP |",
        "|---|---|---|---|",
        f"| FFN bytes per rank (MiB) | {res['ffn_repl'] / MIB:.1f} | {res['ffn_rank'] / MIB:.1f} "
        f"(`ffn_bytes_per_rank`) | {(res['ffn_rank'] - res['ffn_repl']) / MIB:+.1f} |",
        f"| FFN cache slots (MiB) | 0 | {res['slots'] / MIB:.1f} (`slot_bytes`) | {res['slots'] / MIB:+.1f} |",
        f"| all weights per rank, storage bytes (MiB) | {res['dp_weights'] / MIB:.1f} | "
        f"{res['sidp_weights'] / MIB:.1f} + slots {res['slots'] / MIB:.1f} | "
        f"{(res['sidp_weights'] + res['slots'] - res['dp_weights']) / MIB:+.1f} |",
        f"| KV store at equal memory (MiB) | {res['dp_kv'] / MIB:.1f} | "
        f"{(res['budget'] - res['sidp_weights'] - res['slots']) / MIB:.1f} | "
        f"{(res['dp_weights'] - res['sidp_weights'] - res['slots']) / MIB:+.1f} |",
        f"| KV tokens at equal memory (measured) | {res['dp_tokens']} | {res['sidp_tokens_measured']} | "
        f"{res['sidp_tokens_measured'] - res['dp_tokens']:+d} "
        f"({(res['sidp_tokens_measured'] / res['dp_tokens'] - 1) * 100:+.0f}%) |",
        f"| `kv_tokens_gained` (summary) | - | - | +{s['kv_tokens_gained']} |",
        "",
        f"A paged store grown by `kv_tokens_gained` (rounded down to whole blocks) allocates "
        f"{res['grown'] / MIB:.2f} MiB more; the freed FFN bytes are "
        f"{(res['ffn_repl'] - res['ffn_rank'] - res['slots']) / MIB:.2f} MiB. The all-gather baseline "
        f"holds {res['ag_ffn'] / MIB:.1f} MiB of FFN per rank (1/G, no slots).",
        "",
        f"Llama-3-8B shapes (hidden 4096, MLP 14336, 32 layers, 32/8 heads x 128, vocab 128256, untied, "
        f"bf16), analytic: weights {llama3_8b_rows(prefetch_depth)[0]['weights'] / GIB:.2f} GiB, of which "
        f"FFN {llama3_8b_rows(prefetch_depth)[0]['ffn'] / GIB:.2f} GiB; "
        f"{llama3_8b_rows(prefetch_depth)[0]['per_token']} KV bytes/token; slots = max(prefetch_depth "
        f"{prefetch_depth}, G-1); rank 0 owns ceil(32/G) layers. Activations and the allocator's overhead "
        f"not counted.",
        "",
        "| G | memory per rank GiB | DP weights GiB | SiDP weights + slots GiB | owned layers | slots "
        "| DP KV tokens | SiDP KV tokens | gained | gain |",
        "|" + "---|" * 10,
    ]
    for r in llama3_8b_rows(prefetch_depth):
        sidp = r["dp_tokens"] + r["gained"]
        lines.append(
            f"| {r['G']} | {r['mem']} | {r['weights'] / GIB:.2f} | {r['sidp_weights'] / GIB:.2f} "
            f"| {r['owned']} | {r['slots']} | {r['dp_tokens']:,} | {sidp:,} | +{r['gained']:,} "
            f"| {(sidp / r['dp_tokens'] - 1) * 100:+.1f}% |"
        )
    return lines


# ---- section 3: end-to-end with a long tail --------------------------------------------------------------
def tail_requests(args) -> list[Request]:
    """Seeded: prompts uniform 16..64; outputs uniform 4..24, except 3 long ones (96, 144, 192
    scaled to the e2e size) at random places in the queue."""
    rng = random.Random(0)
    n = args.e2e_requests
    long_ids = set(rng.sample(range(n // 2, n), 3))
    longs = iter([48, 72, 96] if args.small else [96, 144, 192])
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(args.vocab) for _ in range(rng.randint(16, 64))]
        new = next(longs) if i in long_ids else rng.randint(4, 24)
        reqs.append(Request(i, prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
    return reqs


def section_e2e(path: Path, args, threshold: float, log) -> dict:
    world = dist.get_world_size()
    reqs = tail_requests(args)
    seq_len = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in reqs)
    eargs = EngineConfig(
        max_batch_size=args.e2e_batch, max_seq_len=seq_len, kv_block_size=16, kv_tokens=args.e2e_batch * seq_len
    )
    strategies, engines = {}, {}
    common = {"strategy": "sidp", "prefetch_depth": args.prefetch_depth, "threshold": threshold}
    if args.slots:
        common["slots"] = args.slots
    for v in ("auto", "was", "cas"):
        strategies[v] = make_strategy({**common, "mode": v})
        engines[v] = strategies[v].build(path, eargs)
    engines["dp"] = Engine(parallelize(path, ParallelDims(dp=world, world_size=world)), eargs)
    order = ("dp", "was", "cas", "auto")
    rows = {v: {"wall": [], "step": []} for v in order}
    for v in order:  # warm-up
        out = gen(engines[v], reqs)
        rows[v].update(outputs=out["outputs"], tokens=out["tokens"], steps=out["steps"])
    snap = {v: _snapshot(engines[v]) for v in order}
    for _ in range(args.e2e_repeats):
        for v in order:
            out = gen(engines[v], reqs)
            rows[v]["wall"].append(out["wall"])
            rows[v]["step"].append(out["step"])
        log("e2e round: " + ", ".join(f"{v} {rows[v]['wall'][-1]:.1f}s" for v in order))
    for v in order:
        rows[v]["same"] = rows[v]["outputs"] == rows["dp"]["outputs"]
        rows[v]["mean_batch"] = engines[v].stats.mean_decode_batch
        if v != "dp":
            s = strategies[v].summary(engines[v])
            base = snap[v]
            n = args.e2e_repeats + 1
            rows[v]["summary"] = {  # per generate (the engine's counters span warm-up + repeats)
                "mode_steps": {k: x // n for k, x in s["mode_steps"].items()},
                "mode_switches": s["mode_switches"] / n,
                "dummy_steps": s["dummy_steps"] / n,
                "max_concurrent_readers": s["max_concurrent_readers"],
                "fetch_mib": s["fetch_bytes"] / n / MIB,
                "threshold": s["threshold"],
                "modes_first": base,
            }
    short = sum(1 for r in reqs if r.sampling.max_new_tokens <= 24)
    return {
        "rows": rows,
        "requests": len(reqs),
        "short": short,
        "threshold": threshold,
        "seq_len": seq_len,
        "new_tokens": sum(r.sampling.max_new_tokens for r in reqs),
        "longs": sorted(r.sampling.max_new_tokens for r in reqs if r.sampling.max_new_tokens > 24),
    }


def _snapshot(engine) -> str:
    """The mode sequence of the warm-up generate, run-length encoded (SiDP engines only)."""
    modes = getattr(engine.stats, "modes", None)
    if not modes:
        return "-"
    out = []
    prev = None
    n = 0
    for m in modes + [None]:
        if m == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev.split(':')[1]}x{n}")
        prev, n = m, 1
    return " ".join(out)


def format_e2e(res: dict) -> list[str]:
    rows = res["rows"]
    lines = [
        "| variant | tok/s | wall s | vs DP | vs WaS-only | decode ms/step | decode steps | mean decode batch "
        "| mode_steps (was/cas) | mode_switches | dummy_steps | max_concurrent_readers | fetched MiB (all ranks) "
        "| same tokens as DP |",
        "|" + "---|" * 14,
    ]
    tps = {v: res["new_tokens"] / med(r["wall"]) for v, r in rows.items()}
    for v in ("dp", "was", "cas", "auto"):
        r = rows[v]
        s = r.get("summary")
        label = {"dp": "replicated DP", "was": "SiDP WaS-only", "cas": "SiDP CaS-only", "auto": "SiDP auto"}[v]
        ms = f"{s['mode_steps']['was']}/{s['mode_steps']['cas']}" if s else "-"
        lines.append(
            f"| {label} | {tps[v]:.1f} | {med(r['wall']):.2f} | {tps[v] / tps['dp']:.2f} "
            f"| {tps[v] / tps['was']:.2f} | {1e3 * med(r['step']):.1f} | {r['steps']} | {r['mean_batch']:.2f} "
            f"| {ms} | {s['mode_switches'] if s else '-'} | {s['dummy_steps'] if s else '-'} "
            f"| {s['max_concurrent_readers'] if s else '-'} | {format(s['fetch_mib'], '.0f') if s else '-'} "
            f"| {'yes' if r['same'] else 'NO'} |"
        )
    auto = rows["auto"].get("summary")
    if auto:
        lines += ["", f"auto's modes in the warm-up run (run-length): {auto['modes_first']}"]
    return lines


# ---- main ------------------------------------------------------------------------------------------------
def build_models(path: Path, args) -> dict:
    world = dist.get_world_size()
    cfg = {"strategy": "sidp", "mode": "was", "prefetch_depth": args.prefetch_depth, "threshold": 8.0}
    if args.slots:
        cfg["slots"] = args.slots
    strategy = make_strategy(cfg)
    seed_engine = strategy.build(path, EngineConfig(max_batch_size=1, max_seq_len=args.prompt_len + args.new_tokens))
    fetcher = seed_engine.policy.fetcher
    dims = ParallelDims(dp=world, world_size=world)
    ag_model = parallelize(path, dims)
    return {
        "strategy": strategy,
        "sidp": seed_engine.model,
        "fetcher": fetcher,
        "pools": seed_engine.policy.pools,
        "dp": parallelize(path, dims),
        "ag": ag_model,
        "ag_ffn": AllGatherFFN(ag_model),
    }


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pids = [None] * world
    dist.all_gather_object(pids, (os.getpid(), os.getppid()))
    sampler = LoadSampler({p for pair in pids for p in pair}) if rank == 0 else None
    t_start, started = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:.0f}s] {msg}", flush=True)

    path = checkpoint(args)
    models = build_models(path, args) if {"sweep", "kv"} & set(args.sections) else {}
    log("models built")
    out = {}
    if "sweep" in args.sections:
        out["sweep"] = section_sweep(path, args, models, log)
    if "kv" in args.sections:
        out["kv"] = section_kv(path, args, models, log)
    threshold = args.threshold
    if threshold is None and "sweep" in out:
        threshold = float(out["sweep"]["crossover"] or out["sweep"]["profiled"])
    threshold = threshold or 8.0
    models.clear()
    if "e2e" in args.sections:
        out["e2e"] = section_e2e(path, args, threshold, log)
    if rank == 0:
        pool_slots = args.slots or max(args.prefetch_depth, world - 1)
        ffn_layer = 3 * args.hidden * args.intermediate * 4
        print(
            f"\n{started:%Y-%m-%d %H:%M} UTC; Llama hidden {args.hidden}, MLP {args.intermediate}, {args.layers} "
            f"layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}, fp32; FFN {ffn_layer / MIB:.1f} MiB "
            f"per layer; G={world} replicas (1 per rank), SiDP slots {pool_slots}, prefetch_depth "
            f"{args.prefetch_depth}, peak shifting on; torch {torch.__version__}, {world} gloo ranks, 1 thread each"
        )
        if "sweep" in out:
            r = out["sweep"]
            print(
                f"\n1. Decode step time vs batch size per replica: {args.prompt_len}-token prompts, "
                f"{args.new_tokens} greedy tokens ({args.new_tokens - 1} full-batch decode steps per run); warm-up "
                f"1 + median of {args.repeats}, variants round-robin; max over ranks\n"
            )
            print("\n".join(format_sweep(r, args)))
            print(
                f"\ncrossover b* (smallest swept b with WaS < CaS): {r['crossover'] or 'none in ' + str(args.sizes)}; "
                f"profile_threshold(fetcher) returned {r['profiled']:g} ({r['profile_s']:.1f} s)"
            )
        if "kv" in out:
            print("\n2. KV capacity at equal memory per rank\n")
            print("\n".join(format_kv(out["kv"], args, args.prefetch_depth)))
        if "e2e" in out:
            r = out["e2e"]
            print(
                f"\n3. Offline workload with a long tail: {r['requests']} requests, prompts 16..64 tokens, "
                f"{r['short']} with 4..24 new tokens and {len(r['longs'])} long ones ({r['longs']}); "
                f"{r['new_tokens']} generated tokens; max_batch_size {args.e2e_batch} per replica, paged KV "
                f"(block 16); auto's threshold b* = {r['threshold']:g} (hysteresis 0.25, interval 4); "
                f"warm-up 1 + median of {args.e2e_repeats}, round-robin; counters per generate\n"
            )
            print("\n".join(format_e2e(r)))
        print(f"\nmachine: {sampler.summary()}")
        print(f"command: {rerun_command('sidp.py', world)}")
        print(f"total {time.perf_counter() - t_start:.0f}s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
