"""Small DTensor constructors that never run a collective (safe on meshes of any rank order)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from reshard.layout import Layout, box_slices


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def wrap_local(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    """DTensor of global ``shape`` whose local shard on this rank is ``local`` (no communication)."""
    return DTensor.from_local(
        local, mesh, tuple(placements), run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def empty_dtensor(
    shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> DTensor:
    """Uninitialized DTensor: this rank allocates only its own box of ``shape`` (nothing off the mesh)."""
    layout = Layout.of(mesh, placements, shape, dtype)
    local_shape = layout.local_shape(dist.get_rank()) if dist.is_initialized() else tuple(shape)
    if local_shape is None:  # not on the mesh: an empty local tensor, as in DTensor
        local_shape = (0,) * len(shape)
    device = device if device is not None else mesh.device_type
    return wrap_local(torch.empty(local_shape, dtype=dtype, device=device), mesh, placements, shape)


def slice_to_dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """Distribute a tensor every rank holds in full by slicing locally (no scatter from rank 0)."""
    layout = Layout.of(mesh, placements, full.shape, full.dtype)
    box = layout.box(dist.get_rank())
    assert box is not None, "this rank is not on the mesh"
    local = full[box_slices(box)].contiguous()
    return wrap_local(local.to(mesh.device_type), mesh, placements, full.shape)
