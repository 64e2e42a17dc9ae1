"""PyTorch's own DTensor redistribute tests, ported: their (source, destination) placement pairs
run through ``reshard.redistribute``.

The case list follows torch's ``test/distributed/tensor/test_redistribute.py`` (``RedistributeTest``
on a 1-D mesh, its 2x2-mesh cases, ``MultiDimRedistributeTest``): Shard <-> Replicate <-> Partial,
even and uneven shards, every reduce op, forward and backward, on torch's 4 ranks: its 1-D mesh
of 4 (sizes scaled by the world size, as torch scales them) and its 2x2 mesh; one process pool.
Every case is checked against a reference built by local slicing of the global tensor (the sum,
mean, max or min of distinct per-rank contributions of integer values, so every result is exact)
and, on the ascending meshes, against DTensor's own ``redistribute`` bitwise (NOTES.md: never on
meshes whose ranks are not ascending). Moves to the layout a tensor already has, ``Partial`` ones
included, must move nothing, as DTensor's do. Many cases run per harness job.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from reshard.layout import Layout
from reshard.plan import plan_transfer
from tests import dist_harness

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
P = Partial()
ONE_D, TWO_D = [0, 1, 2, 3], [[0, 1], [2, 3]]  # torch's 1-D mesh of 4 ranks, its 2x2 mesh
WORLD = 4


@dataclass(frozen=True)
class Case:
    """One move: ``src`` placements on ``grid`` to ``dst`` on ``dst_grid`` (default ``grid``);
    ``grad``: also compare the gradient with DTensor's; ``refused``: the ``ValueError`` expected."""

    name: str
    grid: list
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    grad: bool = False
    dst_grid: list | None = None
    refused: str | None = None

    @property
    def layouts(self) -> tuple[Layout, Layout]:
        dst_grid = self.grid if self.dst_grid is None else self.dst_grid
        return _layout(self.grid, self.src, self.shape, self.dtype), _layout(dst_grid, self.dst, self.shape, self.dtype)


def _layout(grid, placements, shape, dtype) -> Layout:
    from reshard.layout import _normalize, nested_tuple

    return Layout(nested_tuple(grid), tuple(_normalize(p, tuple(shape)) for p in placements), tuple(shape), dtype)


# ---- the case list ----------------------------------------------------------------------------------
def _sizes_and_dims(ws: int) -> list[tuple[tuple[int, int], int]]:
    """torch's ``input_sizes_and_shard_dim``: even, +1 and +2 rows (or columns) per world size."""
    return [((ws * 3 + k, 3), 0) for k in range(3)] + [((3, ws * 3 + k), 1) for k in range(3)]


def one_d_cases(ws: int = WORLD) -> list[Case]:
    """``RedistributeTest``'s 1-D cases on ``ws`` ranks."""
    cases = []
    for dtype in (torch.float32, torch.cfloat):
        grad = dtype == torch.float32
        for shape, dim in _sizes_and_dims(ws):
            cases.append(Case("shard_to_replicate", ONE_D, (Shard(dim),), (R,), shape, dtype, grad))
            cases.append(Case("partial_to_shard", ONE_D, (P,), (Shard(dim),), shape, dtype))
        cases.append(Case("partial_to_partial", ONE_D, (P,), (P,), (12, 3), dtype, grad))
        cases.append(Case("partial_to_replicate", ONE_D, (P,), (R,), (12, 3), dtype, grad))
        for shape in [(8, 8), (8, 8, 8), (8, 5), (5, 8), (5, 5)]:
            for src, dst in [((S0,), (S1,)), ((S1,), (S0,))]:
                cases.append(Case("shard_dim_change", ONE_D, src, dst, shape, dtype))
    for shape, dim in _sizes_and_dims(ws):
        cases.append(Case("replicate_to_shard", ONE_D, (R,), (Shard(dim),), shape, grad=True))
    cases.append(Case("replicate_to_replicate", ONE_D, (R,), (R,), (12, 3), grad=True))
    cases.append(Case("replicate_to_partial", ONE_D, (R,), (P,), (12, 3)))
    cases.append(Case("negative_shard_dim", ONE_D, (S1,), (Shard(-1),), (12, 3), grad=True))
    for op in ("avg", "max", "min"):  # the other reduce ops, kept and reduced (gloo has no avg all-reduce)
        cases.append(Case(f"partial_{op}_to_partial_{op}", ONE_D, (Partial(op),), (Partial(op),), (6, 4), grad=True))
        for dst in ((R,), (S0,), (S1,)):
            cases.append(Case(f"partial_{op}_reduced", ONE_D, (Partial(op),), dst, (5, 3), grad=op != "avg"))
    for src, dst in itertools.product([R, S0, S1, P], [R, S0, S1]):  # MultiDimRedistributeTest, 1-D
        cases.append(Case("multi_dim_mesh", ONE_D, (src,), (dst,), (16, 24)))
    one_chunk = [[r] for r in ONE_D]  # test_one_chunk_mesh: a mesh axis of size 1 moves nothing
    for src, dst in itertools.product([S1, R, P], [S0, S1, R]):
        cases.append(Case("one_chunk_mesh", one_chunk, (S0, src), (S0, dst), (16, 8)))
    return cases


