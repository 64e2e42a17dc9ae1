"""The server's metrics, in Prometheus' text format (``GET /metrics``): requests waiting and
running, tokens, finished requests by reason, rejections, each engine group's free KV, and
TTFT / TPOT / end-to-end latency histograms (seconds, as vLLM's names them)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Mapping

from reshard.parallel.engine.channel import Load
from reshard.parallel.engine.request import Completion

PREFIX_COUNTERS = (  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
    ("reshard_prefix_cache_queries_total", "prefix_queries", "prompt tokens looked up in the prefix cache"),
    ("reshard_prefix_cache_hits_total", "prefix_hits", "prompt tokens the prefix cache held"),
)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for k in range(bisect.bisect_left(self.buckets, value), len(self.buckets)):
            self.counts[k] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help: str) -> list[str]:
        out = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.count}",
        ]


class Metrics:
    """Counters the front end updates (thread safe) and renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0  # accepted, no token yet
        self.running = 0  # a token out, not finished
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # by finish reason ("abort": cancelled)
        self.rejected: Counter[int] = Counter()  # by HTTP status
        self.ttft, self.tpot, self.latency = Histogram(), Histogram(), Histogram()

    def accepted(self, prompt_len: int) -> None:
        with self._lock:
            self.waiting += 1
            self.prompt_tokens += prompt_len

    def first_token(self) -> None:
        with self._lock:
            self.waiting -= 1
            self.running += 1

    def completed(self, c: Completion, had_token: bool) -> None:
        with self._lock:
            if had_token:
                self.running -= 1
            else:
                self.waiting -= 1
            self.generation_tokens += len(c.output_ids)
            self.finished[c.finish_reason] += 1
            if c.timing is not None and c.finish_reason != "abort":
                self.ttft.observe(c.timing.ttft)
                self.tpot.observe(c.timing.tpot)
                self.latency.observe(c.timing.latency)

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] += 1

    def render(self, loads: Mapping[str, Load]) -> str:
        with self._lock:
            lines = [
                *_gauge("reshard_requests_waiting", "accepted requests without a first token", self.waiting),
                *_gauge("reshard_requests_running", "requests generating", self.running),
                *_counter("reshard_prompt_tokens_total", "prompt tokens accepted", self.prompt_tokens),
                *_counter("reshard_generation_tokens_total", "tokens generated", self.generation_tokens),
                "# HELP reshard_requests_finished_total finished requests by reason (abort: cancelled)",
                "# TYPE reshard_requests_finished_total counter",
                *(f'reshard_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())),
                "# HELP reshard_requests_rejected_total refused requests by HTTP status",
                "# TYPE reshard_requests_rejected_total counter",
                *(f'reshard_requests_rejected_total{{status="{s}"}} {n}' for s, n in sorted(self.rejected.items())),
                *self.ttft.lines("reshard_time_to_first_token_seconds", "time to first token"),
                *self.tpot.lines("reshard_time_per_output_token_seconds", "time per output token after the first"),
                *self.latency.lines("reshard_e2e_request_latency_seconds", "arrival to last token"),
            ]
        lines += [
            "# HELP reshard_kv_free_tokens free KV tokens per engine group",
            "# TYPE reshard_kv_free_tokens gauge",
        ]
        lines += [f'reshard_kv_free_tokens{{group="{g}"}} {load.free_tokens}' for g, load in sorted(loads.items())]
        lines += [
            "# HELP reshard_kv_free_slots free sequence slots per engine group",
            "# TYPE reshard_kv_free_slots gauge",
        ]
        lines += [f'reshard_kv_free_slots{{group="{g}"}} {load.free_slots}' for g, load in sorted(loads.items())]
        for name, field, what in PREFIX_COUNTERS:
            lines += [f"# HELP {name} {what} per engine group", f"# TYPE {name} counter"]
            lines += [f'{name}{{group="{g}"}} {getattr(load, field)}' for g, load in sorted(loads.items())]
        return "\n".join(lines) + "\n"


def _gauge(name: str, help: str, value) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(name: str, help: str, value) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name} {value}"]
