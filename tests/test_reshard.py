"""The movement core: plans (pure) and their execution on 4 gloo ranks.

References are built by slicing the global tensor locally, never with DTensor collectives (which
misplace shards on meshes whose ranks are not ascending).
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from reshard import Layout, plan_transfer
from reshard.layout import box_numel, box_slices
from tests import dist_harness
from tests.tolerance import assert_close_reduced

WORLD = 4


# ---- pure planning ---------------------------------------------------------------------------
def test_plan_bytes_and_lower_bound_simple():
    src = Layout((0, 1, 2, 3), (Shard(0),), (8, 3), torch.float32)
    dst = Layout((0, 1, 2, 3), (Replicate(),), (8, 3), torch.float32)
    plan = plan_transfer(src, dst)
    assert plan.lower_bound_bytes == plan.bytes_moved == 4 * (3 * 2 * 3) * 4  # each needs 3 of 4 rows pairs
    assert plan.messages == 12


def test_replicated_source_spreads_senders():
    src = Layout((0, 1, 2, 3), (Replicate(),), (8, 8), torch.float32)
    dst = Layout((4, 5, 6, 7), (Shard(0),), (8, 8), torch.float32)
    plan = plan_transfer(src, dst)
    senders = [p.src for p in plan.pieces]
    assert sorted(senders) == [0, 1, 2, 3]  # no holder sends twice: no incast hotspot
    assert plan.bytes_moved == plan.lower_bound_bytes == 8 * 8 * 4


def test_local_copy_when_already_held():
    a = Layout((0, 1), (Shard(1),), (4, 6), torch.float32)
    plan = plan_transfer(a, a)
    assert plan.bytes_moved == 0 and all(p.local for p in plan.pieces)


def test_plan_rejects_mismatches():
    a = Layout((0, 1), (Shard(0),), (4, 6), torch.float32)
    with pytest.raises(ValueError, match=r"global shape mismatch: source \(4, 6\) vs destination \(4, 7\)"):
        plan_transfer(a, Layout((0, 1), (Shard(0),), (4, 7), torch.float32))
    dtype_mismatch = "dtype mismatch: source torch.float32 vs destination torch.bfloat16"
    with pytest.raises(ValueError, match=re.escape(dtype_mismatch)):
        plan_transfer(a, Layout((0, 1), (Shard(0),), (4, 6), torch.bfloat16))
    ints = Layout((0, 1), (Shard(0),), (4, 6), torch.int64)
    with pytest.raises(ValueError, match=r"a Partial\(sum\) destination divides its values: torch.int64 is not"):
        plan_transfer(ints, Layout((0, 1), (Partial(),), (4, 6), torch.int64))
    partial = Layout((0, 1), (Partial(),), (4, 6), torch.float32)
    with pytest.raises(ValueError, match=r"moves to Shard or Replicate placements, got \(Partial\(avg\),\)"):
        plan_transfer(partial, Layout((0, 1), (Partial("avg"),), (4, 6), torch.float32))
    mixed = Layout(((0,), (1,)), (Partial("max"), Partial("sum")), (4, 6), torch.float32)
    with pytest.raises(ValueError, match=r"reduce with one of \['sum', 'avg', 'max', 'min'\] .* got \['max', 'sum'\]"):
        plan_transfer(mixed, Layout(((0,), (1,)), (Replicate(), Replicate()), (4, 6), torch.float32))
    assert (
        plan_transfer(a, partial).bytes_moved
        == plan_transfer(a, Layout((0, 1), (Replicate(),), (4, 6), torch.float32)).bytes_moved
    )


def test_a_casting_plan_moves_the_destination_dtype_and_refuses_what_cannot_convert():
    src = Layout((0, 1), (Shard(0),), (4, 6), torch.float32)
    bf16 = Layout((0, 1), (Shard(1),), (4, 6), torch.bfloat16)
    plan = plan_transfer(src, bf16, cast=True)
    assert plan.itemsize == 2 and plan.bytes_moved == plan.lower_bound_bytes == 2 * (2 * 3) * 2
    with pytest.raises(ValueError, match=re.escape("dtype mismatch: source torch.float32 vs destination torch.int32")):
        plan_transfer(src, Layout((0, 1), (Shard(1),), (4, 6), torch.int32), cast=True)
    partial = Layout((0, 1), (Partial(),), (4, 6), torch.float32)
    with pytest.raises(ValueError, match=r"a Partial source \(\(Partial\(sum\),\)\) cannot change dtype"):
        plan_transfer(partial, bf16, cast=True)


# ---- execution on 4 ranks: property-based --------------------------------------------------------
def _contribution(shape, dtype, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _global(layout: Layout) -> torch.Tensor:
    """The tensor a layout represents: the sum of its partial contributions (exact integers)."""
    k = 1
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            k *= layout.grid.shape[axis]
    return sum(_contribution(layout.shape, layout.dtype, j) for j in range(k))


def _source_local(layout: Layout, rank: int) -> torch.Tensor | None:
    coord = layout.coordinate(rank)
    if coord is None:
        return None
    j = 0
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            j = j * layout.grid.shape[axis] + coord[axis]
    full = _contribution(layout.shape, layout.dtype, j) if layout.is_partial else _global(layout)
    return full[box_slices(layout.box(rank))].clone()


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _check_move(src: Layout, dst: Layout, bucket):
    """Runs on every rank: (stats, A -> B equals the sliced reference, B -> A returns the bytes).

    Checks are returned, not raised, so every rank reaches the second move.
    """
    import torch.distributed as dist

    from reshard import execute

    rank = dist.get_rank()
    x = _global(src)
    src_local = _source_local(src, rank)
    [out], stats = execute([plan_transfer(src, dst)], [src_local], bucket_bytes=bucket)
    box = dst.box(rank)
    forward_ok = _same(out, None if box is None else x[box_slices(box)])
    back_ok = True
    if not src.is_partial:
        [back], _ = execute([plan_transfer(dst, src)], [out], bucket_bytes=bucket)
        back_ok = _same(back, src_local)
    return stats, forward_ok, back_ok


@st.composite
def _layouts(draw, partial_ok: bool):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    size = draw(st.sampled_from([1, 2, 3, 4]))
    ranks = draw(st.permutations(range(WORLD)))[:size]
    grid_shape = draw(
        st.sampled_from(
            [
                s
                for s in [(size,), (2, size // 2), (size // 2, 2)]
                if all(n > 0 for n in s) and s[0] * (s[1] if len(s) > 1 else 1) == size
            ]
        )
    )
    grid = torch.tensor(ranks).view(grid_shape).tolist()
    kinds = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if partial_ok else [])
    placements = tuple(draw(st.sampled_from(kinds)) for _ in grid_shape)
    from reshard.layout import nested_tuple

    return Layout(nested_tuple(grid), placements, shape, torch.float32), shape


@st.composite
def _cases(draw):
    src, shape = draw(_layouts(partial_ok=True))
    dst, _ = draw(_layouts(partial_ok=False))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int32, torch.bfloat16]))
    src = Layout(src.ranks, src.placements, shape, dtype)
    dst = Layout(
        dst.ranks,
        tuple(p if not isinstance(p, Shard) or p.dim < len(shape) else Replicate() for p in dst.placements),
        shape,
        dtype,
    )
    bucket = draw(st.sampled_from([None, 8, 24, 64, 256, 10_000]))
    return src, dst, bucket


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_any_layout_to_any_layout(case):
    src, dst, bucket = case
    if bucket is not None and bucket < src.dtype.itemsize:
        bucket = src.dtype.itemsize
    plan = plan_transfer(src, dst)
    results = dist_harness.run(WORLD, _check_move, src, dst, bucket)
    assert all(fwd for _, fwd, _ in results), "A -> B differs from the sliced reference"
    assert all(back for _, _, back in results), "A -> B -> A changed the bytes"
    stats = [s for s, _, _ in results]
    sent = sum(s.bytes_sent for s in stats)
    assert sent == sum(s.bytes_received for s in stats) == plan.bytes_moved == plan.lower_bound_bytes
    if bucket is not None:  # send + receive buffers of any round on any rank
        assert all(s.peak_extra_bytes <= bucket for s in stats)


# ---- DTensor API on real meshes ----------------------------------------------------------------------
def _dtensor_moves():
    """Non-ascending, permuted, overlapping and disjoint meshes through ``reshard.redistribute``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from reshard import redistribute

    rank = dist.get_rank()
    x = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    meshes = {
        name: DeviceMesh("cpu", torch.tensor(r))
        for name, r in [
            ("tp01", [0, 1]),
            ("tp23", [2, 3]),
            ("r3", [3]),
            ("perm", [0, 3, 2]),
            ("all", [3, 1, 0, 2]),
            ("grid", [[2, 0], [3, 1]]),
        ]
    }
    cases = [
        ("tp01", (Shard(0),), "tp23", (Shard(0),)),
        ("tp01", (Shard(1),), "r3", (Replicate(),)),
        ("perm", (Shard(0),), "all", (Shard(1),)),
        ("all", (Replicate(),), "grid", (Shard(0), Shard(1))),
        ("grid", (Shard(1), Replicate()), "perm", (Replicate(),)),
    ]
    results = []
    for a, pa, b, pb in cases:
        t = distribute_tensor(x, meshes[a], pa, src_data_rank=None)
        out, s = redistribute(t, meshes[b], pb, return_stats=True)
        expect = distribute_tensor(x, meshes[b], pb, src_data_rank=None)
        on_mesh = meshes[b].get_coordinate() is not None
        assert (out is None) != on_mesh
        if on_mesh:
            assert torch.equal(out.to_local(), expect.to_local()), (a, b, rank)
        results.append((s.bytes_sent, s.lower_bound_bytes))
    return results


