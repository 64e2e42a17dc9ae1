"""KV mirrors across engine groups (``fault.migrate=kv``): a failed group's sequences move, with
their KV, to the group that mirrors it, and decode on there.

Rank ``i`` of engine group ``g`` streams the KV entries it writes to rank ``i`` of group
``(g + 1) mod G`` (the same position: the same layers and heads, since the groups are replicas of
one layout), which keeps them in a mirror cache laid out like the sender's. Groups do not step
together, so each message names what it carries (request ids, slots, token ranges) and the
receiver unpacks it as it lands, on a thread of its own. Each direction is a two-rank process
group of its own per pair of generations (:class:`Link`), so a respawned peer never meets the
old one's connections. ``every`` steps' entries leave in one message (a failure recomputes at
most that many tokens per sequence).

When group ``g`` fails, the router hands its requests to group ``g + 1``
(:class:`reshard.parallel.engine.request.Migrated`, with the tokens its journal holds); that
group's policy gives each a slot and fires the engine's ``adopt`` event: :meth:`KVMirror.adopt`
copies what landed in the mirror into the slot (the group's ranks agree on the shortest landed
length), keeps the tokens that KV covers and decodes on. A sender whose receiver died waits for
the receiver's next generation and streams every live sequence whole again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.kv import KVCache
from reshard.kv.stream import Packing, Span, kv_box
from reshard.parallel.engine import Engine
from reshard.parallel.engine.request import Migrated
from reshard.parallel.engine.sampling import skip_draws
from reshard.plan import Piece

LINK_TIMEOUT = datetime.timedelta(days=1)  # a quiet link is not a dead one
WATCH_S = 0.05  # how often a mirror looks for its peers' generations
_LINKS: list = []  # every link this process opened (see Link)


class Link:
    """A two-rank gloo process group named ``name`` in ``store``: ``side`` 0 sends, 1 receives
    (connected lazily, on first use). A message is a header (two sizes), pickled metadata and a
    byte buffer. Waits block (a gloo wait with a timeout breaks the connection): a link whose
    peer died before it connected blocks its thread for good, so every link has a thread of its
    own that is abandoned when its peer's endpoint moves on."""

    def __init__(self, store: dist.Store, name: str, side: int) -> None:
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), side, 2, LINK_TIMEOUT)
        self.peer = 1 - side
        _LINKS.append(self)  # never destroyed: a gloo group torn down with an operation pending aborts the process

    def send(self, meta, data: torch.Tensor) -> None:
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        header = torch.tensor([blob.numel(), data.numel()], dtype=torch.int64)
        for t in (header, blob, data.cpu()):
            self.pg.send([t], self.peer, 0).wait()

    def recv(self) -> tuple[object, torch.Tensor]:
        """The next message: its metadata and bytes."""
        header = torch.empty(2, dtype=torch.int64)
        self.pg.recv([header], self.peer, 0).wait()
        blob, data = torch.empty(int(header[0]), dtype=torch.uint8), torch.empty(int(header[1]), dtype=torch.uint8)
        self.pg.recv([blob], self.peer, 0).wait()
        self.pg.recv([data], self.peer, 0).wait()
        return pickle.loads(blob.numpy().tobytes()), data


@dataclass(frozen=True)
class Peers:
    """Where this rank's mirror traffic goes: the engine groups' count, this group's index and
    this rank's position in it; ``endpoint(store, g)`` is group ``g``'s live generation once it
    is ready (None while it is down or starting), looked up through ``store``."""

    groups: int
    group: int
    position: int
    endpoint: Callable[[dist.Store, int], str | None]  # (a store client, group) -> its live endpoint

    @property
    def successor(self) -> int:
        return (self.group + 1) % self.groups

    @property
    def predecessor(self) -> int:
        return (self.group - 1) % self.groups


