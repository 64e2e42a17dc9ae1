"""Collectives used inside layer forwards.

Eager inference calls c10d's own collectives on the mesh axis' group (the output written in
place); under torch.compile, or where a gradient flows through, the functional ones, which trace
and carry autograd. Both run the same c10d kernel: the functional ones add ~0.2-0.4 ms of Python
per call on this CPU (their wrapper tensor's dispatch), paid on every TP layer of every eager step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from reshard.layout import chunk_range


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axis: int = 0) -> torch.Tensor:
    """Sum over the ``axis`` mesh axis; a no-op on a size-1 axis."""
    if mesh.size(axis) == 1:
        return x
    if not _eager(x):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", (mesh, axis)))
    x = x.contiguous()
    dist.all_reduce(x, group=mesh.get_group(axis))  # in place: callers pass a partial sum of their own
    return x


# c10d's gather into one tensor (older torch names it ``all_gather_into_tensor``, deprecated in 2.13)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _eager(x: torch.Tensor) -> bool:
    """Whether a collective on ``x`` may be c10d's own: not traced, and no gradient to carry."""
    return not torch.compiler.is_compiling() and not _training(x)


def _gather(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """``(n * len(x), ...)``: every rank's contiguous ``x`` (one shape on every rank) in rank order
    along dim 0 over ``axis`` (inference)."""
    if not _eager(x):
        return funcol.wait_tensor(funcol.all_gather_single(x, 0, (mesh, axis)))
    out = x.new_empty((mesh.size(axis) * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(out, x, group=mesh.get_group(axis))
    return out


def _exchange(
    x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, mesh: DeviceMesh, axis: int
) -> torch.Tensor:
    """All-to-all along dim 0 of contiguous ``x`` over ``axis`` (``None`` splits: equal ones)."""
    if not _eager(x):
        return funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, (mesh, axis)))
    out = x.new_empty((x.shape[0] if out_splits is None else sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=mesh.get_group(axis))
    return out


def all_gather_last(x: torch.Tensor, mesh: DeviceMesh, full: int, axis: int = 0) -> torch.Tensor:
    """Concatenate Shard(-1) pieces (DTensor chunk rule, uneven allowed) into the full last dim."""
    n = mesh.size(axis)
    if n == 1:
        return x
    chunk = -(-full // n)
    pad = chunk - x.shape[-1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    lead = x.shape[:-1]
    flat = x.reshape(-1, chunk).t().contiguous()  # (chunk, M)
    gathered = _gather(flat, mesh, axis)  # (n*chunk, M)
    pieces = [
        gathered[i * chunk : i * chunk + (hi - lo)]
        for i, (lo, hi) in enumerate(chunk_range(full, n, i) for i in range(n))
    ]
    return torch.cat(pieces, 0).t().reshape(*lead, full)


class _ReduceFwd(torch.autograd.Function):
    """Sum over a mesh axis in forward; identity in backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", (mesh, axis)))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceBwd(torch.autograd.Function):
    """Identity in forward; sum of the gradients over a mesh axis in backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", (ctx.mesh, ctx.axis))), None, None


def _training(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def reduce_output(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """All-reduce partial outputs over ``axis``; differentiable (identity backward)."""
    if mesh.size(axis) == 1:
        return x
    return _ReduceFwd.apply(x, mesh, axis) if _training(x) else all_reduce(x, mesh, axis)


def replicated_input(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Mark a replicated input consumed by sharded weights: its gradient is summed over ``axis``."""
    if mesh.size(axis) == 1 or not _training(x):
        return x
    return _ReduceBwd.apply(x, mesh, axis)


def all_to_all(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 over ``axis`` (chunk ``i`` goes to the axis' rank ``i``)."""
    if mesh.size(axis) == 1:
        return x
    if _training(x):
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, (mesh, axis))
    return _exchange(x.contiguous(), None, None, mesh, axis)


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 over ``axis`` (differentiable)."""
    if mesh.size(axis) == 1:
        return x
    if _training(x):
        return funcol.all_gather_tensor_autograd(x.contiguous(), 0, (mesh, axis))
    return _gather(x.contiguous(), mesh, axis)


def all_gather_chunks(x: torch.Tensor, total: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """The whole ``(total, ...)`` from each rank's dim-0 chunk ``x`` (DTensor's chunk rule, uneven
    allowed: :func:`reshard.layout.chunk_range`), over ``axis`` (inference)."""
    n = mesh.size(axis)
    if n == 1 or total == 0:
        return x
    chunk = -(-total // n)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, chunk - x.shape[0]))
    gathered = _gather(padded.contiguous(), mesh, axis)  # (n*chunk, ...)
    ranges = [chunk_range(total, n, i) for i in range(n)]
    return torch.cat([gathered[i * chunk : i * chunk + (hi - lo)] for i, (lo, hi) in enumerate(ranges)])


def all_to_all_split(x: torch.Tensor, out_splits: list[int], in_splits: list[int], mesh: DeviceMesh, axis: int):
    """All-to-all along dim 0 over ``axis`` with exact (uneven) splits: ``in_splits[i]`` rows go to
    the axis' rank ``i``, ``out_splits[i]`` rows come from it (inference: not differentiable)."""
    if mesh.size(axis) == 1:
        return x
    return _exchange(x.contiguous(), out_splits, in_splits, mesh, axis)
