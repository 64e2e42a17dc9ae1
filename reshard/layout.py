"""Layouts: which index box of a global tensor each rank holds.

A :class:`Layout` is a pure description (rank grid + placements + global shape + dtype); it needs no
process group, so transfer plans computed from layouts can be tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from reshard.mesh import rank_tensor

Box = tuple[tuple[int, int], ...]  # per tensor dim: [start, stop)


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """DTensor's (``torch.chunk``) rule: chunks of ``ceil(size / n)``, the last ones short or empty."""
    chunk = -(-size // num_chunks) if size else 0
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


@dataclass(frozen=True)
class Layout:
    """Global tensor ``shape``/``dtype`` laid out on a grid of ranks with DTensor ``placements``.

    ``ranks`` is the mesh as nested tuples (any subset of the world, any order); one placement per
    mesh axis. ``Partial`` holders hold the full box with partial values.
    """

    ranks: tuple
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        axes = self.grid.dim()
        if axes != len(self.placements):
            raise ValueError(f"mesh has {axes} axes but {len(self.placements)} placements were given")
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise ValueError(f"{p!r} is out of range for a tensor of shape {self.shape}")

    @staticmethod
    def of(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype) -> Layout:
        """Layout of a tensor of global ``shape`` placed on ``mesh``."""
        placements = tuple(_normalize(p, tuple(shape)) for p in placements)
        return Layout(nested_tuple(mesh.mesh.tolist()), placements, tuple(shape), dtype)

    @staticmethod
    def of_dtensor(t: DTensor) -> Layout:
        return Layout.of(t.device_mesh, t.placements, t.shape, t.dtype)

    @property
    def grid(self) -> torch.Tensor:
        return rank_tensor(self.ranks)

    @property
    def all_ranks(self) -> list[int]:
        return self.grid.flatten().tolist()

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        hits = (self.grid == rank).nonzero()
        return tuple(hits[0].tolist()) if len(hits) else None

    def box_at(self, coord: Sequence[int]) -> Box:
        """Index box held at mesh coordinate ``coord`` (shards nest left to right, as in DTensor)."""
        box = [(0, n) for n in self.shape]
        grid_shape = self.grid.shape
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard):
                lo, hi = box[p.dim]
                start, stop = chunk_range(hi - lo, grid_shape[axis], coord[axis])
                box[p.dim] = (lo + start, lo + stop)
        return tuple(box)

    def box(self, rank: int) -> Box | None:
        """Index box ``rank`` holds, or ``None`` if ``rank`` is not on the mesh."""
        coord = self.coordinate(rank)
        return None if coord is None else self.box_at(coord)

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        b = self.box(rank)
        return None if b is None else tuple(hi - lo for lo, hi in b)

    @property
    def is_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)


def nested_tuple(x):
    """A (nested) list of ranks as a hashable nested tuple."""
    return tuple(nested_tuple(v) for v in x) if isinstance(x, (list, tuple)) else int(x)


def _normalize(p: Placement, shape: tuple[int, ...]) -> Placement:
    """A negative ``Shard`` dim counted from the end; ``ValueError`` naming the placement as given."""
    if isinstance(p, Shard) and p.dim < 0:
        if p.dim + len(shape) < 0:
            raise ValueError(f"{p!r} is out of range for a tensor of shape {shape}")
        return Shard(p.dim + len(shape))
    return p


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(hi - lo, 0)
    return n


def replicate_all(ndim: int) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(ndim))
