"""Transfer plans: which pieces of which source ranks each destination rank needs.

A plan is a pure function of two layouts (no processes), so it can be cached and tested alone.
Source boxes of Shard/Replicate layouts partition the tensor (replicas hold identical boxes), so
every destination box splits into disjoint pieces, one per distinct source box it meets. A piece
the destination already holds is a local copy; otherwise one holder sends it, chosen to spread the
sending load. ``Partial`` sources hold one *contribution* per partial coordinate; every
contribution is moved and the receiver reduces them, unless the destination keeps the source's
partial axes (:func:`keeps_partial`): then each contribution moves as a plain tensor to the
destination ranks of its partial coordinate and nothing is reduced. A move to the layout the
tensor already has is the plainest case: every rank keeps what it holds (local pieces only, no
bytes cross between ranks), for Partial layouts too, as ``DTensor.redistribute`` does.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from torch.distributed.tensor import Partial

from reshard.layout import Box, Layout, box_numel


@dataclass(frozen=True)
class Piece:
    """``box`` (global coordinates) of contribution ``contribution`` moves ``src`` -> ``dst``."""

    src: int
    dst: int
    box: Box
    contribution: int = 0

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclass(frozen=True)
class Plan:
    src: Layout
    dst: Layout
    pieces: tuple[Piece, ...]
    reduce_op: str | None = None  # "sum" | "avg" | "max" | "min" when a Partial source is reduced
    num_contributions: int = 1
    _itemsize: int = field(default=0, repr=False)

    @property
    def itemsize(self) -> int:
        return self._itemsize

    @property
    def bytes_moved(self) -> int:
        """Bytes crossing between ranks (local copies excluded)."""
        return sum(box_numel(p.box) for p in self.pieces if not p.local) * self.itemsize

    @property
    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = defaultdict(int)
        for p in self.pieces:
            if not p.local:
                out[(p.src, p.dst)] += box_numel(p.box) * self.itemsize
        return dict(out)

    @property
    def messages(self) -> int:
        """Distinct (sender, receiver) pairs: one coalesced message each, before bucketing."""
        return len(self.bytes_by_pair)

    @property
    def lower_bound_bytes(self) -> int:
        """Bytes destination ranks need and do not already hold (each contribution counted)."""
        return lower_bound_bytes(self.src, self.dst)

    def bytes_received(self, rank: int) -> int:
        return sum(b for (s, d), b in self.bytes_by_pair.items() if d == rank)

    def bytes_sent(self, rank: int) -> int:
        return sum(b for (s, d), b in self.bytes_by_pair.items() if s == rank)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) or not box else None


def contributions(layout: Layout) -> list[tuple[Box, list[int]]]:
    """Distinct data items of a layout: (box, holder ranks). Partial coordinates are distinct items."""
    partial_axes = [i for i, p in enumerate(layout.placements) if isinstance(p, Partial)]
    items: dict[tuple, tuple[Box, list[int]]] = {}
    grid = layout.grid
    for coord in _coords(grid.shape):
        box = layout.box_at(coord)
        key = (box, tuple(coord[i] for i in partial_axes))
        items.setdefault(key, (box, []))[1].append(int(grid[coord]))
    return list(items.values())


REDUCE_OPS = ("sum", "avg", "max", "min")  # a Partial source's reductions (DTensor's reduce_op names)


def _coords(shape) -> list[tuple[int, ...]]:
    return list(itertools.product(*map(range, shape)))


def _reduce_op(layout: Layout) -> str | None:
    ops = {p.reduce_op for p in layout.placements if isinstance(p, Partial)}
    if not ops:
        return None
    if len(ops) > 1 or not ops <= set(REDUCE_OPS):
        raise ValueError(
            f"Partial sources reduce with one of {list(REDUCE_OPS)} over all their partial axes, got {sorted(ops)}"
        )
    return ops.pop()


def check_compatible(src: Layout, dst: Layout, cast: bool = False) -> None:
    """``ValueError`` naming both sides unless ``src`` can move to ``dst`` (``cast``: a floating
    dtype may become another floating dtype, converted where the data is packed)."""
    if src.shape != dst.shape:
        raise ValueError(f"global shape mismatch: source {src.shape} vs destination {dst.shape}")
    if src.dtype != dst.dtype and not (cast and src.dtype.is_floating_point and dst.dtype.is_floating_point):
        raise ValueError(f"dtype mismatch: source {src.dtype} vs destination {dst.dtype}")
    if src.dtype != dst.dtype and src.is_partial:
        raise ValueError(
            f"a Partial source ({src.placements}) cannot change dtype on the way ({src.dtype} -> {dst.dtype}): "
            "its contributions would be reduced in the destination's precision"
        )
    if src.is_partial and dst.is_partial and not keeps_partial(src, dst):
        axes = ", ".join(f"mesh axis {a} of size {n}: {p!r}" for a, n, p in _partial_axes(src))
        raise ValueError(
            f"a Partial source ({src.placements}) moves to Shard or Replicate placements, got {dst.placements} "
            f"on a mesh of shape {tuple(dst.grid.shape)}; or to Partial placements that keep the source's "
            f"Partial axes as they are ({axes}), such as the unchanged layout (which moves nothing)"
        )
    if dst.is_partial and not src.is_partial:
        _check_partition(dst)


def _partial_axes(layout: Layout) -> tuple[tuple[int, int, Partial], ...]:
    """``(mesh axis, its size, placement)`` of every Partial axis of ``layout``."""
    return tuple((a, layout.grid.shape[a], p) for a, p in enumerate(layout.placements) if isinstance(p, Partial))


def keeps_partial(src: Layout, dst: Layout) -> bool:
    """``True`` when ``src`` is Partial and ``dst`` has the same Partial placements on the same mesh
    axes, of the same sizes (the other axes, and the ranks, may differ): contribution ``j`` then
    moves unreduced to the destination ranks at partial index ``j``, as ``DTensor.redistribute``
    keeps a Partial axis whose placement it is asked to keep. An unchanged Partial layout is one."""
    return src.is_partial and _partial_axes(src) == _partial_axes(dst)


def partial_index(layout: Layout, rank: int) -> int:
    """Which contribution ``rank`` holds: its coordinates on the Partial axes, in mesh-axis order,
    as one index (0 for a layout without Partial axes); ``rank`` must be on the mesh."""
    coord = layout.coordinate(rank)
    assert coord is not None, f"rank {rank} is not on the mesh {layout.ranks}"
    index = 0
    for axis, size, _ in _partial_axes(layout):
        index = index * size + coord[axis]
    return index


def _check_partition(dst: Layout) -> None:
    """``ValueError`` for a Partial destination DTensor's rule cannot make of full values (its
    ``_partition_value``: ``sum`` divides by the axis's size, ``avg`` / ``max`` / ``min`` keep)."""
    for p in dst.placements:
        if isinstance(p, Partial) and p.reduce_op not in REDUCE_OPS:
            raise ValueError(f"a Partial destination reduces with one of {list(REDUCE_OPS)}, got {p}")
        if isinstance(p, Partial) and p.reduce_op == "sum" and not dst.dtype.is_floating_point:
            raise ValueError(f"a Partial(sum) destination divides its values: {dst.dtype} is not a floating dtype")


