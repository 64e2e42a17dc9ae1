"""The control plane of a job's engine groups: :class:`Channel`, pickled values in the job's
``torch.distributed`` store (a TCP key-value server every job already has), and the values that
travel on it (:class:`GroupLayout`, :class:`Load`, :class:`Handoff`, :class:`Cancel`), and the job's
:class:`Topology`: which groups take new requests and where each group's KV goes.

A group never joins a collective another group must join: what passes between groups, and
between the router and the groups, are keys in the store. The store needs no process group of its
own, and a key read by every rank of a group is the same bytes for all of them (a P2P message
would reach one rank and need a re-broadcast inside the group).
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch.distributed as dist

from reshard.mesh import job_timeout
from reshard.parallel.engine.request import Request

POLL_S = (0.0005, 0.02)  # a waiting party looks at the store again after this, doubling up to that
# a group waiting for its next request looks at most this long apart: the request's first step waits
# for the group's last rank to see it (one store look each, cheap beside the router's round of looks)
WAIT_POLL_S = 0.005


@dataclass(frozen=True)
class GroupLayout:
    """Which group of the job this rank's engine is: ``index`` of ``count``, over ``ranks``.

    ``entries``: the groups the router hands new requests to (default: all); the others only
    take requests other groups hand over (DejaVu's token groups). ``channel`` names the job's
    keys in the store; ``job``: the process group over every group's ranks (``None``: the whole
    job), which gathers the completions at the end.
    """

    index: int
    count: int
    ranks: tuple[int, ...]
    entries: tuple[int, ...] | None = None
    channel: str = "groups"
    job: dist.ProcessGroup | None = field(default=None, compare=False)

    @property
    def entry_groups(self) -> tuple[int, ...]:
        return tuple(range(self.count)) if self.entries is None else self.entries

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader


@dataclass(frozen=True)
class Load:
    """What a group's leader publishes after a step that changed it: its free room and how many
    of its assignments it has taken into its queue."""

    free_slots: int
    free_tokens: int
    taken: int
    prefix_queries: int = 0  # prompt tokens looked up in its prefix cache so far
    prefix_hits: int = 0  # ... of them its cache held


@dataclass(frozen=True)
class Handoff:
    """Sequences one group ran part of, handed to group ``target`` (DejaVu's prefilled prompts):
    each request, its tokens so far and whether it already finished (its KV streams all the
    same, so the receiver keeps the stream's order). ``tag`` names the stream: the source
    group's step that produced them. ``times``: each sequence's wall-clock marks so far (its
    first step's start, its first token), which its latency figures continue from; ``logprobs``: its tokens'
    log-probabilities, where its request asks."""

    source: int
    target: int
    tag: int
    requests: tuple[Request, ...]
    tokens: tuple[tuple[int, ...], ...]
    finished: tuple[bool, ...]
    times: tuple[tuple[float, ...], ...] = ()
    logprobs: tuple[tuple, ...] = ()  # each sequence's TokenLogprobs so far (its request asked for them)
    leaders: tuple[int, ...] = ()
    lease: object = None  # DejaVu: the token group's kept prompts for it (dejavu.lease.Lease; None: none)

    def rows(self) -> list[tuple]:
        """Each sequence's ``(request, tokens, finished, times, logprobs)`` (blank marks and
        log-probabilities where the hand-off carries none)."""
        n = len(self.requests)
        times, logprobs = self.times or ((),) * n, self.logprobs or ((),) * n
        return list(zip(self.requests, self.tokens, self.finished, times, logprobs))

    def streamed(self) -> list[int]:
        """Indices of the requests whose KV streams (in the stream's order)."""
        return [i for i in range(len(self.requests)) if not self.leaders or self.leaders[i] == i]

    @property
    def open(self) -> int:
        """How many of its sequences the receiver still runs."""
        return self.finished.count(False)


@dataclass(frozen=True)
class Cancel:
    """Request ``id``'s client went away (posted to the group it was sent to): the group ends it
    at its next step, ``"abort"``, and frees its KV."""

    id: int


def backoff(tries: int, most: float = POLL_S[1]) -> float:
    """Seconds to sleep before looking again, after ``tries`` looks found nothing (polling the
    store costs a round trip and the CPU the ranks compute on: back off, up to ``most``)."""
    return min(POLL_S[0] * 2 ** min(tries, 30), most)  # (2**tries overflows a float past 1023)


class Channel:
    """The control plane: pickled values under ``reshard/<name>/`` of ``store`` (default: the
    job's, the default process group's). Keys of one attempt of a job: a job that torchrun may
    restart gives each attempt a store of its own at its entry point (the ``reshard`` launcher's
    process group does, ``recipes/launch.py``; a supervised job's store is per attempt too)."""

    def __init__(self, name: str, store: dist.Store | None = None) -> None:
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"reshard/{name}/", store)
        # rung by every append through this object: a party of this process waiting on it (rank 0's
        # group, its router's) looks at once, not after its backoff; parties elsewhere poll the store
        self.bell = threading.Event()
        # each list's length as appended through this object (appends serialized: every index below
        # it is set), and the groups whose every post comes through it (:meth:`posts_only_here`)
        self.appended: dict[str, int] = {}
        self.only_here: set[str] = set()
        self.lock = threading.Lock()

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))

    def ready(self, key: str) -> bool:
        return self.store.check([key])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def post(self, group: int | str, value) -> int:
        """Append ``value`` to group ``group``'s input (``assign/<group>/<k>``, ``k`` counted
        atomically: several parties may post to one group); returns ``k``."""
        return self.append(f"assign/{group}", value, count=f"count/{group}")

    def append(self, name: str, value, count: str | None = None) -> int:
        """Add ``value`` to the list ``name`` (``<name>/<k>``; its length under ``count``,
        default ``<name>/count``); returns its index ``k``."""
        with self.lock:  # (the router's thread and rank 0's group append alike)
            k = self.store.add(count or f"{name}/count", 1) - 1
            self.put(f"{name}/{k}", value)
            self.appended[name] = k + 1
        self.bell.set()
        return k

    def posts_only_here(self, groups: Seq[str]) -> None:
        """Every post to ``groups`` comes through this object (the router's, in its process): a
        group led from this process counts its input here (:meth:`posted_here`), with no store look."""
        self.only_here.update(groups)

    def posted_here(self, group: str) -> int | None:
        """How many values were posted to ``group`` (each one set in the store), where every post
        to it comes through this object; None where some may come from elsewhere."""
        return self.appended.get(f"assign/{group}", 0) if group in self.only_here else None

    def idle(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if something is appended through this object meanwhile."""
        self.bell.wait(seconds)
        self.bell.clear()  # (whoever woke looks at the store next: a ring for another key costs a look)

    def read_list(self, name: str, start: int = 0) -> list:
        """The values of list ``name`` from index ``start`` that are in (see :meth:`append`: its
        count moves before its value lands). Never blocks: a blocking ``get`` would hold the
        store client, which the appender may share (the router's thread and rank 0's group)."""
        count, out = self.store.add(f"{name}/count", 0), []
        for k in range(start, count):
            if not self.store.check([f"{name}/{k}"]):
                break
            out.append(self.get(f"{name}/{k}"))
        return out

    def job_keys(self, endpoints: Seq[str]) -> list[str]:
        """Every key one call of the groups ``endpoints`` made (for :meth:`clear` once all are done)."""
        done = self.store.add("done/count", 0)
        keys = ["finished", "seed", "start", "all_done", "done/count", *(f"done/{k}" for k in range(done))]
        for e in endpoints:
            posted = self.store.add(f"count/{e}", 0)
            keys += [f"assign/{e}/{k}" for k in range(posted)] + [f"count/{e}", f"load/{e}"]
        return keys

    def clear(self, keys: Seq[str]) -> None:
        """Delete ``keys`` (once every reader is past them), so the next call starts clean."""
        for key in keys:
            self.store.delete_key(key)

    def wait(
        self, key: str, what: str, timeout: datetime.timedelta | None = None, poll: Callable[[], None] | None = None
    ) -> None:
        """Poll until ``key`` is set (at least every :data:`WAIT_POLL_S`; at once when it is
        appended through this object); ``RuntimeError`` naming ``what`` after ``timeout`` (default:
        the job's collective timeout), so a group whose peer is gone fails instead of hanging.
        ``poll()`` runs at every look (a heartbeat: waiting is not hanging)."""
        limit = (timeout or job_timeout() or datetime.timedelta(minutes=30)).total_seconds()
        deadline = time.monotonic() + limit
        tries = 0
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: nothing arrived within {limit:g} s (is the router's rank 0 gone?)")
            if poll is not None:
                poll()
            self.idle(backoff(tries, WAIT_POLL_S))
            tries += 1


@dataclass(frozen=True)
class Topology:
    """The engine groups the router knows and where their KV goes (mirrored, under supervision).

    ``entries`` take new requests: every group (data-parallel groups), or DejaVu's prompt
    groups, whose every prefilled request is handed, with its first token, to a *taker* (a
    token group), resumed from that entry's KV: a hand-off is a migration whose source lives
    on. An entry's KV streams to its taker (``entries[i]`` to ``takers[i % T]``: the hand-off's
    transport, always); with ``kv`` mirrors, each group of the ring (the takers, or every group
    when there are none) streams to the next. ``hosted``: one group of every rank (a lockstep
    strategy's) whose KV its ranks' supervisors keep (:mod:`reshard.parallel.fault.host`), as
    group :attr:`host` (never routed to): its requests wait for its next generation with their KV.
    """

    groups: int
    entries: tuple[int, ...]
    hosted: bool = False

    @classmethod
    def ring(cls, groups: int) -> Topology:
        return cls(groups, tuple(range(groups)))

    @classmethod
    def lockstep(cls, hosted: bool) -> Topology:
        return cls(1, (0,), hosted)

    @property
    def host(self) -> int:
        """The hosted mirrors' group index (past the engine groups')."""
        return self.groups

    @classmethod
    def disaggregated(cls, prompt: int, token: int) -> Topology:
        return cls(prompt + token, tuple(range(prompt)))

    @property
    def takers(self) -> tuple[int, ...]:
        return tuple(g for g in range(self.groups) if g not in self.entries)

    def successor(self, g: int, kv: bool) -> int | None:
        """The group ``g``'s KV streams to (None: nowhere)."""
        if self.hosted:  # the group streams to its host, which replays to the group's next generation
            return (self.host if g != self.host else 0) if kv else None
        if g in self.entries and self.takers:
            return self.takers[self.entries.index(g) % len(self.takers)]
        ring = self.takers or self.entries
        nxt = ring[(ring.index(g) + 1) % len(ring)]
        return nxt if kv and nxt != g else None

    def sources(self, g: int, kv: bool) -> tuple[int, ...]:
        """The groups whose KV ``g`` keeps."""
        return tuple(h for h in range(self.groups + self.hosted) if self.successor(h, kv) == g)