def identity_cases_1d() -> list[Case]:
    """Every 1-D layout moved to itself (DTensor: the same local tensor, no communication)."""
    one = [(p,) for p in (R, S0, S1, P, Partial("avg"), Partial("max"), Partial("min"))]
    cases = [Case("identity", ONE_D, pl, pl, (5, 3)) for pl in one]
    return cases + [Case("identity", [2, 0, 3, 1], pl, pl, (5, 3)) for pl in one]  # ranks not ascending


def identity_cases_2d() -> list[Case]:
    """Every 2x2 layout of Shard, Replicate and Partial moved to itself."""
    two = list(itertools.product([R, S0, S1, P], repeat=2)) + [(Partial("max"), S0), (S1, Partial("min"))]
    return [Case("identity", TWO_D, pl, pl, (5, 6)) for pl in two]


def two_d_cases() -> list[Case]:
    """``RedistributeTest``'s 2x2-mesh cases and ``MultiDimRedistributeTest`` on 4 ranks."""
    cases = [Case("replicate_to_partial_2d", TWO_D, (R, R), (P, P), (12, 3))]
    for shape in [(8, 8), (8, 8, 8), (8, 5), (5, 8), (5, 5)]:
        pairs = [((S0, S1), (S0, S0)), ((S0, S1), (S1, S0)), ((S0, S0), (S1, S1))]
        pairs += [((S0, S2), (S1, S0)), ((S1, S1), (S1, S2))] if len(shape) > 2 else []
        cases += [Case("shard_dim_change_2d", TWO_D, src, dst, shape) for src, dst in pairs]
    for shape, src in itertools.product([(10, 5), (9, 5), (3, 5), (1, 3)], [(S0, S0), (S0, S1)]):
        cases.append(Case("uneven_sharding", TWO_D, src, (R, R), shape))
    to_partial = [  # test_redistribute_to_partial: DTensor keeps a Partial axis asked for as it is
        ((P, S0), (P, S0)),
        ((P, S0), (P, S1)),
        ((S0, P), (R, P)),
        ((S0, Partial("prod")), (R, Partial("prod"))),
        ((S0, R), (S0, P)),  # DTensor refuses these three publicly; reshard uses its partition rule
        ((S0, R), (R, P)),
        ((S0, S1), (R, P)),
    ]
    # (no gradient oracle for Shard -> Partial: DTensor has no such move, not even internally)
    cases += [Case("redistribute_to_partial", TWO_D, src, dst, (12, 8), grad=src[1] != S1) for src, dst in to_partial]
    inputs, outputs = list(itertools.product([R, S0, S1, P], repeat=2)), list(itertools.product([R, S0, S1], repeat=2))
    cases += [Case("multi_dim_mesh", TWO_D, src, dst, (16, 24)) for src in inputs for dst in outputs]
    return cases


