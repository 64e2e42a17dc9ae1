"""Shift Parallelism benchmark: per-layer communication (TP vs SP) and a CPU bursty trace.

Run from the repo root (4 ranks; 2 ranks also work, then only degree 2 / sp=2 is measured):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/shift.py

Part 1 (the shape of the paper's Table 2): bytes one rank sends for one decoder layer's attention
+ MLP forward (a prefill of N tokens of one sequence through a KV-cache ``AttentionContext``),
TP-d vs SP-d. The real layers are used: ``UlyssesAttention`` and ``SwiGLUMLP`` built with the
tiny Llama's sizes on ``ParallelDims(dp=world/d, sp=d, tp=1)`` with the shift (full-TP) layouts
added, so mode ``"sp"`` is pure Ulysses SP-d and mode ``"tp"`` is pure TP-d over the same d
ranks. On 4 ranks degree 2 runs as two independent 2-rank groups (dp=2), so both degrees come
from one run. Weights are seeded random (bytes do not depend on values); the SP and TP outputs
are checked against each other.

Bytes are counted by wrapping the collectives of ``layers/_comm.py`` in this process only.
"payload" is the size of the tensor a rank hands to the collective; "wire" is what a rank sends
with the usual algorithms: ring all-reduce 2(p-1)/p x payload, all-to-all (p-1)/p x payload
(its own chunk stays), ring all-gather (p-1) x payload. Token broadcasts (``dist.broadcast`` in
``agree_tokens``) are not counted.

``--moe``: part 2 on a Qwen3-MoE of the built-in model's sizes (16 experts, top-4, expert MLP 176:
Qwen3-30B-A3B's shape scaled down), Shift as SP x EP (experts over all ranks, tokens dispatched by
all-to-all; its rows to other ranks counted exactly), the plain TP Engine with every expert split;
part 1 is skipped.

Part 2: the built-in tiny Llama, ``parallelize_shift(sp=--sp, tp=world/sp)``, one seeded bursty
trace of phases ``[long, burst] x --cycles``: a long phase is one request with a ``--long-len``
prompt, a burst is ``--burst-size`` requests with ``--burst-len`` prompts, all generating
``--new-tokens`` greedy tokens (no stop tokens). Each phase is one ``generate`` call (its requests
arrive together when the previous phase is done). Engines: ``shift_engine`` with threshold 10**9
(TP-only), 0 (SP-only) and ``--threshold`` (Shift) on the same model, plus the plain TP
``Engine`` as a reference. TTFT: per request, from the start of its phase's ``generate`` to the
end of the prefill step that sampled its first token (timed on rank 0 by wrapping
a ``step_end`` listener). TPOT: decode seconds / decode steps. Throughput: generated tokens / wall
seconds of all phases (combined: prompt + generated tokens). One warm-up trace per engine (with
byte counting on), then ``--repeats`` timed traces, engines round-robin; medians are reported.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from _common import parser, rerun_command
from torch.distributed.tensor import Replicate, Shard

import reshard.layers._comm as comm
from reshard import KVCache
from reshard.kv import KVSpec
from reshard.layers.attention import AttentionContext
from reshard.layers.mlp import SwiGLUMLP
from reshard.layers.ulysses import SHIFT_WEIGHTS, UlyssesAttention
from reshard.layers.weights import use_weights
from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
from reshard.parallel.model.tiny_models import builtin_checkpoint
from reshard.parallel.strategies.shift import (
    ShiftStats,
    base_mesh,
    parallelize_shift,
    shift_engine,
    shift_mesh,
    shift_meshes,
)

REPO = Path(__file__).resolve().parent.parent

TP_ONLY = 10**9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--tokens", default="8,64,512,2048", help="part 1 token counts")
    p.add_argument("--sp", type=int, default=0, help="part 2 sp degree (default: world size, tp=1)")
    p.add_argument("--threshold", type=int, default=64, help="Shift threshold (tokens > T run SP)")
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--burst-size", type=int, default=16)
    p.add_argument("--burst-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cycles", type=int, default=2, help="[long, burst] pairs in the trace")
    p.add_argument("--repeats", type=int, default=7, help="timed traces per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plain-tp", action="store_true", help="skip the plain TP Engine row")
    p.add_argument("--moe", action="store_true", help="part 2 on a Qwen3-MoE-shaped model (SP x EP; part 1 skipped)")
    return p.parse_args(argv)


# ---- byte counting ----------------------------------------------------------------------------
WIRE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "all_gather": lambda p: p - 1,
    "all_gather_last": lambda p: p - 1,
    "all_gather_chunks": lambda p: p - 1,
    "all_to_all_split": lambda p: 1.0,  # (wire: the rows to other ranks, counted exactly in _counted)
}


@dataclass
class CommCount:
    calls: Counter = field(default_factory=Counter)
    payload: int = 0
    wire: float = 0.0

    def add(self, name: str, x: torch.Tensor, p: int) -> None:
        if p == 1:
            return  # the wrappers return x unchanged on a size-1 axis
        size = x.numel() * x.element_size()
        self.calls[name] += 1
        self.payload += size
        self.wire += WIRE[name](p) * size


_ACTIVE: list[CommCount] = []


def _counted(name: str, fn: Callable) -> Callable:
    sig = inspect.signature(fn)

    def wrapped(*args, **kwargs):
        if _ACTIVE:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            x = a["x"]
            if name == "all_to_all_split" and x.shape[0]:  # only the rows sent to other ranks
                me = a["mesh"].get_local_rank(a["axis"])
                x = x[: sum(n for i, n in enumerate(a["in_splits"]) if i != me)]
            _ACTIVE[-1].add(name, x, a["mesh"].size(a["axis"]))
        return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn
    return wrapped


def install_counters() -> None:
    """Replace the ``layers._comm`` collectives everywhere our packages imported them."""
    for name in WIRE:
        orig = getattr(comm, name)
        new = _counted(name, orig)
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.split(".")[0] in ("layers", "parallel", "reshard") and getattr(mod, name, None) is orig:
                setattr(mod, name, new)


@contextmanager
def counting() -> Iterator[CommCount]:
    count = CommCount()
    _ACTIVE.append(count)
    try:
        yield count
    finally:
        _ACTIVE.pop()


# ---- part 1: one layer's communication ----------------------------------------------------------
def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (Llama) RoPE cos/sin ``(1, T, head_dim)``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos(), emb.sin()


def fill_replicated(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded values for parameters that are whole on every rank (tp=1 base layout)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            local = p.to_local()
            assert local.shape == p.shape, f"{name}: expected a replicated parameter"
            local.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def build_layer(cfg, dims: ParallelDims, seed: int) -> tuple[UlyssesAttention, SwiGLUMLP]:
    """One decoder layer's attention and MLP, SP-d base layout plus the full-TP shift layout."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attn = UlyssesAttention(
        cfg.hidden_size, heads, kv, head_dim, meshes=shift_meshes(dims, kv), rms_norm_eps=cfg.rms_norm_eps
    )
    mlp = SwiGLUMLP(
        cfg.hidden_size,
        cfg.intermediate_size,
        mesh=base_mesh(dims),
        hidden_act=cfg.hidden_act,
        placements=(Replicate(), Shard(0)),
    )
    gen = torch.Generator().manual_seed(seed)
    fill_replicated(attn, gen)
    fill_replicated(mlp, gen)
    attn.add_shift_layouts(copy=True)
    mlp.add_source(SHIFT_WEIGHTS, shift_mesh(dims), (Shard(0), Shard(0)), copy=True)
    return attn, mlp