def test_dtensor_redistribute_across_meshes():
    per_rank = dist_harness.run(WORLD, _dtensor_moves)
    for case in zip(*per_rank):
        assert sum(sent for sent, _ in case) == case[0][1]  # bytes moved == lower bound


def _partial_and_mixed_module():
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from reshard import redistribute, redistribute_module

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([1, 0, 3, 2]))
    # Partial(sum) source: every rank holds (rank + 1) * base; the reduction is 10 * base
    base = torch.arange(12.0).view(4, 3)
    partial = DTensor.from_local(base * (rank + 1), mesh, (Partial(),), run_check=False)
    reduced = redistribute(partial, mesh, (Shard(0),))
    expect = distribute_tensor(base * 10, mesh, (Shard(0),), src_data_rank=None).to_local()
    assert torch.equal(reduced.to_local(), expect)
    # a module with parameters and buffers of three dtypes moves in one coalesced transfer
    full = {
        "a": torch.randn(6, 4, generator=torch.Generator().manual_seed(0)),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    }
    m = nn.Module()
    m.a = nn.Parameter(distribute_tensor(full["a"], mesh, (Shard(0),), src_data_rank=None))
    m.register_buffer("b", distribute_tensor(full["b"], mesh, (Replicate(),), src_data_rank=None))
    m.register_buffer("c", distribute_tensor(full["c"], mesh, (Shard(1),), src_data_rank=None))
    dst = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]))
    stats = redistribute_module(
        m, {"a": (dst, (Replicate(), Shard(1))), "b": (dst, (Shard(0), Replicate())), "c": (dst, (Shard(0), Shard(1)))}
    )
    for name, pl in [("a", (Replicate(), Shard(1))), ("b", (Shard(0), Replicate())), ("c", (Shard(0), Shard(1)))]:
        got = getattr(m, name)
        assert got.dtype == full[name].dtype
        assert torch.equal(got.to_local(), distribute_tensor(full[name], dst, pl, src_data_rank=None).to_local())
    assert isinstance(m.a, nn.Parameter)
    return stats.messages, stats.bytes_sent, stats.lower_bound_bytes