def cross_mesh_partial_cases() -> list[Case]:
    """Partial placements kept across meshes (DTensor moves within one mesh only): each
    contribution moves unreduced to the destination ranks at its partial coordinate."""
    return [
        Case("partial_across_meshes", [0, 1], (P,), (P,), (5, 3), dst_grid=[2, 3]),
        Case("partial_across_meshes", ONE_D, (Partial("max"),), (Partial("max"),), (5, 3), dst_grid=[3, 1, 0, 2]),
        Case("partial_across_meshes", [0, 1], (P,), (P, S0), (5, 3), dst_grid=[[3, 1], [0, 2]]),
        Case("partial_across_meshes", TWO_D, (P, S0), (P, S1), (5, 6), dst_grid=[[2, 3], [0, 1]]),
    ]


REFUSED = "or to Partial placements that keep the source's Partial axes as they are"


def refused_cases() -> list[Case]:
    """Partial to another Partial: refused by name on every rank, before any collective."""
    return [
        Case("partial_other_op", TWO_D, (S0, Partial("prod")), (R, P), (12, 8), refused=REFUSED),
        Case("partial_other_op", TWO_D, (P, S0), (Partial("avg"), S0), (4, 4), refused=REFUSED),
        Case("partial_other_axis", TWO_D, (P, S0), (S0, P), (4, 4), refused=REFUSED),
        Case("partial_other_size", [0, 1], (P,), (P,), (4, 4), dst_grid=ONE_D, refused=REFUSED),
        Case("partial_added_axis", TWO_D, (P, S0), (P, P), (4, 4), refused=REFUSED),
    ]


# ---- running cases on every rank ----------------------------------------------------------------------
def _contribution(shape, dtype: torch.dtype, j: int) -> torch.Tensor:
    """Partial contribution ``j``: small integers, so every sum, mean (over 2 or 4) and max is exact."""
    g = torch.Generator().manual_seed(100 + j)
    real = torch.randint(-50, 50, shape, generator=g).float()
    if dtype.is_complex:
        return torch.complex(real, torch.randint(-50, 50, shape, generator=g).float()).to(dtype)
    return real.to(dtype)


def _value(layout: Layout) -> torch.Tensor:
    """The global tensor ``layout`` represents: its contributions reduced by its reduce op."""
    from reshard.plan import _partial_count

    parts = [_contribution(layout.shape, layout.dtype, j) for j in range(_partial_count(layout))]
    op = next((p.reduce_op for p in layout.placements if isinstance(p, Partial)), "sum")
    if op in ("sum", "avg"):
        total = sum(parts[1:], parts[0].clone())
        return total / len(parts) if op == "avg" else total
    return torch.stack(parts).amax(0) if op == "max" else torch.stack(parts).amin(0)


def _expected(src: Layout, dst: Layout, rank: int) -> torch.Tensor | None:
    """This rank's destination shard by local slicing: the value's box, a kept contribution's box,
    or (a Partial destination of a whole value) the box divided by each Partial(sum) axis's size."""
    from reshard.layout import box_slices
    from reshard.plan import keeps_partial, partial_index

    box = dst.box(rank)
    if box is None:
        return None
    if keeps_partial(src, dst):
        return _contribution(src.shape, src.dtype, partial_index(dst, rank))[box_slices(box)]
    out = _value(src)[box_slices(box)]
    for axis, p in enumerate(dst.placements):
        if isinstance(p, Partial) and p.reduce_op == "sum":
            out = out / dst.grid.shape[axis]
    return out


def _source(layout: Layout, rank: int, *, grad: bool):
    """The source DTensor: contribution ``partial_index`` of this rank, sliced to its box."""
    from torch.distributed.tensor import DTensor

    from reshard.dtensor import _contiguous_stride, wrap_local
    from reshard.layout import box_slices
    from reshard.mesh import cached_mesh
    from reshard.plan import partial_index

    mesh = cached_mesh(layout.grid, tuple(f"a{i}" for i in range(layout.grid.dim())))
    box = layout.box(rank)
    if box is None:
        return wrap_local(torch.empty(0, dtype=layout.dtype), mesh, layout.placements, layout.shape)
    local = _contribution(layout.shape, layout.dtype, partial_index(layout, rank))[box_slices(box)].clone()
    shape, stride = torch.Size(layout.shape), _contiguous_stride(layout.shape)
    x = DTensor.from_local(local, mesh, layout.placements, run_check=False, shape=shape, stride=stride)
    return x.detach().requires_grad_() if grad else x