def layer_forward(
    attn: UlyssesAttention, mlp: SwiGLUMLP, x: torch.Tensor, mode: str, theta: float
) -> tuple[torch.Tensor, CommCount]:
    """Attention + MLP over ``x`` (N, D) as one prefill; SP mode feeds this rank's N/d tokens."""
    n, d = x.shape[0], attn.meshes.sp
    kv = KVCache(
        KVSpec(num_layers=1, num_slots=1, num_heads=attn.local_kv_heads, max_seq_len=n, head_dim=attn.head_dim)
    )
    ctx = AttentionContext.build(kv, [0], [0], [n])
    pos = torch.arange(n)
    if mode == "sp":
        s, local = attn.meshes.base.get_coordinate()[0], n // d
        x, pos = x[s * local : (s + 1) * local], pos[s * local : (s + 1) * local]
    with torch.inference_mode(), counting() as count, use_weights(SHIFT_WEIGHTS if mode == "tp" else None):
        h, _ = attn(x[None], rope(pos, attn.head_dim, theta), attn_context=ctx, sequence_parallel=mode == "sp")
        out = mlp(h)[0]
    return out, count


def measure_degree(cfg, d: int, tokens: list[int], seed: int) -> list[dict]:
    """Rows for degree ``d``: TP-d and SP-d bytes per rank at each token count."""
    world = dist.get_world_size()
    dims = ParallelDims(dp=world // d, sp=d, tp=1, world_size=world)
    attn, mlp = build_layer(cfg, dims, seed)
    theta = _rope_theta(cfg)
    rows = []
    for n in tokens:
        assert n % d == 0, f"token count {n} must be divisible by the degree {d}"
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + n))
        out_tp, tp = layer_forward(attn, mlp, x, "tp", theta)
        out_sp, sp = layer_forward(attn, mlp, x, "sp", theta)
        s, local = attn.meshes.base.get_coordinate()[0], n // d
        match = torch.allclose(out_tp[s * local : (s + 1) * local], out_sp, atol=1e-4, rtol=1e-4)
        rows.append(
            dict(
                tokens=n,
                degree=d,
                tp_calls=dict(tp.calls),
                sp_calls=dict(sp.calls),
                tp_payload=tp.payload,
                tp_wire=tp.wire,
                sp_payload=sp.payload,
                sp_wire=sp.wire,
                match=bool(match),
            )
        )
    return rows


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def part1(cfg, tokens: list[int], seed: int) -> tuple[list[dict], bool]:
    """All degrees in {2, 4} that divide the world; returns rank 0's rows and rank agreement."""
    world = dist.get_world_size()
    rows = []
    for d in (2, 4):
        if d <= world and world % d == 0:
            rows += measure_degree(cfg, d, tokens, seed)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    same = all(r == everyone[0] for r in everyone)
    match_all = all(row["match"] for rank_rows in everyone for row in rank_rows)
    for row in rows:
        row["match"] = match_all
    return rows, same


