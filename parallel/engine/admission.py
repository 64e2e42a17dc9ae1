"""Where an engine group's loop takes its requests from (:class:`Admission`).

What a group admits is read by every rank of the group at the same step, so the group stays in
step without a message of its own: its leader (first rank) proposes how many new requests it can
see, the proposal rides on the step's one token all-reduce (``Step.agree``), and every rank then
takes exactly that many. The leader counts them once the step has computed, just before that
all-reduce, so a request that arrives while a step computes runs in the next one. A group with
nothing to run waits for exactly its next request.

- :class:`LocalAdmission`: one group owns the whole request list (lockstep strategies, a
  single replica). Offline, everything is admitted at the start (the loop as it always was);
  online, a request is admitted once its arrival time has passed on the leader's clock.
- :class:`RoutedAdmission`: one group of several; its requests come from the job's
  :class:`reshard.parallel.engine.router.Router` (and hand-offs from other groups).
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from reshard.parallel.engine.channel import Cancel, Channel, GroupLayout, Handoff, Load
from reshard.parallel.engine.request import Completion, Request, Sequence

ADMIT = "_admitted"  # the key of the admission proposal in a step's agreed integers


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


class LocalAdmission(Admission):
    """One group owns ``requests`` and those :meth:`add` ed later (the same on every rank);
    ``start`` is the job's wall-clock start (``time.time()``) and a request is admitted
    ``request.arrival`` seconds after it. Offline (every arrival 0): all at once, before the
    first step; one added later (or arriving) while a step computes, at the step after it."""

    def __init__(self, requests: Seq[Request], start: float, leader: bool, progress=None) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival)  # stable: request order within a time
        self.start = start
        self.leader = leader
        self.online = any(r.arrival > 0 for r in self.requests)
        self.progress = progress
        self.exhausted = not self.requests
        self.unfinished = {r.id for r in self.requests}  # the ids of the requests added and not ended

    def add(self, request: Request) -> None:
        """Queue ``request`` after every request not taken yet that arrives no later than it."""
        arrivals = [r.arrival for r in self.requests[self.taken :]]
        self.requests.insert(self.taken + bisect.bisect_right(arrivals, request.arrival), request)
        self.unfinished.add(request.id)
        self.online = self.online or request.arrival > 0
        self.exhausted = False

    def remove(self, request_id: int) -> Request | None:
        """Drop a request not taken yet (an abort); None if there is none."""
        index = next((i for i, r in enumerate(self.requests[self.taken :]) if r.id == request_id), None)
        if index is None:
            return None
        request = self.requests.pop(self.taken + index)
        self.unfinished.discard(request_id)
        self.exhausted = self.taken == len(self.requests)
        return request

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
        self.unfinished.difference_update(c.id for c in finished)
        if self.progress is not None and finished:
            self.progress.update(len(finished))

    def _next(self, count: int) -> list[Request]:
        out = self.requests[self.taken : self.taken + count]
        self.taken += len(out)
        self.exhausted = self.taken == len(self.requests)
        return out


class RoutedAdmission(Admission):
    """Group ``layout.index``'s share of the job, handed out by the router (and hand-offs from
    other groups) as keys ``assign/<endpoint>/<k>``; the leader publishes its :class:`Load` and
    appends every completion to the channel's ``done`` list as the request finishes (the router
    collects them there). The input ends with a ``None``, which the leader posts itself once the
    router has every completion (``all_done``): everything ever posted to the group was posted
    before that, so nothing is left unread.

    ``endpoint``: the router's name for this group, ``<index>.<generation>`` (default generation
    0; a supervised group's names its own, :class:`reshard.parallel.fault.supervisor.ChildSpec`);
    ``beat()``: called while it waits for requests (a supervised group's heartbeat).

    A cancellation of a request this group handed to another (DejaVu's prompt group) is passed on
    to that group, whose requests the router does not see move.
    """

    HANDED = 65536  # the most hand-offs remembered (a cancel for an older one is dropped)

    def __init__(
        self,
        channel: Channel,
        layout: GroupLayout,
        progress=None,
        timeout: datetime.timedelta | None = None,
        *,
        endpoint: str | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        self.channel, self.beat = channel, beat
        self.layout = layout
        self.progress = progress
        self.timeout = timeout
        self.endpoint = endpoint_of(layout.index) if endpoint is None else endpoint
        self.ended = False  # the leader posted the None that ends the input
        self.handed: OrderedDict[int, int] = OrderedDict()  # request id -> the group it was handed to, oldest first

    def _key(self, k: int) -> str:
        return f"assign/{self.endpoint}/{k}"

    read = 0  # assignment keys read (requests, hand-offs and the ``None`` that ends the input)
    published: Load | None = None  # the leader's last published load (a store round trip each)

    def proposal(self) -> int:
        if not self.layout.is_leader or self.exhausted:
            return 0
        posted = self.channel.posted_here(self.endpoint)
        if posted is not None:  # the router posts through this process's channel: no store look a step
            assert posted >= self.read, f"group {self.endpoint} read {self.read} posts of {posted} (a post bypassed it)"
            return posted - self.read
        count = 0
        while self.channel.ready(self._key(self.read + count)):
            count += 1
        return count

    def _end_if_done(self) -> None:
        """The leader ends the group's input once the router has every completion (looked at
        while the group waits for requests: a group with work is not done)."""
        if self.layout.is_leader and not self.ended and self.channel.ready("all_done"):
            self.channel.post(self.endpoint, None)
            self.ended = True

    def take(self, count: int) -> list[Request]:
        values = [self.channel.get(self._key(self.read + i)) for i in range(count)]
        self.read += count
        self.exhausted = None in values
        items = [v for v in values if v is not None and not self._passed_on(v)]
        self.taken += sum(isinstance(v, Request) for v in items)  # (a hand-off's are added with their KV source)
        return items

    def _passed_on(self, item) -> bool:
        """Whether ``item`` cancels a request handed on from here: the leader posts it there."""
        target = self.handed.get(item.id) if isinstance(item, Cancel) else None
        if target is not None and self.layout.is_leader:
            self.channel.post(endpoint_of(target), item)
        return target is not None

    def wait_next(self) -> list[Request]:
        if self.exhausted:
            return []
        what = f"engine group {self.layout.index} waiting for requests"
        self.channel.wait(self._key(self.read), what, self.timeout, self._poll)
        return self.take(1)

    def _poll(self) -> None:
        if self.beat is not None:
            self.beat()
        self._end_if_done()

    def report(self, load: Load | None, finished: list) -> None:
        if not self.layout.is_leader:
            return
        load = None if load is None else dataclasses.replace(load, taken=self.taken)
        if load is not None and load != self.published:  # (the same as the last: the router has it)
            self.channel.put(f"load/{self.endpoint}", load)
            self.published = load
        for completion in finished:
            self.channel.append("done", completion)
        if finished:
            done = self.channel.add("finished", len(finished))
            if self.progress is not None:
                self.progress.n = done
                self.progress.refresh()

    def hand_off(self, handoff: Handoff) -> None:
        if self.layout.is_leader:
            self.channel.post(endpoint_of(handoff.target), handoff)
        self.handed.update((r.id, handoff.target) for r in handoff.requests)
        while len(self.handed) > self.HANDED:
            self.handed.popitem(last=False)


class Done(dict):
    """A group's finished requests, by id (what its loop returns); ``keep=False`` (a server's,
    which runs without end) counts them and keeps none."""

    def __init__(self, keep: bool = True) -> None:
        super().__init__()
        self.keep, self.count = keep, 0

    def __setitem__(self, rid: int, completion: Completion) -> None:
        if self.keep:
            super().__setitem__(rid, completion)
        self.count += 1

    def __len__(self) -> int:
        return super().__len__() if self.keep else self.count


def enqueue(queue: deque, requests: Seq[Request]) -> None:
    """Queue ``requests`` as they arrive, except that a request resumed with KV held elsewhere
    (``kv_source``: a migration, a hand-off) goes ahead of the fresh requests already queued,
    behind those resumed or preempted before it: its KV waits in a connector, and it has tokens
    out already (vLLM runs resumed requests first)."""
    for request in requests:
        if request.kv_source:
            ahead = next((i for i, r in enumerate(queue) if not resumes(r)), len(queue))
            queue.insert(ahead, request)
        else:
            queue.append(request)


def resumes(request: Request) -> bool:
    """Whether a queued request goes on with work begun before: its KV elsewhere (``kv_source``)
    or preempted. :func:`enqueue` keeps such requests ahead of the fresh ones."""
    return bool(request.kv_source) or request.preempted


def take_resuming(queue: deque) -> deque:
    """The queue's head requests that :func:`resumes` (taken out; ``queue`` keeps the fresh ones
    after them): a policy whose two sides hand off to each other runs them on the side that takes
    hand-offs (Seesaw's decode side, DejaVu's token side), the rest on the other. Every request
    enters the queue through :func:`enqueue`, a policy's own requeues at the head of its side's
    part, or ``longest_first``'s order, which all keep such requests ahead of the fresh ones."""
    taken: deque = deque()
    while queue and resumes(queue[0]):
        taken.append(queue.popleft())
    return taken


