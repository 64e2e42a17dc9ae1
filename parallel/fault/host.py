"""A lockstep engine group's KV kept by its supervisors: ``fault.migrate=kv`` for a strategy that
runs one engine group of every rank (Shift, Seesaw; TP over every rank), where no peer group can
mirror it.

The supervisor of rank ``i + 1`` (mod the group's size) keeps rank ``i``'s KV in host memory: it
outlives rank ``i``'s engine child, which streams the entries it writes there exactly as it
would to a successor group's rank (:class:`reshard.parallel.fault.mirror.KVMirror`, to the
*host* endpoint, a group of its own in the job's :class:`Topology`). When the group dies, the
router holds its requests (resumed, ``kv_source`` naming the host) for the group's next
generation; the host replays what landed to that generation's rank ``i`` (one message, then an
end-of-stream mark) and the new engine's mirror connector loads it at admission. One mechanism
serves migration, hand-offs and this replay after a respawn.

The host owns its watcher thread, its links and their threads, ended by :meth:`MirrorHost.close`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from reshard.kv.scatter import Packing
from reshard.kv.stream_plan import Span, kv_box
from reshard.parallel.engine.channel import Channel
from reshard.parallel.fault.landing import Landing, land
from reshard.parallel.fault.link import Link, Links
from reshard.parallel.fault.mirror import CLOSE_S, END, WATCH_S
from reshard.plan import Piece

log = logging.getLogger(__name__)
SLOTS = 2  # mirror slots per slot of the engine's cache (a respawn replays what the last one held)


def spec_key(endpoint: str, position: int) -> str:
    """The store key where rank ``position`` of ``endpoint`` publishes its cache's (spec, layout)."""
    return f"kvspec/{endpoint}/{position}"


class MirrorHost:
    """Keeps rank ``position`` of engine ``group``'s KV (see the module docstring) as endpoint
    ``me``. ``connect()``: a new client of the job's store (one per thread); ``channel``: the
    name of the job's :class:`Channel` in it, where each child publishes its cache's (spec,
    layout) under :func:`spec_key`; ``endpoint(store, g)``: group ``g``'s serving generation
    (None while it is down or starting). Starts following the group at once."""

    def __init__(
        self,
        connect: Callable[[], dist.Store],
        channel: str,
        me: str,
        group: int,
        position: int,
        endpoint: Callable[[dist.Store, int], str | None],
    ) -> None:
        self.channel = channel
        self.connect, self.me, self.group, self.position, self.endpoint = connect, me, group, position, endpoint
        self.device = torch.device("cpu")  # host memory: it outlives the child and the child's device
        self.lock = threading.Lock()
        self.landing: tuple[str, Landing, Piece] | None = None  # (the live generation, its mirror, its box)
        self.links = Links(connect, "reshard-mirror-host")  # the watcher, the open links and their threads
        self.stopping = self.links.stopping
        self.links.watch(self._watch)

    def _watch(self) -> None:
        """Follow the group's generations: each new one gets what the last one mirrored, then
        mirrors here itself."""
        store, live = self.connect(), None
        while not self.stopping.wait(WATCH_S):
            now = self.endpoint(store, self.group)
            if now is None or now == live:
                continue
            try:
                self._follow(store, now)
            except (RuntimeError, OSError) as e:  # it died before it published its cache (or host memory ran out)
                log.warning("KV host %s could not follow %s (its requests are prefilled again): %s", self.me, now, e)
            live = now

    def _follow(self, store: dist.Store, now: str) -> None:
        spec, layout = Channel(self.channel, store=store).get(spec_key(now, self.position))
        landing = Landing(spec, SLOTS * spec.num_slots, self.device)
        with self.lock:
            kept, self.landing = self.landing, (now, landing, Piece(0, 1, kv_box(layout)))
        self.links.open(f"mirror/{self.me}->{now}/{self.position}", 0, self._replay, now, kept)
        self.links.open(f"mirror/{now}->{self.me}/{self.position}", 1, self._receive_all, now)

    def _replay(self, link: Link, to: str, kept: tuple[str, Landing, Piece] | None) -> None:
        """Send generation ``to`` every request's KV the last generation mirrored here (oldest
        written first), then the end mark: nothing more comes from this host for it."""
        try:
            if kept is not None:
                _, landing, piece = kept
                spans = [Span(rid, slot, 0, n) for rid, (slot, n) in landing.index.items() if n > 0]
                if spans:
                    link.send(spans, Packing.of(landing.cache, [piece], spans).pack(self.device))
            link.send(END, torch.empty(0, dtype=torch.uint8, device=self.device))
        except RuntimeError:  # the new generation died before it took it
            pass
        finally:
            link.close()

    def _receive_all(self, link: Link, source: str) -> None:
        """Land ``source``'s messages until it dies, leaves or a newer generation replaces it."""
        try:
            while not self.stopping.is_set():
                spans, data = link.recv()
                with self.lock:
                    if spans is END or self.landing is None or self.landing[0] != source:
                        return
                    land(self.landing[1], self.landing[2], spans, data)
        except RuntimeError:  # it died (or closed its end)
            pass
        finally:
            link.close()

    def close(self, timeout: float = CLOSE_S) -> None:
        """Stop (not collective): the watcher and the links' threads are joined, up to ``timeout``
        s in all, and the links closed (a thread blocked on a peer that died before it
        connected is left, a daemon, as :meth:`KVMirror.close` leaves its own)."""
        self.links.close(timeout)

    def __enter__(self) -> MirrorHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
