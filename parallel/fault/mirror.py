"""KV mirrors across engine groups: a failed group's sequences move, with their KV, to the group
that mirrors it (``fault.migrate=kv``), and DejaVu's prompt groups hand their prefilled prompts
to token groups the same way.

Rank ``i`` of an engine group streams the KV entries it writes to rank ``i`` of its successor
group (the same position: the same layers and heads, since the groups are replicas of one
layout; which group follows which is the job's
:class:`reshard.parallel.engine.channel.Topology`), which keeps them in a mirror per source
(:class:`reshard.parallel.fault.landing.Landing`: contiguous slots of its own, each request's
slot and landed length). Groups do not step together, so each message names what it carries
(request ids, slots, token ranges) and the receiver unpacks it as it lands, on a thread of its
own. Each direction is a two-rank process group of its own per pair of generations
(:class:`Link`), so a respawned peer never meets the old one's connections; the mirror owns its
links and their threads and closes them in :meth:`KVMirror.close`. A failure recomputes at most
``every`` tokens per sequence: messages of ``(every + 1) // 2`` steps' entries, one in flight
(:attr:`KVMirror.cadence`).

The mirror is the engine's KV connector (:mod:`reshard.parallel.engine.connector`): a
migrated or handed-off request is resumed (its tokens so far in its prompt) with ``kv_source``
naming its source endpoint; when the group that takes it gives it a slot,
:meth:`KVMirror.matched_tokens` answers how many positions landed from that source (the group's
ranks agree on the shortest; from a source that lives on, a hand-off, the request awaits KV
still on its way) and :meth:`KVMirror.load` copies them into the slot; the step computes the
rest. A sender whose receiver died waits for the receiver's next generation and streams every
live sequence whole again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.kv import KVCache
from reshard.kv.scatter import Packing
from reshard.kv.stream_plan import Span, kv_box
from reshard.parallel.engine import Endpoint, Engine
from reshard.parallel.engine.connector import KVConnector
from reshard.parallel.fault.landing import Landing, land
from reshard.parallel.fault.link import Link, Links
from reshard.plan import Piece

WATCH_S = 0.05  # how often a mirror looks for its peers' generations
HANDOFF_WAIT_S = 2.0  # longest a request awaits KV still on its way from a live source (by default)
REPLAY_WAIT_S = 60.0  # ... from a source that ends its stream (a supervisors' host replays it whole, then END)
CLOSE_S = 1.0  # longest close() waits for the links' threads (a peer that leaves ends them)
END = None  # a message's metadata that ends its stream: nothing more comes from that source


@dataclass(frozen=True)
class Peers:
    """Where this rank's mirror traffic goes: this group's index and this rank's position in it,
    the group its KV streams to (``successor``, None: nowhere) and the groups whose KV it keeps
    (``sources``); ``endpoint(store, g)`` is group ``g``'s live generation once it is ready (None
    while it is down or starting), looked up through ``store``."""

    group: int
    position: int
    successor: int | None
    sources: tuple[int, ...]
    endpoint: Callable[[dist.Store, int], str | None]  # (a store client, group) -> its live endpoint
    ends: tuple[int, ...] = ()  # sources whose stream ends with END (hosts): awaited up to REPLAY_WAIT_S


class KVMirror(KVConnector):
    """This rank's side of the mirrors: streams the KV of ``cache`` to the successor group and
    keeps the source groups' (see the module docstring); a KV connector for requests resumed
    from them (it supplies their KV: an *adoption*). It holds no engine: :func:`mirror_engine`
    makes one for an engine's cache (its policy's :attr:`Policy.kv_layout`'s) and adds it to the
    engine's connectors. ``layouts``: the layouts whose steps write ``cache``; a step in a
    layout with a cache of its own (Seesaw's prefill) is not sent, its KV reaches ``cache``
    through a connector (the CPU tier) and is sent from there.

    ``me``: this generation's endpoint; ``connect()``: a new client of the job's store (each
    thread and each link has its own: a client blocked in a wait, as a link's lazy connection
    is, blocks every thread sharing it); ``every``: the most tokens per sequence a failure makes
    the adopter compute again (see :attr:`cadence`); ``group``: the engine
    group's process group (adoption agrees on lengths over it); ``report(adoption)``: told of
    each adoption as it happens (:attr:`adopted`'s entries); ``slots``: a source's mirror slots
    per slot of this rank's cache (hand-offs wait there until adopted); ``handoff_wait_s``: the
    longest a request awaits KV still on its way from a live source. It owns its watcher
    thread, its links and their threads, ended by :meth:`close` (or leaving a ``with`` block).
    """

    def __init__(
        self,
        cache: KVCache,
        layouts: frozenset[str],
        connect: Callable[[], dist.Store],
        me: str,
        peers: Peers,
        *,
        every: int = 1,
        group=None,
        report: Callable[[tuple], None] | None = None,
        slots: int = 2,
        handoff_wait_s: float = HANDOFF_WAIT_S,
    ) -> None:
        self.cache, self.layouts, self.connect, self.me, self.peers = cache, layouts, connect, me, peers
        self.every, self.group = every, group
        self.handoff_wait_s = handoff_wait_s
        self.piece = Piece(0, 1, kv_box(self.cache.layout))
        self.slots = slots * self.cache.spec.num_slots
        self.mirrors: dict[str, Landing] = {}  # source endpoint -> its mirror
        self.late: set[str] = set()  # sources a request awaited in vain (since their last message)
        self.asked: dict[int, float] = {}  # request id -> when it first awaited its KV (monotonic)
        self.lock = threading.Condition()  # notified whenever something lands or a source closes
        self.sent: dict[int, int] = {}  # request id -> positions streamed so far
        self.occupant: dict[int, int] = {}  # slot -> the request whose KV it holds
        self.pending: list[Span] = []
        self.steps = 0
        self.resync = False  # the receiver changed: stream every live sequence whole
        self.outbox: queue.Queue | None = None  # the live sender's (None: no receiver yet)
        self.connected = threading.Event()  # the live sender's link is up
        self.watched = threading.Event()  # the watcher looked once: the live sources' mirrors exist
        # the outbox the last message was queued in, and its event (set once it has been sent)
        self.last: tuple[queue.Queue | None, threading.Event] = (None, threading.Event())
        # (source endpoint, request id, output tokens whose KV came, positions computed again): adoptions
        self.adopted: list[tuple[str, int, int, int]] = []
        self.report = report or (lambda adoption: None)
        self.links = Links(connect, "reshard-mirror")  # the watcher, the open links and their threads
        self.stopping = self.links.stopping
        if peers.successor is not None or peers.sources:
            self.links.watch(self._watch)

    # ---- sending ----------------------------------------------------------------------------------
    def save(self, step, seqs: list) -> None:
        """Gather ``seqs``' new entries; every :attr:`cadence`-th step, hand them to the sending thread."""
        if self.peers.successor is None or step.layout not in self.layouts:
            return  # (another layout's cache: its KV reaches this one through a connector, and is sent from here)
        fed = {id(s): n for s, n in zip(step.seqs, step.num_tokens)}
        live = {s.request.id for s in seqs} if step.kind != "prefill" else None
        whole = self.resync and live is not None  # a step of every live sequence resends them all
        self.resync = self.resync and not whole
        for s in seqs:
            rid = s.request.id
            if self.occupant.get(s.slot) != rid:  # a new occupant of the slot (or of its blocks)
                self.sent.pop(self.occupant.get(s.slot), None)
                self.pending = [sp for sp in self.pending if sp.slot != s.slot]  # the last one's are stale
                self.occupant[s.slot] = rid
            start = 0 if whole or step.kind == "prefill" else self.sent.get(rid, 0)
            stop = s.num_computed_tokens + fed[id(s)]
            if stop > start:
                self.pending.append(Span(rid, s.slot, start, stop))
                self.sent[rid] = stop
        if live is not None:  # a decode step runs every live sequence: forget the finished ones
            self.sent = {rid: n for rid, n in self.sent.items() if rid in live}
        self.steps += 1
        outbox = self.outbox
        if self.pending and self.steps % self.cadence == 0:
            spans, self.pending = self.pending, []
            if outbox is None:  # nobody mirrors this rank now: the next receiver gets everything
                self.resync = True
                return
            self._wait_sent(outbox)  # one message in flight at most
            self.last = (outbox, threading.Event())
            outbox.put((spans, Packing.of(self.cache, [self.piece], spans).pack(self.cache.device), self.last[1]))

    @property
    def cadence(self) -> int:
        """Steps per message: ``m = (every + 1) // 2``. With one message in flight, a failure
        loses the ``m`` steps it carries and the ``m - 1`` gathered since, ``2m - 1 <= every``
        (1 for ``every`` 1 and 2); the step never waits on a message it just queued, only, rarely,
        on the one before (``m`` steps to leave)."""
        return (self.every + 1) // 2

    def _wait_sent(self, outbox: queue.Queue) -> None:
        """Wait until the last message queued has left, unless its sender was replaced meanwhile
        (one message in flight: see :attr:`cadence`)."""
        queued_in, sent = self.last
        if queued_in is not outbox:  # it went to a receiver since replaced: nothing to wait for here
            return
        while not sent.wait(0.05):
            if self.outbox is not outbox or self.stopping.is_set():
                return

    def wait_connected(
        self, timeout: float = 60.0, *, starting: bool = False, done: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait until the live sources' mirrors exist (a request resumed from one must not find
        none and be prefilled whole) and this rank's KV has a live mirror, if the successor group
        is up (or, with ``starting``, until it is: a prompt group's hand-offs need it, unless
        ``done()``: the job has nothing left to serve, and a successor that left comes back no
        more); whether it has one. A group should not serve unmirrored when it need not."""
        store, deadline = self.connect(), time.monotonic() + timeout
        self.watched.wait(timeout)  # a request resumed from a live source finds its mirror
        while self.peers.successor is not None and time.monotonic() < deadline:
            if self.connected.wait(0.05):
                return True
            if (not starting or done()) and self.peers.endpoint(store, self.peers.successor) is None:
                return False
        return self.connected.is_set()

    # ---- the links --------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Follow the successor's and the sources' generations: a new one gets a link (and a
        thread) of its own; the old link's thread is left to end (or block, on a peer that died
        before it connected) on its own."""
        store, to, sources = self.connect(), None, dict.fromkeys(self.peers.sources)
        while not self.stopping.wait(WATCH_S):
            now = None if self.peers.successor is None else self.peers.endpoint(store, self.peers.successor)
            if now != to:
                to = now
                self.connected.clear()
                if self.outbox is not None:
                    self.outbox.put(None)  # the old sender ends (or stays blocked on a dead peer)
                self.outbox = None if now is None else self._start_sender(now)
                self.resync = True
            for g, known in sources.items():
                now = self.peers.endpoint(store, g)
                if now != known and known is not None:
                    self._closed(known)  # down, or done: nothing more lands from it
                if now is not None and now != known:
                    self._start_receiver(now, g)
                sources[g] = now
            self.watched.set()

    def _closed(self, source: str) -> None:
        with self.lock:
            if source in self.mirrors:
                self.mirrors[source].closed = True
            self.lock.notify_all()

    def _start_sender(self, to: str) -> queue.Queue:
        outbox: queue.Queue = queue.Queue()
        self.links.open(f"mirror/{self.me}->{to}/{self.peers.position}", 0, self._send_all, outbox)
        return outbox

    def _send_all(self, out: Link, outbox: queue.Queue) -> None:
        """Send what is queued until the receiver dies (its next generation gets a new sender)."""
        item = None
        try:
            out.send(
                [], torch.empty(0, dtype=torch.uint8, device=self.cache.device)
            )  # connects: this rank's KV is mirrored from here on
            self.connected.set()
            while not self.stopping.is_set():
                item = outbox.get()
                if item is None:
                    return
                spans, data, sent = item
                out.send(spans, data)
                sent.set()
        except RuntimeError:
            self.resync = True
        finally:  # whatever is left is lost (the message it was sending too): nobody waits for it
            out.close()  # the receiver's thread ends: nothing more comes this way
            if self.outbox is outbox:  # until the receiver's next generation, nothing is sent
                self.outbox = None
            if item is not None:
                item[2].set()
            while not outbox.empty():
                item = outbox.get()
                if item is not None:
                    item[2].set()

    def _start_receiver(self, source: str, g: int) -> None:
        landing = Landing(self.cache.spec, self.slots, self.cache.device)
        with self.lock:
            older = [e for e in self.mirrors if Endpoint(e).group == g]
            for old in older[:-1]:  # group g's last dead generation's stays until adopted
                del self.mirrors[old]
            self.mirrors[source] = landing
        self.links.open(f"mirror/{source}->{self.me}/{self.peers.position}", 1, self._receive_all, source)

    def _receive_all(self, into: Link, source: str) -> None:
        """Unpack ``source``'s messages into its mirror as they land, until it dies or leaves."""
        try:
            while not self.stopping.is_set() and self._receive(into, source):
                pass
            self._closed(source)
        except RuntimeError:
            self._closed(source)
        finally:
            into.close()

    def _receive(self, link: Link, source: str) -> bool:
        """One message from ``source`` into its mirror; each sequence's landed length moves on
        (only from where it stood: a sequence first seen mid-way waits for its whole resend).
        False once the source ended its stream (:data:`END`) or its mirror was dropped."""
        spans, data = link.recv()
        with self.lock:
            landing = self.mirrors.get(source)
            if landing is None or spans is END:
                return False
            land(landing, self.piece, spans, data)
            self.late.discard(source)
            self.lock.notify_all()
        return True

    # ---- the connector's scheduler and worker halves ------------------------------------------------
    def matched_tokens(self, seq) -> int | None:
        """Positions of ``seq`` (a request resumed from ``kv_source``) whose KV landed from its
        source on every rank of the group, at most all but its last (which the step feeds); 0
        when that KV does not cover its prompt (it is prefilled whole); None while it is still on
        its way from a source that lives on (a hand-off), up to :meth:`_bound` s after the
        group first agreed it is awaited. Collective over the group."""
        request = seq.request
        if not request.kv_source or not self.peers.sources:
            return 0
        need = seq.prompt_len - 1
        with self.lock:
            settled = self._settled(request, need)
            if not settled and time.monotonic() - self.asked.get(request.id, time.monotonic()) > self._bound(request):
                self.late.add(request.kv_source)  # its next requests await it no more until something lands
            landing = self.mirrors.get(request.kv_source)
            landed = landing.landed(request.id)[1] if landing is not None else 0
        settled_all, cached = self._agreed(int(settled), landed)  # a collective: outside the lock the receivers take
        if not settled_all:  # awaited from now on (not from before a peer joined the agreement)
            self.asked.setdefault(request.id, time.monotonic())
            return None
        self.asked.pop(request.id, None)
        return min(cached, need) if cached >= seq.prompt_len - seq.request.resumed else 0

    def wait_for(self, request) -> None:
        """Nothing else runs: block until ``request``'s KV landed whole here, or will land no
        further, or it has been awaited :meth:`_bound` s."""
        if not request.kv_source or not self.peers.sources:
            return
        need, asked = len(request.prompt_ids) - 1, self.asked.setdefault(request.id, time.monotonic())
        with self.lock:
            self.lock.wait_for(
                lambda: self._settled(request, need), max(0.0, asked + self._bound(request) - time.monotonic())
            )

    def load(self, seq, num_tokens: int) -> None:
        """Copy ``seq``'s KV from its source's mirror into its slot (this rank's shard); its
        mirror slot is free again."""
        request = seq.request
        with self.lock:
            landing = self.mirrors[request.kv_source]
            slot, landed = landing.landed(request.id)
            buf = self._packed(landing.cache, Span(request.id, slot, 0, landed))
            landing.release(request.id)
        if self.cache.spec.paged:
            self.cache.assign(seq.slot, seq.blocks)
        Packing.of(self.cache, [self.piece], [Span(request.id, seq.slot, 0, landed)]).unpack(buf)
        # (source, request id, output tokens whose KV came, positions computed again)
        kept = num_tokens - (seq.prompt_len - request.resumed) + 1
        self.adopted.append((request.kv_source, request.id, kept, seq.prompt_len - 1 - num_tokens))
        self.report(self.adopted[-1])

    def _bound(self, request) -> float:
        """How long ``request`` may await its KV: :attr:`handoff_wait_s`, or :data:`REPLAY_WAIT_S`
        from a source that ends its stream (its END settles it sooner)."""
        ends = Endpoint(request.kv_source).group in self.peers.ends
        return REPLAY_WAIT_S if ends else self.handoff_wait_s

    def _settled(self, request, need: int) -> bool:
        """Whether ``request``'s KV landed whole, or will land no further (its source closed)."""
        landing = self.mirrors.get(request.kv_source)
        if landing is None or landing.closed or request.kv_source in self.late:
            return True
        return landing.landed(request.id)[1] >= need

    def _packed(self, mirror: KVCache, span: Span) -> torch.Tensor:
        """``span``'s entries of ``mirror``, packed (one indexed copy per layer and K/V); unpacked
        into this rank's slot (paged: the blocks the policy gave it) once the group agrees.
        Entries past the agreed length are written too: nothing reads them before a step does."""
        return Packing.of(mirror, [self.piece], [span]).pack(self.cache.device)

    def _agreed(self, settled: int, landed: int) -> tuple[int, int]:
        """The least of each over the group's ranks (each holds its own shard)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return settled, landed
        t = torch.tensor([settled, landed], dtype=torch.long, device=self.cache.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]), int(t[1])

    def close(self, timeout: float = CLOSE_S) -> None:
        """Stop mirroring (not collective; safe on an error path): the watcher and the links'
        threads are joined, up to ``timeout`` s in all, and the links closed. A thread still
        blocked then (on a peer that died before it connected, or a source that still sends) is
        left, a daemon, holding its link's group until its operation returns."""
        self.stopping.set()
        if self.outbox is not None:
            self.outbox.put(None)
        self.links.close(timeout)

    def __enter__(self) -> KVMirror:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mirror_engine(engine: Engine, connect: Callable[[], dist.Store], me: str, peers: Peers, **options) -> KVMirror:
    """A :class:`KVMirror` of ``engine``'s KV cache (its policy's ``kv_layout``'s; the steps of
    every layout that shares that cache are sent), added to the engine's connectors where it
    has peers. ``options``: :class:`KVMirror`'s keywords."""
    layout = engine.policy.kv_layout or next(iter(engine.runners))
    cache = engine.runners[layout].kv
    layouts = frozenset(name for name, runner in engine.runners.items() if runner.kv is cache)
    mirror = KVMirror(cache, layouts, connect, me, peers, **options)
    if peers.successor is not None or peers.sources:
        engine.connector.add(mirror)
    return mirror
