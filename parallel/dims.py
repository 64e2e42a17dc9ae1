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


_MESHES: dict = {}  # "world": the default process group they belong to; key -> DeviceMesh


def cached_mesh(grid: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """``DeviceMesh(grid, names)``, created once per process group.

    Every DeviceMesh creates a process group per axis, and gloo keeps threads per group; engines
    rebuilt in a loop (tests, benchmarks, an RL loop re-parallelizing a model) would otherwise
    pile up thousands of threads. Collective on first use, like ``DeviceMesh`` itself.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    if _MESHES.get("world") is not world:  # a new default process group: old meshes are dead
        _MESHES.clear()
        _MESHES["world"] = world
    key = (device_type(), tuple(grid.flatten().tolist()), tuple(grid.shape), names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type(), grid, mesh_dim_names=names)
    return _MESHES[key]


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
            self._meshes["world"] = cached_mesh(grid, AXES)
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
            self._meshes[key] = cached_mesh(grid, names)["tp_kv", "tp_rep"]
        return self._meshes[key]

    # ---- pipeline stages -------------------------------------------------------------------------
    def stage_meshes(self) -> list[DeviceMesh]:
        """The 1-D tp mesh of every pipeline stage of this rank's (dp, sp) group.

        Meshes of all groups are created on every rank in the same order (mesh creation is
        collective over the world); this rank keeps its group's.
        """
        if "stages" not in self._meshes:
            self._check_world()
            grid = torch.arange(self.world_size).view(self.shape)
            coord = self.world_mesh().get_coordinate()
            for d in range(self.dp):
                for s in range(self.sp):
                    row = [cached_mesh(grid[d, p, s], ("tp",))
                           for p in range(self.pp)]
                    if (d, s) == (coord[0], coord[2]):
                        self._meshes["stages"] = row
        return self._meshes["stages"]

    # ---- Shift parallelism: one head-block map for SP and TP ---------------------------------
    def head_block(self, sp_rank: int, tp_rank: int) -> int:
        """The head block rank ``(sp_rank, tp_rank)`` attends over, in both Shift modes.

        The base (SP x TP) layout splits heads over tp, then the SP all-to-all splits each tp
        shard over sp, so the block is ``tp_rank * sp + sp_rank``. The shift (full TP) layout
        must give each rank that same block so the KV cache is shared (the paper's Figure 7).
        """
        return tp_rank * self.sp + sp_rank

    def base_mesh(self) -> DeviceMesh:
        """2-D ``(sp, tp)`` mesh of this rank's SP x TP group (the base layout)."""
        return self.world_mesh()["sp", "tp"]

    def shift_mesh(self) -> DeviceMesh:
        """The same ranks as a ``(tp, sp)`` mesh: ``(Shard(d), Shard(d))`` on it nests tp then sp,
        so rank ``(s, t)`` holds chunk :meth:`head_block` ``(s, t)`` — full TP in block order."""
        return self._derived("shift", self._block_grid(), ("shift_tp", "shift_sp"))

    def block_mesh(self, groups: int) -> DeviceMesh:
        """Ranks in head-block order split into ``(groups, sp * tp // groups)`` — for KV heads that
        the shift layout replicates over consecutive blocks (``groups`` = KV heads)."""
        grid = self._block_grid().flatten(-2).unflatten(-1, (groups, -1))
        return self._derived(("block", groups), grid, ("kv_block", "kv_rep"))

    def sp_split_mesh(self, kv_groups: int) -> DeviceMesh:
        """The sp axis split into ``(kv_groups, sp // kv_groups)`` for the paper's Algorithm 1:
        all-to-all along ``sp_aa`` (one rank per GQA group), all-gather along ``sp_ag``."""
        grid = torch.arange(self.world_size).view(self.shape).unflatten(2, (kv_groups, -1))
        grid = grid.permute(0, 1, 4, 2, 3)  # (dp, pp, tp, sp_aa, sp_ag)
        return self._derived(("sp_split", kv_groups), grid, ("sp_aa", "sp_ag"))

    def shift_meshes(self, num_kv_heads: int):
        """Every mesh :class:`layers.UlyssesAttention` needs for ``num_kv_heads`` KV heads."""
        from layers.ulysses import ShiftMeshes, check_shift_heads

        p = self.sp * self.tp
        kv_per_tp = num_kv_heads // self.tp if num_kv_heads % self.tp == 0 else 0
        return ShiftMeshes(
            base=self.base_mesh(), shift=self.shift_mesh(),
            shift_kv=self.block_mesh(num_kv_heads) if num_kv_heads < p and p % num_kv_heads == 0 else None,
            sp_split=self.sp_split_mesh(kv_per_tp) if 0 < kv_per_tp < self.sp and self.sp % kv_per_tp == 0 else None)

    def _block_grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.shape).transpose(2, 3)  # (dp, pp, tp, sp)

    def _derived(self, key, grid: torch.Tensor, names: tuple[str, str]) -> DeviceMesh:
        """A mesh over the whole world with ``grid``'s last two axes named ``names``; this rank's 2-D slice."""
        if key not in self._meshes:
            self._check_world()
            lead = tuple(f"_lead{i}" for i in range(grid.dim() - 2))
            mesh = cached_mesh(grid, lead + names)
            self._meshes[key] = mesh[names]
        return self._meshes[key]

    def _check_world(self) -> None:
        actual = dist.get_world_size() if dist.is_initialized() else 1
        if actual != self.world_size:
            raise ValueError(
                f"ParallelDims expects world_size({self.world_size}) but the job has "
                f"{actual} ranks"
            )
