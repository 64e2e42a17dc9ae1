"""Engine groups and the router between them: where each group's loop takes its requests from.

A job's ranks form groups; each group runs the one request loop (:class:`Engine`) over its own
process group and agrees on tokens only inside itself. What a group admits comes from an
:class:`Admission`, read by every rank of the group at the same step so the group stays in step
without a message of its own: its leader (first rank) proposes how many new requests it can see,
the proposal rides on the step's one token all-reduce (``Step.agree``), and every rank then takes
exactly that many. A group with nothing to run waits for exactly its next request.

- :class:`LocalAdmission`: one group owns the whole request list (lockstep strategies, a
  single replica). Offline, everything is admitted at the start (the loop as it always was);
  online, a request is admitted once its arrival time has passed on the leader's clock.
- :class:`RoutedAdmission`: one group of several; its requests come from the :class:`Router`.

The router is a thread on rank 0 that talks to groups through the job's ``torch.distributed``
store (a TCP key-value server every job already has): a group never joins a collective another
group must join, the store needs no process group of its own, and a key read by every rank of a
group is the same bytes for all of them (a P2P message would reach one rank and need a
re-broadcast inside the group). Keys live under a per-attempt, per-call prefix.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch.distributed as dist

from reshard.mesh import job_timeout
from reshard.parallel.engine.request import Request

ROUTING = ("least_loaded", "round_robin", "longest_first")
POLL_S = (0.0005, 0.02)  # a waiting party looks at the store again after this, doubling up to that
ADMIT = "_admitted"  # the key of the admission proposal in a step's agreed integers


@dataclass(frozen=True)
class GroupLayout:
    """Which group of the job this rank's engine is: ``index`` of ``count``, over ``ranks``.

    ``entries``: the groups the router hands new requests to (default: all); the others only
    take requests other groups hand over (DejaVu's token groups). ``stops``: how many parties
    end this group's input (the router, or every group that hands over to it). ``channel``
    names the job's keys in the store; ``job``: the process group over every group's ranks
    (``None``: the whole job), which gathers the completions at the end.
    """

    index: int
    count: int
    ranks: tuple[int, ...]
    entries: tuple[int, ...] | None = None
    stops: int = 1
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
    """What a group's leader publishes after each step: its free room and how many of its
    assignments it has taken into its queue."""

    free_slots: int
    free_tokens: int
    taken: int


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

    @property
    def open(self) -> int:
        """How many of its sequences the receiver still runs."""
        return self.finished.count(False)


def backoff(tries: int) -> float:
    """Seconds to sleep before looking again, after ``tries`` looks found nothing (polling the
    store costs a round trip and the CPU the ranks compute on: back off)."""
    return min(POLL_S[0] * 2 ** min(tries, 30), POLL_S[1])  # (2**tries overflows a float past 1023)


class Channel:
    """The control plane: pickled values under ``reshard/<attempt>/<name>/`` of ``store`` (default:
    the job's, the default process group's)."""

    def __init__(self, name: str, store: dist.Store | None = None) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"reshard/{attempt}/{name}/", store)

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))

    def ready(self, key: str) -> bool:
        return self.store.check([key])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def post(self, group: int | str, value) -> None:
        """Append ``value`` to group ``group``'s input (``assign/<group>/<k>``, ``k`` counted
        atomically: several parties may post to one group)."""
        self.append(f"assign/{group}", value, count=f"count/{group}")

    def append(self, name: str, value, count: str | None = None) -> int:
        """Add ``value`` to the list ``name`` (``<name>/<k>``; its length under ``count``,
        default ``<name>/count``); returns its index ``k``."""
        k = self.store.add(count or f"{name}/count", 1) - 1
        self.put(f"{name}/{k}", value)
        return k

    def read_list(self, name: str, start: int = 0) -> list:
        """The values of list ``name`` from index ``start`` (see :meth:`append`)."""
        count = self.store.add(f"{name}/count", 0)
        return [self.get(f"{name}/{k}") for k in range(start, count)]

    def job_keys(self, groups: int) -> list[str]:
        """Every key one call of ``groups`` groups made (for :meth:`clear` once all are done)."""
        keys = ["finished", "start"]
        for g in range(groups):
            posted = self.store.add(f"count/{g}", 0)
            keys += [f"assign/{g}/{k}" for k in range(posted)] + [f"count/{g}", f"load/{g}"]
        return keys

    def clear(self, keys: Seq[str]) -> None:
        """Delete ``keys`` (once every reader is past them), so the next call starts clean."""
        for key in keys:
            self.store.delete_key(key)

    def wait(
        self, key: str, what: str, timeout: datetime.timedelta | None = None, poll: Callable[[], None] | None = None
    ) -> None:
        """Poll until ``key`` is set; ``RuntimeError`` naming ``what`` after ``timeout`` (default:
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
            time.sleep(backoff(tries))
            tries += 1


class Admission:
    """Where a group's loop takes requests from; every rank of the group calls the same methods
    at the same steps and gets the same requests."""

    taken = 0  # requests handed to the loop so far
    exhausted = False  # no request will come any more

    def initial(self) -> list[Request]:
        """Requests admitted before the first step."""
        return []

    def proposal(self) -> int:
        """The leader's count of new requests it can hand over now (0 on other ranks)."""
        return 0

    def take(self, count: int) -> list[Request]:
        """The next ``count`` requests (the agreed proposal)."""
        assert count == 0, count
        return []

    def wait_next(self) -> list[Request]:
        """Nothing to run: block until exactly the next request (``[]`` if none will come)."""
        self.exhausted = True
        return []

    def report(self, load: Load | None, finished: list) -> None:
        """After a step: the group's free room (leader) and the completions of the requests that
        finished in it."""

    def hand_off(self, handoff: Handoff) -> None:
        """Pass sequences to another group (only groups of a routed job have others)."""
        raise ValueError(f"a single engine group cannot hand requests to group {handoff.target}")

    def finish(self) -> None:
        """The loop is done: tell whoever waits on this group's hand-offs."""


class LocalAdmission(Admission):
    """One group owns ``requests``; ``start`` is the job's wall-clock start (``time.time()``) and
    a request is admitted ``request.arrival`` seconds after it. Offline (every arrival 0): all
    at once, before the first step."""

    def __init__(self, requests: Seq[Request], start: float, leader: bool, progress=None) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival)  # stable: request order within a time
        self.start = start
        self.leader = leader
        self.online = any(r.arrival > 0 for r in self.requests)
        self.progress = progress

    def initial(self) -> list[Request]:
        return [] if self.online else self._next(len(self.requests))

    def proposal(self) -> int:
        if not self.leader:
            return 0
        now = time.time() - self.start
        rest = self.requests[self.taken :]
        return next((i for i, r in enumerate(rest) if r.arrival > now), len(rest))

    def take(self, count: int) -> list[Request]:
        return self._next(count)

    def wait_next(self) -> list[Request]:
        if self.taken == len(self.requests):
            self.exhausted = True
            return []
        time.sleep(max(0.0, self.start + self.requests[self.taken].arrival - time.time()))
        return self._next(1)

    def report(self, load: Load | None, finished: list) -> None:
        if self.progress is not None and finished:
            self.progress.update(len(finished))

    def _next(self, count: int) -> list[Request]:
        out = self.requests[self.taken : self.taken + count]
        self.taken += len(out)
        self.exhausted = self.taken == len(self.requests)
        return out


