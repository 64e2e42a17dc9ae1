"""Movement benchmark: ``reshard`` against DTensor / full_tensor baselines on a Llama-shaped stack.

Run from the repo root:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/movement.py
    (options: --hidden 1024 --layers 8 --bucket-mb 64 --repeats 3)

Tensors: ``--layers`` layers, each with q, k, v, o (hidden x hidden) and gate, up (ffn x hidden),
down (hidden x ffn), fp32, where ffn is Llama's MLP width: 8/3 * hidden rounded up to a multiple
of 256 (2816 for hidden 1024). Defaults: 8 x (4 * 1024^2 + 3 * 1024 * 2816) = 102.8M parameters
(411 MB). Colwise (TP Shard(0)): q, k, v, gate, up; rowwise (TP Shard(1)): o, down.

Scenarios (ours = one ``reshard.redistribute_module`` call moving the whole stack; baseline =
a loop over the tensors):

1. same ascending 1-D mesh of 4 ranks: Shard(0)->Replicate, Shard(0)->Shard(1), Replicate->Shard(0),
   Shard(1)->Shard(0). Baseline: ``DTensor.redistribute``.
2. tp4->stages (TP(4) -> whole layers per pipeline stage, Replicate on a 1-rank mesh per stage),
   fsdp4->tp4 (all Shard(0) -> colwise Shard(0) / rowwise Shard(1)), tp2{0,1}->tp2{2,3} (disjoint
   meshes). Baseline: ``full_tensor()`` then slice; for disjoint meshes an all-gather over the
   world (ranks 2, 3 contribute a dummy shard of equal size) then each destination rank slices.

Measured per scenario: wall seconds (barrier, then max over ranks; median of ``--repeats`` timed
runs after one untimed warm-up run of each side), bytes sent summed over ranks (ours: CommStats;
baseline: counted from every functional collective the baseline issues, see ``CountCollectives``),
the plans' lower bound, peak extra memory (ours: max over ranks of CommStats.peak_extra_bytes;
baseline: largest collective output buffer a rank holds at once, i.e. one full tensor for an
all-gather), and whether both results equal the reference (local slicing of the global tensor).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _common import parser, rerun_command
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import reshard
from reshard.layout import Layout, box_slices

REPO = Path(__file__).resolve().parent.parent

WORLD = 4
MIB = 2**20
COLWISE = ("q", "k", "v", "gate", "up")
ROWWISE = ("o", "down")

Target = tuple[DeviceMesh, tuple[Placement, ...]]
Targets = dict[str, Target]
Locals = dict[str, torch.Tensor | None]  # this rank's result per tensor (None: not on the mesh)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def ffn_width(hidden: int) -> int:
    """Llama's MLP width: int(8/3 * hidden) rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden / 3) / 256)


def shapes(hidden: int, layers: int) -> dict[str, tuple[int, int]]:
    f = ffn_width(hidden)
    one = {
        "q": (hidden, hidden),
        "k": (hidden, hidden),
        "v": (hidden, hidden),
        "o": (hidden, hidden),
        "gate": (f, hidden),
        "up": (f, hidden),
        "down": (hidden, f),
    }
    return {f"layers.{i}.{n}": s for i in range(layers) for n, s in one.items()}


