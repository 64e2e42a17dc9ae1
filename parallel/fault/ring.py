"""KV replication around a ring (DejaVu section 4.2.3, the first half of fault tolerance).

Every rank streams the KV entries it writes (prompt and decode) to rank ``(x + 1) mod N``,
which keeps them in a mirror cache laid out like rank ``x``'s and acknowledges
``(worker, request, step)`` once they are in; ``replicate_every=k`` sends the entries of ``k``
steps (every sequence's) in one message, so a failure recomputes at most ``k`` steps. Streaming overlaps the next step
(:class:`reshard.kv.stream.TokenStream`); replication listens to the engine's ``step_end`` and
``idle`` events of the layouts that write the replicated cache, so it composes with any layout
whose KV lives in the store (TP, pipeline stages, Shift's two modes over one cache).
Recovery after a failure (restoring a restarted rank from its neighbour's mirror) builds on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.distributed as dist

from reshard.kv import KVCache, KVLayout, KVSpec
from reshard.kv.stream import KVStreamer, TokenStream
from reshard.kv.stream_plan import StreamPlan, kv_box, world_layouts
from reshard.mesh import all_gather_objects
from reshard.parallel.engine import Engine, ModelRunner
from reshard.plan import Piece


class RingReplication:
    """Mirror of rank ``x - 1``'s KV on every rank ``x`` of ``engine``'s ``layout`` (default: its
    first) (collective); ``mirror_at(spec, source)`` makes the mirror cache (default: in memory).

    Every layout whose runner shares that layout's cache is replicated (Shift's two modes). With
    data-parallel replicas the two ends of a ring edge may run different sequences: the receiver
    takes the sender's from the step, and a replica with nothing to run still takes part (its
    ``idle`` event). ``replicate_every``: steps whose entries leave in one message (the last
    ``replicate_every`` steps are what a failure may lose); ``landed``: steps whose entries are
    all in the mirror.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        layout: str | None = None,
        timeout: float = 60.0,
        mirror_at: Callable[[KVSpec, int], KVCache] | None = None,
        background: bool = True,
        replicate_every: int = 1,
    ) -> None:
        if replicate_every < 1:
            raise ValueError(f"replicate_every must be >= 1 (steps per message), got {replicate_every}")
        if engine.engine_group is not None:
            raise ValueError(
                "ring replication follows one lockstep group: build the engine with replicas='lockstep' "
                f"(it runs engine group {engine.engine_group.index} of {engine.engine_group.count})"
            )
        layout = layout if layout is not None else next(iter(engine.runners))
        runner = engine.runners[layout]
        layouts, replicas = world_layouts(runner.kv, runner.group), _world_replicas(runner)
        ranks = sorted(layouts)
        self.rank, self.ranks = dist.get_rank(), ranks
        self.source = ranks[(ranks.index(self.rank) - 1) % len(ranks)]  # whose KV this rank mirrors
        self.replica, self.source_replica = replicas[self.rank], replicas[self.source]
        spec = _spec_for(runner.kv, layouts[self.source])
        self.mirror = mirror_at(spec, self.source) if mirror_at else KVCache(spec, device=runner.kv.device)
        # background: pack and unpack on the streamer's thread, not the step's
        streamer = KVStreamer(_ring_plan(layouts), timeout=timeout, background=background)
        self.stream = TokenStream(streamer, runner.kv, self.mirror, timeout=timeout, every=replicate_every)
        self._streaming: dict[int, set[int]] = {}  # replica -> request ids whose entries so far are streamed
        self.layouts = sorted(name for name, r in engine.runners.items() if r.kv is runner.kv)
        for event in ("step_end", "idle"):
            engine.events.on(event, self.step_end, layout=self.layouts)

    def step_end(self, step, seqs: list) -> None:
        """Gather this replica's entries of ``step`` (``seqs``) and the source's, sent every
        ``replicate_every``-th step; the message before, now in, is acknowledged. A sequence
        decoding here for the first time (its prompt KV was swapped in, as Seesaw's decode does)
        streams everything it holds."""
        phase, incoming = step.kind, seqs
        if self.source_replica != self.replica:
            incoming = [s for s in step.seqs if s.replica == self.source_replica]
        whole = self._whole(self.replica, phase, seqs)
        if incoming is not seqs:
            whole |= self._whole(self.source_replica, phase, incoming)
        self.stream.step_end(phase, seqs, whole=whole, incoming=incoming)

    @property
    def acked(self) -> dict[int, int]:
        """Request id -> last step (0-based, of this ring's) of the source's KV that is in the mirror."""
        return self.stream.acked

    @property
    def landed(self) -> int:
        """Steps (of this ring's) whose entries are all in the mirror (and all sent)."""
        return self.stream.landed

    def _whole(self, replica: int, phase: str, seqs: list) -> set[int]:
        """Sequences of ``replica`` decoding for the first time since they were streamed."""
        ids, live = {s.request.id for s in seqs}, self._streaming.get(replica, set())
        # a decode step runs every live sequence of a replica: the ones missing have finished
        self._streaming[replica] = live | ids if phase == "prefill" else ids
        return ids - live if phase == "decode" else set()

    def drain(self) -> None:
        """Send what is gathered and wait for everything in flight (collective)."""
        self.stream.drain()

    def close(self) -> None:
        self.drain()
        self.stream.streamer.close()


def _world_replicas(runner: ModelRunner) -> dict[int, int]:
    """Every rank's data-parallel replica in ``runner``'s layout."""
    return dict(all_gather_objects((dist.get_rank(), runner.replica.rank), runner.group))


def _ring_plan(layouts: dict[int, KVLayout]) -> StreamPlan:
    """Rank ``x - 1``'s whole KV to rank ``x``, around the sorted ranks (each edge its own piece:
    another rank holding the same layout, a data-parallel twin, runs other sequences)."""
    ranks = sorted(layouts)
    dst = {r: layouts[ranks[i - 1]] for i, r in enumerate(ranks)}
    pieces = tuple(Piece(ranks[i - 1], r, kv_box(dst[r])) for i, r in enumerate(ranks))
    return StreamPlan(tuple(sorted(layouts.items())), tuple(sorted(dst.items())), pieces)


def _spec_for(cache: KVCache, layout: KVLayout):
    """A cache spec like ``cache``'s (slots, length, paging) holding ``layout``'s layers and heads."""
    return dataclasses.replace(
        cache.spec,
        first_layer=layout.first_layer,
        num_layers=layout.num_layers,
        head_start=layout.head_start,
        num_heads=layout.num_heads,
    )
