"""Layouts: which index box of a global tensor each rank holds.

A :class:`Layout` is a pure description (rank grid + placements + global shape + dtype); it needs no
process group, so transfer plans computed from layouts can be tested without processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

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
    mesh axis. ``Partial`` holders hold the full box with partial values. ``_StridedShard`` (FSDP2
    over tensor parallelism: the dim sharded right to left) follows DTensor's own rule; a layout
    in which some rank would hold a non-contiguous set of indices is refused (``ValueError``).
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
            if not isinstance(p, (Shard, _StridedShard, Replicate, Partial)):
                raise ValueError(f"placement {p!r} is not supported (Shard, _StridedShard, Replicate or Partial)")
            if isinstance(p, (Shard, _StridedShard)) and not 0 <= p.dim < len(self.shape):
                raise ValueError(f"{p!r} is out of range for a tensor of shape {self.shape}")
        if any(isinstance(p, _StridedShard) for p in self.placements):
            for coord in itertools.product(*map(range, self.grid.shape)):
                self.box_at(coord)  # ValueError where a rank's indices are not one box

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
        if any(isinstance(p, _StridedShard) for p in self.placements):
            return tuple(self._strided_range(dim, coord) for dim in range(len(self.shape)))
        box = [(0, n) for n in self.shape]
        grid_shape = self.grid.shape
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard):
                lo, hi = box[p.dim]
                start, stop = chunk_range(hi - lo, grid_shape[axis], coord[axis])
                box[p.dim] = (lo + start, lo + stop)
        return tuple(box)

    def _strided_range(self, dim: int, coord: Sequence[int]) -> tuple[int, int]:
        """The indices of ``dim`` held at ``coord`` by DTensor's rule, placement by placement: a
        ``Shard`` keeps its chunk; a ``_StridedShard`` cuts ``split_factor`` pieces, chunks each
        and keeps its chunk of every piece, concatenated. ``ValueError`` unless contiguous."""
        idx = torch.arange(self.shape[dim])  # host index math (a layout is a pure description)
        for axis, p in enumerate(self.placements):
            n, i = self.grid.shape[axis], coord[axis]
            if isinstance(p, _StridedShard) and p.dim == dim:
                idx = torch.cat([_chunk(piece, n, i) for piece in _chunks(idx, p.split_factor)])
            elif isinstance(p, Shard) and p.dim == dim:
                idx = _chunk(idx, n, i)
        if len(idx) == 0:
            return (self.shape[dim], self.shape[dim])
        lo = int(idx[0])
        if not torch.equal(idx, torch.arange(lo, lo + len(idx))):
            raise ValueError(
                f"placements {self.placements} of a tensor of shape {self.shape} on a mesh of shape "
                f"{tuple(self.grid.shape)}: mesh coordinate {tuple(coord)} would hold non-contiguous indices of dim "
                f"{dim} (a _StridedShard without the Shard that follows it); not supported"
            )
        return lo, lo + len(idx)

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


def _chunk(idx: torch.Tensor, num_chunks: int, index: int) -> torch.Tensor:
    lo, hi = chunk_range(len(idx), num_chunks, index)
    return idx[lo:hi]


def _chunks(idx: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    return [_chunk(idx, num_chunks, i) for i in range(num_chunks)]


def nested_tuple(x):
    """A (nested) list of ranks as a hashable nested tuple."""
    return tuple(nested_tuple(v) for v in x) if isinstance(x, (list, tuple)) else int(x)


def _normalize(p: Placement, shape: tuple[int, ...]) -> Placement:
    """A negative ``Shard`` dim counted from the end; ``ValueError`` naming the placement as given."""
    if isinstance(p, (Shard, _StridedShard)) and p.dim < 0:
        if p.dim + len(shape) < 0:
            raise ValueError(f"{p!r} is out of range for a tensor of shape {shape}")
        if isinstance(p, _StridedShard):
            return _StridedShard(p.dim + len(shape), split_factor=p.split_factor)
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
