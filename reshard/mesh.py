"""Device meshes and process groups, created once per default process group: the one cache of the
project's meshes and groups (foreground collectives and every background thread's group)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


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


_MESHES: dict = {}  # "world": the default process group they belong to; key -> DeviceMesh or group


def _cache() -> dict:
    """The meshes and groups of the current default process group (a new one: the old are dead)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if _MESHES.get("world") is not world:
        _MESHES.clear()
        _MESHES["world"] = world
    return _MESHES


def cached_mesh(grid: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """``DeviceMesh(grid, names)``, created once per process group.

    Every DeviceMesh creates a process group per axis, and gloo keeps threads per group; engines
    rebuilt in a loop (tests, benchmarks, an RL loop re-parallelizing a model) would otherwise
    pile up thousands of threads. Collective on first use, like ``DeviceMesh`` itself: every rank
    must ask for the same meshes in the same order, including meshes it is not part of.
    """
    cache = _cache()
    key = (device_type(), tuple(grid.flatten().tolist()), tuple(grid.shape), names)
    if key not in cache:
        cache[key] = DeviceMesh(device_type(), grid, mesh_dim_names=names)
    return cache[key]


def cached_group(
    ranks: Iterable[int] | torch.Tensor | None = None, *, purpose: str = "collectives"
) -> dist.ProcessGroup:
    """The process group of ``purpose`` over ``ranks`` (default: every rank of the job), created
    once per default group with the job's collective timeout (:func:`job_timeout`).

    A thread that communicates in the background needs a group no other thread uses (gloo and
    NCCL order a group's operations per group): each background job names its own ``purpose``
    (``"kv-transport"``, ``"sidp-fetch"``, ...); foreground collectives share the default one.
    Collective on first use: every rank of the job asks for the same groups in the same order,
    including groups it is not part of.
    """
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.flatten().tolist()
    members = tuple(sorted(range(dist.get_world_size()) if ranks is None else ranks))
    cache = _cache()
    key = ("group", purpose, members)
    if key not in cache:
        cache[key] = dist.new_group(list(members), timeout=job_timeout())
    return cache[key]


def job_timeout() -> datetime.timedelta | None:
    """How long a collective of the default process group may wait (``init_process_group``'s
    ``timeout``); ``None`` where the backend does not say (torch's default then applies)."""
    try:
        return dist.group.WORLD._get_backend(torch.device(device_type())).options._timeout
    except (AttributeError, RuntimeError):
        return None


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` computed on rank 0 alone and sent to every rank (collective over the job); an
    exception it raises is raised on every rank."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (fn(), None)
        except Exception as e:  # every rank must leave the broadcast, then raise
            box[0] = (None, e)
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return value


__all__ = ["cached_group", "cached_mesh", "device_type", "from_rank0", "job_timeout", "rank_tensor"]
