"""Collectives used inside layer forwards (functional, so they trace under torch.compile)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from reshard.layout import chunk_range


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axis: int = 0) -> torch.Tensor:
    """Sum over the ``axis`` mesh axis; a no-op on a size-1 axis."""
    if mesh.size(axis) == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", (mesh, axis)))


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
    gathered = funcol.wait_tensor(funcol.all_gather_single(flat, 0, (mesh, axis)))  # (n*chunk, M)
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
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, (mesh, axis)))


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 over ``axis`` (differentiable)."""
    if mesh.size(axis) == 1:
        return x
    if _training(x):
        return funcol.all_gather_tensor_autograd(x.contiguous(), 0, (mesh, axis))
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, (mesh, axis)))


def all_gather_chunks(x: torch.Tensor, total: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """The whole ``(total, ...)`` from each rank's dim-0 chunk ``x`` (DTensor's chunk rule, uneven
    allowed: :func:`reshard.layout.chunk_range`), over ``axis`` (inference)."""
    n = mesh.size(axis)
    if n == 1 or total == 0:
        return x
    chunk = -(-total // n)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, chunk - x.shape[0]))
    gathered = funcol.wait_tensor(funcol.all_gather_single(padded.contiguous(), 0, (mesh, axis)))  # (n*chunk, ...)
    ranges = [chunk_range(total, n, i) for i in range(n)]
    return torch.cat([gathered[i * chunk : i * chunk + (hi - lo)] for i, (lo, hi) in enumerate(ranges)])


def all_to_all_split(x: torch.Tensor, out_splits: list[int], in_splits: list[int], mesh: DeviceMesh, axis: int):
    """All-to-all along dim 0 over ``axis`` with exact (uneven) splits: ``in_splits[i]`` rows go to
    the axis' rank ``i``, ``out_splits[i]`` rows come from it (inference: not differentiable)."""
    if mesh.size(axis) == 1:
        return x
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, (mesh, axis)))
