"""Background KV movement between a cache and the CPU tier (one worker thread, futures).

Swapping out runs beside the compute thread: a prefill's KV goes out to the tier while the next
prefill computes (the way back is a connector's load, :class:`CPUKVTier.swap_in`, at admission).
Each job's future reports its bytes; an exception in the thread reaches the caller at ``result()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from reshard.kv.cache import KVCache
from reshard.kv.tier import CPUKVTier


class KVSwapper:
    """Swap jobs between caches and one :class:`CPUKVTier`, in submission order."""

    def __init__(self, tier: CPUKVTier) -> None:
        self.tier = tier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-swap")

    def swap_out(self, cache: KVCache, jobs: Sequence[tuple[int, int, int]]) -> Future:
        """Copy ``(slot, request id, tokens)`` of ``cache`` into the tier entries the caller made;
        the future gives bytes (and raises where an entry was freed before its copy ran)."""
        jobs = list(jobs)
        return self._pool.submit(lambda: sum(self.tier.swap_out(cache, *job, allocate=False) for job in jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class MicrobatchSwap:
    """DejaVu's microbatch swapping (section 4.2.2, appendix G) for pipeline decode.

    ``host`` holds every slot's KV (all D micro-batches); ``device`` has room for two
    micro-batches of ``per`` slots each (regions 0 and 1). Micro-batch ``i`` of a step computes in
    region ``i % 2`` while one background thread first copies micro-batch ``i - 1``'s new entries
    back to the host and then brings micro-batch ``i + 1``'s KV into the other region. The host
    is the truth between steps; the device regions are staging.
    """

    def __init__(self, host: KVCache, device: KVCache, per: int) -> None:
        assert device.spec.num_slots >= 2 * per, (device.spec.num_slots, per)
        self.host = host
        self.device = device
        self.per = per
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-mb-swap")
        self.bytes_in = self.bytes_out = 0

    def base(self, i: int) -> int:
        """First device row of the region micro-batch ``i`` of a step computes in."""
        return (i % 2) * self.per

    def decode(self, ranges: Sequence[tuple[int, int]], positions, kv_len: int) -> DecodeSwap:
        """The swap schedule of one decode step over host slot ``ranges`` (its micro-batches)."""
        return DecodeSwap(self, list(ranges), positions, kv_len)

    def swap_in(self, i: int, a: int, b: int, length: int) -> None:
        """Host slots ``[a, b)``, positions ``[0, length)`` -> region of micro-batch ``i``."""
        r = self.base(i)
        for (hk, hv), (dk, dv) in zip(self._layers(self.host), self._layers(self.device)):
            dk[r : r + b - a, :, :length].copy_(hk[a:b, :, :length], non_blocking=True)
            dv[r : r + b - a, :, :length].copy_(hv[a:b, :, :length], non_blocking=True)
        self.bytes_in += 2 * len(self.host.k) * (b - a) * self._row_bytes(length)

    def swap_out(self, i: int, a: int, b: int, positions) -> None:
        """The entries micro-batch ``i`` wrote at ``positions`` (one per slot of ``[a, b)``) -> host."""
        r = self.base(i)
        host = self.host.device
        dev = self.device.device
        rows, pos = torch.arange(a, b, device=host), positions[a:b].to(host)  # (b - a,) each
        dev_rows, dev_pos = torch.arange(r, r + b - a, device=dev), positions[a:b].to(dev)
        for (hk, hv), (dk, dv) in zip(self._layers(self.host), self._layers(self.device)):
            hk[rows, :, pos] = dk[dev_rows, :, dev_pos].to(host)
            hv[rows, :, pos] = dv[dev_rows, :, dev_pos].to(host)
        self.bytes_out += 2 * len(self.host.k) * (b - a) * self._row_bytes(1)

    def mixed(self, ranges: Sequence[tuple[int, int]], written: Sequence[Sequence[tuple[int, int, int]]]) -> MixedSwap:
        """The swap schedule of one mixed step over host slot ``ranges`` (its micro-batches);
        ``written[i]``: ``(slot, start, count)`` of each sequence of micro-batch ``i``, which
        reads positions ``[0, start)`` and writes ``[start, start + count)``."""
        return MixedSwap(self, list(ranges), [list(w) for w in written])

    def store(self, i: int, entries: Sequence[tuple[int, int, int, int]]) -> None:
        """``(row, slot, start, count)``: positions ``[start, start + count)`` micro-batch ``i``
        wrote at row ``base(i) + row`` of the device -> host ``slot``."""
        r = self.base(i)
        for (hk, hv), (dk, dv) in zip(self._layers(self.host), self._layers(self.device)):
            for row, slot, c, n in entries:
                hk[slot, :, c : c + n].copy_(dk[r + row, :, c : c + n])
                hv[slot, :, c : c + n].copy_(dv[r + row, :, c : c + n])
        self.bytes_out += 2 * len(self.host.k) * sum(self._row_bytes(n) for *_, n in entries)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(_in_inference_mode, fn, *args)

    def _layers(self, cache: KVCache):
        return list(zip(cache.k, cache.v))

    def _row_bytes(self, length: int) -> int:
        s = self.host.spec
        return s.num_heads * length * s.head_dim * torch.empty((), dtype=s.dtype).element_size()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RangeSwaps:
    """One step's swaps over its micro-batches' host slot ``ranges``, driven by the runner around
    each micro-batch it computes: micro-batch ``i``'s KV comes into its region before it computes
    (:meth:`_swap_in`), and while it computes one background thread sends ``i - 1``'s new entries
    home (:meth:`_store`) and then brings ``i + 1``'s in (the region ``i - 1`` left)."""

    def __init__(self, swap: MicrobatchSwap, ranges: list[tuple[int, int]]) -> None:
        self.swap = swap
        self.ranges = ranges
        self._next: Future | None = None

    def before(self, i: int) -> None:
        """Micro-batch ``i`` is about to compute: its KV is in place; start the next swaps."""
        if i == 0:
            self._swap_in(0)
        else:
            self._next.result()
        self._next = self.swap.submit(self._around, i)

    def _around(self, i: int) -> None:
        if i > 0:
            self._store(i - 1)
        if i + 1 < len(self.ranges):
            self._swap_in(i + 1)

    def finish(self) -> None:
        """After the last micro-batch: its new entries go home too."""
        if self._next is not None:
            self._next.result()
        self._store(len(self.ranges) - 1)

    def _swap_in(self, i: int) -> None:
        raise NotImplementedError

    def _store(self, i: int) -> None:
        raise NotImplementedError