def _dtensor_can(src: Layout, dst: Layout) -> bool:
    """DTensor's own redistribute is a fair oracle: one ascending mesh, a reduce op gloo runs, and
    Partial destination axes that DTensor either keeps or makes of Replicate ones."""
    same_mesh = src.ranks == dst.ranks and src.all_ranks == sorted(src.all_ranks)
    ops = {p.reduce_op for p in src.placements + dst.placements if isinstance(p, Partial)}
    partial_ok = all(
        not isinstance(d, Partial) or s == d or isinstance(s, Replicate) for s, d in zip(src.placements, dst.placements)
    )
    return same_mesh and "avg" not in ops and partial_ok


def _dtensor_move(x, mesh, placements):
    """DTensor's move: its public ``redistribute``, or the internal one its tests use for a
    Replicate axis made Partial (its public API keeps that for internal use)."""
    from torch.distributed.tensor._redistribute import Redistribute

    if all(not isinstance(d, Partial) or s == d for s, d in zip(x.placements, placements)):
        return x.redistribute(mesh, placements)
    options = {"op_dtype": x.dtype, "out_dtype": x.dtype}
    return Redistribute.apply(x, mesh, placements, False, {**options, "backward_options": dict(options)})


def _run_case(case: Case) -> tuple[list[str], tuple[int, int, int]]:
    """One case on this rank: what differs from the references, and (bytes sent, bytes received,
    messages) of this rank's move."""
    import torch.distributed as dist

    from reshard import redistribute
    from reshard.mesh import cached_mesh

    rank, (src, dst) = dist.get_rank(), case.layouts
    mesh = cached_mesh(dst.grid, tuple(f"a{i}" for i in range(dst.grid.dim())))
    x = _source(src, rank, grad=case.grad)
    out, stats = redistribute(x, mesh, case.dst, return_stats=True)
    expect, wrong = _expected(src, dst, rank), []
    if (out is None) != (expect is None):
        wrong.append(f"on the mesh: {out is not None}")
    elif out is not None:
        if out.placements != dst.placements or not torch.equal(out.to_local(), expect):
            wrong.append(f"differs from the sliced reference ({out.placements})")
        if _dtensor_can(src, dst) and not torch.equal(out.to_local(), _dtensor_move(x, mesh, case.dst).to_local()):
            wrong.append("differs from DTensor's redistribute")
    if case.grad:
        wrong += _grad_differs(case, src, dst)
    return wrong, (stats.bytes_sent, stats.bytes_received, stats.messages)


def _grad_differs(case: Case, src: Layout, dst: Layout) -> list[str]:
    """The gradient of ``sum(y * w)`` (``w`` by global position) through our move and DTensor's:
    placements and values bitwise equal, the output requiring grad."""
    import torch.distributed as dist

    from reshard import redistribute
    from reshard.layout import box_slices
    from reshard.mesh import cached_mesh

    rank = dist.get_rank()
    mesh = cached_mesh(dst.grid, tuple(f"a{i}" for i in range(dst.grid.dim())))
    w = torch.arange(1, 1 + torch.Size(src.shape).numel(), dtype=src.dtype).view(src.shape)
    grads = []
    for move in (redistribute, _dtensor_move):
        x = _source(src, rank, grad=True)
        y = move(x, mesh, case.dst)
        (y.to_local() * w[box_slices(dst.box(rank))]).sum().backward()
        grads.append((y.requires_grad, x.grad.placements, x.grad.to_local()))
    (ours_req, ours_pl, ours), (_, theirs_pl, theirs) = grads
    return [] if ours_req and ours_pl == theirs_pl and torch.equal(ours, theirs) else [f"gradient {ours_pl}"]


