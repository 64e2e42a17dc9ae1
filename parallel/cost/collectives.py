"""The roofline and the link costs the cost model builds on (:mod:`parallel.cost.roofline`,
:mod:`parallel.cost.moe`): seconds for FLOPs and bytes on one GPU, and for each collective over
``n`` GPUs of a :class:`~reshard.parallel.cost.profiles.Hardware` profile. ``span``: the GPUs of the
aligned block the group lies in (``n`` for ``n`` neighbours; the tp group of a (dp, pp, sp, tp) grid spans
``tp``, its sp group ``sp * tp``, its stages ``pp * sp * tp``): the collective runs at the level of the
machine's topology that block crosses, its slowest link. Units: seconds, bytes.
"""

from __future__ import annotations

import math

from reshard.parallel.cost.profiles import Hardware


def roofline_time(hw: Hardware, flops: float, nbytes: float) -> float:
    """The slower of compute (``flops`` at peak) and memory (``nbytes`` at the HBM bandwidth)."""
    return max(flops / hw.flops, nbytes / hw.mem_bw)


def all_reduce_time(hw: Hardware, nbytes: float, n: int, span: int | None = None) -> float:
    """All-reduce of ``nbytes`` over ``n`` GPUs: the faster of a ring (``2(n-1)`` latency hops,
    bandwidth-optimal) and a tree / one-shot (``2 log2 n`` hops, the whole message each way), as
    NCCL and vLLM's custom all-reduce pick by message size."""
    if n == 1:
        return 0.0
    lat, bw = hw.comm("all_reduce", span or n)
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * lat
    return min(ring, tree)


def all_to_all_time(hw: Hardware, nbytes: float, n: int, span: int | None = None) -> float:
    """All-to-all of ``nbytes`` per GPU (the ``(n-1)/n`` not kept) over ``n`` GPUs: ``n-1``
    pairwise messages, each paying the link latency."""
    if n == 1:
        return 0.0
    lat, bw = hw.comm("all_to_all", span or n)
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def all_gather_time(hw: Hardware, nbytes: float, n: int, span: int | None = None) -> float:
    """Ring all-gather of an ``nbytes`` result over ``n`` GPUs (each holds ``1/n`` of it): the
    ``(n-1)/n`` it lacks over the link, ``n-1`` latency hops. A ring all-gather is the second half
    of a ring all-reduce, so it runs at the all-reduce's link parameters (those a calibration fits)."""
    if n == 1:
        return 0.0
    lat, bw = hw.comm("all_reduce", span or n)
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def send_time(hw: Hardware, nbytes: float, span: int = 2) -> float:
    """One point-to-point message of ``nbytes`` between two GPUs of an aligned block of ``span``
    (neighbours by default)."""
    lat, bw = hw.comm("send", span)
    return lat + nbytes / bw