def test_partial_source_and_mixed_dtype_module():
    per_rank = dist_harness.run(WORLD, _partial_and_mixed_module)
    for messages, _, _ in per_rank:
        assert messages <= WORLD - 1  # one coalesced message per peer for all three tensors
    assert sum(sent for _, sent, _ in per_rank) == per_rank[0][2]


def _bad_inputs():
    import torch.distributed as dist

    from reshard import execute

    errors = []
    outside = Layout((0, 7), (Shard(0),), (4,), torch.float32)
    inside = Layout((0, 1), (Shard(0),), (4,), torch.float32)
    for call in (
        lambda: execute([plan_transfer(inside, outside)], [torch.zeros(2)]),
        lambda: execute(
            [plan_transfer(inside, Layout((2, 3), (Shard(0),), (4,), torch.float32))],
            [torch.zeros(2) if dist.get_rank() < 2 else None],
            bucket_bytes=3,
        ),
    ):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_inputs_raise_value_error():
    for outside, budget in dist_harness.run(WORLD, _bad_inputs):
        assert "mesh names ranks [7] outside the world of 4 ranks" in outside
        assert "bucket_bytes (3) is smaller than the minimum chunk: one element of torch.float32 (4 bytes)" in budget


# ---- a whole Llama model through five layouts ---------------------------------------------------------
def _model_through_layouts(path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM

    from reshard import Layout, redistribute_module
    from reshard.parallel import parallelize
    from reshard.parallel.model.layouts import fsdp_layout, replicate_over, stage_layout, tp_layout

    rank = dist.get_rank()
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ids = torch.tensor([[5, 9, 33, 2, 100, 7, 64]])
    model = parallelize(path)  # TP(4); 2 KV heads -> replicated on a (2, 2) kv mesh
    tp4 = tp_layout(model, model.model.embed_tokens.weight.device_mesh)
    assert all(tp4[n] == (p.device_mesh, p.placements) for n, p in model.named_parameters())
    world = DeviceMesh("cpu", torch.arange(4))
    grid = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    stages = [DeviceMesh("cpu", torch.tensor([r])) for r in range(4)]
    layouts = [
        ("fsdp", fsdp_layout(model, world), False),
        ("stages", stage_layout(model, stages), False),
        ("tp2xdp2", replicate_over(tp_layout(model, grid["tp"]), grid), True),
        ("tp4", tp4, True),
    ]
    with torch.no_grad():
        logits = {"start": model(ids).logits}
    moves = []
    for name, targets, runnable in layouts:
        stats = redistribute_module(model, targets)
        for pname, p in model.named_parameters():
            box = Layout.of_dtensor(p).box(rank)
            expect = full[pname][box_slices(box)] if box is not None else torch.empty(0)
            assert torch.equal(p.to_local(), expect), (name, pname, rank)
        if runnable:
            with torch.no_grad():
                logits[name] = model(ids).logits
        moves.append((name, stats.bytes_sent, stats.lower_bound_bytes))
    return logits, moves


def test_llama_through_tp_fsdp_stages_tpdp_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    path = str(make_tiny_checkpoint("llama", tmp_path / "llama4", seed=3, num_hidden_layers=4))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 33, 2, 100, 7, 64]])
    with torch.no_grad():
        expected = hf(ids).logits
        expected64 = hf.double()(ids).logits
    # (this once failed in CI runs, every few runs: the embedding's vocab range was cached under
    # id(weight), and the tp2xdp2 weight could take over the id of the tp4 one it was cached for;
    # test_layers.py::test_embedding_follows_its_weight_through_every_move repeats it every time)
    results = dist_harness.run(WORLD, _model_through_layouts, path)
    for logits, _ in results:
        assert_close_reduced(logits["start"], expected, expected64, msg="tp4")
        assert_close_reduced(logits["tp2xdp2"], expected, expected64, msg="tp2xdp2")
        assert torch.equal(logits["tp4"], logits["start"])  # back in TP(4): bitwise the same logits
    for move in zip(*[moves for _, moves in results]):
        name, lower_bound = move[0][0], move[0][2]
        assert sum(sent for _, sent, _ in move) == lower_bound > 0, name


