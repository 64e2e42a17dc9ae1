"""Device meshes, created once per process group: the one mesh cache of the project."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def device_type() -> str:
    """``cuda`` when the default process group runs NCCL, else ``cpu`` (never hard-coded)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def rank_tensor(ranks) -> torch.Tensor:
    """``ranks`` (nested lists, tuples or a ``range``) as a rank grid: a host tensor, whatever the
    backend. Rank grids are metadata: ``DeviceMesh`` keeps its ranks on the CPU (it moves a device
    tensor there), and the index math on layouts reads them back as Python ints."""
    return torch.tensor(ranks, device="cpu")


_MESHES: dict = {}  # "world": the default process group they belong to; key -> DeviceMesh


def cached_mesh(grid: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """``DeviceMesh(grid, names)``, created once per process group.

    Every DeviceMesh creates a process group per axis, and gloo keeps threads per group; engines
    rebuilt in a loop (tests, benchmarks, an RL loop re-parallelizing a model) would otherwise
    pile up thousands of threads. Collective on first use, like ``DeviceMesh`` itself: every rank
    must ask for the same meshes in the same order, including meshes it is not part of.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    if _MESHES.get("world") is not world:  # a new default process group: old meshes are dead
        _MESHES.clear()
        _MESHES["world"] = world
    key = (device_type(), tuple(grid.flatten().tolist()), tuple(grid.shape), names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type(), grid, mesh_dim_names=names)
    return _MESHES[key]


def cached_group(ranks: torch.Tensor) -> dist.ProcessGroup:
    """A process group over ``ranks``, created once per default group (collective: every rank
    of the job asks for the same groups in the same order)."""
    world = dist.group.WORLD
    if _MESHES.get("world") is not world:
        _MESHES.clear()
        _MESHES["world"] = world
    key = ("group", tuple(sorted(ranks.flatten().tolist())))
    if key not in _MESHES:
        _MESHES[key] = dist.new_group(list(key[1]))
    return _MESHES[key]


__all__ = ["cached_group", "cached_mesh", "device_type", "rank_tensor"]
