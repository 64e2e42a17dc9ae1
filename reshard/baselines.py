"""The common ways to sync weights, in the same code as :class:`reshard.sync.WeightSync` for
comparison (its ``method="full_tensor"`` and ``"broadcast"``): every parameter gathered whole on
the source ranks (``DTensor.full_tensor()``, as ZeRO-3's ``GatheredParameters`` does), broadcast
from the first source rank to the destination ranks that lack it, then sliced."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from reshard.executor import CommStats
from reshard.layout import Layout, box_slices
from reshard.mesh import cached_group, rank_tensor

if TYPE_CHECKING:
    from reshard.sync import SyncEntry


class Baseline:
    """The common ways, for comparison: each parameter gathered whole (``full_tensor()``) on the
    source ranks, broadcast from the first source rank to destination ranks that lack it
    (``full_tensor``: ranks outside the source; ``broadcast``: every destination rank), sliced."""

    def __init__(self, entries: list[SyncEntry], method: str) -> None:
        self.entries, self.method = entries, method
        self.needy = [self._needy(e) for e in entries]
        self.groups = {ranks: cached_group(rank_tensor(ranks)) for ranks in sorted(set(self.needy)) if len(ranks) > 1}

    def _needy(self, e: SyncEntry) -> tuple[int, ...]:
        """Root first, then the ranks the root broadcasts to."""
        root = e.src.all_ranks[0]
        holders = set(e.src.all_ranks) if self.method == "full_tensor" else {root}
        return (root,) + tuple(sorted(set(e.dst.all_ranks) - holders))

    def run(self, src: Mapping[str, torch.Tensor], outs: list[torch.Tensor | None]) -> CommStats:
        t0, rank = time.perf_counter(), dist.get_rank()
        stats = CommStats()
        for e, needy, out in zip(self.entries, self.needy, outs):
            full, allocated = self._gather(src.get(e.source), e, stats)
            if rank in needy and len(needy) > 1:
                if full is None:
                    full, allocated = torch.empty(e.src.shape, dtype=e.src.dtype, device=out.device), True
                if rank != needy[0]:
                    stats.bytes_received += _nbytes(e.src)
                dist.broadcast(full, src=needy[0], group=self.groups[needy])
            if out is not None:
                out.copy_(full[box_slices(e.dst.box(rank))])
            if allocated:  # a whole-tensor buffer this rank did not hold before
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, full.numel() * full.element_size())
            stats.planned_bytes += _gathered_bytes(e.src) + (len(needy) - 1) * _nbytes(e.src)
        stats.rounds, stats.seconds = len(self.entries), time.perf_counter() - t0
        return stats

    def _gather(self, t: torch.Tensor | None, e: SyncEntry, stats: CommStats) -> tuple[torch.Tensor | None, bool]:
        """The whole tensor on a source rank (``full_tensor()``), and whether it is a new buffer."""
        rank = dist.get_rank()
        if t is None or e.src.box(rank) is None:
            return None, False
        t = _plain(t)
        if not isinstance(t, DTensor):
            return t, False
        stats.bytes_received += _nbytes(e.src) - _box_bytes(e.src.box(rank), e.src)
        return t.full_tensor(), True


def _plain(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.data if isinstance(t, torch.nn.Parameter) else t


def _nbytes(layout: Layout) -> int:
    return _box_bytes(tuple((0, n) for n in layout.shape), layout)


def _box_bytes(box, layout: Layout) -> int:
    n = torch.empty((), dtype=layout.dtype).element_size()
    for lo, hi in box:
        n *= hi - lo
    return n


def _gathered_bytes(layout: Layout) -> int:
    """Bytes an all-gather of the whole tensor delivers to every holder of a shard of it."""
    return sum(_nbytes(layout) - _box_bytes(layout.box(r), layout) for r in layout.all_ranks)
