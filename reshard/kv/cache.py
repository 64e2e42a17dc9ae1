"""Preallocated KV cache, heads outermost within a slot (HND), one slot per running sequence.

Each rank stores the KV heads ``[head_start, head_start + num_heads)`` of the global
``num_kv_heads`` for layers ``[first_layer, first_layer + num_layers)``; with KV-head replication
several ranks hold the same range. The descriptor (:class:`KVLayout`) travels with the cache: a
reader (an attention layer, a tier, a peer) whose layout differs is refused when it attaches.

Every slot has ``max_seq_len + 1`` positions: the last one is a scratch column that decode steps
over all slots write for slots with no running sequence, so such a write never lands on a slot
another thread is filling (a swap-in) and is never read (no query attends past its position).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Which part of a model's KV a cache holds: global layers and KV heads, head dim, dtype."""

    first_layer: int
    num_layers: int
    head_start: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def covers(self, reader: "KVLayout") -> bool:
        """Whether ``reader``'s layers lie in this layout's, with the same heads, head dim and dtype."""
        return (self.first_layer <= reader.first_layer
                and reader.first_layer + reader.num_layers <= self.first_layer + self.num_layers
                and (reader.head_start, reader.num_heads, reader.head_dim, reader.dtype)
                == (self.head_start, self.num_heads, self.head_dim, self.dtype))

    def check(self, reader: "KVLayout", who: str) -> None:
        """``ValueError`` naming both layouts unless this layout covers ``reader``'s."""
        if not self.covers(reader):
            raise ValueError(f"{who} expects KV layout {reader} but the cache holds {self}")


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_slots: int
    num_heads: int  # KV heads held on this rank
    max_seq_len: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    head_start: int = 0  # first global KV head held on this rank
    first_layer: int = 0  # global index of layer 0 here (a pipeline stage holds a block of layers)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "num_heads", "max_seq_len", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def scratch(self) -> int:
        """The position decode writes for an idle slot (never read)."""
        return self.max_seq_len

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(num_slots, num_heads, max_seq_len + 1, head_dim)`` per layer, for K and for V."""
        return (self.num_slots, self.num_heads, self.max_seq_len + 1, self.head_dim)

    @property
    def bytes(self) -> int:
        n = 2 * self.num_layers * torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.first_layer, self.num_layers, self.head_start, self.num_heads,
                        self.head_dim, self.dtype)


class KVCache:
    """K and V per layer, each ``(num_slots, num_heads, max_seq_len + 1, head_dim)``."""

    def __init__(self, spec: KVSpec, device: torch.device | str = "cpu") -> None:
        self.spec, self.device = spec, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.restore()

    @property
    def layout(self) -> KVLayout:
        return self.spec.layout

    def attach(self, reader: KVLayout, who: str) -> None:
        """A reader announces the layout it will read and write; ``ValueError`` unless covered."""
        self.layout.check(reader, who)

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def release(self) -> int:
        """Free the cache's memory (its contents are lost); returns the bytes freed."""
        freed = self.spec.bytes if self.allocated else 0
        self.k, self.v = [], []
        return freed

    def restore(self) -> None:
        """(Re)allocate a zeroed cache after :meth:`release` (no-op when allocated)."""
        if self.allocated:
            return
        s = self.spec
        with torch.inference_mode(False):  # plain tensors even when restored inside generate():
            # background swap threads (outside inference mode) write into them
            self.k = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
            self.v = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of global layer ``index``."""
        index -= self.spec.first_layer
        return self.k[index], self.v[index]

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store per-token ``k``/``v`` ``(N, num_heads, head_dim)`` at ``(slots[i], :, positions[i])``."""
        kc, vc = self.layer(layer)
        kc[slots, :, positions] = k
        vc[slots, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor | slice, length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``(len(slots), num_heads, length, head_dim)``: views for a slice, copies otherwise."""
        kc, vc = self.layer(layer)
        return kc[slots, :, :length], vc[slots, :, :length]