def _async_move():
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from reshard import MoveHandle, redistribute_module

    x = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    src = DeviceMesh("cpu", torch.arange(4))
    dst = DeviceMesh("cpu", torch.tensor([3, 2, 1, 0]))
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(x, src, (Shard(0),), src_data_rank=None))
    before = m.w
    handle = redistribute_module(m, {"w": (dst, (Shard(1),))}, async_op=True, bucket_bytes=1024)
    assert isinstance(handle, MoveHandle)
    busy = sum(torch.ones(200, 200).matmul(torch.ones(200, 200)).sum().item() for _ in range(5))  # overlap
    still_old = m.w is before
    stats = handle.wait(timeout=60)
    expect = distribute_tensor(x, dst, (Shard(1),), src_data_rank=None).to_local()
    return still_old, torch.equal(m.w.to_local(), expect), stats.rounds > 1, busy > 0


def test_async_module_move_overlaps_and_installs_on_wait():
    for still_old, correct, bucketed, _ in dist_harness.run(WORLD, _async_move):
        assert still_old and correct and bucketed


def _boxes_vs_dtensor(layout: Layout):
    """This rank's box from ``Layout`` against DTensor's own local slicing on a real mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    x = torch.arange(box_numel(tuple((0, n) for n in layout.shape)), dtype=torch.float32).view(layout.shape)
    mesh = DeviceMesh("cpu", layout.grid)
    box = layout.box(dist.get_rank())
    if box is None:
        return True
    local = distribute_tensor(x, mesh, layout.placements, src_data_rank=None).to_local()
    return torch.equal(local, x[box_slices(box)])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(_layouts(partial_ok=False))
def test_layout_boxes_agree_with_dtensor_local_slicing(layout_and_shape):
    """The property tests' reference (Layout boxes) is DTensor's own chunk rule."""
    layout, _ = layout_and_shape
    assert all(dist_harness.run(WORLD, _boxes_vs_dtensor, layout))


# ---- misuse: a clear error on every rank, never a hang (issue 10) ----------------------------------
def _disagreeing_ranks():
    import torch.distributed as dist

    from reshard import redistribute, slice_to_dtensor
    from reshard.mesh import cached_mesh

    mesh = cached_mesh(torch.arange(dist.get_world_size()), ("x",))
    t = slice_to_dtensor(torch.arange(16.0).view(4, 4), mesh, (Shard(0),))
    target = (Shard(1),) if dist.get_rank() == 1 else (Replicate(),)  # rank 1 asks for another layout
    redistribute(t, mesh, target)


def test_ranks_with_different_arguments_get_a_value_error_not_a_hang():
    with pytest.raises(RuntimeError) as info:
        dist_harness.run(2, _disagreeing_ranks, timeout=60)
    text = str(info.value)
    assert "failed on ranks [0, 1]" in text  # every rank raises, none is left waiting
    assert "ranks called the move with different arguments (rank 0 vs rank 1, tensor 0:" in text
    assert "Replicate()" in text and "Shard(dim=1)" in text  # both layouts named


def _bad_move_arguments(case):
    import torch.distributed as dist

    from reshard import redistribute, redistribute_module, slice_to_dtensor
    from reshard.mesh import cached_mesh

    mesh = cached_mesh(torch.arange(dist.get_world_size()), ("x",))
    if case == "plain":
        redistribute(torch.zeros(4), mesh, (Shard(0),))
    module = torch.nn.Linear(4, 4)
    module.weight = torch.nn.Parameter(slice_to_dtensor(torch.zeros(4, 4), mesh, (Shard(0),)))
    redistribute_module(module, {"weight": (Shard(1),)})


@pytest.mark.parametrize(
    "case,match",
    [
        ("plain", r"redistribute moves DTensors; got a Tensor"),
        ("no-mesh", r"a move target is \(mesh, placements\); got \(Shard\(dim=1\),\)"),
    ],
)
def test_bad_move_arguments_are_named(case, match):
    with pytest.raises(RuntimeError, match=match):
        dist_harness.run(1, _bad_move_arguments, case)


def _layout_of(placement):
    import torch.distributed as dist

    from reshard.mesh import cached_mesh

    Layout.of(cached_mesh(torch.arange(dist.get_world_size()), ("x",)), (placement,), (4, 4), torch.float32)


def test_out_of_range_shard_dim_is_named_as_given():
    with pytest.raises(RuntimeError, match=r"Shard\(dim=-3\) is out of range for a tensor of shape \(4, 4\)"):
        dist_harness.run(1, _layout_of, Shard(-3))


def _groups():
    import torch.distributed as dist

    from reshard.mesh import cached_group

    moves = cached_group(purpose="moves")
    again = cached_group(purpose="moves")
    kv = cached_group(purpose="kv")
    pair = cached_group([1, 0], purpose="pair")
    timeout = moves._get_backend(torch.device("cpu")).options._timeout
    return moves is again, moves is not kv, dist.get_process_group_ranks(pair), timeout


def test_background_groups_are_cached_by_purpose_with_the_jobs_timeout():
    from tests.dist_harness import COLLECTIVE_TIMEOUT

    for same, distinct, ranks, timeout in dist_harness.run(2, _groups):
        assert same and distinct and ranks == [0, 1]
        assert timeout == COLLECTIVE_TIMEOUT  # the job's, not torch's 30-minute default


# ---- _StridedShard: FSDP2 over tensor parallelism (issue 23) ---------------------------------------
def _strided_moves(shape, ranks):
    """The moves that went wrong before (issue 23), through ``reshard.redistribute`` on a 2x2
    mesh, against DTensor's own placement of the global tensor (local slicing by coordinate) and,
    on an ascending mesh, its own ``full_tensor`` (which reads ``_StridedShard`` right there)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from reshard import redistribute

    mesh = DeviceMesh("cpu", torch.tensor(ranks))
    x = torch.arange(box_numel(tuple((0, n) for n in shape)), dtype=torch.float32).view(shape)
    fsdp_tp, fsdp_tp1 = (_StridedShard(0, split_factor=2), Shard(0)), (_StridedShard(1, split_factor=2), Shard(1))
    cases = [
        (fsdp_tp, (Shard(0), Shard(0))),
        ((Replicate(), Replicate()), fsdp_tp),
        (fsdp_tp, (Shard(0), Shard(1))),
        (fsdp_tp, (Replicate(), Replicate())),
        ((Shard(0), Shard(1)), fsdp_tp),
        (fsdp_tp1, (Replicate(), Shard(0))),
        (fsdp_tp, fsdp_tp1),
    ]
    for src, dst in cases:
        t = distribute_tensor(x, mesh, src, src_data_rank=None)
        out = redistribute(t, mesh, dst)
        expect = distribute_tensor(x, mesh, dst, src_data_rank=None).to_local()
        assert out.to_local().shape == expect.shape and torch.equal(out.to_local(), expect), (src, dst, shape)
        if ranks == ASCENDING:  # elsewhere DTensor's own collectives permute the shards
            assert torch.equal(out.full_tensor(), x), (src, dst, shape)
    return len(cases)


