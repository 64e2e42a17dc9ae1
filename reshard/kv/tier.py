"""A CPU tier for KV caches, shared by the ranks of one machine, heads outermost (HND).

The tier is one shared-memory file per store, mapped by every rank: ``(layers, 2, kv_heads,
capacity_tokens, head_dim)``. A request's KV occupies a token range; a rank writes the KV heads
its cache layout holds (:meth:`swap_out`) and later reads the heads of *another* layout
(:meth:`swap_in`), so KV is re-sharded between layouts (e.g. TP4 -> TP2) in the swap itself,
without any collective. Every rank runs the same allocation sequence, so no rank needs to tell
another where a request lives; callers order writes before reads with a barrier.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from reshard import shm
from reshard.kv.cache import KVCache, KVLayout


@dataclass(frozen=True)
class TierSpec:
    num_layers: int
    num_kv_heads: int  # global KV heads
    head_dim: int
    capacity_tokens: int
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.capacity_tokens, self.head_dim)

    @property
    def bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


class CPUKVTier:
    """Shared-memory KV store with a first-fit token allocator replicated on every rank."""

    def __init__(self, spec: TierSpec, path: str | os.PathLike) -> None:
        self.spec = spec
        self.remap(path)
        self.ranges: dict[Hashable, tuple[int, int]] = {}  # entry (a request id) -> [start, stop) tokens

    def remap(self, path: str | os.PathLike) -> None:
        """Hold the KV in the shared-memory file ``path`` from now on (created if missing; an
        existing file's contents are kept: a restarted job finds what the tier held)."""
        self.path = Path(path)
        self.pool = shm.map_file(self.path, self.spec.bytes).view(self.spec.dtype).view(self.spec.shape)

    @property
    def free_tokens(self) -> int:
        return self.spec.capacity_tokens - sum(b - a for a, b in self.ranges.values())

    def can_fit(self, num_tokens: int, without: Collection[Hashable] = ()) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` would succeed now (``without``: once those
        entries were freed)."""
        return self._first_fit(num_tokens, without) + num_tokens <= self.spec.capacity_tokens

    def _first_fit(self, num_tokens: int, without: Collection[Hashable] = ()) -> int:
        start = 0
        for a, b in sorted(r for e, r in self.ranges.items() if e not in without):
            if a - start >= num_tokens:
                break
            start = max(start, b)
        return start

    def allocate(self, request_id: int, num_tokens: int) -> tuple[int, int]:
        """Reserve ``num_tokens`` for ``request_id`` (first fit); ``ValueError`` if it can never fit."""
        if num_tokens > self.spec.capacity_tokens:
            raise ValueError(
                f"request {request_id} needs {num_tokens} KV tokens but the CPU tier holds {self.spec.capacity_tokens}"
            )
        if request_id in self.ranges:
            raise ValueError(f"request {request_id} already has KV in the CPU tier")
        start = self._first_fit(num_tokens)
        if start + num_tokens > self.spec.capacity_tokens:
            raise MemoryError(f"CPU KV tier full: {self.free_tokens} free tokens, {num_tokens} needed")
        self.ranges[request_id] = (start, start + num_tokens)
        return self.ranges[request_id]

    def free(self, request_id: Hashable) -> None:
        self.ranges.pop(request_id)

    def rename(self, entry: Hashable, new: Hashable) -> None:
        """The KV of ``entry`` is ``new``'s from now on (kept past its request: a retained prompt)."""
        assert new not in self.ranges, (entry, new)
        self.ranges[new] = self.ranges.pop(entry)

    def swap_out(self, cache: KVCache, slot: int, request_id: int, num_tokens: int, *, allocate: bool = True) -> int:
        """Copy ``num_tokens`` of ``slot`` (this rank's layers and KV heads) into the tier, into
        the request's entry (made now if it has none and ``allocate``; a background swap-out
        passes False: an entry freed before its copy ran is a caller's bug, not a new entry).

        A cache on a device is staged through a pinned buffer (shared memory cannot be pinned).
        Returns the bytes written.
        """
        held = self.ranges.get(request_id)
        assert held is not None or allocate, f"request {request_id}'s tier entry was freed before its swap-out ran"
        a, b = held or self.allocate(request_id, num_tokens)
        h0, h1 = _heads(cache, self.spec)
        first = cache.spec.first_layer
        for layer in range(cache.spec.num_layers):
            k, v = cache.read_slot(first + layer, slot, num_tokens)  # (H, T, hd), paged or not
            self.pool[first + layer, 0, h0:h1, a:b].copy_(_to_host(k))
            self.pool[first + layer, 1, h0:h1, a:b].copy_(_to_host(v))
        return 2 * cache.spec.num_layers * (h1 - h0) * num_tokens * cache.spec.head_dim * _itemsize(self.spec.dtype)

    def swap_in(self, cache: KVCache, slot: int, request_id: Hashable, num_tokens: int | None = None) -> int:
        """Copy the request's KV (its first ``num_tokens`` positions; None: all) for this cache's
        layers and head range into ``slot``; returns its tokens."""
        a, b = self.ranges[request_id]
        b = b if num_tokens is None else a + num_tokens
        assert b <= self.ranges[request_id][1], (request_id, num_tokens, self.ranges[request_id])
        h0, h1 = _heads(cache, self.spec)
        first = cache.spec.first_layer
        for layer in range(cache.spec.num_layers):
            cache.write_slot(
                first + layer, slot, self.pool[first + layer, 0, h0:h1, a:b], self.pool[first + layer, 1, h0:h1, a:b]
            )
        return b - a

    def close(self, *, unlink: bool = False) -> None:
        del self.pool
        if unlink:
            shm.unlink(self.path)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU; from a device, through a pinned staging buffer."""
    if x.device.type == "cpu":
        return x
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    staged.copy_(x, non_blocking=True)
    torch.accelerator.current_stream(x.device).synchronize()
    return staged


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _heads(cache: KVCache, tier: TierSpec) -> tuple[int, int]:
    """The cache's KV-head range; ``ValueError`` unless the tier holds that part of the model."""
    s = cache.spec
    whole = KVLayout(0, tier.num_layers, s.head_start, s.num_heads, tier.head_dim, tier.dtype)
    if s.head_start + s.num_heads > tier.num_kv_heads or not whole.covers(s.layout):
        raise ValueError(
            f"a cache with KV layout {s.layout} cannot swap with a CPU tier of "
            f"{tier.num_layers} layers x {tier.num_kv_heads} KV heads x head dim "
            f"{tier.head_dim} ({tier.dtype})"
        )
    return s.head_start, s.head_start + s.num_heads
