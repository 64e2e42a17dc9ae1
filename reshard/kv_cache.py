"""Preallocated KV cache, heads outermost within a slot (HND), one slot per running request.

Each rank stores the KV heads ``[head_start, head_start + num_heads)`` of the global
``num_kv_heads``; with KV-head replication several ranks hold the same range. The descriptor
(:meth:`layout_key`) travels with the cache so a reader with an incompatible layout is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    def bytes(self) -> int:
        per = self.num_slots * self.num_heads * self.max_seq_len * self.head_dim
        return 2 * self.num_layers * per * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """K and V per layer, each ``(num_slots, num_heads, max_seq_len, head_dim)``."""

    def __init__(self, spec: KVSpec, device: torch.device | str = "cpu") -> None:
        self.spec, self.device = spec, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.restore()

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
        shape = (s.num_slots, s.num_heads, s.max_seq_len, s.head_dim)
        with torch.inference_mode(False):  # plain tensors even when restored inside generate():
            # background swap threads (outside inference mode) write into them
            self.k = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
            self.v = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store per-token ``k``/``v`` ``(N, num_heads, head_dim)`` at ``(slots[i], :, positions[i])``."""
        layer -= self.spec.first_layer
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor | slice, length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``(len(slots), num_heads, length, head_dim)``: views for a slice, copies otherwise."""
        layer -= self.spec.first_layer
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def layout_key(self) -> tuple:
        s = self.spec
        return (s.num_layers, s.head_start, s.num_heads, s.head_dim, s.dtype)