ASCENDING, PERMUTED = [[0, 1], [2, 3]], [[2, 0], [3, 1]]


@pytest.mark.parametrize("shape,ranks", [((8, 4), ASCENDING), ((7, 5), ASCENDING), ((3, 2), PERMUTED)])
def test_strided_shard_moves_equal_dtensors_placement_on_every_rank(shape, ranks):
    """Even and uneven sizes (on a 2x2 mesh every rank's rows stay contiguous), ascending and not."""
    assert dist_harness.run(WORLD, _strided_moves, shape, ranks) == [7] * WORLD


def test_a_strided_shard_that_leaves_a_rank_non_contiguous_indices_is_refused_by_name():
    from torch.distributed.tensor.placement_types import _StridedShard

    ss = _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match=r"mesh coordinate \(0,\) would hold non-contiguous indices of dim 0"):
        Layout((0, 1, 2, 3), (ss,), (8, 4), torch.float32)  # alone: rank 0 holds rows 0 and 4
    with pytest.raises(ValueError, match=r"_StridedShard\(dim=0, sf=2\), Shard\(dim=0\).*coordinate \(2, 0\)"):
        Layout(((0, 1), (2, 3), (4, 5)), (ss, Shard(0)), (13, 2), torch.float32)  # 13 rows on 3 x 2: uneven
    assert Layout(((0, 1), (2, 3)), (ss, Shard(0)), (8, 4), torch.float32).box(1) == ((4, 6), (0, 4))