class RoutedAdmission(Admission):
    """Group ``layout.index``'s share of the job, handed out by the :class:`Router` as keys
    ``assign/<endpoint>/<k>`` (``None``: no more); the leader publishes its :class:`Load`.

    ``endpoint``: the router's name for this group (default its index; a supervised group's
    names its generation too, :class:`reshard.parallel.fault.supervisor.ChildSpec`);
    ``publish``: the leader also appends every completion to the channel's ``done`` list as the
    request finishes (a supervised job's router collects them there); ``beat()``: called while
    it waits for requests (a supervised group's heartbeat).
    """

    def __init__(
        self,
        channel: Channel,
        layout: GroupLayout,
        progress=None,
        timeout: datetime.timedelta | None = None,
        *,
        endpoint: str | None = None,
        publish: bool = False,
        beat: Callable[[], None] | None = None,
    ) -> None:
        self.channel, self.beat = channel, beat
        self.layout = layout
        self.progress = progress
        self.timeout = timeout
        self.endpoint = str(layout.index) if endpoint is None else endpoint
        self.publish = publish

    def _key(self, k: int) -> str:
        return f"assign/{self.endpoint}/{k}"

    read = 0  # assignment keys read (requests, hand-offs and the ``None`` that end the input)
    stops = 0  # ``None`` read so far

    def proposal(self) -> int:
        if not self.layout.is_leader or self.exhausted:
            return 0
        count = 0
        while self.channel.ready(self._key(self.read + count)):
            count += 1
        return count

    def take(self, count: int) -> list[Request]:
        values = [self.channel.get(self._key(self.read + i)) for i in range(count)]
        self.read += count
        self.stops += values.count(None)
        self.exhausted = self.stops == self.layout.stops
        items = [v for v in values if v is not None]
        self.taken += sum(v.open if isinstance(v, Handoff) else 1 for v in items)
        return items

    def wait_next(self) -> list[Request]:
        if self.exhausted:
            return []
        what = f"engine group {self.layout.index} waiting for requests"
        self.channel.wait(self._key(self.read), what, self.timeout, self.beat)
        return self.take(1)

    def report(self, load: Load | None, finished: list) -> None:
        if load is not None and self.layout.is_leader:
            self.channel.put(f"load/{self.endpoint}", dataclasses.replace(load, taken=self.taken))
        if self.publish and self.layout.is_leader:
            for completion in finished:
                self.channel.append("done", completion)
        if finished and self.layout.is_leader:
            done = self.channel.add("finished", len(finished))
            if self.progress is not None:
                self.progress.n = done
                self.progress.refresh()

    def hand_off(self, handoff: Handoff) -> None:
        if self.layout.is_leader:
            self.channel.post(handoff.target, handoff)

    def finish(self) -> None:
        """Groups this one hands over to learn that no more will come (once per target group)."""
        targets = [g for g in range(self.layout.count) if g not in self.layout.entry_groups]
        if self.layout.is_leader and self.layout.index in self.layout.entry_groups:
            for g in targets:
                self.channel.post(g, None)


