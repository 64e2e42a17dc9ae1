"""The one owner of mesh axes: degrees, validation and named device meshes.

Meshes derived from the axes for one parallelism live with its plan: KV-head replication in
:mod:`parallel.plans`, pipeline stages in :mod:`parallel.pipeline`, Shift's head-block meshes in
:mod:`parallel.shift`; all of them come from :func:`reshard.mesh.cached_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from reshard.mesh import cached_group, cached_mesh, device_type, rank_tensor

AXES = ("dp", "pp", "sp", "tp")


def rank_grid(dims: ParallelDims) -> torch.Tensor:
    """The layout's ranks (``0..world_size-1``, or from ``first_rank``) as the ascending
    ``(dp, pp, sp, tp)`` grid (checks the job's size)."""
    dims._check_world()
    first = dims.first_rank or 0
    return rank_tensor(range(first, first + dims.world_size)).view(dims.shape)


@dataclass
class ParallelDims:
    """Degrees of the mesh axes ``(dp, pp, sp, tp)``; their product must equal ``world_size``.

    ``stages``: decoder layers per pipeline stage, e.g. ``(5, 3)`` to give the last stage (which
    also runs the LM head and sampling) fewer (:func:`parallel.model.pipeline.balanced_stages`);
    ``None``: contiguous near-equal blocks. ``ep``: the experts of mixture-of-experts layers split
    over ``ep`` groups of the tp ranks, each expert tensor parallel over ``tp // ep``.
    ``first_rank``: ``None`` (default) spans the whole
    job; an int places the layout on ranks ``first_rank..first_rank + world_size - 1`` of a
    larger job (e.g. rollout ranks beside training ranks). Meshes are built on every rank of
    the job (collective), so ranks outside the layout build the same model with empty shards.
    """

    dp: int = 1
    pp: int = 1
    sp: int = 1
    tp: int = 1
    world_size: int = 1
    first_rank: int | None = None
    stages: tuple[int, ...] | None = None  # decoder layers per pipeline stage (None: near-equal blocks)
    ep: int = 1  # expert parallelism inside the tp group: experts over ep, each expert TP over tp // ep
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # "world" only

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} degree must be >= 1, got {axis}({getattr(self, axis)})")
        product = self.dp * self.pp * self.sp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"dp({self.dp}) * pp({self.pp}) * sp({self.sp}) * tp({self.tp}) = {product} "
                f"!= world_size({self.world_size})"
            )
        if self.ep < 1 or (self.tp % self.ep != 0 and not self.expert_dispatch):
            raise ValueError(
                f"ep ({self.ep}) must divide tp ({self.tp}) (experts split in the tp group), or equal dp "
                f"({self.dp}) with tp, pp and sp 1 (data-parallel attention, experts over the replicas)"
            )
        if self.stages is not None and (len(self.stages) != self.pp or min(self.stages) < 1):
            raise ValueError(f"stages {self.stages} must give each of the pp({self.pp}) stages >= 1 layer")

    @property
    def expert_dispatch(self) -> bool:
        """Data-parallel attention with expert-parallel MoE: each replica attends over its own
        requests and the experts are spread over the replicas (``ep == dp > 1``, no other axis)."""
        return self.ep == self.dp > 1 and self.tp == self.pp == self.sp == 1

    @staticmethod
    def from_world(**degrees: int) -> ParallelDims:
        """Dims for the running job; ``world_size`` is read from the default process group."""
        return ParallelDims(**degrees, world_size=dist.get_world_size())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def world_mesh(self) -> DeviceMesh:
        """4-D mesh ``(dp, pp, sp, tp)`` over the layout's ranks in ascending order."""
        if "world" not in self._meshes:
            self._meshes["world"] = cached_mesh(rank_grid(self), AXES)
            self._meshes["group"] = None if self.first_rank is None else cached_group(rank_grid(self))
        return self._meshes["world"]

    def group(self) -> dist.ProcessGroup | None:
        """The process group of the layout's ranks (``None``: the default group, the whole job)."""
        self.world_mesh()
        return self._meshes["group"]

    @property
    def ranks(self) -> list[int]:
        first = self.first_rank or 0
        return list(range(first, first + self.world_size))

    @property
    def notation(self) -> str:
        """``D2T2``, ``T4P2``, ``S2T2``: the degrees above 1 (data, sequence, tensor, pipeline), as
        the papers and the cost model write layouts; ``T1`` on one rank."""
        return layout_notation(dp=self.dp, sp=self.sp, tp=self.tp, pp=self.pp)

    def describe(self) -> dict:
        """The layout as ``summary.json`` reports it: ``{"dp", "pp", "sp", "tp", "ranks"}``."""
        return {**dict(zip(AXES, self.shape)), "ranks": self.ranks}

    def mesh(self, axis: str) -> DeviceMesh:
        """1-D mesh of this rank's group along ``axis``; on a rank outside the layout, the first
        group's (such a rank holds no shard on it and never communicates over it)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")
        world = self.world_mesh()
        if world.get_coordinate() is not None:
            return world[axis]
        line = rank_grid(self).movedim(AXES.index(axis), -1).reshape(-1, getattr(self, axis))[0]  # (axis,)
        return DeviceMesh(device_type(), line, mesh_dim_names=(axis,), _init_backend=False)

    def _check_world(self) -> None:
        actual = dist.get_world_size() if dist.is_initialized() else 1
        if self.first_rank is not None:
            if not 0 <= self.first_rank <= actual - self.world_size:
                raise ValueError(
                    f"ranks {self.first_rank}..{self.first_rank + self.world_size - 1} of the "
                    f"layout are not all in the job's {actual} ranks"
                )
        elif actual != self.world_size:
            raise ValueError(f"ParallelDims expects world_size({self.world_size}) but the job has {actual} ranks")


__all__ = ["AXES", "ParallelDims", "cached_mesh", "device_type", "layout_notation", "rank_grid"]


def layout_notation(*, dp: int = 1, sp: int = 1, tp: int = 1, pp: int = 1) -> str:
    """``D2T2``, ``T4P2``, ``S2T2``: the degrees above 1 (data, sequence, tensor, pipeline), as the
    papers write layouts; ``T1`` for one device. One notation for the engine and the cost model."""
    parts = [f"{k}{v}" for k, v in (("D", dp), ("S", sp), ("T", tp), ("P", pp)) if v > 1]
    return "".join(parts) or "T1"