def _unmovable(case):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from reshard import redistribute, slice_to_dtensor, wrap_local
    from reshard.mesh import cached_mesh

    mesh = cached_mesh(torch.arange(dist.get_world_size()), ("x",))
    if case == "partial-to-partial":
        t = DTensor.from_local(torch.zeros(4, 4), mesh, (Partial(),), run_check=False)
        redistribute(t, mesh, (Partial("max"),))
    elif case == "grad-on-one-rank":  # rank 1's tensor does not require grad: both must refuse, not hang
        t = slice_to_dtensor(torch.zeros(4, 4), mesh, (Replicate(),)).requires_grad_(dist.get_rank() == 0)
    else:  # requires grad, moving from rank 0 alone to both ranks: no backward could run on rank 1
        one = cached_mesh(torch.tensor([0]), ("one",))
        local = torch.zeros(4, 4) if dist.get_rank() == 0 else torch.empty(0, 0)
        t = wrap_local(local, one, (Replicate(),), (4, 4)).requires_grad_()
    redistribute(t, mesh, (Shard(0),))


@pytest.mark.parametrize(
    "case,match",
    [
        ("partial-to-partial", r"ranks \[0, 1\][\s\S]*moves to Shard or Replicate placements, got \(Partial\(max\),\)"),
        ("grad-on-one-rank", r"ranks \[0, 1\][\s\S]*different arguments[\s\S]*differentiate=True"),
        ("grad", r"differentiates moves within one set of ranks only; got a tensor that requires grad on ranks \[0\]"),
    ],
)
def test_tensors_no_move_can_carry_are_refused_before_any_collective(case, match):
    with pytest.raises(RuntimeError, match=match):
        dist_harness.run(2, _unmovable, case)


def _meta_moves() -> list:
    """Meta DTensors (FSDP2's initialization) moved as DTensor moves them: the destination layout
    on the meta device, no data, no collective. Returns what differs from DTensor's."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor

    from reshard import redistribute, redistribute_module
    from reshard.mesh import cached_mesh

    rank, wrong = dist.get_rank(), []
    mesh, flipped = cached_mesh(torch.tensor([0, 1]), ("m",)), cached_mesh(torch.tensor([1, 0]), ("f",))
    src = DTensor.from_local(torch.empty(5, 3, device="meta"), mesh, (Replicate(),), run_check=False)
    src.requires_grad_()
    for placements in ((Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)):
        ours = redistribute(src, mesh, placements)
        same = (ours.shape, ours.placements, ours.to_local().shape, ours.requires_grad, ours.device.type)
        if placements == (Partial(),):  # (DTensor's public redistribute keeps moves to Partial internal)
            theirs = (src.shape, placements, src.shape, True, "meta")
        else:
            t = src.redistribute(mesh, placements)
            theirs = (t.shape, t.placements, t.to_local().shape, True, "meta")
        if same != theirs:
            wrong.append((placements, same))
    across = redistribute(redistribute(src, mesh, (Shard(0),)), flipped, (Shard(0),))  # rank 1 holds rows 0-2
    if (across.to_local().shape, across.device.type) != (((2, 3), (3, 3))[rank], "meta"):
        wrong.append(("across", across.to_local().shape))
    if rank == 0:  # alone: a move that ran a collective would wait for rank 1 forever
        alone = redistribute(src, mesh, (Shard(1),))
        wrong += [] if alone.to_local().shape == (5, 2) else [("alone", alone.to_local().shape)]
    with torch.device("meta"):
        linear = nn.Linear(3, 4)
    real = nn.Linear(3, 4)  # a meta tensor and a real one in one move: the real one's data moves
    for m in (linear, real):
        for name, p in list(m.named_parameters()):
            setattr(m, name, nn.Parameter(DTensor.from_local(p.detach(), mesh, (Replicate(),), run_check=False)))
    linear.real = real
    before = real.weight.to_local().clone()
    stats = redistribute_module(linear, lambda name, t: (mesh, (Shard(0),)))
    shapes = [(n, p.device.type, tuple(p.to_local().shape)) for n, p in linear.named_parameters()]
    expect = [
        ("weight", "meta", (2, 3)),
        ("bias", "meta", (2,)),
        ("real.weight", "cpu", (2, 3)),
        ("real.bias", "cpu", (2,)),
    ]
    if shapes != expect or not torch.equal(real.weight.to_local(), before[2 * rank : 2 * rank + 2]):
        wrong.append(("module", shapes))
    return wrong + ([] if stats.bytes_sent == 0 else [("bytes", stats.bytes_sent)])


def _max_min_moves() -> list:
    """Partial(max) / Partial(min) sources: DTensor's own result bitwise on the same mesh, the
    elementwise reduction across meshes; floats and ints. Returns what differs."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from reshard import redistribute
    from reshard.layout import box_slices
    from reshard.mesh import cached_mesh

    rank, wrong = dist.get_rank(), []
    mesh, flipped = cached_mesh(torch.tensor([0, 1]), ("m",)), cached_mesh(torch.tensor([1, 0]), ("f",))
    for dtype in (torch.float32, torch.int64):
        parts = [_contribution((5, 4), dtype, j) for j in range(2)]
        for op, reduce in (("max", torch.maximum), ("min", torch.minimum)):
            x = DTensor.from_local(parts[rank].clone(), mesh, (Partial(op),), run_check=False)
            for dst in ((Replicate(),), (Shard(0),), (Shard(1),)):
                ours, theirs = redistribute(x, mesh, dst).to_local(), x.redistribute(mesh, dst).to_local()
                if not torch.equal(ours, theirs):
                    wrong.append((dtype, op, dst))
            across = redistribute(x, flipped, (Shard(0),))
            box = Layout.of(flipped, (Shard(0),), (5, 4), dtype).box(rank)
            if not torch.equal(across.to_local(), reduce(*parts)[box_slices(box)]):
                wrong.append((dtype, op, "across"))
    return wrong


