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
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch.distributed as dist

from reshard.mesh import job_timeout
from reshard.parallel.engine.request import Request

ROUTING = ("least_loaded", "round_robin", "longest_first")
POLL_S = 0.0005  # how often a waiting party looks at the store again
ADMIT = "_admitted"  # the key of the admission proposal in a step's agreed integers


@dataclass(frozen=True)
class GroupLayout:
    """Which group of the job this rank's engine is: ``index`` of ``count``, over ``ranks``."""

    index: int
    count: int
    ranks: tuple[int, ...]

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


class Channel:
    """The control plane: pickled values under ``reshard/<attempt>/<name>/`` of the job's store."""

    def __init__(self, name: str) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"reshard/{attempt}/{name}/", store)

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))

    def ready(self, key: str) -> bool:
        return self.store.check([key])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def clear(self, keys: Seq[str]) -> None:
        """Delete ``keys`` (once every reader is past them), so the next call starts clean."""
        for key in keys:
            self.store.delete_key(key)

    def wait(self, key: str, what: str, timeout: datetime.timedelta | None = None) -> None:
        """Poll until ``key`` is set; ``RuntimeError`` naming ``what`` after ``timeout`` (default:
        the job's collective timeout), so a group whose peer is gone fails instead of hanging."""
        limit = (timeout or job_timeout() or datetime.timedelta(minutes=30)).total_seconds()
        deadline = time.monotonic() + limit
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: nothing arrived within {limit:g} s (is the router's rank 0 gone?)")
            time.sleep(POLL_S)


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

    def report(self, load: Load | None, finished: int) -> None:
        """After a step: the group's free room (leader) and how many requests finished in it."""


class LocalAdmission(Admission):
    """One group owns ``requests``; ``start`` is the job's wall-clock start (``time.time()``) and
    a request is admitted ``request.arrival`` seconds after it. Offline (every arrival 0): all
    at once, before the first step."""

    def __init__(self, requests: Seq[Request], start: float, leader: bool, progress=None) -> None:
        self.requests = list(requests)
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

    def report(self, load: Load | None, finished: int) -> None:
        if self.progress is not None and finished:
            self.progress.update(finished)

    def _next(self, count: int) -> list[Request]:
        out = self.requests[self.taken : self.taken + count]
        self.taken += len(out)
        self.exhausted = self.taken == len(self.requests)
        return out


class RoutedAdmission(Admission):
    """Group ``layout.index``'s share of the job, handed out by the :class:`Router` as keys
    ``assign/<group>/<k>`` (``None``: no more); the leader publishes its :class:`Load`."""

    def __init__(
        self, channel: Channel, layout: GroupLayout, progress=None, timeout: datetime.timedelta | None = None
    ) -> None:
        self.channel = channel
        self.layout = layout
        self.progress = progress
        self.timeout = timeout

    def _key(self, k: int) -> str:
        return f"assign/{self.layout.index}/{k}"

    read = 0  # assignment keys read (the requests taken and the final ``None``)

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
        self.exhausted = self.exhausted or None in values
        requests = [v for v in values if v is not None]
        self.taken += len(requests)
        return requests

    def wait_next(self) -> list[Request]:
        if self.exhausted:
            return []
        self.channel.wait(self._key(self.read), f"engine group {self.layout.index} waiting for requests", self.timeout)
        return self.take(1)

    def report(self, load: Load | None, finished: int) -> None:
        if load is not None and self.layout.is_leader:
            self.channel.put(f"load/{self.layout.index}", dataclasses.replace(load, taken=self.taken))
        if finished and self.layout.is_leader:
            done = self.channel.add("finished", finished)
            if self.progress is not None:
                self.progress.n = done
                self.progress.refresh()


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
        self, channel: Channel, requests: Seq[Request], groups: int, start: float, routing: str = "least_loaded"
    ) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        self.channel = channel
        self.pending = sorted(requests, key=lambda r: r.arrival)  # stable: request order within a time
        self.groups = groups
        self.start = start
        self.routing = routing
        self.sent = [0] * groups
        self.sent_tokens: list[list[int]] = [[] for _ in range(groups)]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="reshard-router", daemon=True)

    def __enter__(self) -> Router:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the router failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while self.pending:
                if not self._dispatch():
                    time.sleep(POLL_S)
            for g in range(self.groups):
                self._send(g, None)
        except BaseException as e:  # reported by __exit__ on rank 0; groups then time out by name
            self.error = e

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
            return sum(self.sent) % self.groups
        room = [self._room(g) for g in range(self.groups)]
        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        fits = [g for g, (slots, tokens) in enumerate(room) if slots >= 1 and tokens >= need]
        return max(fits, key=lambda g: room[g][1]) if fits else None

    def _room(self, g: int) -> tuple[int, int]:
        """(free slots, free KV tokens) of group ``g``, less what it was handed since it last said."""
        if not self.channel.ready(f"load/{g}"):
            return 0, 0
        load: Load = self.channel.get(f"load/{g}")
        since = self.sent_tokens[g][load.taken :]
        return load.free_slots - len(since), load.free_tokens - sum(since)

    def keys(self) -> list[str]:
        """Every key of this call (for :meth:`Channel.clear` once all groups are done)."""
        assigned = [f"assign/{g}/{k}" for g in range(self.groups) for k in range(self.sent[g])]
        return [*assigned, *(f"load/{g}" for g in range(self.groups)), "finished", "start"]

    def _send(self, g: int, request: Request | None) -> None:
        self.channel.put(f"assign/{g}/{self.sent[g]}", request)
        self.sent[g] += 1
        if request is not None:
            self.sent_tokens[g].append(len(request.prompt_ids) + request.sampling.max_new_tokens)
