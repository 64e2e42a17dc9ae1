"""RL weight-sync benchmark: FSDP2 training model -> TP rollout model, ``WeightSync`` against baselines.

Run from the repo root:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/rollout_sync.py
    (options: --hidden 1024 --intermediate 2816 --layers 8 --heads 16 --kv-heads 8 --vocab 32000
     --bucket-mb 64 --repeats 3; --small for a quick check on a 4-layer, hidden-256 model)
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 6 bench/rollout_sync.py --world6
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/rollout_sync.py --moe

Model: a seeded Llama checkpoint built once with ``parallel.tiny_models.cached_checkpoint`` (fp32,
untied embeddings; defaults: hidden 1024, MLP 2816, 8 layers, 16 query / 8 KV heads, vocab 32000).
The training model is ``parallel.rollout.train_model`` (the HF model, FSDP2 ``fully_shard``-ed, so
every parameter is ``Shard(0)``) after one Adam step on a seeded batch, so its weights differ from
the checkpoint and optimizer state exists. The rollout model is ``rollout_model(path, "tp", ...)``.

Scenarios (world 4):

1. colocated: FSDP2 over ranks [0, 1, 2, 3] -> TP4 over [0, 1, 2, 3];
2. split: FSDP2 over [0, 1] -> TP2 over [2, 3] (ranks 0, 1 pass ``None`` as the rollout side);
3. colocated 2-D FSDP2 x TP (2 x 2, ``train_model(..., "fsdp_tp")``: ``_StridedShard``) -> TP4;
4. colocated HSDP (2 x 2, ``(Replicate(), Shard(0))``) -> TP4;
5. split FSDP2 [0, 1] -> TP2 [2, 3] in bf16 (fp32 converted while packed).

Then (``--delta-steps``, default 5): delta vs dense syncs into two bf16 TP2 rollout models on
[2, 3] after each of that many real Adam steps (``--delta-lr``, default 1e-5): bytes, seconds,
bitwise equality per step. Per scenario the planned sync's ``verify()`` is timed too.

With ``--world6`` (6 processes): colocated FSDP2 [0..3] -> TP4 [0..3] (ranks 4, 5 idle but in
every collective) and split FSDP2 [0..3] -> TP2 [4, 5] (the issue's "FSDP2 on 4 ranks -> TP2 on 2
other ranks").

Methods (``reshard.sync.WeightSync``, via ``parallel.weight_sync.model_sync``): ``planned`` (ours),
``full_tensor`` and ``broadcast`` (baselines). Per scenario: every method's sync is built once
(build seconds: barrier, max over ranks), then each method runs one warm-up sync into zeroed rollout
weights and its result is compared bitwise with the planned sync's; then ``--repeats`` timed syncs
per method, round-robin over the methods (so drift on a shared machine hits all alike); medians.

Measured: wall seconds of ``sync(step)`` (barrier before, max over ranks), MiB moved (sum over ranks
of ``CommStats.bytes_received``), the lower bound (``WeightSync.lower_bound_bytes``), peak extra MiB
(max over ranks of ``CommStats.peak_extra_bytes``; ours is bounded by ``--bucket-mb``; the baselines
report their largest gathered tensor), and per-phase memory accounting: the bytes of this rank's
training parameter shards + Adam state, of the rollout shards, max over ranks (tensor bytes, not
allocator measurements), plus each process's resident set size (VmRSS) after each phase.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from _common import add_sizes, bench_checkpoint, fill_sizes, parser, rerun_command
from torch.distributed.tensor import DTensor

from reshard.parallel.model.weight_sync import model_sync, rollout_tensors
from reshard.parallel.strategies.rollout import rollout_model, train_model
from reshard.sync import SYNC_METHODS

REPO = Path(__file__).resolve().parent.parent

MIB = 2**20
DEFAULTS = {"hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "kv_heads": 8, "vocab": 32000}
SMALL = {"hidden": 256, "intermediate": 688, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096}


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    p.add_argument("--bucket-mb", type=int, default=64, help="the staging budget (WeightSync bucket_bytes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world6", action="store_true", help="6 processes: FSDP2 on 4 ranks -> TP2 on 2 others")
    p.add_argument("--delta-steps", type=int, default=5, help="optimizer steps of the delta vs dense section (0: skip)")
    p.add_argument("--delta-lr", type=float, default=1e-5, help="Adam learning rate of the delta section")
    p.add_argument(
        "--moe", action="store_true", help="a Qwen3-MoE policy (16 experts, top-4, expert width MLP/4) into EP layouts"
    )
    return fill_sizes(p.parse_args(), DEFAULTS, SMALL)


def checkpoint(args: argparse.Namespace) -> Path:
    """The seeded Llama (``--moe``: Qwen3-MoE) checkpoint of these sizes, built by rank 0 once
    (cached across runs)."""
    if not args.moe:
        return bench_checkpoint(args, "bench-sync")
    from reshard.parallel.model.tiny_models import cached_checkpoint

    moe = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=args.intermediate // 4, mlp_only_layers=[])
    sizes = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=2048, initializer_range=0.02, **moe,
    )  # fmt: skip
    name = f"bench-sync-qwen3moe-h{args.hidden}-i{args.intermediate}-l{args.layers}-v{args.vocab}-seed0-v1"
    if dist.get_rank() == 0:
        cached_checkpoint(name, sizes, family="qwen3_moe")
    dist.barrier()
    return cached_checkpoint(name, sizes, family="qwen3_moe")


# ---- measuring -----------------------------------------------------------------------------------
def reduce_scalar(x: float, op: dist.ReduceOp) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def all_ranks_ok(ok: bool) -> bool:
    return reduce_scalar(float(ok), dist.ReduceOp.MIN) == 1.0


def timed(fn):
    """Wall seconds of ``fn`` (barrier before, max over ranks) and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    return reduce_scalar(time.perf_counter() - t0, dist.ReduceOp.MAX), result


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        t = t.to_local() if isinstance(t, DTensor) else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def local_shards(rollout) -> dict[str, torch.Tensor]:
    return {k: t.to_local() for k, t in rollout_tensors(rollout).items()}


