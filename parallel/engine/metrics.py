"""Latency figures of a run: per-request :class:`Timing` summarized as percentiles."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from reshard.parallel.engine.request import Completion

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "latency", "normalized", "queued")


def percentiles(values: Seq[float]) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` of ``values`` (linear interpolation)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64))
    return {**{f"p{p}": v for p, v in zip(PERCENTILES, q.tolist())}, "mean": t.mean().item()}


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
    }
