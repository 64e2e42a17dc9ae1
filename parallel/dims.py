"""The one owner of mesh axes: degrees, validation and named device meshes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("dp", "pp", "sp", "tp")


def device_type() -> str:
    """``cuda`` when the default process group runs NCCL, else ``cpu`` (never hard-coded)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


@dataclass
class ParallelDims:
    """Degrees of the mesh axes ``(dp, pp, sp, tp)``; their product must equal ``world_size``."""

    dp: int = 1
    pp: int = 1
    sp: int = 1
    tp: int = 1
    world_size: int = 1
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    @staticmethod
    def from_world(**degrees: int) -> "ParallelDims":
        """Dims for the running job; ``world_size`` is read from the default process group."""
        return ParallelDims(**degrees, world_size=dist.get_world_size())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def world_mesh(self) -> DeviceMesh:
        """4-D mesh ``(dp, pp, sp, tp)`` over ranks ``0..world_size-1`` in ascending order."""
        if "world" not in self._meshes:
            self._check_world()
            grid = torch.arange(self.world_size).view(self.shape)
            self._meshes["world"] = DeviceMesh(device_type(), grid, mesh_dim_names=AXES)
        return self._meshes["world"]

    def mesh(self, axis: str) -> DeviceMesh:
        """1-D mesh of this rank's group along ``axis``."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")
        return self.world_mesh()[axis]

    def kv_head_mesh(self, num_kv_heads: int) -> DeviceMesh:
        """2-D ``(tp_kv, tp_rep)`` split of the tp axis for KV-head replication.

        The head-block-to-rank map: tp rank ``r`` holds KV head ``r // (tp // num_kv_heads)``.
        """
        key = ("kv", num_kv_heads)
        if key not in self._meshes:
            rep = self.tp // num_kv_heads
            grid = torch.arange(self.world_size).view(*self.shape[:3], num_kv_heads, rep)
            names = AXES[:3] + ("tp_kv", "tp_rep")
            self._meshes[key] = DeviceMesh(device_type(), grid, mesh_dim_names=names)["tp_kv", "tp_rep"]
        return self._meshes[key]

    def _check_world(self) -> None:
        actual = dist.get_world_size() if dist.is_initialized() else 1
        if actual != self.world_size:
            raise ValueError(
                f"ParallelDims expects world_size({self.world_size}) but the job has "
                f"{actual} ranks"
            )
