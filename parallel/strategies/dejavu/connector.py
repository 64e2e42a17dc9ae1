"""A DejaVu token group's KV connector: each hand-off's prompt KV, streamed layer by layer from the
prompt group that prefilled it, lands in a staging cache of the connector's; a request resumed
from that hand-off is copied into its token slot when the policy admits it (vLLM v1's
``KVConnector``: :mod:`reshard.parallel.engine.connector`). The staging cache also keeps the
prompts each prompt group leases there (:mod:`.lease`): a later hand-off copies their prefixes
instead of receiving them."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from dataclasses import dataclass

from reshard.kv import KVCache
from reshard.kv.stream import KVStreamer, StreamIn
from reshard.kv.stream_plan import Span
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.connector import KVConnector
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.strategies.dejavu.lease import NONE, Lease

MISS = "miss"  # a kept prompt a hand-off copies from is not here whole: its request computes its prompt


@dataclass(frozen=True)
class Kept:
    """A prompt kept for its prompt group (:mod:`.lease`): its staging slot, its tokens, the
    prompt group's epoch it was computed in, the hand-off that streamed it, and whether its slot
    holds every position (not so where a prefix it was to copy was missing)."""

    slot: int
    prompt: tuple[int, ...]
    epoch: int
    key: str
    whole: bool


@dataclass
class Incoming:
    """One hand-off's prompt KV on its way into the staging cache: each of its sequences' staging
    slot (a sibling's: its prompt's), the streams (one per layer, in the order the prompt side
    flushes them), the sequences that run on (the others finished at their first token: their KV
    streams all the same, in the stream's order), whether every rank of the group has its share
    (``landed``) and whether this rank unpacked it; ``copies``: the kept prefixes it copies when
    it is unpacked, ``(its slot, the kept prompt, positions)``."""

    slots: dict[int, int]
    streams: list[StreamIn]
    open: set[int]
    copies: list[tuple[int, Kept, int]]
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
    layers and heads); the staging cache has as many slots, contiguous, and ``kept`` more for
    the prompts the prompt groups lease here (every prompt group's together). ``cache=None``: a
    rank of the group outside the token layout (lockstep sides, where the group is the job): it
    keeps the same books over ``slots`` staging slots, receives nothing and counts its share
    landed."""

    def __init__(
        self,
        streamers: dict[int, KVStreamer],
        cache: KVCache | None,
        num_layers: int,
        group_size: int,
        slots: int | None = None,
        kept: int = 0,
    ) -> None:
        self.streamers, self.cache, self.num_layers, self.group_size = streamers, cache, num_layers, group_size
        self.staging = None
        if cache is not None:
            slots = cache.spec.num_slots
            spec = dataclasses.replace(cache.spec, num_slots=slots + kept, block_size=None, num_blocks=None)
            self.staging = KVCache(spec, device=cache.device)
        assert slots is not None, "a rank outside the token layout names the staging slots"
        self.free = list(reversed(range(slots + kept)))
        self.capacity = kept  # prompts kept at most (the prompt groups' books keep within it)
        self.kept: dict[tuple[int, int], Kept] = {}  # (prompt group, serial) -> its kept prompt, oldest first
        self.epochs: dict[int, int] = {}  # prompt group -> the epoch of its last hand-off posted
        self.pins: Counter[int] = Counter()  # staging slot -> copies from it not made yet
        # kv_source -> (its hand-off, its open request ids): booked, waiting for staging slots, oldest first
        self.unposted: dict[str, tuple[Handoff, set[int]]] = {}
        self.incoming: dict[str, Incoming] = {}  # kv_source -> its hand-off's streams
        self.marks: dict[int, tuple[tuple, tuple]] = {}  # request id -> its times and logprobs so far
        self.bytes, self.wait_seconds = 0, 0.0  # received; spent waiting with nothing else to run
        self.loads = 0  # sequences supplied
        self.positions = 0  # prompt positions streamed here (counted as posted)
        self.reused = 0  # prompt positions copied from kept prompts instead of received
        self.misses = 0  # sequences whose kept prefix was not here: computed on this group

    def receive(self, handoff: Handoff) -> list[tuple[Request, str]]:
        """Book ``handoff`` (its streams are posted once the staging cache has a slot for each of
        its sequences, hand-offs in the order they came); its requests that run on, resumed after
        their tokens so far, each with the hand-off's key ``"<prompt group>:<tag>"`` as KV source."""
        key = f"{handoff.source}:{handoff.tag}"
        rows = [(r, tokens, marks, lps) for r, tokens, done, marks, lps in handoff.rows() if not done]
        self.marks.update((r.id, (marks, lps)) for r, _, marks, lps in rows)
        self.unposted[key] = (handoff, {r.id for r, *_ in rows})
        self._post_ready()
        return [(r.resume(list(tokens)), key) for r, tokens, *_ in rows]

    def _post_ready(self) -> None:
        """Post the booked hand-offs' streams, oldest first, while the staging cache has room;
        the kept prefixes they copy are copied when they are unpacked."""
        for key, (handoff, open_ids) in list(self.unposted.items()):
            streamed = [handoff.requests[i] for i in handoff.streamed()]
            if len(self.free) < len(streamed):
                return  # (a later hand-off waits behind it)
            del self.unposted[key]
            lease = handoff.lease or Lease(0, (NONE,) * len(streamed), (-1,) * len(streamed), ())
            slots = {r.id: self.free.pop() for r in streamed}
            copies, missed = self._plan_copies(handoff.source, lease, streamed, slots)
            for r, leader in zip(handoff.requests, handoff.leaders):  # a sibling: its prompt's slot
                slots.setdefault(r.id, slots[handoff.requests[leader].id])
                if handoff.requests[leader].id in missed:
                    missed.add(r.id)
            self.misses += len(missed & open_ids)  # (not those that finished at their first token)
            spans = [
                Span(r.id, slots[r.id], n, len(r.prompt_ids))
                for r, (_, n) in zip(streamed, lease.shared)
                if n < len(r.prompt_ids)
            ]
            streams = [  # layer by layer, in the order the prompt side flushes them
                self.streamers[handoff.source].stream_in(self.staging, spans, layers=[layer], tag=handoff.tag)
                for layer in (range(self.num_layers) if self.staging is not None and spans else ())
            ]
            self.positions += sum(span.stop - span.start for span in spans)
            self.incoming[key] = Incoming(slots, streams, open_ids - missed, copies)
            self._follow(handoff.source, lease, streamed, slots, missed, key)

    def _plan_copies(self, group: int, lease: Lease, streamed: list[Request], slots: dict) -> tuple[list, set[int]]:
        """The kept prefixes ``streamed`` copy (their kept prompts' slots pinned until then), and
        the ids of the requests whose kept prompt is not here whole, of that epoch and those
        tokens (books that disagree): they compute their prompts here."""
        copies, missed = [], set()
        for r, (serial, n) in zip(streamed, lease.shared):
            kept = self.kept.get((group, serial)) if serial >= 0 else None
            if serial >= 0 and not _holds(kept, lease.epoch, r.prompt_ids[:n]):
                missed.add(r.id)
            elif kept is not None:
                copies.append((slots[r.id], kept, n))
                self.pins[kept.slot] += 1
                self.reused += n
        return copies, missed

    def _staged_layers(self) -> range:
        """The layers this rank stages (none outside the token layout)."""
        if self.staging is None:
            return range(0)
        return range(self.staging.spec.first_layer, self.staging.spec.first_layer + self.staging.spec.num_layers)

    def _follow(self, group: int, lease: Lease, streamed: list[Request], slots: dict, missed: set, key: str) -> None:
        """Keep and free what prompt group ``group``'s hand-off ``key`` says; a new epoch frees
        what it kept before. Past :attr:`capacity`, the oldest kept prompt goes (only where the
        books disagree)."""
        if self.epochs.setdefault(group, lease.epoch) != lease.epoch:
            self.epochs[group] = lease.epoch
            for k in [k for k in self.kept if k[0] == group]:
                self._drop(k)
        for r, serial in zip(streamed, lease.keep):
            if serial >= 0:
                self._drop((group, serial))
                self.kept[(group, serial)] = Kept(
                    slots[r.id], tuple(r.prompt_ids), lease.epoch, key, r.id not in missed
                )
        for serial in lease.drop:
            self._drop((group, serial))
        while len(self.kept) > self.capacity:
            self._drop(next(iter(self.kept)))

    def _drop(self, k: tuple[int, int]) -> None:
        """Keep prompt ``k`` no longer: its slot is free now, or once its hand-off is released
        and no copy from it waits."""
        kept = self.kept.pop(k, None)
        if kept is not None and not self._filling(kept) and not self.pins[kept.slot]:
            self.free.append(kept.slot)

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
        self._post_ready()  # (slots freed by the copies just made)

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

    def forget(self, request: Request) -> None:
        """An aborted request of a hand-off here: no longer open (its hand-off's staging slots go
        back once the rest are loaded and it landed)."""
        key = request.kv_source
        self.marks.pop(request.id, None)
        if key in self.unposted:
            self.unposted[key][1].discard(request.id)
        elif key in self.incoming:
            self.incoming[key].open.discard(request.id)
            self._release(key)

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
            self._post_ready()

    def _unpack(self, incoming: Incoming) -> None:
        """This rank's share of ``incoming`` into staging: its kept prefixes copied (each kept
        prompt's own hand-off unpacked first), its streams waited for."""
        if incoming.unpacked:
            return
        for dst, kept, n in incoming.copies:
            if self._filling(kept):
                self._unpack(self.incoming[kept.key])
            for layer in self._staged_layers():
                self.staging.write_slot(layer, dst, *self.staging.read_slot(layer, kept.slot, n))
            self._unpin(kept)
        self.bytes += sum(stream.wait() for stream in incoming.streams)
        incoming.unpacked = True

    def _unpin(self, kept: Kept) -> None:
        """A copy from ``kept`` was made: its slot is free now if nothing keeps or fills it."""
        self.pins[kept.slot] -= 1
        if self.pins[kept.slot] or self._filling(kept):
            return
        del self.pins[kept.slot]
        if all(k.slot != kept.slot for k in self.kept.values()):
            self.free.append(kept.slot)

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
        """A landed hand-off none of whose sequences waits any more gives its staging slots back,
        but those of the prompts kept."""
        incoming = self.incoming[key]
        if incoming.landed and not incoming.open:
            held = {k.slot for k in self.kept.values()} | {s for s, n in self.pins.items() if n}
            self.free.extend(s for s in dict.fromkeys(incoming.slots.values()) if s not in held)  # (siblings share)
            del self.incoming[key]
            self._post_ready()

    def released_caches(self) -> list:
        """The staging cache (where this rank stages): the engine frees it now, so no prompt is
        kept any more (on every rank alike); hand-offs that copy from one compute their prompts
        here. ``RuntimeError`` while hand-offs still arrive (only after a failed ``generate``):
        their KV would land in freed memory."""
        if self.incoming or self.unposted:
            arriving = sorted({*self.incoming, *self.unposted})
            raise RuntimeError(
                f"release_memory() while DejaVu hand-offs {arriving} still arrive at this token group "
                "(a generate call failed?): their KV would be lost; build a new engine"
            )
        for k in list(self.kept):
            self._drop(k)
        return [self.staging] if self.staging is not None else []

    def _filling(self, kept: Kept) -> bool:
        """Whether the hand-off that streamed ``kept`` still holds its slot (it is incoming)."""
        incoming = self.incoming.get(kept.key)
        return incoming is not None and kept.slot in incoming.slots.values()

    def close(self) -> None:
        for streamer in self.streamers.values():
            streamer.close()


def _holds(kept: Kept | None, epoch: int, tokens: list[int]) -> bool:
    """Whether ``kept`` holds the KV of ``tokens`` (its first positions) under weights ``epoch``."""
    return kept is not None and kept.whole and kept.epoch == epoch and kept.prompt[: len(tokens)] == tuple(tokens)


def _arrived(streams: list[StreamIn]) -> int:
    """1 once every stream's fetches arrived on this rank (a step's ``agree`` entry), else 0."""
    return int(all(stream.done() for stream in streams))
