"""Arrival times of online workloads: when each request reaches the engine."""

from __future__ import annotations

import itertools
import random


def poisson_arrivals(n: int, rate: float, seed: int = 0, burst: int = 1) -> list[float]:
    """``n`` arrival times (seconds, ascending, the first after 0) of a Poisson process at ``rate``
    requests per second, seeded; ``burst``: requests arrive ``burst`` at a time (the bursts a
    Poisson process at ``rate / burst``)."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    if burst < 1:
        raise ValueError(f"burst must be >= 1 request, got {burst}")
    gen = random.Random(seed)
    times = list(itertools.accumulate(gen.expovariate(rate / burst) for _ in range(-(-n // burst))))
    return [times[i // burst] for i in range(n)]