def separator(head: str) -> str:
    """The markdown rule under ``head``, column widths kept."""
    return "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"


def calls_str(calls: dict) -> str:
    short = {"all_reduce": "AR", "all_to_all": "A2A", "all_gather": "AG", "all_gather_last": "AGL"}
    return "+".join(f"{v}x{short[k]}" for k, v in sorted(calls.items())) or "none"


def part1_table(rows: list[dict]) -> str:
    head = (
        "| tokens N | degree | TP collectives | TP payload B/rank | TP wire B/rank "
        "| SP collectives | SP payload B/rank | SP wire B/rank | SP/TP wire | SP out == TP out |"
    )
    lines = [head, separator(head)]
    for r in rows:
        lines.append(
            f"| {r['tokens']:8d} | {r['degree']:6d} | {calls_str(r['tp_calls']):>14} "
            f"| {r['tp_payload']:17,d} | {r['tp_wire']:14,.0f} | {calls_str(r['sp_calls']):>15} "
            f"| {r['sp_payload']:17,d} | {r['sp_wire']:14,.0f} "
            f"| {r['sp_wire'] / r['tp_wire']:10.3f} | {'yes' if r['match'] else 'NO':16} |"
        )
    return "\n".join(lines)


def scaling_table(rows: list[dict]) -> str:
    """Per token count: degree 4 vs degree 2, bytes per rank and bytes per local token (N / d).

    Per-rank compute is proportional to the local tokens, so bytes per local token is the
    communication-to-compute ratio of the paper's Table 2.
    """
    by = {(r["tokens"], r["degree"]): r for r in rows}
    head = (
        "| tokens N | TP wire/rank d4÷d2 | SP wire/rank d4÷d2 | TP payload per local token d2 -> d4 "
        "| SP payload per local token d2 -> d4 | TP wire per local token d2 -> d4 "
        "| SP wire per local token d2 -> d4 |"
    )
    lines = [head, separator(head)]
    for n in sorted({r["tokens"] for r in rows}):
        if (n, 2) not in by or (n, 4) not in by:
            continue
        a, b = by[(n, 2)], by[(n, 4)]
        cells = [f"{b['tp_wire'] / a['tp_wire']:.2f}", f"{b['sp_wire'] / a['sp_wire']:.2f}"]
        for key in ("tp_payload", "sp_payload", "tp_wire", "sp_wire"):
            lo, hi = a[key] / (n / 2), b[key] / (n / 4)
            cells.append(f"{lo:,.0f} -> {hi:,.0f} B ({hi / lo:.2f}x)")
        lines.append(f"| {n:8d} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


# ---- part 2: bursty trace -------------------------------------------------------------------------
def make_trace(args: argparse.Namespace, vocab_size: int) -> list[list[Request]]:
    """``[long, burst] x cycles`` phases of seeded random prompts (ids in ``[3, vocab)``)."""
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    phases, rid = [], 0
    for _ in range(args.cycles):
        for count, length in ((1, args.long_len), (args.burst_size, args.burst_len)):
            phase = []
            for _ in range(count):
                phase.append(Request(rid, torch.randint(3, vocab_size, (length,), generator=gen).tolist(), params))
                rid += 1
            phases.append(phase)
    return phases


@dataclass
class TraceRun:
    wall: float = 0.0
    generated: int = 0
    prompt_tokens: int = 0
    ttft_long: list[float] = field(default_factory=list)
    ttft_burst: list[float] = field(default_factory=list)
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    switches: int = 0
    steps_by_mode: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    wire: float = 0.0


def run_trace(engine: Engine, trace: list[list[Request]], long_len: int) -> TraceRun:
    """All phases on one fresh engine; per-request TTFT from the end of its prefill step."""
    first: dict[int, float] = {}

    def prefill_done(step, seqs) -> None:
        if step.kind == "prefill":
            now = time.perf_counter()
            for s in seqs:
                first[s.request.id] = now

    engine.events.on("step_end", prefill_done)
    run = TraceRun()
    for phase in trace:
        dist.barrier()
        t0 = time.perf_counter()
        done = engine.generate(phase)
        run.wall += time.perf_counter() - t0
        for r, c in zip(phase, done):
            (run.ttft_long if len(r.prompt_ids) == long_len else run.ttft_burst).append(first[r.id] - t0)
            run.outputs.append(c.output_ids)
            run.generated += len(c.output_ids)
            run.prompt_tokens += len(r.prompt_ids)
    st = engine.stats
    run.prefill_steps, run.prefill_seconds = st.prefill_steps, st.prefill_seconds
    run.decode_steps, run.decode_seconds = st.decode_steps, st.decode_seconds
    if isinstance(st, ShiftStats):
        run.switches, run.steps_by_mode = st.mode_switches, dict(st.steps_by_mode)
    return run


def part2(path: Path, args: argparse.Namespace, trace: list[list[Request]]) -> dict[str, list[TraceRun]]:
    """Warm-up (counted) + ``repeats`` timed traces per engine, round-robin over engines."""
    world = dist.get_world_size()
    sp = args.sp or world
    model = parallelize_shift(path, ParallelDims(sp=sp, tp=world // sp, world_size=world), shift_weights="copy")
    config = EngineConfig(
        max_batch_size=args.burst_size,
        max_seq_len=max(args.long_len, args.burst_len) + args.new_tokens,
        max_prefill_tokens=max(args.long_len, args.burst_size * args.burst_len),
    )
    makers: dict[str, Callable[[], Engine]] = {
        "TP-only (T=1e9)": lambda: shift_engine(model, config, threshold=TP_ONLY),
        "SP-only (T=0)": lambda: shift_engine(model, config, threshold=0),
        f"Shift (T={args.threshold})": lambda: shift_engine(model, config, threshold=args.threshold),
    }
    if not args.no_plain_tp:
        tp_model = parallelize(path, ParallelDims(tp=world, world_size=world))
        makers["TP plain Engine"] = lambda: Engine(tp_model, config)
    runs: dict[str, list[TraceRun]] = {name: [] for name in makers}
    wire: dict[str, float] = {}
    for name, make in makers.items():  # warm-up with byte counting (untimed)
        with counting() as count:
            run_trace(make(), trace, args.long_len)
        wire[name] = count.wire
    for _ in range(args.repeats):
        for name, make in makers.items():
            run = run_trace(make(), trace, args.long_len)  # a fresh engine: own KV cache and stats
            run.wire = wire[name]
            runs[name].append(run)
    return runs


def med(values: list[float]) -> float:
    return statistics.median(values)


def summarize(runs: list[TraceRun]) -> dict:
    return dict(
        ttft_long=med([statistics.mean(r.ttft_long) for r in runs]) * 1e3,
        ttft_burst=med([statistics.mean(r.ttft_burst) for r in runs]) * 1e3,
        prefill=med([r.prefill_seconds / r.prefill_steps for r in runs]) * 1e3,
        tpot=med([r.decode_seconds / r.decode_steps for r in runs]) * 1e3,
        tok_s=med([r.generated / r.wall for r in runs]),
        comb_s=med([(r.generated + r.prompt_tokens) / r.wall for r in runs]),
        wall=med([r.wall for r in runs]),
        switches=runs[0].switches,
        modes=runs[0].steps_by_mode,
        wire=runs[0].wire,
        spread=(min(r.wall for r in runs), max(r.wall for r in runs)),
    )


def part2_table(runs: dict[str, list[TraceRun]]) -> str:
    stats = {name: summarize(rs) for name, rs in runs.items()}
    base = stats["TP-only (T=1e9)"]
    head = (
        f"| {'engine':18} | steps sp/tp | switches | TTFT long ms | TTFT burst ms | prefill step ms "
        "| TPOT ms | gen tok/s | combined tok/s | wall s (min-max) | wire MB/rank |"
    )
    lines = [head, separator(head)]
    for name, s in stats.items():
        modes = f"{s['modes'].get('sp', 0)}/{s['modes'].get('tp', 0)}" if s["modes"] else "-/all"
        switches = str(s["switches"]) if s["modes"] else "-"
        lines.append(
            f"| {name:18} | {modes:11} | {switches:8} | {s['ttft_long']:12.1f} | {s['ttft_burst']:13.1f} "
            f"| {s['prefill']:15.1f} | {s['tpot']:7.1f} | {s['tok_s']:9.1f} "
            f"| {s['comb_s']:14.1f} | {s['wall']:.2f} ({s['spread'][0]:.2f}-{s['spread'][1]:.2f}) "
            f"| {s['wire'] / 1e6:12.2f} |"
        )
    lines += ["", "Ratios vs TP-only (time ratios < 1 and throughput ratios > 1 favour the engine):", ""]
    head2 = f"| {'engine':18} | TTFT long | TTFT burst | prefill step | TPOT | gen tok/s | wire bytes |"
    lines += [head2, separator(head2)]
    for name, s in stats.items():
        lines.append(
            f"| {name:18} | {s['ttft_long'] / base['ttft_long']:9.2f} "
            f"| {s['ttft_burst'] / base['ttft_burst']:10.2f} | {s['prefill'] / base['prefill']:12.2f} "
            f"| {s['tpot'] / base['tpot']:4.2f} | {s['tok_s'] / base['tok_s']:9.2f} "
            f"| {s['wire'] / base['wire']:10.2f} |"
        )
    return "\n".join(lines)


def token_check(runs: dict[str, list[TraceRun]]) -> str:
    """Greedy tokens of every engine and repeat against TP-only's first run."""
    ref = runs["TP-only (T=1e9)"][0].outputs
    parts = []
    for name, rs in runs.items():
        diff = sum(a != b for r in rs for a, b in zip(r.outputs, ref))
        parts.append(f"{name}: {'identical' if diff == 0 else f'{diff} request outputs differ'}")
    same = all(r.outputs == ref for rs in runs.values() for r in rs)
    return f"identical greedy tokens across all engines and repeats: {'yes' if same else 'NO'} ({'; '.join(parts)})"


# ---- main -------------------------------------------------------------------------------------
MOE = dict(  # the built-in model's sizes with Qwen3-30B-A3B's MoE shape: 16 experts, top-4, narrow experts
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=176,
    mlp_only_layers=[], norm_topk_prob=True, initializer_range=0.05,
)  # fmt: skip


def checkpoint(moe: bool = False) -> Path:
    """The built-in tiny Llama, or (``moe``) a Qwen3-MoE of its sizes; built by rank 0 once."""
    from reshard.parallel.model.tiny_models import cached_checkpoint

    def make() -> Path:
        return (
            cached_checkpoint("bench-shift-qwen3moe-seed0-v1", MOE, family="qwen3_moe") if moe else builtin_checkpoint()
        )

    if dist.get_rank() == 0:
        make()
    dist.barrier()
    return make()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    t_start = time.perf_counter()
    try:
        from transformers import AutoConfig

        path = checkpoint(args.moe)
        cfg = AutoConfig.from_pretrained(path)
        install_counters()
        tokens = [int(t) for t in args.tokens.split(",")]
        rows, same = part1(cfg, tokens, args.seed) if not args.moe else ([], True)
        trace = make_trace(args, cfg.vocab_size)
        runs = part2(path, args, trace)
        if rank == 0:
            print_report(args, world, cfg, rows, same, runs, time.perf_counter() - t_start)
    finally:
        dist.destroy_process_group()


def print_report(
    args: argparse.Namespace,
    world: int,
    cfg,
    rows: list[dict],
    same: bool,
    runs: dict[str, list[TraceRun]],
    seconds: float,
) -> None:
    sp = args.sp or world
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    print(f"command: {rerun_command('shift.py', world)}")
    print(
        f"torch {torch.__version__}, gloo, {world} ranks, torch threads/rank {torch.get_num_threads()}, "
        f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print()
    if rows:
        print_part1(cfg, rows, same, head_dim)
    else:
        print(
            f"MoE model: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, expert MLP "
            f"{cfg.moe_intermediate_size}, hidden {cfg.hidden_size}; experts over all {world} ranks (SP x EP)"
        )
    print()
    n_req = sum(len(p) for p in make_trace(args, cfg.vocab_size))
    print(
        f"Part 2: bursty trace, sp={sp} tp={world // sp}, phases [1 x {args.long_len}-token prompt, "
        f"{args.burst_size} x {args.burst_len}-token prompts] x {args.cycles} ({n_req} requests), "
        f"{args.new_tokens} greedy new tokens each; Shift threshold {args.threshold}; "
        f"1 warm-up + median of {args.repeats} traces (rank 0 clock)"
    )
    print(
        "TTFT = phase start -> end of the request's prefill step; TPOT = decode s / decode steps; "
        "wire MB/rank = whole trace, counted in the warm-up"
    )
    print()
    print(part2_table(runs))
    print()
    print(token_check(runs))
    print(f"\ntotal script time {seconds:.0f} s")


def print_part1(cfg, rows: list[dict], same: bool, head_dim: int) -> None:
    print(
        f"Part 1: one layer (attention + MLP) forward, prefill of N tokens, fp32; hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads x {head_dim}, "
        f"MLP {cfg.intermediate_size}. Bytes per rank (same on all ranks: {'yes' if same else 'NO'})."
    )
    print("wire = ring all-reduce 2(p-1)/p, all-to-all (p-1)/p, all-gather (p-1) x payload")
    print()
    print(part1_table(rows))
    scaling = scaling_table(rows)
    if scaling:
        print()
        print("Scaling with degree (local tokens per rank = N / d; per-rank compute is proportional to it):")
        print()
        print(scaling)


if __name__ == "__main__":
    main()