def withdraw(queue: Seq, request_ids: Iterable[int], running: dict[int, Sequence]) -> list[Completion]:
    """End requests ``request_ids``; the completions of those that end now. One still in
    ``queue`` leaves it, completed as ``"abort"`` (a resumed one with the output it had); one
    ``running`` (request id -> its sequence) is marked: the engine ends it between steps where its
    policy can (:meth:`~reshard.parallel.engine.policy.Policy.ends_now`), else at its next token
    (retired as any other: its KV freed). An unknown id is ignored. Every rank of a group ends the
    same ids between the same steps (an in-flight pipeline's later stages, which never see the
    first stage's admissions, at the step its notes say)."""
    ended: list[Completion] = []
    for rid in request_ids:
        queued = next((r for r in queue if isinstance(r, Request) and r.id == rid), None)
        if queued is not None:
            queue.remove(queued)
            running.pop(rid, None)  # (a sequence made for it while its KV was awaited)
            ended.append(queued.aborted())
        elif rid in running:
            running[rid].cancelled = True
    return ended


class Endpoint(str):
    """The router's name for one generation of an engine group, ``"<group>.<generation>"``: a
    ``str`` (stores, journals and ``summary.json`` carry it as text) whose parts are read here,
    not split apart at each use. ``Endpoint(text)`` checks the form (``ValueError`` naming it)."""

    __slots__ = ()

    def __new__(cls, text: str) -> Endpoint:
        group, dot, generation = text.partition(".")
        if not (group.isdigit() and dot and generation.isdigit()):
            raise ValueError(f"an endpoint is '<group>.<generation>' (two integers), got {text!r}")
        return super().__new__(cls, text)

    @property
    def group(self) -> int:
        """The engine group's index in the job."""
        return int(self.partition(".")[0])

    @property
    def generation(self) -> int:
        """The group's life: 0 for its first, one more per respawn."""
        return int(self.partition(".")[2])


def endpoint_of(group: int, generation: int = 0) -> Endpoint:
    """The router's name for generation ``generation`` of engine group ``group``."""
    return Endpoint(f"{group}.{generation}")
