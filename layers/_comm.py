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
    pieces = [gathered[i * chunk: i * chunk + (hi - lo)]
              for i, (lo, hi) in enumerate(chunk_range(full, n, i) for i in range(n))]
    return torch.cat(pieces, 0).t().reshape(*lead, full)