class DecodeSwap(RangeSwaps):
    """A decode step's: every slot of a range reads ``kv_len`` positions and writes one, at its
    entry of ``positions``."""

    def __init__(self, swap: MicrobatchSwap, ranges: list[tuple[int, int]], positions, kv_len: int) -> None:
        super().__init__(swap, ranges)
        self.positions = positions
        self.kv_len = kv_len

    def _swap_in(self, i: int) -> None:
        self.swap.swap_in(i, *self.ranges[i], self.kv_len)

    def _store(self, i: int) -> None:
        self.swap.swap_out(i, *self.ranges[i], self.positions)


class MixedSwap(RangeSwaps):
    """A mixed step's: ``written[i]``, ``(slot, start, count)`` of each sequence of micro-batch
    ``i``, which reads positions ``[0, start)`` and writes ``[start, start + count)``."""

    def __init__(self, swap: MicrobatchSwap, ranges: list[tuple[int, int]], written: list[list[tuple[int, int, int]]]):
        super().__init__(swap, ranges)
        self.written = written

    def _swap_in(self, i: int) -> None:
        self.swap.swap_in(i, *self.ranges[i], max(start for _, start, _ in self.written[i]))

    def _store(self, i: int) -> None:
        a = self.ranges[i][0]
        self.swap.store(i, [(slot - a, slot, start, count) for slot, start, count in self.written[i]])


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)
