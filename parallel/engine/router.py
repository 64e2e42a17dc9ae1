"""The job's router: one thread (rank 0's; under supervision, rank 0's supervisor's,
which outlives every engine) that places each request on an engine group, collects
every completion, hands a prefilled request on to a token group, and moves a failed
group's requests.

Requests are placed once they have arrived (``routing``: least loaded, round robin
or longest first). Groups talk to the router through the job's store
(:class:`Channel`): the router posts to ``assign/<endpoint>/<k>``, each group's
leader publishes its :class:`Load` and appends every completion to ``done``; once
every request has completed the router sets ``all_done`` and each group's leader
ends its own input. An endpoint is ``<group>.<generation>``.

The job's :class:`Topology` names the entry groups (which take new requests) and
where each group's KV goes:

- **Hand-offs** (DejaVu under supervision): an entry (prompt group) runs each
  request to its first token, then it is resumed (``kv_source``: that group) on the
  token group that mirrors its KV: a migration whose source lives on. (Unsupervised
  DejaVu groups hand over among themselves.)
- **Failures** are router events: when a group's generation moves on
  (``generation(g)``, the supervisors' count in the store; a job without supervision
  has none), the dead generation's requests are rebuilt from its journal
  (:mod:`reshard.parallel.fault.journal`): a request that finished there is
  completed from the journal; the others are re-admitted with prompt + tokens so far
  (:meth:`Request.resume`; a seeded generator skips the draws already made, so
  tokens equal a failure-free run's). With ``migrate="reprefill"`` they go to any
  live group at once; with ``"none"`` they wait for their own group's next
  generation; with ``"kv"`` they go to the group that mirrors the dead one's KV (or,
  for a lockstep group, to its next generation, with its supervisors' mirrors),
  resumed with ``kv_source`` naming it: the engine's KV connector supplies what
  landed. The router stops handing the dead group work and takes it back once its
  new generation is ready. A dead prompt group's prompts are prefilled again by
  another.

The router places requests and watches the groups. What it keeps of each request
(completions read from ``done``) is its :class:`~reshard.parallel.engine.ledger.Ledger`;
a server's inbox, token relay and store clean-up, its
:class:`~reshard.parallel.engine.intake.ServerIntake`; a failure's record, the steps
journaled and the hand-offs' choices are in :mod:`reshard.parallel.engine.migration`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future

from reshard.background import Worker
from reshard.parallel.engine.admission import endpoint_of
from reshard.parallel.engine.channel import Cancel, Channel, Load, Topology, backoff
from reshard.parallel.engine.inbox import Inbox
from reshard.parallel.engine.intake import ServerIntake
from reshard.parallel.engine.ledger import Ledger
from reshard.parallel.engine.migration import Handoffs, Migration, StepCount, group_of, prefill_only
from reshard.parallel.engine.prefix import PrefixRoutes
from reshard.parallel.engine.request import Completion, Request

ROUTING = ("least_loaded", "round_robin", "longest_first")
MIGRATE = ("kv", "reprefill", "none")


class Router:
    """The job's router (see the module docstring), run on a thread by ``with`` until every
    request completed: ``worker``'s (an engine's, which runs each routed ``generate`` call's
    router in turn: a call starts no thread), else a thread of its own.

    ``routing``: ``"least_loaded"`` (the group with the most free KV tokens, estimated from its
    last published :class:`Load` minus what was handed to it since; a request waits in the
    router until some group has a free slot for it), ``"round_robin"`` (request ``i`` to group
    ``i % groups`` on arrival) or ``"longest_first"`` (least loaded, the arrived request with
    the most prompt + new tokens first). Requests are hashed to no group in particular: tokens
    do not depend on where a request runs (each request's sampling generator is its own).

    ``generation(g)``: group ``g``'s current generation (None: a job without supervision, whose
    groups never fail); ``migrate``: what a failed generation's requests do; ``kept``,
    ``keep`` and ``die_after``: see :class:`Ledger`. A server's router also takes ``inbox``'s
    requests as they come (and ends once it is closed and they are done) and hands
    ``on_tokens`` each step's new tokens (:class:`ServerIntake`).
    """

    def __init__(
        self,
        channel: Channel,
        requests: Seq[Request],
        topology: Topology,
        start: float,
        routing: str = "least_loaded",
        migrate: str = "none",
        generation: Callable[[int], int] | None = None,
        *,
        kept: Seq[Completion] = (),
        keep: Callable[[Completion], None] | None = None,
        die_after: int | None = None,
        inbox: Inbox | None = None,
        on_tokens: Callable[[list], None] | None = None,
        worker: Worker | None = None,
    ) -> None:
        _check(routing, migrate, inbox, on_tokens)
        self.channel, self.topology, self.start = channel, topology, start
        self.routing, self.migrate, self.generation = routing, migrate, generation

        self.server = None if inbox is None else ServerIntake(channel, inbox, start, on_tokens)
        # what it keeps of each request (callers read its originals, completions, kept and routed)
        self.book = Ledger(requests, kept, keep=keep, die_after=die_after, server=self.server)
        self.closed = inbox is None  # no request will come but those given
        self.pending = self.book.unfinished()  # waiting to be placed, earliest arrival first

        # placement: the live entries' and takers' endpoints, what each was sent
        self.groups = [endpoint_of(g) for g in topology.entries]
        self.takers = [endpoint_of(g) for g in topology.takers]
        # the entries' input is the router's posts alone (the takers' also comes from entries that
        # hand off among themselves): a group led from this process reads its count here
        channel.posts_only_here(self.groups if not self.takers else ())
        self.sent_tokens: dict[str, list[int]] = {e: [] for e in self.groups + self.takers}
        self.where: dict[int, str] = {}  # request id -> the endpoint it was last sent to
        self.handoffs = Handoffs(channel, topology, kv=migrate == "kv")
        self.prefixes = PrefixRoutes()  # which prompt prefixes each entry was sent

        # failures: each group's generation, what waits for one, what the router saw
        self.generations = [0] * topology.groups
        self.held: dict[int, list[Request]] = {}  # group -> requests for its next generation
        self.migrations: list[Migration] = []
        # ("died" | "ready", endpoint) in the order the router saw them: tests check what happened
        # between two of them (the steps journaled meanwhile, see Migration), never how long it took
        self.observed: list[tuple[str, str]] = []
        self.journal = StepCount(channel)

        self.error: BaseException | None = None
        # set when rank 0 leaves the job's serving (also on an error)
        self.stopped = threading.Event()
        self.worker, self.owns_worker = worker, worker is None
        self.running: Future | None = None

    def __enter__(self) -> Router:
        if self.worker is None:
            self.worker = Worker("reshard-router")
        self.running = self.worker.submit(self._run)
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()  # a router still waiting for room (groups gone) stops looking
        self.running.result()
        if self.owns_worker:
            self.worker.close()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the router failed: {self.error}") from self.error

    @property
    def ended(self) -> bool:
        """Whether its loop has ended (every request completed, stopped, or failed)."""
        return self.running is not None and self.running.done()

    # ---- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Collect, watch the groups' generations, place what arrived; ``all_done`` at the end."""
        try:
            tries = 0
            while not self._over() and not self.stopped.is_set():
                self._intake()
                self._collect()
                if self.generation is not None:
                    self._watch()

                tries = 0 if self._dispatch() else tries + 1
                if tries:  # nothing handed out: look again soon, or when the next request arrives
                    wait = self.server.wait if self.server is not None else self.channel.idle
                    wait(self._pause(tries))

            if self._over():
                self.channel.put("all_done", time.time())
        except BaseException as e:  # reported by __exit__ on rank 0; groups then time out by name
            self.error = e

    def _over(self) -> bool:
        """Every request completed, and no other will come."""
        return self.book.over(self.closed)

    def _pause(self, tries: int) -> float:
        """How long to wait after ``tries`` looks that placed nothing (at most until the next
        request arrives)."""
        until = self._next_arrival() - time.time()
        return min(backoff(tries), until) if until > 0 else backoff(tries)

    # ---- a server's requests --------------------------------------------------------------
    def _intake(self) -> None:
        """A server's: what its inbox got since the last look (requests, cancellations)."""
        if self.server is None:
            return

        intake = self.server.take(self.groups + self.takers)
        for r in intake.requests:
            self.book.arrive(r)
            self.pending.append(r)
        for rid in intake.cancelled:
            self._cancel(rid)
        self.closed = intake.closed

    def _cancel(self, rid: int) -> None:
        """Request ``rid``'s client went away: one not placed yet completes here (``"abort"``);
        a placed one is cancelled at its group, which ends it at its next step and frees its KV
        (one whose group died meanwhile is ended where it would have moved, :meth:`_continued`)."""
        if not self.book.cancel(rid):
            return

        if rid in self.where:
            self.channel.post(self.where[rid], Cancel(rid))
            return

        for waiting in (self.pending, self.handoffs.waiting, *self.held.values()):
            waiting[:] = [r for r in waiting if r.id != rid]
        self.book.abort(rid)

    # ---- placement --------------------------------------------------------------------------
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

    def _choose(self, request: Request) -> str | None:
        """The live entry to send ``request`` to (None: none has room now, or every one is down)."""
        if not self.groups:
            return None
        if self.routing == "round_robin":
            sent = sum(len(tokens) for tokens in self.sent_tokens.values())
            return self.groups[sent % len(self.groups)]

        room = {g: self._room(g) for g in self.groups}
        if None in room.values():  # a group has not said how much room it has: wait for it to start
            return None

        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        fits = [g for g, (slots, tokens) in room.items() if slots >= 1 and tokens >= need]
        if not fits:
            return None
        keys = self.prefixes.keys(request.prompt_ids)  # the most of its prefix first, then the most room
        best = max(fits, key=lambda g: (self.prefixes.matched(g, keys), room[g][1]))
        self.prefixes.routed += self.prefixes.matched(best, keys) > 0
        return best

    def _room(self, g: str) -> tuple[int, int] | None:
        """(free slots, free KV tokens) of endpoint ``g``, less what it was handed since it last
        said (None: it has not said yet). An entry has none while the taker it streams to is
        down (its prompts' KV would have nowhere to go) or has a backlog of twice its slots
        (prompt groups run ahead of token groups no further than their mirrors hold)."""
        if not self.channel.ready(f"load/{g}"):
            return None

        load: Load = self.channel.get(f"load/{g}")
        since = self.sent_tokens[g][load.taken :]
        room = load.free_slots - len(since), load.free_tokens - sum(since)
        if not self.takers or g in self.takers:
            return room
        return (0, 0) if self.handoffs.blocked(g, self.takers, self.generations, self.where) else room

    def _send(self, g: str, request: Request) -> None:
        """Post ``request`` to endpoint ``g`` (an entry of a disaggregated job runs it to its
        first token only, then hands it off) and count it there."""
        if self.takers and group_of(g) in self.topology.entries:
            request = prefill_only(request)

        k = self.channel.post(g, request)
        self.prefixes.record(g, self.prefixes.keys(request.prompt_ids))
        self.book.sent(request.id, g, f"assign/{g}/{k}")
        self.sent_tokens[g].append(len(request.prompt_ids) + request.sampling.max_new_tokens)
        self.where[request.id] = g

    # ---- completions and hand-offs ------------------------------------------------------------
    def _collect(self) -> None:
        """Completions published since the last look (a prefilled request's: its hand-off); a
        server's streamed tokens first (a request's last tokens come before its completion)."""
        if self.server is not None:
            self.server.relay()

        for c in self.book.collect(self.channel):
            source = self.where.pop(c.id, None)
            if self.topology.takers and not self.book.finished(c.id, c.output_ids, c.finish_reason):
                self._hand_off(c.id, c.output_ids, source)
            else:
                self.book.complete(c)

    def _hand_off(self, rid: int, tokens: Seq[int], source: str) -> None:
        """Request ``rid``, prefilled by entry ``source`` with ``tokens`` so far, to a taker
        (:meth:`Handoffs.taker_for`); one whose client went away meanwhile ends here."""
        if rid in self.book.cancelled:
            self.book.abort(rid, tokens)
            return

        self.book.so_far[rid] = list(tokens)
        self.handoffs.add(self.book.originals[rid], tokens, source)
        self._hand_out()

    def _hand_out(self) -> None:
        """Send the waiting hand-offs on, while some taker is live."""
        while self.handoffs.waiting and self.takers:
            request = self.handoffs.waiting.pop(0)
            self._send(self.handoffs.taker_for(request, self.takers, self.generations, self._room), request)

    # ---- failures ---------------------------------------------------------------------------
    def _watch(self) -> None:
        """Groups whose generation moved on: migrate the old one's requests; groups whose new
        generation is ready: route to it again. While a group is down, the steps journaled are
        counted before its ready key is looked at (a count the look finds unset was made while
        it was down: :attr:`Migration.steps_down`)."""
        before = len(self.observed)  # observations made before this pass
        steps = self._steps() if any(m.rejoined is None for m in self.migrations) else None
        for g, known in enumerate(self.generations):
            current = self.generation(g)
            if current > known:
                self._collect()  # whatever the dead generation published before it died
                self._fail(g, known)
                self.generations[g] = current

            endpoint = endpoint_of(g, self.generations[g])
            if ("ready", endpoint) in self.observed:
                continue
            if self.channel.ready(f"ready/{endpoint}"):
                order = self._observe("ready", endpoint)
                if endpoint not in self.groups + self.takers:
                    self._rejoin(g, endpoint, order)
            elif steps is not None:
                self._still_down(g, steps, before)

    def _still_down(self, g: int, steps: dict[str, int], before: int) -> None:
        """Group ``g``'s next generation is not ready yet: ``steps``, counted while it was down,
        are its migrations' ``steps_down`` (those observed before this pass)."""
        for m in self.migrations:
            if group_of(m.endpoint) == g and m.rejoined is None and m.order < before:
                m.steps_down = steps

    def _observe(self, what: str, endpoint: str) -> int:
        """Record that the router saw ``endpoint`` die or become ready; returns its place."""
        self.observed.append((what, endpoint))
        return len(self.observed) - 1

    def _steps(self) -> dict[str, int]:
        """The steps every endpoint has journaled: each group's current generation counted now,
        an earlier one as last counted (a dead generation's: every step it ran)."""
        return self.journal.count(endpoint_of(g, k) for g, k in enumerate(self.generations))

    def _fail(self, g: int, generation: int) -> None:
        """Generation ``generation`` of group ``g`` died: its requests go on elsewhere."""
        dead = endpoint_of(g, generation)
        for live in (self.groups, self.takers):
            if dead in live:
                live.remove(dead)

        steps = self._steps()  # self.generations still names the dead one: its every step
        migration = Migration(dead, time.time() - self.start, self._observe("died", dead), steps, dict(steps))
        self.migrations.append(migration)
        self._move(g, self._rebuilt(migration), migration)

    def _rebuilt(self, migration: Migration) -> list[Request]:
        """The dead endpoint's requests, rebuilt from its journal: those to continue elsewhere
        (the others completed or handed off, :meth:`_continued`)."""
        # (imported here: the fault layer imports this module)
        from reshard.parallel.fault.journal import read_journal, tokens_by_request

        journal = tokens_by_request(read_journal(self.channel, migration.endpoint))
        there = [rid for rid, e in self.where.items() if e == migration.endpoint]
        for rid in there:
            del self.where[rid]

        moved = [self._continued(rid, journal.get(rid, ({}, None, None)), migration) for rid in there]
        return [r for r in moved if r is not None]

    def _move(self, g: int, moved: list[Request], migration: Migration) -> None:
        """Where dead group ``g``'s continued requests go, by ``migrate``: held for its next
        generation, adopted by the group that mirrors its KV, or placed again."""
        if self.migrate == "kv" and self.topology.hosted:
            # its supervisors keep its KV for its next generation
            host = endpoint_of(self.topology.host)
            kept = [dataclasses.replace(r, kv_source=host) if r.resumed else r for r in moved]
            self.held.setdefault(g, []).extend(kept)
        elif self.migrate == "none":
            self.held.setdefault(g, []).extend(moved)
        elif self.migrate == "kv" and (holder := self._holder(g)) is not None:
            self._adopt(moved, holder, migration)
        else:  # reprefill (or no live group holds its KV)
            migration.reprefilled_tokens += sum(r.resumed for r in moved)
            self.pending[:0] = moved  # arrived already: ahead of the rest

    def _holder(self, g: int) -> str | None:
        """The live endpoint that mirrors group ``g``'s KV for migration (an entry of a
        disaggregated job has none: what it prefilled was handed off)."""
        h = self.topology.successor(g, kv=True)
        if h is None or (g in self.topology.entries and self.takers):
            return None

        endpoint = endpoint_of(h, self.generations[h])
        return endpoint if endpoint in self.groups + self.takers else None

    def _continued(self, rid: int, journaled: tuple, migration: Migration) -> Request | None:
        """Request ``rid`` continued after its tokens in the dead generation's journal
        (``(tokens, finish reason, first token time)``); None when the journal finished it."""
        tokens, reason, first = journaled
        so_far = self.book.journaled(rid, tokens, None if first is None else first - self.start)
        if reason is not None and self.topology.takers and not self.book.finished(rid, so_far, reason):
            # an entry of a disaggregated job ran it to its first token: its hand-off
            self._hand_off(rid, so_far, migration.endpoint)
            return None

        # finished there, or cancelled (its client is gone: it goes on nowhere)
        if reason is not None or rid in self.book.cancelled:
            prompt = list(self.book.originals[rid].prompt_ids)
            self.book.complete(Completion(rid, prompt, so_far, reason or "abort"))
            migration.completed.append(rid)
            return None
        return migration.continued(self.book.originals[rid], so_far)

    def _adopt(self, moved: list[Request], holder: str, migration: Migration) -> None:
        """``migrate="kv"``: the dead endpoint's requests to ``holder``, which mirrors its KV (a
        request with no token yet is routed as any other)."""
        for request in moved:
            if request.resumed == 0:
                self.pending.insert(0, request)
                continue
            self._send(holder, dataclasses.replace(request, kv_source=migration.endpoint))
            migration.adopted_by = holder

    def _rejoin(self, g: int, endpoint: str, order: int) -> None:
        """Group ``g``'s new generation ``endpoint`` is ready (observation ``order``): route
        to it."""
        (self.groups if g in self.topology.entries else self.takers).append(endpoint)
        self.sent_tokens.setdefault(endpoint, [])
        for m in self.migrations:
            if group_of(m.endpoint) == g and m.rejoined is None:
                m.rejoined, m.rejoined_order = time.time() - self.start, order
                m.adopted_by = endpoint if self.topology.hosted and self.migrate == "kv" else m.adopted_by

        for request in self.held.pop(g, []):  # migrate="none": they waited for this generation
            self._send(endpoint, request)
        self._hand_out()


def _check(routing: str, migrate: str, inbox: Inbox | None, on_tokens: Callable | None) -> None:
    """Refuse a router's arguments that name no choice, or stream tokens with no server."""
    if routing not in ROUTING:
        raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
    if migrate not in MIGRATE:
        raise ValueError(f"fault.migrate must be one of {MIGRATE}, got {migrate!r}")
    if on_tokens is not None and inbox is None:
        raise ValueError("on_tokens streams a server's tokens: pass its inbox too")
