"""A runner's decode body compiled (``engine.compile``): one graph per shape, CUDA graphs on a GPU.

:class:`CompiledBody` wraps the body once; the calls that compiled a graph add their wall time to
:attr:`CompiledBody.seconds` (reported apart from decode), and rank 0 logs a line before the first
compile and one after each call that compiled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

log = logging.getLogger("reshard.parallel.engine.runner")  # (the runner's decode step: its messages, its logger)


class CompiledBody:
    """``body`` compiled once per shape; CUDA graphs where ``device`` is a GPU, which need static
    shapes and buffers: ``static()`` gives the tensors a step writes in place (the KV cache),
    marked static before each call. ``clone``: each output copied out of the graphs' memory pool
    (a caller that keeps it past the next call: the next replay would overwrite it)."""

    def __init__(
        self, body: Callable, device: torch.device, static: Callable[[], Iterable[torch.Tensor]], clone: bool = True
    ) -> None:
        self.graphs_on = device.type == "cuda"
        self.body = torch.compile(body, mode="reduce-overhead" if self.graphs_on else None)
        self.static = static
        self.clone = clone and self.graphs_on  # a replay's output copied out of the graphs' pool
        self.seconds = 0.0  # wall time of the calls that compiled a graph
        self.said = not _logs_progress()  # (only rank 0 tells)

    def __call__(self, *args, **kwargs):
        if self.graphs_on:  # the step writes the KV cache in place: static inputs, or no CUDA graph at all
            for t in self.static():
                torch._dynamo.mark_static_address(t)
        if not self.said:
            log.info("compiling the decode step (%s)", _compile_cache_note())
        graphs, t0 = _graphs_compiled(), time.perf_counter()
        out = self.body(*args, **kwargs)
        if self.clone:  # (a replay's output lives in the graphs' pool, which the next replay
            out = out.clone()  # overwrites: a stage's next micro-batch, before its send or cat)
        if _graphs_compiled() != graphs:
            self.seconds += time.perf_counter() - t0
            if _logs_progress():
                what = "the decode step" if not self.said else "the decode step for a new shape"
                log.info("compiled %s in %.1f s", what, time.perf_counter() - t0)
        self.said = True
        return out


def _logs_progress() -> bool:
    """Whether this process logs compile progress: rank 0, or a process outside any group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _compile_cache_note() -> str:
    """Where the compiled code is cached, and what a first run costs."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return f"a first run on this machine can take minutes; cached afterwards in {cache_dir()}"


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its own counter; private, read-only)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
