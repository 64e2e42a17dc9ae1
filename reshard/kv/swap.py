"""Background KV movement between a cache and the CPU tier (one worker thread, futures).

Swapping runs beside the compute thread: a prefill's KV goes out to the tier while the next
prefill computes, and a waiting sequence's KV comes back into a free decode slot while the current
decode step computes. Each job's future reports its bytes (out) or tokens (in); an exception in
the thread reaches the caller at ``result()``.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from .cache import KVCache
from .tier import CPUKVTier


class KVSwapper:
    """Swap jobs between caches and one :class:`CPUKVTier`, in submission order."""

    def __init__(self, tier: CPUKVTier) -> None:
        self.tier = tier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-swap")

    def swap_out(self, cache: KVCache, jobs: Sequence[tuple[int, int, int]]) -> Future:
        """Copy ``(slot, request id, tokens)`` of ``cache`` into the tier; the future gives bytes."""
        jobs = list(jobs)
        return self._pool.submit(lambda: sum(self.tier.swap_out(cache, *job) for job in jobs))

    def swap_in(self, cache: KVCache, slot: int, request_id: int) -> Future:
        """Copy the request's KV (this cache's layers and heads) into ``slot``; the future gives tokens."""
        return self._pool.submit(self.tier.swap_in, cache, slot, request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
