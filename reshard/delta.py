"""Delta execution of a schedule: only the elements that changed since the last run cross ranks.

For a weight sync run again and again (RL: every optimizer step) into low-precision rollout
weights, most elements are bitwise the same as last time: at RL learning rates an fp32 update
rarely moves a bf16 value. A :class:`DeltaCache` on each sender keeps, per chunk it sends, what
it sent last time (in the destination's dtype); the next run sends, per chunk, either the changed
elements (int32 flat indices + values) or the whole chunk, whichever is smaller, so a run is never
larger than the dense one (plus a header). The schedule's rounds are the dense ones (same pieces,
same senders, same bucket budget); a round exchanges fixed-size headers first (per chunk: how
many changed, or dense), then the payloads.

The receiver's destination must still hold what the last run wrote (nothing else writes it):
then the result is bitwise the dense one. A run that fails (or a verification that finds a wrong
shard) invalidates the cache, and every rank drops its own before the next run, which is dense.
Chunks must have fewer than 2^31 elements (int32 indices): :func:`check_chunks`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from reshard.executor import CommStats, Schedule, _check_out, _check_world, _Item, _local_slices, _src_view
from reshard.layout import box_numel
from reshard.mesh import device_type

DENSE = -1  # header value: the chunk is sent whole
_ALIGN = 8
# element size (bytes) -> the integer dtype of that size (bit patterns compared or hashed as ints)
INT_OF_SIZE: Mapping[int, torch.dtype] = MappingProxyType(
    {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
)


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DeltaCache:
    """What this rank last sent of each chunk (``{item order: flat tensor in the destination's
    dtype}``); empty at first and after :meth:`invalidate` (then the next run is dense).
    ``invalid``: this rank's cache was dropped by a failure (a run or a verification) and every
    rank must drop its own before the next run (:class:`reshard.sync.WeightSync` agrees on it)."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}
        self.invalid = False

    def invalidate(self) -> None:
        """Drop what was sent: the receivers may not hold it (a failure, a corrupted shard)."""
        self.sent.clear()
        self.invalid = True

    def clear(self) -> None:
        self.sent.clear()
        self.invalid = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sent.values())


def execute_delta(
    schedule: Schedule,
    src_locals: list[torch.Tensor | None],
    out: list[torch.Tensor | None],
    cache: DeltaCache,
    group: dist.ProcessGroup | None = None,
) -> CommStats:
    """Run ``schedule`` writing ``out`` in place, sending only what changed since the last run
    with this ``cache``. Returns this rank's :class:`CommStats` (headers included in the bytes;
    ``planned_bytes`` and ``lower_bound_bytes`` are the dense plan's)."""
    t0, rank = time.perf_counter(), dist.get_rank()
    plans = schedule.plans
    _check_world(plans)
    assert all(p.reduce_op is None for p in plans), "a delta run copies; Partial sources are reduced densely"
    outs = _check_out(plans, out, rank)
    stats = CommStats(
        planned_bytes=sum(p.bytes_moved for p in plans), lower_bound_bytes=sum(p.lower_bound_bytes for p in plans)
    )
    try:
        for items in schedule.rounds:
            mine = [it for it in items if rank in (it.piece.src, it.piece.dst)]
            if mine:
                _delta_round(mine, plans, src_locals, outs, rank, cache, stats, group)
            stats.rounds += 1
    except BaseException:
        cache.invalidate()
        raise
    stats.peak_extra_bytes += cache.nbytes  # what this rank keeps between runs to send deltas
    stats.seconds = time.perf_counter() - t0
    return stats


def _delta_round(items: list[_Item], plans, src_locals, outs, rank: int, cache: DeltaCache, stats, group) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for it in sorted(items, key=lambda i: i.order):
        p = it.piece
        if p.local:
            target = outs[it.plan][_local_slices(it.box, plans[it.plan].dst.box(rank))]
            target.copy_(_src_view(it, plans, src_locals, rank))
            stats.bytes_copied_locally += it.nbytes
        else:
            (sends[p.dst] if p.src == rank else recvs[p.src]).append(it)
    encoded = {peer: [_encode(it, plans, src_locals, rank, cache) for it in its] for peer, its in sends.items()}
    device = torch.device(device_type())
    headers = _exchange(
        {peer: torch.tensor([e[0] for e in enc], dtype=torch.int64, device=device) for peer, enc in encoded.items()},
        {peer: len(its) for peer, its in recvs.items()},
        torch.int64,
        device,
        group,
    )
    sent = {peer: _concat(enc, device) for peer, enc in encoded.items()}
    payloads = _exchange(
        sent,
        {peer: _payload_size(its, headers[peer], plans) for peer, its in recvs.items()},
        torch.uint8,
        device,
        group,
    )
    for peer, its in recvs.items():
        _apply(its, headers[peer], payloads[peer], plans, outs, rank)
    for enc in encoded.values():
        for _, _, order, new in enc:
            cache.sent[order] = new
    stats.bytes_sent += sum(buf.numel() + 8 * len(encoded[peer]) for peer, buf in sent.items())
    stats.bytes_received += sum(b.numel() for b in payloads.values()) + 8 * sum(map(len, recvs.values()))
    stats.messages += 2 * len(encoded)  # a header and a payload per peer
    staged = sum(b.numel() for b in sent.values()) + sum(b.numel() for b in payloads.values())
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, staged)


