"""Latency figures of a run: per-request :class:`Timing` summarized as percentiles."""

from __future__ import annotations

import statistics
from collections.abc import Sequence as Seq
from types import MappingProxyType

from reshard.parallel.engine.request import Completion

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "latency", "normalized", "queued")
UNITS = MappingProxyType(
    {  # of each figure in latency_summary (summary.json's "latency" says them as "units")
        "ttft": "s",
        "tpot": "s/token",
        "latency": "s",
        "normalized": "s/token",
        "queued": "s",
        "requests_per_s": "1/s",
        "output_tokens_per_s": "tokens/s",
    }
)


def percentiles(values: Seq[float]) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` of ``values`` (linear interpolation
    between the closest ranks, as numpy's default)."""
    data = sorted(values)
    cuts = statistics.quantiles(data, n=100, method="inclusive") if len(data) > 1 else data * 99
    return {**{f"p{p}": cuts[p - 1] for p in PERCENTILES}, "mean": statistics.fmean(data)}


def latency_summary(completions: Seq[Completion], seconds: float) -> dict:
    """Time to first token, time per output token, end-to-end and normalized latency (seconds per
    generated token) and queueing time, each as percentiles over the requests; throughput over
    the run's ``seconds``. Empty if the completions carry no timing."""
    timed = [c.timing for c in completions if c.timing is not None]
    if not timed:
        return {}
    generated = sum(t.tokens for t in timed)
    return {
        **{name: percentiles([getattr(t, name) for t in timed]) for name in METRICS},
        "requests_per_s": len(timed) / max(seconds, 1e-9),
        "output_tokens_per_s": generated / max(seconds, 1e-9),
        "units": dict(UNITS),
    }