# ---- one scenario ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    label: str
    train_layout: str  # fsdp | fsdp_tp | hsdp (parallel.strategies.rollout.train_model)
    train_ranks: list[int]
    rollout_ranks: list[int]
    tp: int
    dtype: torch.dtype | None = None  # the rollout weights' dtype (None: fp32, the checkpoint's)
    ep: int = 1  # a MoE policy's experts over ep groups of the rollout's tp ranks


def trained(path: Path, ranks: list[int], layout: str = "fsdp", lr: float = 1e-3):
    """The training model after one Adam step on a seeded batch (``None, None`` off its ranks)."""
    model = train_model(path, ranks, layout)
    if model is None:
        return None, None
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    adam_step(model, opt, 0)
    return model, opt


def adam_step(model, opt, seed: int) -> None:
    """One forward/backward on a seeded 2 x 16 batch and one optimizer step."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_scenario(path: Path, sc: Scenario, args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    train_ranks, rollout_ranks, tp = sc.train_ranks, sc.rollout_ranks, sc.tp
    out: dict = {"phases": {}}
    train, opt = trained(path, train_ranks, sc.train_layout)
    train_bytes = storage_bytes(train.parameters()) if train is not None else 0
    opt_bytes = (
        storage_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)) if opt is not None else 0
    )
    out["phases"]["train params"] = reduce_scalar(train_bytes, dist.ReduceOp.MAX)
    out["phases"]["Adam state"] = reduce_scalar(opt_bytes, dist.ReduceOp.MAX)
    out["phases"]["RSS after train"] = reduce_scalar(rss_bytes(), dist.ReduceOp.MAX)
    rollout = rollout_model(path, "tp", rollout_ranks, tp=tp, ep=sc.ep, dtype=sc.dtype)
    mine = rollout if rank in rollout_ranks else None
    roll_bytes = storage_bytes(rollout_tensors(mine).values()) if mine is not None else 0
    out["phases"]["rollout params"] = reduce_scalar(roll_bytes, dist.ReduceOp.MAX)
    out["phases"]["RSS after rollout"] = reduce_scalar(rss_bytes(), dist.ReduceOp.MAX)

    bucket = args.bucket_mb * MIB
    syncs, rows = {}, {}
    for method in SYNC_METHODS:  # build every sync once
        seconds, syncs[method] = timed(lambda m=method: model_sync(train, mine, bucket_bytes=bucket, method=m))
        rows[method] = {"build_s": seconds, "lb": syncs[method].lower_bound_bytes, "times": []}

    step, reference = 0, None
    for method in SYNC_METHODS:  # warm-up: from zeroed rollout weights, compared with planned's
        if mine is not None:
            with torch.no_grad():
                for t in local_shards(mine).values():
                    t.zero_()
        step += 1
        _, stats = timed(lambda m=method, s=step: syncs[m].sync(s))
        shards = local_shards(mine) if mine is not None else {}
        if reference is None:
            reference = {k: t.clone() for k, t in shards.items()}
        same = all(torch.equal(t, reference[k]) for k, t in shards.items()) and shards.keys() == reference.keys()
        rows[method]["equal"] = all_ranks_ok(same)
        rows[method]["bytes"] = reduce_scalar(stats.bytes_received, dist.ReduceOp.SUM)
        rows[method]["peak"] = reduce_scalar(stats.peak_extra_bytes, dist.ReduceOp.MAX)
    out["phases"]["RSS after warm-up syncs"] = reduce_scalar(rss_bytes(), dist.ReduceOp.MAX)

    verify_times = []
    for _ in range(args.repeats):  # timed, round-robin over the methods
        for method in SYNC_METHODS:
            step += 1
            seconds, stats = timed(lambda m=method, s=step: syncs[m].sync(s))
            rows[method]["times"].append(seconds)
            if method == "planned":  # the digest check of what was just written
                verify_times.append(timed(syncs[method].verify)[0])
            rows[method]["peak"] = max(rows[method]["peak"], reduce_scalar(stats.peak_extra_bytes, dist.ReduceOp.MAX))
            assert reduce_scalar(stats.bytes_received, dist.ReduceOp.SUM) == rows[method]["bytes"]
    shards = local_shards(mine) if mine is not None else {}
    final_ok = all_ranks_ok(all(torch.equal(t, reference[k]) for k, t in shards.items()))
    for method in SYNC_METHODS:
        rows[method]["seconds"] = statistics.median(rows[method]["times"])
        rows[method]["equal"] = rows[method]["equal"] and final_ok
    out["rows"] = rows
    out["verify_s"] = statistics.median(verify_times)
    out["version"] = mine.parallel_info.weight_version.step if mine is not None else None
    dist.barrier()
    return out  # the models and syncs are freed with this frame


# ---- report ----------------------------------------------------------------------------------------
HEADER = (
    "| scenario | method | build s | sync s | base/ours time | MiB moved | lower bound MiB | bytes/LB "
    "| peak extra MiB | budget MiB | peak <= budget | equal to planned | verify s (verify/sync) |"
)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("1.00" if a == 0 else "inf")


def format_rows(label: str, rows: dict, budget_mb: int, verify_s: float) -> list[str]:
    ours = rows["planned"]["seconds"]
    lines = []
    for method, r in rows.items():
        lines.append(
            f"| {label} | {method}{' (ours)' if method == 'planned' else ''} | {r['build_s']:.3f} "
            f"| {r['seconds']:.3f} | {'-' if method == 'planned' else ratio(r['seconds'], ours)} "
            f"| {r['bytes'] / MIB:.1f} | {r['lb'] / MIB:.1f} | {ratio(r['bytes'], r['lb'])} "
            f"| {r['peak'] / MIB:.1f} | {budget_mb} | {'yes' if r['peak'] <= budget_mb * MIB else 'NO'} "
            f"| {'yes' if r['equal'] else 'NO'} "
            f"| {f'{verify_s:.3f} ({verify_s / ours:.2f})' if method == 'planned' else '-'} |"
        )
    return lines


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    world = dist.get_world_size()
    expect = 6 if args.world6 else 4
    assert world == expect, f"run with --nproc-per-node {expect}"
    torch.set_num_threads(1)
    rank, t_start = dist.get_rank(), time.perf_counter()
    path = checkpoint(args)
    results = []
    for sc in moe_scenarios() if args.moe else scenarios(world):
        results.append((sc.label, run_scenario(path, sc, args)))
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:.0f}s] {sc.label} done", flush=True)
    delta = run_delta(path, args) if world == 4 and args.delta_steps and not args.moe else None
    if rank == 0:
        numel = sum(math.prod(shape) for shape in _param_shapes(path))
        family = f"Qwen3-MoE (16 experts, top-4, expert MLP {args.intermediate // 4})" if args.moe else "Llama"
        print(
            f"\n{family} hidden {args.hidden}, MLP {args.intermediate}, {args.layers} layers, "
            f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}: {numel / 1e6:.1f}M fp32 parameters "
            f"({numel * 4 / MIB:.0f} MiB); bucket {args.bucket_mb} MiB; warm-up 1 + median of "
            f"{args.repeats} (round-robin over methods); torch {torch.__version__}, {world} gloo ranks\n"
        )
        print(f"{HEADER}\n|{'---|' * 13}")
        for label, r in results:
            for line in format_rows(label, r["rows"], args.bucket_mb, r["verify_s"]):
                print(line)
        print("\nMemory accounting per phase (max over ranks; tensor bytes except RSS):\n")
        phases = list(results[0][1]["phases"])
        print("| scenario | " + " | ".join(f"{p} MiB" for p in phases) + " | sync peak extra MiB (planned) |")
        print(f"|{'---|' * (len(phases) + 2)}")
        for label, r in results:
            print(
                f"| {label} | "
                + " | ".join(f"{r['phases'][p] / MIB:.1f}" for p in phases)
                + f" | {r['rows']['planned']['peak'] / MIB:.1f} |"
            )
        if delta is not None:
            print_delta(delta, args)
        print(f"\ncommand: {rerun_command('rollout_sync.py', world)}")
        print(f"total {time.perf_counter() - t_start:.0f}s")
    dist.destroy_process_group()


def scenarios(world: int) -> list[Scenario]:
    if world == 6:
        return [
            Scenario("colocated FSDP2[0-3]->TP4[0-3] (4,5 idle)", "fsdp", [0, 1, 2, 3], [0, 1, 2, 3], 4),
            Scenario("split FSDP2[0-3]->TP2[4,5]", "fsdp", [0, 1, 2, 3], [4, 5], 2),
        ]
    return [
        Scenario("colocated FSDP2[0-3]->TP4[0-3]", "fsdp", [0, 1, 2, 3], [0, 1, 2, 3], 4),
        Scenario("split FSDP2[0,1]->TP2[2,3]", "fsdp", [0, 1], [2, 3], 2),
        Scenario("colocated FSDP2xTP(2x2)[0-3]->TP4[0-3]", "fsdp_tp", [0, 1, 2, 3], [0, 1, 2, 3], 4),
        Scenario("colocated HSDP(2x2)[0-3]->TP4[0-3]", "hsdp", [0, 1, 2, 3], [0, 1, 2, 3], 4),
        Scenario("split FSDP2[0,1]->TP2[2,3] fp32->bf16", "fsdp", [0, 1], [2, 3], 2, torch.bfloat16),
    ]


def moe_scenarios() -> list[Scenario]:
    """A MoE policy (world 4) into the expert-parallel rollout layouts: EP2 x TP2, EP4, split EP2."""
    return [
        Scenario("colocated FSDP2[0-3]->TP4 EP2[0-3]", "fsdp", [0, 1, 2, 3], [0, 1, 2, 3], 4, ep=2),
        Scenario("colocated HSDP(2x2)[0-3]->TP4 EP4[0-3]", "hsdp", [0, 1, 2, 3], [0, 1, 2, 3], 4, ep=4),
        Scenario("split FSDP2[0,1]->TP2 EP2[2,3]", "fsdp", [0, 1], [2, 3], 2, ep=2),
    ]


# ---- delta vs dense over real optimizer steps --------------------------------------------------------
def run_delta(path: Path, args: argparse.Namespace) -> list[dict]:
    """Split FSDP2[0,1] -> two bf16 TP2 rollout models on [2,3], one synced dense and one delta,
    after each of ``--delta-steps`` Adam steps at ``--delta-lr``: per step the bytes (sum over
    ranks), seconds (max over ranks) and whether the two rollout models are bitwise equal."""
    train, opt = trained(path, [0, 1], lr=args.delta_lr)
    models = [rollout_model(path, "tp", [2, 3], dtype=torch.bfloat16) for _ in range(2)]
    mine = [m if dist.get_rank() in (2, 3) else None for m in models]
    bucket = args.bucket_mb * MIB
    dense, delta = (model_sync(train, m, bucket_bytes=bucket, delta=d) for m, d in zip(mine, (False, True)))
    rows = []
    for step in range(args.delta_steps + 1):  # step 0: the first sync (delta's is dense)
        if step and train is not None:
            adam_step(train, opt, step)
        row = {"step": step}
        for name, sync in (("dense", dense), ("delta", delta)):
            row[f"{name}_s"], stats = timed(lambda s=sync, k=step: s.sync(k))
            row[f"{name}_bytes"] = reduce_scalar(stats.bytes_received, dist.ReduceOp.SUM)
        a, b = (local_shards(m) if m is not None else {} for m in mine)
        row["equal"] = all_ranks_ok(all(torch.equal(a[k], b[k]) for k in a))
        row["lb"] = dense.lower_bound_bytes
        rows.append(row)
    dist.barrier()
    return rows


def print_delta(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nDelta vs dense sync, split FSDP2[0,1] -> TP2[2,3] fp32 -> bf16, Adam lr {args.delta_lr:g}, "
        f"one real optimizer step before each sync (step 0: the first sync):\n"
    )
    print("| step | dense MiB | delta MiB | delta/dense bytes | dense s | delta s | delta/dense time | bitwise equal |")
    print(f"|{'---|' * 8}")
    for r in rows:
        print(
            f"| {r['step']} | {r['dense_bytes'] / MIB:.2f} | {r['delta_bytes'] / MIB:.2f} "
            f"| {ratio(r['delta_bytes'], r['dense_bytes'])} | {r['dense_s']:.3f} | {r['delta_s']:.3f} "
            f"| {ratio(r['delta_s'], r['dense_s'])} | {'yes' if r['equal'] else 'NO'} |"
        )


def _param_shapes(path: Path):
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield h.get_slice(k).get_shape()


if __name__ == "__main__":
    main()