def _encode(
    it: _Item, plans, src_locals, rank: int, cache: DeltaCache
) -> tuple[int, list[torch.Tensor], int, torch.Tensor]:
    """``(header, segments, order, new values)`` for one chunk: the changed elements when that is
    smaller than the chunk (header = their count), else the chunk (header = :data:`DENSE`)."""
    dtype = plans[it.plan].dst.dtype
    new = _src_view(it, plans, src_locals, rank).to(dtype).reshape(-1).clone()  # (numel,) in the destination dtype
    old = cache.sent.get(it.order)
    if old is not None and it.box:  # a 0-d tensor is always sent whole
        bits = INT_OF_SIZE[new.element_size()]
        changed = torch.nonzero(new.view(bits) != old.view(bits)).flatten()
        if _delta_bytes(changed.numel(), new.element_size()) < _padded(it.nbytes):
            return changed.numel(), [changed.to(torch.int32), new[changed]], it.order, new
    return DENSE, [new], it.order, new


def check_chunks(schedule: Schedule) -> None:
    """``ValueError`` unless every chunk indexes with int32 (set a ``bucket_bytes``)."""
    big = max((box_numel(it.box) for r in schedule.rounds for it in r), default=0)
    if big >= 2**31:
        raise ValueError(
            f"a delta sync indexes chunks with int32, but one has {big} elements (bucket_bytes="
            f"{schedule.bucket_bytes}); set bucket_bytes to at most {2**31 - 1} elements' bytes"
        )


def _delta_bytes(k: int, itemsize: int) -> int:
    return _padded(4 * k) + _padded(itemsize * k)


def _concat(encoded: list[tuple], device: torch.device) -> torch.Tensor:
    """One peer's payload: every segment's bytes, each padded to 8 bytes (aligned for any dtype)."""
    parts = []
    for _, segments, _, _ in encoded:
        for seg in segments:
            raw = seg.reshape(-1).view(torch.uint8)
            parts += [raw, torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8, device=raw.device)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _payload_size(items: list[_Item], header: torch.Tensor, plans) -> int:
    return sum(
        _padded(it.nbytes) if k == DENSE else _delta_bytes(k, plans[it.plan].itemsize)
        for it, k in zip(items, header.tolist())
    )


def _exchange(sends: dict[int, torch.Tensor], sizes: dict[int, int], dtype: torch.dtype, device, group) -> dict:
    """One batch of P2P: ``sends[peer]`` to each peer, ``sizes[peer]`` elements from each (an
    empty message is not sent: both sides know it is empty)."""
    recvs = {peer: torch.empty(n, dtype=dtype, device=device) for peer, n in sizes.items()}
    ops = [dist.P2POp(dist.isend, buf.contiguous(), peer, group) for peer, buf in sends.items() if buf.numel()]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in recvs.items() if buf.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return recvs


def _apply(items: list[_Item], header: torch.Tensor, payload: torch.Tensor, plans, outs, rank: int) -> None:
    """Write one peer's chunks into the destination shards (whole, or the changed elements)."""
    at = 0
    for it, k in zip(items, header.tolist()):
        plan = plans[it.plan]
        target = outs[it.plan][_local_slices(it.box, plan.dst.box(rank))]
        shape = tuple(hi - lo for lo, hi in it.box)
        if k == DENSE:
            target.copy_(payload[at : at + it.nbytes].view(plan.dst.dtype).view(shape))
            at += _padded(it.nbytes)
            continue
        idx = payload[at : at + 4 * k].view(torch.int32).to(torch.int64)
        at += _padded(4 * k)
        values = payload[at : at + plan.itemsize * k].view(plan.dst.dtype)
        at += _padded(plan.itemsize * k)
        if k:
            target[torch.unravel_index(idx, shape)] = values  # (k,) changed elements; a view writes its base
