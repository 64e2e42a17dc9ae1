"""Public movement API: DTensors and whole modules between any two layouts or meshes.

Unlike ``DTensor.redistribute`` this works across meshes (same, permuted, overlapping or disjoint
rank sets), moves exactly the bytes a rank lacks (no all-gather fallback on CPU), and reports what
it moved: ``redistribute_module`` returns its :class:`CommStats` (an async move's ``wait()`` does),
``redistribute(..., return_stats=True)`` returns them beside the tensor. Every rank of the world
calls it (ranks on neither mesh do nothing); a DTensor on a mesh that excludes this rank carries an
empty local tensor, as in DTensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from reshard.background import Background
from reshard.dtensor import empty_dtensor, wrap_local
from reshard.executor import DEFAULT_BUCKET_BYTES, CommStats, execute
from reshard.layout import Layout
from reshard.mesh import all_gather_objects, cached_group, collective_exit_wait, device_type, let_go
from reshard.plan import Plan, plan_transfer

Target = tuple[DeviceMesh, Sequence[Placement]]


def redistribute(
    t: DTensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    check: bool = True,
    return_stats: bool = False,
) -> DTensor | tuple[DTensor | None, CommStats] | None:
    """Move ``t`` to ``placements`` on ``mesh``.

    Returns a DTensor on ``mesh`` (ranks outside ``mesh`` get ``None``); with ``return_stats``,
    ``(that, CommStats)``: what this rank moved. Collective over the world: every rank calls it
    with the same arguments; ``check`` (default) compares a hash of the plan on every rank first
    and raises ``ValueError`` naming the differing layouts instead of hanging.

    A move to the layout ``t`` already has (same ranks, placements, shape and dtype; ``Partial``
    ones too) moves nothing, as DTensor's: the output is a new DTensor over a view of ``t``'s local
    tensor, and ``check``'s 8-byte agreement exchange is its only collective. A ``Partial`` source
    moves to ``Shard``/``Replicate`` placements (reduced) or to placements that keep its
    ``Partial`` axes as they are (each contribution moved unreduced, as DTensor keeps them).
    The decision is :func:`reshard.plan.plan_transfer`'s, for module and background moves alike.

    A meta-device DTensor (FSDP2's initialization) comes back a meta DTensor in the destination
    layout, as DTensor's does: no data, no collective (and no agreement check).

    A tensor that requires grad (under grad mode) is moved as ``DTensor.redistribute`` moves it
    for autograd: the output requires grad on every rank, and the backward moves the gradient
    back to the source's placements (a ``Partial`` axis as ``Replicate``). Both meshes must hold
    the same ranks then (``ValueError`` otherwise).
    """
    if not isinstance(t, DTensor):
        raise ValueError(
            f"redistribute moves DTensors; got a {type(t).__name__} (wrap a local shard "
            f"with reshard.wrap_local or distribute it first)"
        )
    if _on_meta(t):  # FSDP2's meta initialization: the destination layout, no data, no collective (as DTensor's)
        out = _meta_moved(t, *_target((mesh, placements)))
        out = out if mesh.get_coordinate() is not None else None
        return (out, CommStats()) if return_stats else out
    differentiate = t.requires_grad and torch.is_grad_enabled()
    if check:  # every rank agrees on the plan and on recording it (a refusal is then on every rank)
        _check_movable(t, mesh)
        check_agreement([plan_for(t, mesh, placements)], extra=f"differentiate={differentiate}")
    if differentiate:
        out, stats = _differentiable(t, mesh, tuple(placements), bucket_bytes, False)
    else:
        [out], stats = _move([t], [(mesh, placements)], bucket_bytes, check=False)
    out = out if mesh.get_coordinate() is not None else None
    return (out, stats) if return_stats else out


def _differentiable(t: DTensor, mesh: DeviceMesh, placements: tuple, bucket_bytes, check) -> tuple[DTensor, CommStats]:
    """The move recorded for autograd (its gradient moves back, as ``DTensor.redistribute``'s
    does); ``ValueError`` where the two meshes' ranks differ (a rank off one side could not take
    part in the backward)."""
    src_ranks, dst_ranks = sorted(t.device_mesh.mesh.flatten().tolist()), sorted(mesh.mesh.flatten().tolist())
    if src_ranks != dst_ranks:
        raise ValueError(
            f"reshard.redistribute differentiates moves within one set of ranks only; got a tensor that requires "
            f"grad on ranks {src_ranks} moving to ranks {dst_ranks}: detach it or run under torch.no_grad()"
        )
    stats: list[CommStats] = []
    return _Redistribute.apply(t, mesh, placements, bucket_bytes, check, stats), stats[0]


class _Redistribute(torch.autograd.Function):
    """Forward: the move. Backward: the gradient moved back to the source's mesh and placements,
    a ``Partial`` source's axis as ``Replicate`` (DTensor's rule: the gradient of a sum is
    the same on every contribution)."""

    @staticmethod
    def forward(ctx, t: DTensor, mesh, placements, bucket_bytes, check, stats: list) -> DTensor:
        ctx.source = (t.device_mesh, t.placements)
        ctx.options = (bucket_bytes, check)
        [out], moved = _move([t], [(mesh, placements)], bucket_bytes, check=check)
        stats.append(moved)
        return out

    @staticmethod
    def backward(ctx, grad: DTensor):
        mesh, placements = ctx.source
        target = _gradient_placements(grad.placements, placements)
        if target == tuple(grad.placements) and grad.device_mesh == mesh:
            return grad, None, None, None, None, None
        [back], _ = _move([grad], [(mesh, target)], ctx.options[0], check=ctx.options[1])
        return back, None, None, None, None, None


def _gradient_placements(current: Sequence[Placement], source: Sequence[Placement]) -> tuple[Placement, ...]:
    """Where a gradient goes back to: the source's placements, ``Partial`` axes as ``Replicate``
    unless the gradient is itself ``Partial`` there (then it stays)."""
    if len(current) != len(source):  # a move between meshes of different ndim: the gradient's axes differ
        return tuple(Replicate() if p.is_partial() else p for p in source)
    return tuple(Replicate() if p.is_partial() and not c.is_partial() else p for c, p in zip(current, source))


def redistribute_module(
    module: nn.Module,
    plan: Mapping[str, Target] | Callable[[str, DTensor], Target | None],
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
    check: bool = True,
) -> CommStats | MoveHandle:
    """Move a module's DTensor parameters and buffers in place, all in one coalesced transfer.

    ``plan`` maps fully qualified names to ``(mesh, placements)``, or is a callable returning that
    (or ``None`` to leave a tensor where it is). Ranks outside a target mesh keep a DTensor with an
    empty local tensor. Returns the transfer's :class:`CommStats` on this rank. With
    ``async_op=True`` the transfer runs on a background thread over its own process group and a
    :class:`MoveHandle` is returned; the module keeps its old tensors until ``handle.wait()`` swaps
    the new ones in and returns the stats. ``check``: see :func:`redistribute`.
    """
    names, tensors, targets = _select(module, plan)
    if async_op:
        return MoveHandle(module, names, tensors, targets, bucket_bytes, cached_group(purpose="reshard-move"))
    moved, stats = _move(tensors, targets, bucket_bytes, check=check)
    _install(module, names, moved)
    return stats


def _install(module: nn.Module, names: list[str], moved: list[DTensor]) -> None:
    for name, new in zip(names, moved):
        assign_tensor(module, name, new)


class MoveHandle:
    """A module move running in the background; ``wait()`` installs the result."""

    def __init__(self, module, names, tensors, targets, bucket_bytes, group) -> None:
        self._module, self._names = module, names
        self._job = Background(
            lambda: _move(tensors, targets, bucket_bytes, group),
            "reshard-move",
            "background move",
            exit_wait=collective_exit_wait(),
        )

    def done(self) -> bool:
        return self._job.done()

    def wait(self, timeout: float | None = None) -> CommStats:
        """Block until the move finishes (``TimeoutError`` after ``timeout`` s); install it and
        return its :class:`CommStats` on this rank."""
        moved, stats = self._job.result(timeout)
        _install(self._module, self._names, moved)
        return stats


def plan_for(t: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> Plan:
    """The plan ``redistribute(t, mesh, placements)`` would run (pure, cached)."""
    return plan_transfer(Layout.of_dtensor(t), Layout.of(mesh, placements, t.shape, t.dtype))


def _select(module: nn.Module, plan) -> tuple[list[str], list[DTensor], list[Target]]:
    names = []
    tensors = []
    targets = []
    entries = list(module.named_parameters()) + list(module.named_buffers())
    known = {n for n, _ in entries}
    if isinstance(plan, Mapping):
        unknown = sorted(set(plan) - known)
        if unknown:
            raise ValueError(f"plan names {unknown} that are not parameters or buffers of the module")
    for name, t in entries:
        target = plan.get(name) if isinstance(plan, Mapping) else plan(name, t)
        if target is None:
            continue
        if not isinstance(t, DTensor):
            raise ValueError(f"{name!r} is a plain tensor; only DTensors can be redistributed")
        names.append(name)
        tensors.append(t.data if isinstance(t, nn.Parameter) else t)
        targets.append(target)
    return names, tensors, targets


def _move(
    tensors: Sequence[DTensor], targets: Sequence[Target], bucket_bytes, group=None, *, check: bool = True
) -> tuple[list[DTensor], CommStats]:
    """``tensors`` moved to ``targets``: meta-device ones re-laid out where they are (no data),
    the others in one coalesced transfer (when there are any: a move of meta tensors alone runs
    no collective)."""
    metas = [i for i, t in enumerate(tensors) if _on_meta(t)]
    if not metas:
        return _transfer(tensors, targets, bucket_bytes, group, check=check)
    real = [i for i in range(len(tensors)) if i not in metas]
    out = {i: _meta_moved(tensors[i], *_target(targets[i])) for i in metas}
    stats = CommStats()
    if real:
        moved, stats = _transfer(
            [tensors[i] for i in real], [targets[i] for i in real], bucket_bytes, group, check=check
        )
        out.update(zip(real, moved))
    return [out[i] for i in range(len(tensors))], stats


def _on_meta(t: DTensor) -> bool:
    return t.to_local().device.type == "meta"


def _meta_moved(t: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """Meta DTensor ``t`` in ``placements`` on ``mesh``: this rank's box of the destination, on
    the meta device (``ValueError`` for placements no layout takes); ``requires_grad`` kept."""
    out = empty_dtensor(t.shape, mesh, placements, dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad)


def _transfer(
    tensors: Sequence[DTensor], targets: Sequence[Target], bucket_bytes, group=None, *, check: bool = True
) -> tuple[list[DTensor], CommStats]:
    rank = dist.get_rank()
    plans, srcs = [], []
    for t, target in zip(tensors, targets):
        mesh, placements = _target(target)
        _check_movable(t, mesh)
        plans.append(plan_for(t, mesh, placements))
        srcs.append(t.to_local() if plans[-1].src.box(rank) is not None else None)
    if check:
        check_agreement(plans, group)
    device = targets[0][0].device_type if targets else "cpu"
    outs, stats = execute(plans, srcs, bucket_bytes=bucket_bytes, device=device, group=group)
    result = []
    for t, target, out, plan in zip(tensors, targets, outs, plans):
        local = out if out is not None else torch.empty(0, dtype=t.dtype, device=device)
        result.append(wrap_local(local, target[0], tuple(plan.dst.placements), t.shape))
    return result, stats


def _check_movable(t: DTensor, mesh: DeviceMesh) -> None:
    """``ValueError``, on every rank before any collective, for a tensor no move can carry."""
    if mesh.device_type != t.device_mesh.device_type:
        raise ValueError(
            f"the source mesh is {t.device_mesh.device_type!r} and the destination mesh {mesh.device_type!r}: "
            "a move stays on one device type"
        )


def _target(target) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """``(mesh, placements)``, with a ``ValueError`` naming what was given instead."""
    if not (isinstance(target, (tuple, list)) and len(target) == 2 and isinstance(target[0], DeviceMesh)):
        raise ValueError(f"a move target is (mesh, placements); got {target!r}")
    mesh, placements = target[0], tuple(target[1])
    if len(placements) != mesh.ndim:
        raise ValueError(f"mesh has {mesh.ndim} axes but {len(placements)} placements were given")
    return mesh, placements


def check_agreement(plans: Sequence[Plan], group=None, extra: str = "") -> None:
    """``ValueError`` on every rank unless all ranks of ``group`` run the same ``plans``.

    One all-gather of an 8-byte hash; only on a mismatch are the layouts exchanged to name them.
    Ranks that disagree would otherwise wait for each other forever in the transfer.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    described = [(repr(p.src), repr(p.dst)) for p in plans] + ([("options", extra)] if extra else [])
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    exchanged: list[torch.Tensor] = []
    if len(set(_all_hashes(digest, group, exchanged))) == 1:
        return
    everyone = all_gather_objects(described, group)
    let_go(exchanged)  # the refusal may end the process at once: nothing may be left in the backend
    other = next(r for r in range(world) if everyone[r] != everyone[0])
    first = next((i for i, (a, b) in enumerate(zip(everyone[0], everyone[other])) if a != b), None)
    detail = (
        f"{len(everyone[0])} vs {len(everyone[other])} tensors"
        if first is None
        else f"tensor {first}: {everyone[0][first]} vs {everyone[other][first]}"
    )
    raise ValueError(
        f"ranks called the move with different arguments (rank 0 vs rank {other}, {detail}); "
        f"every rank must pass the same tensors, meshes and placements"
    )


def _all_hashes(digest: bytes, group, exchanged: list[torch.Tensor]) -> list[int]:
    """Every rank's 8-byte ``digest`` as an int (one all-gather); the tensors it used are appended
    to ``exchanged`` (for :func:`reshard.mesh.let_go`) and referenced nowhere else."""
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.long, device=device_type())
    hashes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(hashes, mine, group=group)
    exchanged += [mine, *hashes]
    return [int(h) for h in hashes]


def assign_tensor(module: nn.Module, name: str, value: DTensor) -> None:
    """Replace parameter or buffer ``name`` of ``module`` by ``value`` (keeps ``requires_grad``)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = value