def _partial_destinations() -> list:
    """Replicate / Shard -> Partial: DTensor's rule (``Partial._partition_value``: ``sum``
    divides by the axis's size, the others keep the value) bitwise, on the same mesh and across
    meshes, at the byte lower bound; reduced back, the full value. Returns what differs and
    each move's (bytes this rank sent, lower bound over all ranks)."""
    from reshard import redistribute, slice_to_dtensor
    from reshard.mesh import cached_mesh

    wrong, moved = [], []
    mesh, flipped = cached_mesh(torch.tensor([0, 1]), ("m",)), cached_mesh(torch.tensor([1, 0]), ("f",))
    full = _contribution((5, 4), torch.float32, 7).div(3)  # (not exact in binary: a division shows)
    for src in ((Replicate(),), (Shard(0),), (Shard(1),)):
        x = slice_to_dtensor(full, mesh, src)
        for op in ("sum", "avg", "max", "min"):
            for dst_mesh in (mesh, flipped):
                out, stats = redistribute(x, dst_mesh, (Partial(op),), return_stats=True)
                expect = Partial(op)._partition_value(full, dst_mesh, 0)  # DTensor's own rule
                back = redistribute(out, dst_mesh, (Replicate(),)).to_local()
                if not torch.equal(out.to_local(), expect) or out.placements != (Partial(op),):
                    wrong.append((src, op, dst_mesh.mesh.tolist()))
                moved.append((stats.bytes_sent, stats.lower_bound_bytes))
                if not torch.allclose(back, full, rtol=0, atol=1e-6):
                    wrong.append((src, op, "reduced back"))
    return wrong, moved


def test_replicate_and_shard_move_to_partial_destinations_by_dtensors_rule():
    (wrong0, moved0), (wrong1, moved1) = dist_harness.run(2, _partial_destinations)
    assert wrong0 == wrong1 == []
    assert [a + b for (a, _), (b, _) in zip(moved0, moved1)] == [bound for _, bound in moved0]  # the lower bound
    assert any(bound > 0 for _, bound in moved0)  # (a Shard source's moves send bytes)


def _partial_destination_grads() -> list:
    """Replicate -> Partial(op) through our move and through DTensor's own (its internal
    ``Redistribute``, which its public API keeps for internal use): outputs and the gradients
    of ``sum(y * w)`` (``w`` differing per rank) bitwise equal, placements too. Returns what differs."""
    import torch.distributed as dist
    from torch.distributed.tensor._redistribute import Redistribute

    from reshard import redistribute, slice_to_dtensor
    from reshard.mesh import cached_mesh

    mesh, wrong = cached_mesh(torch.tensor([0, 1]), ("m",)), []
    f64 = {"op_dtype": torch.float64, "out_dtype": torch.float64}
    config = {**f64, "backward_options": dict(f64)}
    full = _contribution((5, 4), torch.float64, 3).div(3)
    w = torch.arange(1, 21, dtype=torch.float64).view(5, 4) * (dist.get_rank() + 1)
    for op in ("sum", "avg", "max", "min"):
        seen = []
        for ours in (True, False):
            x = slice_to_dtensor(full, mesh, (Replicate(),)).detach().requires_grad_()
            dst = (Partial(op),)
            y = redistribute(x, mesh, dst) if ours else Redistribute.apply(x, mesh, dst, False, config)
            (y.to_local() * w).sum().backward()
            seen.append((y.placements, y.to_local(), x.grad.placements, x.grad.to_local()))
        (a, b) = seen
        if a[0] != b[0] or a[2] != b[2] or not (torch.equal(a[1], b[1]) and torch.equal(a[3], b[3])):
            wrong.append(op)
    return wrong


