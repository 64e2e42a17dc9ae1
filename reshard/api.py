"""Public movement API.

Interim implementation (foundation issue): moves within one mesh use DTensor's ``redistribute``;
moves between two meshes over the same ranks go through a replicated intermediate. The
movement-core issue replaces both with planned, accounted transfers.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from .dtensor import slice_to_dtensor, wrap_local


def redistribute(t: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """Move ``t`` to ``placements`` on ``mesh``; returns a DTensor on ``mesh``."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"mesh has {mesh.ndim} axes but {len(placements)} placements were given")
    if t.device_mesh == mesh:
        return t.redistribute(mesh, placements)
    src_ranks = sorted(t.device_mesh.mesh.flatten().tolist())
    dst_ranks = sorted(mesh.mesh.flatten().tolist())
    if src_ranks != dst_ranks:
        raise ValueError(
            f"moving between meshes over different ranks ({src_ranks} -> {dst_ranks}) needs the "
            f"movement core's planner"
        )
    full = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
    return slice_to_dtensor(full, mesh, placements)
