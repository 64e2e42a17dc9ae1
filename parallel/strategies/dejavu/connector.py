"""A DejaVu token group's KV connector: each hand-off's prompt KV, streamed layer by layer from the
prompt group that prefilled it, lands in a staging cache of the connector's; a request resumed
from that hand-off is copied into its token slot when the policy admits it (vLLM v1's
``KVConnector``: :mod:`reshard.parallel.engine.connector`)."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from reshard.kv import KVCache
from reshard.kv.stream import KVStreamer, StreamIn
from reshard.kv.stream_plan import Span
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.connector import KVConnector
from reshard.parallel.engine.request import Request, Sequence


@dataclass
class Incoming:
    """One hand-off's prompt KV on its way into the staging cache: each of its sequences' staging
    slot (a sibling's: its prompt's), the streams (one per layer, in the order the prompt side
    flushes them), the sequences that run on (the others finished at their first token: their KV
    streams all the same, in the stream's order), whether every rank of the group has its share
    (``landed``) and whether this rank unpacked it."""

    slots: dict[int, int]
    streams: list[StreamIn]
    open: set[int]
    landed: bool = False
    unpacked: bool = False


class StreamedKV(KVConnector):
    """The token group's connector over its ``streamers`` (prompt group -> streamer from that
    group's ranks to this group's). A hand-off (:meth:`receive`) posts its streams into staging
    slots (once they are free) and names its open requests' ``kv_source`` ``"<prompt
    group>:<tag>"``, with which the group adds them (``EngineCore.add_request``); such a request
    matches all but its last position (its prompt; its first token is fed by its first step) once
    every one of the ``group_size`` ranks reported its share landed with a step's tokens
    (:meth:`agree`), and awaits KV until then. ``cache``: this rank's token cache (its layout:
    layers and heads); the staging cache has as many slots, contiguous. ``cache=None``: a rank
    of the group outside the token layout (lockstep sides, where the group is the job): it keeps
    the same books over ``slots`` staging slots, receives nothing and counts its share landed."""

    def __init__(
        self,
        streamers: dict[int, KVStreamer],
        cache: KVCache | None,
        num_layers: int,
        group_size: int,
        slots: int | None = None,
    ) -> None:
        self.streamers, self.cache, self.num_layers, self.group_size = streamers, cache, num_layers, group_size
        self.staging = None
        if cache is not None:
            spec = dataclasses.replace(cache.spec, block_size=None, num_blocks=None)
            self.staging, slots = KVCache(spec, device=cache.device), spec.num_slots
        assert slots is not None, "a rank outside the token layout names the staging slots"
        self.free = list(reversed(range(slots)))
        # kv_source -> (its hand-off, its open request ids): booked, waiting for staging slots, oldest first
        self.unposted: dict[str, tuple[Handoff, set[int]]] = {}
        self.incoming: dict[str, Incoming] = {}  # kv_source -> its hand-off's streams
        self.marks: dict[int, tuple[tuple, tuple]] = {}  # request id -> its times and logprobs so far
        self.bytes, self.wait_seconds = 0, 0.0  # received; spent waiting with nothing else to run
        self.loads = 0  # sequences supplied

    def receive(self, handoff: Handoff) -> list[tuple[Request, str]]:
        """Book ``handoff`` (its streams are posted once the staging cache has a slot for each of
        its sequences, hand-offs in the order they came); its requests that run on, resumed after
        their tokens so far, each with the hand-off's key ``"<prompt group>:<tag>"`` as KV source."""
        key = f"{handoff.source}:{handoff.tag}"
        n = len(handoff.requests)
        times, logprobs = handoff.times or ((),) * n, handoff.logprobs or ((),) * n
        rows = [
            row
            for row, done in zip(zip(handoff.requests, handoff.tokens, times, logprobs), handoff.finished)
            if not done
        ]
        self.marks.update((r.id, (marks, lps)) for r, _, marks, lps in rows)
        self.unposted[key] = (handoff, {r.id for r, *_ in rows})
        self._post_ready()
        return [(r.resume(list(tokens)), key) for r, tokens, *_ in rows]

    def _post_ready(self) -> None:
        """Post the booked hand-offs' streams, oldest first, while the staging cache has room."""
        for key, (handoff, open_ids) in list(self.unposted.items()):
            streamed = [handoff.requests[i] for i in handoff.streamed()]
            if len(self.free) < len(streamed):
                return  # (a later hand-off waits behind it)
            del self.unposted[key]
            slots = {r.id: self.free.pop() for r in streamed}
            for r, leader in zip(handoff.requests, handoff.leaders):  # a sibling: its prompt's slot
                slots.setdefault(r.id, slots[handoff.requests[leader].id])
            spans = [Span(r.id, slots[r.id], 0, len(r.prompt_ids)) for r in streamed]
            streams = [  # layer by layer, in the order the prompt side flushes them
                self.streamers[handoff.source].stream_in(self.staging, spans, layers=[layer], tag=handoff.tag)
                for layer in (range(self.num_layers) if self.staging is not None else ())
            ]
            self.incoming[key] = Incoming(slots, streams, open_ids)

    def carried(self, rid: int) -> tuple[tuple, tuple] | None:
        """Request ``rid``'s wall-clock marks and log-probabilities from its prompt group (its
        first token's), once, when it first runs: its sequence continues them (None after that)."""
        return self.marks.pop(rid, None)

    # ---- scheduler half -------------------------------------------------------------------------------
    def matched_tokens(self, seq: Sequence) -> int | None:
        """Its prompt (all but its last position) once its hand-off landed; 0 for a request whose
        staged KV this connector no longer holds (loaded once already: it is computed again)."""
        key = seq.request.kv_source
        if key in self.unposted:
            return None
        incoming = self.incoming.get(key)
        if incoming is None or seq.request.id not in incoming.open:
            return 0
        return seq.prompt_len - 1 if incoming.landed else None

    def agree(self) -> dict:
        return {key: functools.partial(_arrived, inc.streams) for key, inc in self.incoming.items() if not inc.landed}

    def agreed(self, sums: dict[str, int]) -> None:
        """Hand-offs whose KV every rank has: unpacked into staging; those with nothing open released."""
        for key, inc in list(self.incoming.items()):
            if not inc.landed and sums.get(key) == self.group_size:
                self._unpack(inc)
                inc.landed = True
                self._release(key)

    def wait_for(self, request: Request) -> None:
        """Block until this rank's share of ``request``'s hand-off landed (then it has landed on
        every rank: each blocks at this point for its own share); hand-offs booked before it
        land first where it waits for their staging slots."""
        key = request.kv_source
        while key in self.unposted:
            older = next((k for k, i in self.incoming.items() if not i.landed), None)
            assert older is not None, f"hand-off {key} waits for staging slots no landing frees"
            self.land(older)
        self.land(key)

    def arriving(self) -> bool:
        return bool(self.unposted) or any(not i.landed for i in self.incoming.values())

    def land_arriving(self) -> None:
        """Land every posted hand-off, oldest first (and those posted as their slots come back)."""
        while (key := next((k for k, i in self.incoming.items() if not i.landed), None)) is not None:
            self.land(key)
        assert not self.unposted, "hand-offs still wait for staging slots held by sequences that wait"

    def land(self, key: str | None) -> None:
        """Block until this rank's share of hand-off ``key`` landed (see :meth:`wait_for`)."""
        if key in self.incoming:
            t0 = time.perf_counter()
            self._unpack(self.incoming[key])
            self.incoming[key].landed = True
            self.wait_seconds += time.perf_counter() - t0
            self._release(key)

    def _unpack(self, incoming: Incoming) -> None:
        if not incoming.unpacked:
            self.bytes += sum(stream.wait() for stream in incoming.streams)
            incoming.unpacked = True

    # ---- worker half ----------------------------------------------------------------------------------
    def load(self, seq: Sequence, num_tokens: int) -> None:
        """Copy ``num_tokens`` positions of ``seq`` from its staging slot into its token slot
        (its blocks, paged: this rank's layers and heads)."""
        key = seq.request.kv_source
        incoming = self.incoming[key]
        incoming.open.discard(seq.request.id)
        self.loads += 1
        if self.cache is not None:
            self._copy(seq, incoming.slots[seq.request.id], num_tokens)
        self._release(key)

    def _copy(self, seq: Sequence, src: int, num_tokens: int) -> None:
        """Staging slot ``src``'s first ``num_tokens`` positions into ``seq``'s token slot."""
        if self.cache.spec.paged:
            self.cache.assign(seq.slot, seq.blocks)
        first = self.cache.spec.first_layer
        for layer in range(first, first + self.cache.spec.num_layers):
            self.cache.write_slot(layer, seq.slot, *self.staging.read_slot(layer, src, num_tokens))

    def _release(self, key: str) -> None:
        """A landed hand-off none of whose sequences waits any more gives its staging slots back."""
        incoming = self.incoming[key]
        if incoming.landed and not incoming.open:
            self.free.extend(dict.fromkeys(incoming.slots.values()))  # (siblings share their prompt's)
            del self.incoming[key]
            self._post_ready()

    def close(self) -> None:
        for streamer in self.streamers.values():
            streamer.close()


def _arrived(streams: list[StreamIn]) -> int:
    """1 once every stream's fetches arrived on this rank (a step's ``agree`` entry), else 0."""
    return int(all(stream.done() for stream in streams))
