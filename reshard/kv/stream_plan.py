"""Level 1 of DejaVu's KV streaming (:mod:`reshard.kv.stream`): ``stream_out / stream_in``
decisions. From the source and destination KV layouts of every rank (layers x KV heads each holds:
TP degree, pipeline depth, replicas), which ``(layer range x head range)`` goes from which source
rank to which destination rank. A destination box is split over the source boxes it meets (merging
at the destination) and a source box over the destinations that need it (splitting at the source);
a region several ranks hold is sent by the least loaded one. Pure: the movement core's sender
assignment (:func:`reshard.plan.assign_senders`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from reshard.kv.cache import KVCache, KVLayout
from reshard.mesh import all_gather_objects
from reshard.plan import Piece, assign_senders

Box = tuple[tuple[int, int], tuple[int, int]]  # (layers [l0, l1), KV heads [h0, h1))


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, stop)`` of request ``key``, held in ``slot`` of this side's cache."""

    key: int
    slot: int
    start: int
    stop: int


# ---- level 1: which chunks go where ------------------------------------------------------------
def kv_box(layout: KVLayout) -> Box:
    return (
        (layout.first_layer, layout.first_layer + layout.num_layers),
        (layout.head_start, layout.head_start + layout.num_heads),
    )


@dataclass(frozen=True)
class StreamPlan:
    """Pieces ``(src rank, dst rank, (layers, heads))`` between two layouts (every rank's)."""

    src: tuple[tuple[int, KVLayout], ...]
    dst: tuple[tuple[int, KVLayout], ...]
    pieces: tuple[Piece, ...]

    def sends(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` streams out, by destination rank (itself included: a local copy)."""
        return _by(p for p in self.pieces if p.src == rank)

    def receives(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` streams in, by source rank."""
        return _by((p for p in self.pieces if p.dst == rank), key=lambda p: p.src)


def _by(pieces, key=lambda p: p.dst) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = {}
    for p in pieces:
        out.setdefault(key(p), []).append(p)
    return dict(sorted(out.items()))


def plan_stream(src: Mapping[int, KVLayout], dst: Mapping[int, KVLayout]) -> StreamPlan:
    """Which region of the KV each destination rank gets from which source rank.

    ``src`` / ``dst``: the KV layout each rank holds (ranks that hold none are left out). A
    destination whose layers and heads the sources do not cover, or whose head dim or dtype
    differs, is refused with both layouts named.
    """
    items: dict[Box, list[int]] = {}
    for rank, layout in sorted(src.items()):
        items.setdefault(kv_box(layout), []).append(rank)
    first = next(iter(src.values()), None)
    for rank, layout in sorted(dst.items()):
        _check_reader(rank, layout, first, src, items)
    pieces = assign_senders(list(items.items()), [(r, kv_box(lay)) for r, lay in sorted(dst.items())])
    return StreamPlan(tuple(sorted(src.items())), tuple(sorted(dst.items())), tuple(pieces))


def _check_reader(rank: int, layout: KVLayout, first: KVLayout | None, src, items) -> None:
    box = kv_box(layout)
    covered = sum(_area(_intersect(b, box)) for b in items)
    if first is None or (layout.head_dim, layout.dtype) != (first.head_dim, first.dtype) or covered != _area(box):
        raise ValueError(
            f"rank {rank} reads KV layout {layout}, which the source layouts do not hold "
            f"({ {r: lay for r, lay in sorted(src.items())} })"
        )


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _area(box: Box | None) -> int:
    return 0 if box is None else (box[0][1] - box[0][0]) * (box[1][1] - box[1][0])


def world_layouts(cache: KVCache | None, group: dist.ProcessGroup | None = None) -> dict[int, KVLayout]:
    """Every rank's KV layout (ranks without a cache left out): one all-gather of descriptors."""
    everyone = all_gather_objects((dist.get_rank(), cache.layout if cache is not None else None), group)
    return {rank: layout for rank, layout in everyone if layout is not None}