def _run_identity(case: Case) -> list[str]:
    """A move to the same layout: no collective without ``check`` (CommDebugMode sees the
    agreement's all-gather otherwise), no bytes, and the input's local tensor (a view), under
    grad too (the gradient flows back as it came)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from reshard import redistribute

    rank, (src, _) = dist.get_rank(), case.layouts
    wrong = []
    for check, grad in ((False, False), (True, src.dtype.is_floating_point)):
        x = _source(src, rank, grad=grad)
        with CommDebugMode() as comm:
            out, stats = redistribute(x, x.device_mesh, case.dst, check=check, return_stats=True)
        if comm.get_total_counts() != (1 if check else 0) or stats.bytes_sent or stats.bytes_received:
            wrong.append(f"check={check}: {comm.get_total_counts()} collectives, {stats.bytes_sent} bytes")
        local, mine = out.to_local(), x.to_local()
        if local.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr() or not torch.equal(local, mine):
            wrong.append(f"check={check}: not a view of the input")
        if grad:  # d sum / d x = 1 everywhere; a Partial axis's gradient is Replicate (DTensor's to_local rule)
            out.to_local().sum().backward()
            placements = tuple(R if isinstance(p, Partial) else p for p in x.placements)
            if (
                out.requires_grad is not True
                or x.grad.placements != placements
                or not bool((x.grad.to_local() == 1).all())
            ):
                wrong.append(f"gradient {None if x.grad is None else x.grad.placements}")
    return wrong


def _run_refused(case: Case) -> str:
    """The move's ``ValueError`` message on this rank (``"moved"`` if it was not refused)."""
    import torch.distributed as dist

    from reshard import redistribute
    from reshard.mesh import cached_mesh

    src, dst = case.layouts
    x = _source(src, dist.get_rank(), grad=False)
    try:
        redistribute(x, cached_mesh(dst.grid, tuple(f"a{i}" for i in range(dst.grid.dim()))), case.dst)
    except ValueError as e:
        return str(e)
    return "moved"


def _run_all(cases: list[Case]) -> list:
    """Every case on this rank, in order: identity cases and refused ones their own way."""
    out = []
    for case in cases:
        if case.refused is not None:
            out.append(_run_refused(case))
        elif case.layouts[0] == case.layouts[1]:
            out.append((_run_identity(case), *_run_case(case)))
        else:
            out.append(([], *_run_case(case)))
    return out


def _check_results(cases: list[Case], per_rank: list[list]) -> int:
    """Assert every case passed on every rank, bytes summed over ranks equal the plan's lower
    bound (zero for an unchanged layout); returns the number of cases."""
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        if case.refused is not None:
            assert all(case.refused in r for r in results), (case, results)
            continue
        problems = [(rank, w) for rank, (ident, wrong, _) in enumerate(results) for w in ident + wrong]
        assert problems == [], (case, problems)
        sent, received = sum(r[2][0] for r in results), sum(r[2][1] for r in results)
        src, dst = case.layouts
        assert sent == received == plan_transfer(src, dst).lower_bound_bytes, (case, sent, received)
        if src == dst:
            assert sent == 0 and all(r[2][2] == 0 for r in results), case
    return len(cases)


@pytest.mark.timeout(240)  # (starts the 4-rank pool when no earlier test did)
def test_dtensor_redistribute_cases_on_a_1d_mesh_of_4_ranks():
    cases = one_d_cases() + identity_cases_1d()
    n = _check_results(cases, dist_harness.run(WORLD, _run_all, cases))
    print(f"1-D, 4 ranks: {n}/{len(cases)} cases passed")
    assert n == len(cases) == 104


@pytest.mark.timeout(180)
def test_dtensor_redistribute_cases_on_a_2x2_mesh_of_4_ranks():
    cases = two_d_cases() + identity_cases_2d() + cross_mesh_partial_cases() + refused_cases()
    n = _check_results(cases, dist_harness.run(WORLD, _run_all, cases))
    print(f"2x2, 4 ranks: {n}/{len(cases)} cases passed")
    assert n == len(cases) == 204