def test_gradients_through_a_move_to_partial_equal_dtensors():
    assert dist_harness.run(2, _partial_destination_grads) == [[], []]


def test_partial_max_and_min_sources_reduce_as_dtensor_does_and_across_meshes():
    assert dist_harness.run(2, _max_min_moves) == [[], []]


def test_meta_dtensors_move_as_dtensor_moves_them_without_data_or_a_collective():
    assert dist_harness.run(2, _meta_moves) == [[], []]


# ---- autograd: gradients equal DTensor.redistribute's ---------------------------------------------
def _grad_moves(cases):
    """Each case: the gradient of ``sum(y * w)`` through our move and through DTensor's (same
    source shards, same weights ``w`` per global position): equal bitwise, ``requires_grad`` on
    every rank. Returns ``(failures, requires_grad of every output)``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from reshard import redistribute
    from reshard.layout import box_slices
    from reshard.mesh import cached_mesh

    failures, flags = [], []
    for grid, src, dst, shape in cases:
        mesh = cached_mesh(torch.tensor(grid), tuple(f"g{i}" for i in range(len(torch.tensor(grid).shape))))
        layout = Layout.of(mesh, src, shape, torch.float64)
        grads = []
        for move in ("ours", "dtensor"):
            full = _contribution(shape, torch.float64, dist.get_rank()) if layout.is_partial else _global(layout)
            local = full[box_slices(layout.box(dist.get_rank()))].clone()
            x = DTensor.from_local(local, mesh, src, run_check=False, shape=torch.Size(shape), stride=_strides(shape))
            x = x.detach().requires_grad_()  # a DTensor leaf: its .grad is what the backward delivers
            y = redistribute(x, mesh, dst) if move == "ours" else x.redistribute(mesh, dst)
            w = torch.arange(1, 1 + box_numel(tuple((0, n) for n in shape)), dtype=torch.float64).view(shape)
            box = Layout.of(mesh, dst, shape, torch.float64).box(dist.get_rank())
            (y.to_local() * w[box_slices(box)]).sum().backward()
            flags.append(y.requires_grad)
            grads.append((x.grad.placements, x.grad.to_local()))
        if grads[0][0] != grads[1][0] or not torch.equal(grads[0][1], grads[1][1]):
            failures.append((src, dst, shape))
    return failures, flags


def _strides(shape):
    from reshard.dtensor import _contiguous_stride

    return _contiguous_stride(shape)


GRAD_CASES = [
    ([0, 1, 2, 3], (Shard(0),), (Replicate(),), (8, 3)),
    ([0, 1, 2, 3], (Replicate(),), (Shard(0),), (8, 3)),  # was: each rank's block only, labelled Replicate
    ([0, 1, 2, 3], (Replicate(),), (Shard(1),), (3, 6)),  # uneven; a rank with an empty shard
    ([0, 1, 2, 3], (Shard(0),), (Shard(1),), (5, 7)),
    ([0, 1, 2, 3], (Partial(),), (Replicate(),), (4, 4)),
    ([0, 1, 2, 3], (Partial(),), (Shard(0),), (6, 2)),
    ([0, 1, 2, 3], (Partial("avg"),), (Shard(1),), (3, 8)),
    ([[0, 1], [2, 3]], (Shard(0), Shard(1)), (Replicate(), Replicate()), (4, 6)),
    ([[0, 1], [2, 3]], (Replicate(), Replicate()), (Shard(1), Shard(0)), (5, 6)),
    ([[0, 1], [2, 3]], (Replicate(), Shard(0)), (Shard(0), Replicate()), (6, 3)),
    ([[0, 1], [2, 3]], (Partial(), Shard(0)), (Replicate(), Shard(1)), (4, 4)),
    ([[0, 1], [2, 3]], (Shard(0), Partial()), (Shard(1), Shard(0)), (4, 6)),
]


def test_gradients_equal_dtensor_redistribute_on_1d_and_2d_meshes():
    results = dist_harness.run(WORLD, _grad_moves, GRAD_CASES)
    for failures, flags in results:
        assert failures == [] and all(flags), (failures, flags)
