"""A CPU copy of a model's weights in shared memory, written once, read under any layout.

Seesaw's ``weights: reload`` mode: instead of moving shards rank to rank, each rank copies the box
it needs for the new layout out of one machine-wide copy of the full tensors. The store is one
shared-memory file mapped by every rank; each full tensor is filled collectively, every box by
exactly one of the ranks that hold it (:meth:`SharedWeightStore.write`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from reshard import shm
from reshard.layout import Box, Layout, box_slices
from reshard.mesh import device_type

_ALIGN = 64


class SharedWeightStore:
    """Full tensors ``{name: (shape, dtype)}`` at aligned offsets of one shared-memory file."""

    def __init__(self, entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]], path: str | os.PathLike) -> None:
        self.path, self.entries = Path(path), dict(entries)
        self.offsets, total = {}, 0
        for name, (shape, dtype) in self.entries.items():
            self.offsets[name] = total
            total += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
        self.nbytes = total
        self._pool = shm.map_file(self.path, total)
        self.bytes_read = 0

    @staticmethod
    def for_module(module: torch.nn.Module, path: str | os.PathLike) -> SharedWeightStore:
        entries = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
        return SharedWeightStore(entries, path)

    def full(self, name: str) -> torch.Tensor:
        """The stored full tensor (a view into shared memory)."""
        shape, dtype = self.entries[name]
        start = self.offsets[name]
        return self._pool[start : start + _nbytes(shape, dtype)].view(dtype).view(shape)

    def write(self, name: str, t: DTensor, rank: int) -> int:
        """Store this rank's box of ``t`` if this rank is the lowest holder of it; returns bytes written."""
        layout = Layout.of_dtensor(t)
        box = layout.box(rank)
        if box is None or _first_holder(layout, box) != rank:
            return 0
        self.full(name)[box_slices(box)].copy_(t.to_local())
        return t.to_local().numel() * t.to_local().element_size()

    def read(self, name: str, box: Box, device: torch.device | str | None = None) -> torch.Tensor:
        """A contiguous copy of ``box`` of the stored tensor on ``device`` (default: the process
        group's, :func:`reshard.mesh.device_type`)."""
        device = device if device is not None else device_type()
        out = self.full(name)[box_slices(box)].to(device, copy=True).contiguous()
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self, *, unlink: bool = False) -> None:
        del self._pool
        if unlink:
            shm.unlink(self.path)


def _first_holder(layout: Layout, box: Box) -> int:
    return min(r for r in layout.grid.flatten().tolist() if layout.box(r) == box)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n