class KVMirror:
    """This rank's side of the mirrors: streams its runner's KV to the successor group and keeps
    the predecessor group's (see the module docstring); adopts migrated sequences from it.

    ``me``: this generation's endpoint; ``connect()``: a new client of the job's store (each
    thread and each link has its own: a client blocked in a wait, as a link's lazy connection
    is, blocks every thread sharing it); ``every``: steps per message; ``group``: the engine
    group's process group (adoption agrees on lengths over it); ``report(adoption)``: told of
    each adoption as it happens (:attr:`adopted`'s entries).
    """

    def __init__(
        self,
        engine: Engine,
        connect: Callable[[], dist.Store],
        me: str,
        peers: Peers,
        *,
        every: int = 1,
        group=None,
        report: Callable[[tuple], None] | None = None,
    ) -> None:
        runner = engine.runners[next(iter(engine.runners))]
        self.engine, self.cache, self.connect, self.me, self.peers = engine, runner.kv, connect, me, peers
        self.every, self.group, self.vocab = every, group, engine.vocab_size
        self.piece = Piece(0, 1, kv_box(self.cache.layout))
        # source endpoint -> (its mirror cache, request id -> (slot, positions landed))
        self.mirrors: dict[str, tuple[KVCache, dict[int, tuple[int, int]]]] = {}
        self.lock = threading.Lock()
        self.sent: dict[int, int] = {}  # request id -> positions streamed so far
        self.pending: list[Span] = []
        self.steps = 0
        self.resync = False  # the receiver changed: stream every live sequence whole
        self.outbox: queue.Queue | None = None  # the live sender's (None: no receiver yet)
        self.stopping = threading.Event()
        self.connected = threading.Event()  # the live sender's link is up
        self.last = threading.Event()  # set when the last message queued has been sent
        self.last.set()
        # (source endpoint, request id, tokens kept, tokens generated again): what this rank adopted
        self.adopted: list[tuple[str, int, int, int]] = []
        self.report = report or (lambda adoption: None)
        self.watcher = threading.Thread(target=self._watch, name="reshard-mirror", daemon=True)
        if peers.groups > 1:  # one group mirrors nothing
            self.watcher.start()
            engine.events.on("step_end", self._step_end)
            engine.events.on("adopt", self.adopt)

    # ---- sending ----------------------------------------------------------------------------------
    def _step_end(self, step, seqs: list) -> None:
        """Gather ``seqs``' new entries; every ``every``-th step, hand them to the sending thread."""
        live = {s.request.id for s in seqs} if step.phase != "prefill" else None
        whole = self.resync and live is not None  # a step of every live sequence resends them all
        self.resync = self.resync and not whole
        for s in seqs:
            start = 0 if whole else self.sent.get(s.request.id, 0)
            stop = s.cached + (1 if step.phase == "decode" else s.prompt_len - s.cached)
            if stop > start:
                if start == 0:  # a new occupant of the slot (or of its blocks): the last one's are stale
                    self.pending = [sp for sp in self.pending if sp.slot != s.slot]
                self.pending.append(Span(s.request.id, s.slot, start, stop))
                self.sent[s.request.id] = stop
        if live is not None:  # a decode step runs every live sequence: forget the finished ones
            self.sent = {rid: n for rid, n in self.sent.items() if rid in live}
        self.steps += 1
        outbox = self.outbox
        if self.pending and self.steps % self.every == 0:
            spans, self.pending = self.pending, []
            if outbox is None:  # nobody mirrors this rank now: the next receiver gets everything
                self.resync = True
                return
            self._wait_sent(outbox)
            self.last = threading.Event()
            outbox.put((spans, Packing.of(self.cache, [self.piece], spans).pack(self.cache.device), self.last))
            if self.every > 1:  # k steps per message: this one leaves before the next k gather (<= k lost)
                self._wait_sent(outbox)

    def _wait_sent(self, outbox: queue.Queue) -> None:
        """Wait until the last message queued has left, unless its sender was replaced meanwhile.
        With one step per message the previous one is waited for (one in flight: a failure
        loses at most that step); with ``every`` > 1, each message before the next steps gather
        (a failure loses at most the ``every - 1`` steps gathered and the one computing)."""
        while not self.last.wait(0.05):
            if self.outbox is not outbox or self.stopping.is_set():
                return

    def wait_connected(self, timeout: float = 60.0) -> bool:
        """Wait until this rank's KV has a live mirror, if the successor group is up (a group
        should not serve unmirrored when it need not); whether it has one."""
        store, deadline = self.connect(), time.monotonic() + timeout
        while self.peers.groups > 1 and time.monotonic() < deadline:
            if self.connected.wait(0.05):
                return True
            if self.peers.endpoint(store, self.peers.successor) is None:
                return False
        return self.connected.is_set()

    # ---- the links --------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Follow the successor's and predecessor's generations: a new one gets a link (and a
        thread) of its own; the old link's thread is left to end (or block) on its own."""
        store, to, source = self.connect(), None, None
        while not self.stopping.wait(WATCH_S):
            now = self.peers.endpoint(store, self.peers.successor)
            if now != to:
                to = now
                self.connected.clear()
                if self.outbox is not None:
                    self.outbox.put(None)  # the old sender ends (or stays blocked on a dead peer)
                self.outbox = None if now is None else self._start_sender(now)
                self.resync = True
            now = self.peers.endpoint(store, self.peers.predecessor)
            if now is not None and now != source and now != self.me:
                source = now
                self._start_receiver(now)

    def _start_sender(self, to: str) -> queue.Queue:
        outbox: queue.Queue = queue.Queue()
        link = functools.partial(Link, self.connect(), f"mirror/{self.me}->{to}/{self.peers.position}", 0)
        threading.Thread(target=self._send_all, args=(link, outbox), name="reshard-mirror-out", daemon=True).start()
        return outbox

    def _send_all(self, link: Callable[[], Link], outbox: queue.Queue) -> None:
        """Send what is queued until the receiver dies (its next generation gets a new sender)."""
        try:
            out = link()
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
        finally:  # whatever is left is lost: nobody waits for it
            while not outbox.empty():
                item = outbox.get()
                if item is not None:
                    item[2].set()

    def _start_receiver(self, source: str) -> None:
        spec = dataclasses.replace(self.cache.spec, block_size=None, num_blocks=None)  # a slot per sequence
        with self.lock:
            self.mirrors[source] = (KVCache(spec, device=self.cache.device), {})
            for old in list(self.mirrors)[:-2]:  # the last failed source's stays until adopted
                del self.mirrors[old]
        link = functools.partial(Link, self.connect(), f"mirror/{source}->{self.me}/{self.peers.position}", 1)
        threading.Thread(target=self._receive_all, args=(link, source), name="reshard-mirror-in", daemon=True).start()

    def _receive_all(self, link: Callable[[], Link], source: str) -> None:
        """Unpack ``source``'s messages into its mirror as they land, until it dies."""
        try:
            into = link()
            while not self.stopping.is_set():
                self._receive(into, source)
        except RuntimeError:
            pass

    def _receive(self, link: Link, source: str) -> None:
        """One message from ``source`` into its mirror; each sequence's landed length moves on
        (only from where it stood: a sequence first seen mid-way waits for its whole resend)."""
        spans, data = link.recv()
        with self.lock:
            if source not in self.mirrors:
                return
            cache, index = self.mirrors[source]
            packing = Packing.of(cache, [self.piece], spans)
            assert packing.nbytes == data.numel(), (packing.nbytes, data.numel())
            packing.unpack(data.to(cache.device))
            for sp in spans:
                if sp.start == 0:  # a new sequence in that slot: forget the slot's last one
                    for rid in [r for r, (slot, _) in index.items() if slot == sp.slot]:
                        del index[rid]
                if sp.start == 0 or index.get(sp.key, (sp.slot, -1))[1] == sp.start:
                    index[sp.key] = (sp.slot, sp.stop)

    # ---- adopting ---------------------------------------------------------------------------------
    def adopt(self, seq) -> bool:
        """Copy ``seq``'s KV from the mirror of its failed engine into its slot (every rank of the
        group alike); keep the tokens that KV covers (the rest are generated again)."""
        request: Migrated = seq.request
        with self.lock:
            cache, index = self.mirrors.get(request.source, (None, {}))
            slot, landed = index.get(request.id, (-1, 0))
            length = self._agreed(landed)
            n, tokens = len(request.prompt_ids), list(request.tokens)
            cached = min(length, n + len(tokens) - 1)
            if cache is None or cached < n:
                return False
            self._copy(cache, Span(request.id, slot, 0, cached), Span(request.id, seq.slot, 0, cached), seq)
        seq.output, seq.cached = tokens[: cached - n + 1], cached
        if seq.generator is not None:
            skip_draws([request.sampling] * len(seq.output), [seq.generator] * len(seq.output), self.vocab)
        self.adopted.append((request.source, request.id, len(seq.output), len(tokens) - len(seq.output)))
        self.report(self.adopted[-1])
        return True

    def _copy(self, mirror: KVCache, src: Span, dst: Span, seq) -> None:
        """``src``'s entries of ``mirror`` (contiguous) into ``dst`` of this rank's cache (paged:
        into the blocks the policy gave ``seq``): one indexed copy per layer and K/V each way."""
        if self.cache.spec.paged:
            self.cache.assign(seq.slot, seq.blocks)
        buf = Packing.of(mirror, [self.piece], [src]).pack(self.cache.device)
        Packing.of(self.cache, [self.piece], [dst]).unpack(buf)

    def _agreed(self, landed: int) -> int:
        """The shortest landed length over the group's ranks (each holds its own shard)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return landed
        t = torch.tensor([landed], dtype=torch.long, device=self.cache.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def close(self) -> None:
        self.stopping.set()
        if self.outbox is not None:
            self.outbox.put(None)
        if self.watcher.is_alive():
            self.watcher.join(timeout=2)