@lru_cache(maxsize=4096)
def plan_transfer(src: Layout, dst: Layout, cast: bool = False) -> Plan:
    """Plan moving a tensor from ``src`` to ``dst`` (any meshes: equal, permuted, overlapping,
    disjoint). ``cast``: the dtypes may differ (both floating); the sender converts while packing,
    so the bytes moved are the destination dtype's."""
    check_compatible(src, dst, cast)
    if keeps_partial(src, dst):
        return Plan(src, dst, tuple(_kept_partial_pieces(src, dst)), None, 1, _itemsize(dst.dtype))
    pieces = assign_senders(contributions(src), [(rank, dst.box(rank)) for rank in dst.all_ranks])
    return Plan(src, dst, tuple(pieces), _reduce_op(src), _partial_count(src), _itemsize(dst.dtype))


def _kept_partial_pieces(src: Layout, dst: Layout) -> list[Piece]:
    """Pieces moving each contribution of ``src`` unreduced to the ``dst`` ranks at its partial
    index (:func:`keeps_partial`): per contribution a plain move, so a rank that keeps its own
    contribution's box copies it locally (an unchanged layout: local pieces only)."""
    items = contributions(src)
    index = [partial_index(src, holders[0]) for _, holders in items]
    pieces = []
    for j in range(_partial_count(src)):
        mine = [i for i, k in enumerate(index) if k == j]
        wanted = [(rank, dst.box(rank)) for rank in dst.all_ranks if partial_index(dst, rank) == j]
        moved = assign_senders([items[i] for i in mine], wanted)
        pieces += [replace(p, contribution=mine[p.contribution]) for p in moved]
    return pieces


def assign_senders(items: list[tuple[Box, list[int]]], wanted: list[tuple[int, Box]]) -> list[Piece]:
    """The pieces that deliver every wanted ``(rank, box)`` from source ``items`` ``(box,
    holders)``: one piece per overlapping item, a local copy where the rank holds it, else sent
    by the holder with the least sending load so far (ties round-robin from the receiver)."""
    load: dict[int, int] = defaultdict(int)  # elements each rank sends so far
    pieces = []
    for rank, dst_box in wanted:
        for index, (box, holders) in enumerate(items):
            piece = intersect(box, dst_box)
            if piece is None:
                continue
            sender = rank if rank in holders else _least_loaded(holders, load, rank)
            if sender != rank:
                load[sender] += box_numel(piece)
            pieces.append(Piece(sender, rank, piece, index))
    return pieces


def _partial_count(layout: Layout) -> int:
    n = 1
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            n *= layout.grid.shape[axis]
    return n


def _least_loaded(holders: list[int], load: dict[int, int], rank: int) -> int:
    """The holder with the least sending load; ties go round-robin from ``rank``."""
    return min(holders, key=lambda h: (load[h], (h - rank) % (max(holders) + 1)))


def lower_bound_bytes(src: Layout, dst: Layout) -> int:
    """Sum over destination ranks of what they need and do not hold, from boxes alone, in the
    destination's dtype.

    A rank needs its destination box once per partial contribution (once where the destination
    keeps the partial axes) and already holds the part of it that overlaps its own source box (one
    contribution: where the partial axes are kept, only if it is the contribution it needs).
    """
    kept = keeps_partial(src, dst)
    copies = 1 if kept else _partial_count(src)
    total = 0
    for rank in dst.all_ranks:
        dst_box, own = dst.box(rank), src.box(rank)
        held = own is not None and (not kept or partial_index(src, rank) == partial_index(dst, rank))
        overlap = intersect(own, dst_box) if held else None
        total += copies * box_numel(dst_box) - (box_numel(overlap) if overlap is not None else 0)
    return total * _itemsize(dst.dtype)