# ---- modules and background moves decide the same way ------------------------------------------------
def _module_moves() -> list[str]:
    """A module whose Partial and Shard tensors move to their own layouts (foreground, then in
    the background) keeps every local tensor and moves no byte; a module move that keeps a
    Partial axis across meshes moves each contribution to its new holder. Returns what differs."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor

    from reshard import redistribute_module
    from reshard.mesh import cached_mesh

    rank, wrong = dist.get_rank(), []
    mesh, flipped = cached_mesh(torch.tensor(ONE_D), ("m",)), cached_mesh(torch.tensor(ONE_D[::-1]), ("f",))
    m = nn.Module()
    m.a = nn.Parameter(DTensor.from_local(_contribution((4, 3), torch.float32, rank), mesh, (P,), run_check=False))
    m.register_buffer("b", DTensor.from_local(torch.arange(6.0).view(2, 3) + rank, mesh, (S0,), run_check=False))
    c = DTensor.from_local(_contribution((3,), torch.int64, rank), mesh, (Partial("max"),), run_check=False)
    m.register_buffer("c", c)
    before = {n: t.to_local() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    same = {n: (mesh, t.placements) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    for async_op in (False, True):
        moved = redistribute_module(m, same, async_op=async_op)
        stats = moved.wait(timeout=60) if async_op else moved
        if stats.bytes_sent or stats.bytes_received or stats.messages:
            wrong.append(f"async_op={async_op}: {stats.bytes_sent} bytes")
        for n, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.to_local().untyped_storage().data_ptr() != before[n].untyped_storage().data_ptr():
                wrong.append(f"async_op={async_op}: {n} was copied")
    stats = redistribute_module(m, {"a": (flipped, (P,))})
    if (
        not torch.equal(m.a.to_local(), _contribution((4, 3), torch.float32, WORLD - 1 - rank))
        or stats.bytes_sent != 48
    ):
        wrong.append(f"kept Partial across meshes: {stats.bytes_sent} bytes")
    return wrong


@pytest.mark.timeout(60)
def test_module_and_background_moves_to_the_same_layout_move_nothing():
    assert dist_harness.run(WORLD, _module_moves) == [[]] * WORLD


# ---- kept Partial axes, planned (pure) ------------------------------------------------------------------
def _partial_layouts() -> list[Layout]:
    """Partial layouts of a (5, 6) tensor on 1-D and 2-D meshes, ascending or not, of 2 and 4 ranks."""
    grids = [[0, 1], [2, 3], [1, 0], ONE_D, [3, 1, 0, 2], TWO_D, [[2, 0], [3, 1]]]
    out = []
    for grid in grids:
        ndim = len(torch.tensor(grid).shape)
        for placements in itertools.product([R, S0, S1, P, Partial("max")], repeat=ndim):
            if any(isinstance(p, Partial) for p in placements) and len({p for p in placements if p.is_partial()}) == 1:
                out.append(_layout(grid, placements, (5, 6), torch.float32))
    return out


def test_a_kept_partial_plan_gives_every_rank_its_own_contribution_once():
    """Each destination rank's pieces tile its box exactly, all from the source contribution at its
    partial index; bytes moved equal the lower bound; an unchanged layout is local pieces only."""
    from reshard.layout import box_numel
    from reshard.plan import intersect, keeps_partial, partial_index

    layouts, pairs = _partial_layouts(), 0
    for src, dst in itertools.product(layouts, repeat=2):
        if not keeps_partial(src, dst):
            continue
        plan, pairs = plan_transfer(src, dst), pairs + 1
        assert plan.reduce_op is None and plan.bytes_moved == plan.lower_bound_bytes, (src, dst)
        for rank in dst.all_ranks:
            mine = [p for p in plan.pieces if p.dst == rank]
            assert all(partial_index(src, p.src) == partial_index(dst, rank) for p in mine), (src, dst, rank)
            assert sum(box_numel(p.box) for p in mine) == box_numel(dst.box(rank)), (src, dst, rank)
            assert all(intersect(a.box, b.box) is None for a, b in itertools.combinations(mine, 2)), (src, dst)
        if src == dst:
            assert plan.bytes_moved == 0 and all(p.local for p in plan.pieces), src
    assert pairs == 250
