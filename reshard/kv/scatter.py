"""Level 2 of DejaVu's KV streaming (:mod:`reshard.kv.stream`): ``scatter / gather``. The
non-contiguous region of a peer (a head range x a token range, across blocks and layers, for
several sequences) packed into one contiguous buffer per peer and unpacked at the other end (the
paper's buffered copies), with one indexed copy per layer and K/V for all the sequences at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reshard.kv.cache import KVCache
from reshard.kv.pack import pack_kv
from reshard.kv.stream_plan import Span
from reshard.plan import Piece


# ---- level 2: scatter / gather ----------------------------------------------------------------
def _regions(cache: KVCache, pieces: Sequence[Piece], layers: Sequence[int] | None):
    """``(storage, (h0, h1))`` of every chunk, in the canonical order both sides use: piece,
    layer, K then V; heads local to ``cache``. A chunk holds every span's tokens."""
    s = cache.spec
    for piece in pieces:
        (l0, l1), (h0, h1) = piece.box
        for layer in range(l0, l1):
            if layers is not None and layer not in layers:
                continue
            for storage in cache.layer(layer):
                yield storage, (h0 - s.head_start, h1 - s.head_start)


def _locations(cache: KVCache, spans: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage ``(rows, cols)`` of every token of ``spans``, span after span (paged or not)."""
    device = cache.k[0].device
    slots = [sp.slot for sp in spans for _ in range(sp.stop - sp.start)]
    positions = [p for sp in spans for p in range(sp.start, sp.stop)]
    return cache.locate(
        torch.tensor(slots, dtype=torch.long, device=device), torch.tensor(positions, dtype=torch.long, device=device)
    )


def chunk_bytes(cache: KVCache, pieces, spans, layers=None) -> list[int]:
    tokens = sum(sp.stop - sp.start for sp in spans)
    item = torch.empty((), dtype=cache.spec.dtype).element_size()
    return [(h1 - h0) * tokens * cache.spec.head_dim * item for _, (h0, h1) in _regions(cache, pieces, layers)]


@dataclass
class Packing:
    """Where one peer's chunks live in ``cache``: each chunk's storage and local head range, the
    ``(rows, cols)`` of every span token, and each chunk's bytes. Made on the step's thread, so a
    background copy neither looks up a cache that was since released nor a block table since
    changed."""

    regions: list
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    sizes: list[int]
    dtype: torch.dtype

    @classmethod
    def of(
        cls, cache: KVCache, pieces: Sequence[Piece], spans: Sequence[Span], layers: Sequence[int] | None = None
    ) -> Packing:
        rows, cols = _locations(cache, spans) if spans else (None, None)
        return cls(
            list(_regions(cache, pieces, layers)),
            rows,
            cols,
            chunk_bytes(cache, pieces, spans, layers),
            cache.spec.dtype,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def pack(self, device: torch.device | str) -> torch.Tensor:
        """One contiguous byte buffer of every chunk: one indexed copy per chunk."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for (storage, (h0, h1)), view in zip(self.regions, self._views(buf)):
            view.copy_(storage[self.rows, h0:h1, self.cols])
        return buf

    def unpack(self, buf: torch.Tensor) -> None:
        assert buf.numel() == self.nbytes, f"buffer of {buf.numel()} bytes for chunks of {self.nbytes}"
        for (storage, (h0, h1)), view in zip(self.regions, self._views(buf)):
            storage[self.rows, h0:h1, self.cols] = view

    def _views(self, buf: torch.Tensor):
        if self.rows is None:
            return
        at = 0
        for (_, (h0, h1)), n in zip(self.regions, self.sizes):
            yield buf[at : at + n].view(self.dtype).view(len(self.rows), h1 - h0, -1)  # (N, heads, head_dim)
            at += n


def scatter(
    cache: KVCache, pieces: Sequence[Piece], spans: Sequence[Span], layers: Sequence[int] | None = None
) -> torch.Tensor:
    """One contiguous byte buffer of every chunk for one peer (``layers``: only those). Each chunk
    is one indexed copy of all spans' tokens ``(N, heads, head_dim)``, however scattered their
    blocks: one copy per layer and K/V, not one per sequence."""
    return Packing.of(cache, pieces, spans, layers).pack(cache.k[0].device)


def chunks(cache: KVCache, pieces, spans, layers=None) -> list[torch.Tensor]:
    """The same bytes one chunk per (layer, K/V, sequence), each packed by
    :func:`reshard.kv.pack.pack_kv` (the naive per-chunk way, for comparison)."""
    out = []
    for storage, heads in _regions(cache, pieces, layers):
        for span in spans:
            out.append(pack_kv(storage, _blocks(cache, span.slot), heads, (span.start, span.stop)))
    return out


def chunk_sizes(cache: KVCache, pieces, spans, layers=None) -> list[int]:
    """Bytes of each chunk :func:`chunks` makes (what a per-chunk receiver allocates)."""
    item = torch.empty((), dtype=cache.spec.dtype).element_size()
    return [
        (h1 - h0) * (sp.stop - sp.start) * cache.spec.head_dim * item
        for _, (h0, h1) in _regions(cache, pieces, layers)
        for sp in spans
    ]


def _blocks(cache: KVCache, slot: int) -> torch.Tensor:
    """The slot's block table; a contiguous cache is one block of ``max_seq_len + 1`` per slot."""
    if cache.spec.paged:
        return cache.table[slot]
    return torch.tensor([slot], device=cache.k[0].device)


def gather(
    cache: KVCache,
    pieces: Sequence[Piece],
    spans: Sequence[Span],
    buf: torch.Tensor,
    layers: Sequence[int] | None = None,
) -> None:
    """Unpack a peer's buffer (from :func:`scatter` on the other side) into ``cache``."""
    Packing.of(cache, pieces, spans, layers).unpack(buf)
