"""KV replication around a ring (DejaVu section 4.2.3, the first half of fault tolerance).

Every rank streams the KV entries it writes at each step (prompt and decode) to rank
``(x + 1) mod N``, which keeps them in a mirror cache laid out like rank ``x``'s and
acknowledges ``(worker, request, step)`` once they are in. Streaming overlaps the next step
(:class:`reshard.kv.stream.TokenStream`); replication plugs into a runner's ``step_end`` hook,
so it composes with any layout whose KV lives in the store (TP, pipeline stages, Shift).
Recovery after a failure (restoring a restarted rank from its neighbour's mirror) builds on it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.distributed as dist

from reshard.kv import KVCache, KVLayout, KVSpec
from reshard.kv.stream import KVStreamer, TokenStream, plan_stream, world_layouts

from .engine import ModelRunner


class RingReplication:
    """Mirror of rank ``x - 1``'s KV on every rank ``x`` of ``runner``'s layout (collective);
    ``mirror_at(spec, source)`` makes the mirror cache (default: in memory).

    One data-parallel replica: every rank of the layout runs every step's sequences, so both
    ends of each ring edge stream the same spans.
    """

    def __init__(self, runner: ModelRunner, *, timeout: float = 60.0,
                 mirror_at: Callable[[KVSpec, int], KVCache] | None = None) -> None:
        if runner.replica.size != 1:
            raise ValueError(f"ring replication runs on one replica (its ranks run the same sequences); "
                             f"the layout has dp={runner.replica.size}")
        layouts = world_layouts(runner.kv, runner.group)
        ranks = sorted(layouts)
        self.rank, self.ranks = dist.get_rank(), ranks
        self.source = ranks[(ranks.index(self.rank) - 1) % len(ranks)]  # whose KV this rank mirrors
        dst = {r: layouts[ranks[(i - 1) % len(ranks)]] for i, r in enumerate(ranks)}
        spec = _spec_for(runner.kv, dst[self.rank])
        self.mirror = mirror_at(spec, self.source) if mirror_at else KVCache(spec, device=runner.kv.device)
        streamer = KVStreamer(plan_stream(layouts, dst), timeout=timeout, background=True)
        self.stream = TokenStream(streamer, runner.kv, self.mirror, timeout=timeout)
        self.acked: dict[int, int] = {}  # request id -> last step of the source's KV that is in
        self._in_flight: list[tuple[int, int]] = []
        self._streaming: set[int] = set()  # request ids whose entries so far are streamed
        runner.hooks.add("step_end", self.step_end)

    def attach(self, runner: ModelRunner) -> None:
        """Also replicate the steps ``runner`` runs; it must share the cache (Shift's two modes)."""
        if runner.kv is not self.stream.send_cache:
            raise ValueError("a runner joins ring replication only if it shares the replicated KV cache")
        runner.hooks.add("step_end", self.step_end)

    def step_end(self, phase: str, seqs: list) -> None:
        """Stream the step's entries; the previous step's, now in, are acknowledged. A sequence
        decoding here for the first time (its prompt KV was swapped in, as Seesaw's decode
        does) streams everything it holds."""
        step, ids = self.stream.steps, {s.request.id for s in seqs}
        whole = ids - self._streaming if phase == "decode" else set()
        # a decode step runs every live sequence of the cache: the ones missing have finished
        self._streaming = self._streaming | ids if phase == "prefill" else ids
        self.stream.step_end(phase, seqs, whole=whole)  # waits for the previous step's jobs
        self._acknowledge()
        self._in_flight = [(s.request.id, step) for s in seqs]

    def _acknowledge(self) -> None:
        for request_id, step in self._in_flight:
            self.acked[request_id] = step
        self._in_flight = []

    def drain(self) -> None:
        """Wait for everything in flight and acknowledge it."""
        self.stream.drain()
        self._acknowledge()

    def close(self) -> None:
        self.drain()
        self.stream.streamer.close()


def _spec_for(cache: KVCache, layout: KVLayout):
    """A cache spec like ``cache``'s (slots, length, paging) holding ``layout``'s layers and heads."""
    return dataclasses.replace(cache.spec, first_layer=layout.first_layer, num_layers=layout.num_layers,
                               head_start=layout.head_start, num_heads=layout.num_heads)