def global_tensors(spec: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The same seeded tensors on every rank."""
    out = {}
    for i, (name, shape) in enumerate(spec.items()):
        out[name] = torch.randn(shape, generator=torch.Generator().manual_seed(i))
    return out


def tp_placement(name: str) -> tuple[Placement, ...]:
    return (Shard(0),) if name.rsplit(".", 1)[1] in COLWISE else (Shard(1),)


def layer_of(name: str) -> int:
    return int(name.split(".")[1])


# ---- building and checking ---------------------------------------------------------------------
def build_stack(full: dict[str, torch.Tensor], src: Targets) -> nn.Module:
    """A module holding every tensor as a DTensor parameter, built by local slicing (no collective)."""
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Module() for _ in range(1 + max(layer_of(n) for n in full)))
    for name, t in full.items():
        mesh, placements = src[name]
        dt = distribute_tensor(t, mesh, placements, src_data_rank=None)
        root.layers[layer_of(name)].register_parameter(name.rsplit(".", 1)[1], nn.Parameter(dt, requires_grad=False))
    return root


def reference(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor | None:
    box = Layout.of(mesh, placements, full.shape, full.dtype).box(dist.get_rank())
    return None if box is None else full[box_slices(box)]


def matches(full: dict[str, torch.Tensor], dst: Targets, got: Locals) -> bool:
    ok = True
    for name, t in full.items():
        expect = reference(t, *dst[name])
        have = got[name]
        if expect is None:
            ok &= have is None or have.numel() == 0
        else:
            ok &= have is not None and torch.equal(have, expect)
    return ok


def all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def reduce_scalar(x: float, op: dist.ReduceOp) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Wall seconds of ``fn`` (barrier before, max over ranks) and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    return reduce_scalar(time.perf_counter() - t0, dist.ReduceOp.MAX), result


# ---- baseline accounting ------------------------------------------------------------------------
class CountCollectives(TorchDispatchMode):
    """Bytes this rank sends in functional collectives (only all-gather is expected here).

    An all-gather over ``g`` ranks of an ``n``-byte input sends ``(g - 1) * n`` bytes per rank (each
    rank's shard reaches the ``g - 1`` others) and materializes a ``g * n``-byte output.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.peak = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            nbytes, group_size = args[0].numel() * args[0].element_size(), args[1]
            self.sent += (group_size - 1) * nbytes
            self.peak = max(self.peak, group_size * nbytes)
            self.calls += 1
        elif func.namespace in ("_c10d_functional", "c10d") and any(
            k in func.__name__ for k in ("reduce", "gather", "scatter", "all_to_all", "broadcast", "send", "recv")
        ):
            raise NotImplementedError(f"no byte count for {func}")
        return func(*args, **(kwargs or {}))


def waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# ---- the two sides -------------------------------------------------------------------------------
def ours(module: nn.Module, dst: Targets, bucket_bytes: int) -> tuple[Locals, reshard.CommStats]:
    stats = reshard.redistribute_module(module, dst, bucket_bytes=bucket_bytes)
    return {name: p.to_local() for name, p in module.named_parameters()}, stats


def dtensor_redistribute(module: nn.Module, dst: Targets) -> Locals:
    out = {}
    for name, p in module.named_parameters():
        mesh, placements = dst[name]
        out[name] = waited(p.redistribute(mesh, placements).to_local())
    return out


def full_tensor_then_slice(module: nn.Module, dst: Targets) -> Locals:
    out = {}
    for name, p in module.named_parameters():
        full = waited(p.full_tensor())
        box = Layout.of(*dst[name], full.shape, full.dtype).box(dist.get_rank())
        out[name] = None if box is None else full[box_slices(box)].clone()
        del full
    return out


def world_gather_then_slice(module: nn.Module, dst: Targets) -> Locals:
    """Disjoint meshes: all-gather the source shards over the world, destination ranks slice.

    Every rank contributes one shard-sized chunk (ranks off the source mesh an uninitialized dummy);
    the source mesh's chunks are concatenated along the sharded dim into the full tensor.
    """
    out = {}
    for name, p in module.named_parameters():
        src_layout = Layout.of_dtensor(p)
        src_ranks, dim = src_layout.all_ranks, p.placements[0].dim
        shard_shape = src_layout.local_shape(src_ranks[0])
        local = p.to_local().contiguous() if p.to_local().numel() else torch.empty(shard_shape)
        gathered = waited(funcol.all_gather_single(local, 0, dist.group.WORLD))
        chunks = gathered.view(WORLD, *shard_shape)
        box = Layout.of(*dst[name], p.shape, p.dtype).box(dist.get_rank())
        if box is None:
            out[name] = None
        else:
            full = torch.cat([chunks[r] for r in src_ranks], dim=dim)
            out[name] = full[box_slices(box)].clone()
        del gathered, chunks
    return out


# ---- scenarios -----------------------------------------------------------------------------------
def scenarios(names: list[str], layers: int) -> list[tuple[str, Targets, Targets, Callable]]:
    """(label, source targets, destination targets, baseline) for every scenario."""
    world = DeviceMesh("cpu", torch.arange(WORLD))
    stages = [DeviceMesh("cpu", torch.tensor([r])) for r in range(WORLD)]
    first, second = DeviceMesh("cpu", torch.tensor([0, 1])), DeviceMesh("cpu", torch.tensor([2, 3]))

    def on(mesh: DeviceMesh, pick: Callable[[str], tuple[Placement, ...]]) -> Targets:
        return {n: (mesh, pick(n)) for n in names}

    out = []
    for label, a, b in [
        ("S(0)->R", Shard(0), Replicate()),
        ("S(0)->S(1)", Shard(0), Shard(1)),
        ("R->S(0)", Replicate(), Shard(0)),
        ("S(1)->S(0)", Shard(1), Shard(0)),
    ]:
        out.append((label, on(world, lambda n, a=a: (a,)), on(world, lambda n, b=b: (b,)), dtensor_redistribute))
    stage_targets = {n: (stages[layer_of(n) * WORLD // layers], (Replicate(),)) for n in names}
    out.append(("tp4->stages", on(world, tp_placement), stage_targets, full_tensor_then_slice))
    out.append(("fsdp4->tp4", on(world, lambda n: (Shard(0),)), on(world, tp_placement), full_tensor_then_slice))
    out.append(("tp2{0,1}->tp2{2,3}", on(first, tp_placement), on(second, tp_placement), world_gather_then_slice))
    return out


def lower_bound(module: nn.Module, dst: Targets) -> int:
    return sum(reshard.plan_for(p, *dst[n]).lower_bound_bytes for n, p in module.named_parameters())


def run_scenario(
    full: dict[str, torch.Tensor], src: Targets, dst: Targets, baseline: Callable, repeats: int, bucket_bytes: int
) -> dict[str, float]:
    row: dict[str, float] = {}
    # ours: one warm-up, then timed repeats on a freshly built source stack each time
    ok, times = True, []
    for i in range(repeats + 1):
        module = build_stack(full, src)
        if i == 0:
            row["lb"] = lower_bound(module, dst)
        seconds, (got, stats) = timed(lambda module=module: ours(module, dst, bucket_bytes))
        assert stats.lower_bound_bytes == row["lb"], (stats.lower_bound_bytes, row["lb"])
        ok &= matches(full, dst, got)
        if i:
            times.append(seconds)
        del module, got
    row["ours_s"] = statistics.median(times)
    row["ours_bytes"] = reduce_scalar(stats.bytes_sent, dist.ReduceOp.SUM)
    row["ours_peak"] = reduce_scalar(stats.peak_extra_bytes, dist.ReduceOp.MAX)
    row["ours_ok"] = all_ranks_ok(ok)
    # baseline: warm-up run counts bytes, then timed repeats
    module = build_stack(full, src)
    counter = CountCollectives()
    with counter:
        got = baseline(module, dst)
    ok, times = matches(full, dst, got), []
    del got
    for _ in range(repeats):
        seconds, got = timed(lambda: baseline(module, dst))
        ok &= matches(full, dst, got)
        times.append(seconds)
        del got
    row["base_s"] = statistics.median(times)
    row["base_bytes"] = reduce_scalar(counter.sent, dist.ReduceOp.SUM)
    row["base_peak"] = reduce_scalar(counter.peak, dist.ReduceOp.MAX)
    row["base_ok"] = all_ranks_ok(ok)
    return row


# ---- report --------------------------------------------------------------------------------------
HEADER = (
    "| scenario | ours s | base s | ours/base time | ours MiB sent | base MiB sent | lower bound MiB "
    "| ours/LB bytes | base/LB bytes | ours peak extra MiB | base peak MiB | equal to reference |"
)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("1.00" if a == 0 else "inf")


def format_row(label: str, r: dict[str, float]) -> str:
    ok = (
        "ours yes, base yes"
        if r["ours_ok"] and r["base_ok"]
        else f"ours {'yes' if r['ours_ok'] else 'NO'}, base {'yes' if r['base_ok'] else 'NO'}"
    )
    return (
        f"| {label} | {r['ours_s']:.3f} | {r['base_s']:.3f} | {ratio(r['ours_s'], r['base_s'])} "
        f"| {r['ours_bytes'] / MIB:.1f} | {r['base_bytes'] / MIB:.1f} | {r['lb'] / MIB:.1f} "
        f"| {ratio(r['ours_bytes'], r['lb'])} | {ratio(r['base_bytes'], r['lb'])} "
        f"| {r['ours_peak'] / MIB:.1f} | {r['base_peak'] / MIB:.1f} | {ok} |"
    )


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    assert dist.get_world_size() == WORLD, f"run with --nproc-per-node {WORLD}"
    assert args.hidden % WORLD == 0 and args.layers % WORLD == 0, "hidden and layers must divide by 4"
    torch.set_num_threads(1)
    rank, t_start = dist.get_rank(), time.perf_counter()
    spec = shapes(args.hidden, args.layers)
    full = global_tensors(spec)
    numel = sum(t.numel() for t in full.values())
    rows = []
    for label, src, dst, baseline in scenarios(list(spec), args.layers):
        rows.append((label, run_scenario(full, src, dst, baseline, args.repeats, args.bucket_mb * MIB)))
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:.0f}s] {label} done", flush=True)
    if rank == 0:
        print(
            f"\n{args.layers} layers, hidden {args.hidden}, ffn {ffn_width(args.hidden)}: "
            f"{numel / 1e6:.1f}M fp32 parameters ({numel * 4 / MIB:.0f} MiB), {len(spec)} tensors; "
            f"bucket {args.bucket_mb} MiB; median of {args.repeats} after 1 warm-up; "
            f"torch {torch.__version__}, {WORLD} gloo ranks\n"
        )
        for title, part in [
            ("Same mesh (ascending 1-D mesh of 4; baseline DTensor.redistribute)", rows[:4]),
            ("Layout changes (baseline full_tensor()/world all-gather, then slice)", rows[4:]),
        ]:
            print(f"{title}\n\n{HEADER}\n|{'---|' * 12}")
            for label, r in part:
                print(format_row(label, r))
            print()
        print(f"command: {rerun_command('movement.py', dist.get_world_size())}")
        print(f"total {time.perf_counter() - t_start:.0f}s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