class Router:
    """Rank 0's thread that hands each request, once it has arrived, to a group.

    ``routing``: ``"least_loaded"`` (the group with the most free KV tokens, estimated from its
    last published :class:`Load` minus what was handed to it since; a request waits in the router
    until some group has a free slot for it), ``"round_robin"`` (request ``i`` to group
    ``i % groups`` on arrival) or ``"longest_first"`` (least loaded, the arrived request with the
    most prompt + new tokens first). Requests are hashed to no group in particular: tokens do not
    depend on where a request runs (each request's sampling generator is its own).
    """

    def __init__(
        self,
        channel: Channel,
        requests: Seq[Request],
        groups: Seq[int],
        start: float,
        routing: str = "least_loaded",
    ) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        self.channel = channel
        self.pending = sorted(requests, key=lambda r: r.arrival)  # stable: request order within a time
        self.groups = list(groups)  # the entry groups
        self.start = start
        self.routing = routing
        self.sent = dict.fromkeys(self.groups, 0)
        self.sent_tokens: dict[int, list[int]] = {g: [] for g in self.groups}
        self.error: BaseException | None = None
        self.stopped = threading.Event()  # set when rank 0 leaves the job's serving (also on an error)
        self.thread = threading.Thread(target=self._run, name="reshard-router", daemon=True)

    def __enter__(self) -> Router:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()  # a router still waiting for room (groups gone) stops looking
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the router failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            tries = 0
            while self.pending and not self.stopped.is_set():
                tries = 0 if self._dispatch() else tries + 1
                if tries:  # nothing handed out: look again soon, or when the next request arrives
                    until = self._next_arrival() - time.time()
                    time.sleep(min(backoff(tries), until) if until > 0 else backoff(tries))
            for g in self.groups:
                self._send(g, None)
        except BaseException as e:  # reported by __exit__ on rank 0; groups then time out by name
            self.error = e

    def _next_arrival(self) -> float:
        """Wall-clock time of the earliest request not yet arrived (``inf``: all have)."""
        now = time.time() - self.start
        later = [r.arrival for r in self.pending if r.arrival > now]
        return self.start + min(later) if later else float("inf")

    def _dispatch(self) -> bool:
        """Hand out what has arrived and fits; whether anything was handed out."""
        now = time.time() - self.start
        arrived = [r for r in self.pending if r.arrival <= now]
        if self.routing == "longest_first":
            arrived.sort(key=lambda r: -(len(r.prompt_ids) + r.sampling.max_new_tokens))
        handed = False
        for r in arrived:
            g = self._choose(r)
            if g is None:
                break
            self.pending.remove(r)
            self._send(g, r)
            handed = True
        return handed

    def _choose(self, request: Request) -> int | None:
        if self.routing == "round_robin":
            return self.groups[sum(self.sent.values()) % len(self.groups)]
        room = {g: self._room(g) for g in self.groups}
        if None in room.values():  # a group has not said how much room it has: wait for it to start
            return None
        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        fits = [g for g, (slots, tokens) in room.items() if slots >= 1 and tokens >= need]
        return max(fits, key=lambda g: room[g][1]) if fits else None

    def _room(self, g: int) -> tuple[int, int] | None:
        """(free slots, free KV tokens) of group ``g``, less what it was handed since it last said
        (None: it has not said yet)."""
        if not self.channel.ready(f"load/{g}"):
            return None
        load: Load = self.channel.get(f"load/{g}")
        since = self.sent_tokens[g][load.taken :]
        return load.free_slots - len(since), load.free_tokens - sum(since)

    def _send(self, g: int, request: Request | None) -> None:
        self.channel.post(g, request)
        self.sent[g] += 1
        if request is not None:
            self.sent_tokens[g].append(len(request.prompt_ids) + request.sampling.max_new_tokens)
