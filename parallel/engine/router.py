"""The job's router: one thread (rank 0's; under supervision, rank 0's supervisor's, which
outlives every engine) that places each request on an engine group, collects every completion,
hands a prefilled request on to a token group, and moves a failed group's requests.

Requests are placed once they have arrived (``routing``: least loaded, round robin or longest
first). Groups talk to the router through the job's store (:class:`Channel`): the router posts
to ``assign/<endpoint>/<k>``, each group's leader publishes its :class:`Load` and appends every
completion to ``done``; once every request has completed the router sets ``all_done`` and each
group's leader ends its own input. An endpoint is ``<group>.<generation>``.

The job's :class:`Topology` names the entry groups (which take new requests) and where each
group's KV goes:

- **Hand-offs** (DejaVu under supervision): an entry (prompt group) runs each request to its first
  token, then it is resumed (``kv_source``: that group) on the token group that mirrors its KV: a
  migration whose source lives on. (Unsupervised DejaVu groups hand over among themselves.)
- **Failures** are router events: when a group's generation moves on (``generation(g)``, the
  supervisors' count in the store; a job without supervision has none), the dead generation's
  requests are rebuilt from its journal (:mod:`reshard.parallel.fault.journal`): a request that
  finished there is completed from the journal; the others are re-admitted with prompt + tokens
  so far (:meth:`Request.resume`; a seeded generator skips the draws already made, so tokens
  equal a failure-free run's). With ``migrate="reprefill"`` they go to any live group at once;
  with ``"none"`` they wait for their own group's next generation; with ``"kv"`` they go to the
  group that mirrors the dead one's KV (or, for a lockstep group, to its next generation, with
  its supervisors' mirrors), resumed with ``kv_source`` naming it: the engine's KV connector
  supplies what landed. The router stops handing the dead group work and takes it back once
  its new generation is ready. A dead prompt group's prompts are prefilled again by another.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from reshard.parallel.engine.admission import endpoint_of
from reshard.parallel.engine.channel import Cancel, Channel, Load, Topology, backoff
from reshard.parallel.engine.inbox import Inbox
from reshard.parallel.engine.migration import Migration, count_steps, merged, prefill_only
from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.fault.inject import die

ROUTING = ("least_loaded", "round_robin", "longest_first")
MIGRATE = ("kv", "reprefill", "none")


class Router:
    """The job's router (see the module docstring), a thread started and joined by ``with``.

    ``routing``: ``"least_loaded"`` (the group with the most free KV tokens, estimated from its
    last published :class:`Load` minus what was handed to it since; a request waits in the router
    until some group has a free slot for it), ``"round_robin"`` (request ``i`` to group
    ``i % groups`` on arrival) or ``"longest_first"`` (least loaded, the arrived request with the
    most prompt + new tokens first). Requests are hashed to no group in particular: tokens do not
    depend on where a request runs (each request's sampling generator is its own).

    ``generation(g)``: group ``g``'s current generation (None: a job without supervision, whose
    groups never fail); ``migrate``: what a failed generation's requests do; ``kept``:
    completions an earlier attempt of the job finished (not run again); ``keep(c)``: told of each
    completion as it arrives (so a lost router loses none); ``die_after``: fault injection,
    SIGKILL this process (the router's) once that many requests have completed. A server's
    router also takes ``inbox``'s requests as they come (and ends once it is closed and they are
    done) and hands ``on_tokens`` each step's new tokens (:mod:`reshard.parallel.engine.inbox`).
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
    ) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        if migrate not in MIGRATE:
            raise ValueError(f"fault.migrate must be one of {MIGRATE}, got {migrate!r}")
        self.channel, self.topology, self.start, self.routing = channel, topology, start, routing
        self.migrate, self.generation = migrate, generation
        self.originals = {r.id: r for r in requests}
        self.completions: dict[int, Completion] = {c.id: c for c in kept}
        self.kept = len(self.completions)
        self.pending = sorted((r for r in requests if r.id not in self.completions), key=lambda r: r.arrival)
        self.groups = [endpoint_of(g) for g in topology.entries]  # the live entries' endpoints
        self.takers = [endpoint_of(g) for g in topology.takers]  # the live takers' endpoints
        self.sent = dict.fromkeys(self.groups + self.takers, 0)
        self.sent_tokens: dict[str, list[int]] = {e: [] for e in self.groups + self.takers}
        self.handoffs: list[Request] = []  # resumed from an entry's KV, waiting for a live taker
        self.capacity: dict[str, int] = {}  # taker endpoint -> its slots (see _slots)
        self.generations = [0] * topology.groups
        self.where: dict[int, str] = {}  # request id -> the endpoint it was last sent to
        self.so_far: dict[int, list[int]] = {}  # request id -> its output before that endpoint
        self.first_token: dict[int, float] = {}  # request id -> job-clock time of its first token (journaled)
        self.held: dict[int, list[Request]] = {}  # group -> requests waiting for its next generation
        self.keep, self.die_after = keep or (lambda c: None), die_after
        self.migrations: list[Migration] = []
        # ("died" | "ready", endpoint) in the order the router saw them: tests check what happened
        # between two of them (the steps journaled meanwhile, see Migration), never how long it took
        self.observed: list[tuple[str, str]] = []
        self._journaled: dict[str, tuple[int, int]] = {}  # endpoint -> (bytes of its journal counted, steps in them)
        self.routed: dict[int, list[str]] = {}  # request id -> every endpoint it was sent to
        self._read = 0  # ``done`` entries read
        self.error: BaseException | None = None
        self.stopped = threading.Event()  # set when rank 0 leaves the job's serving (also on an error)
        self.inbox, self.on_tokens, self.closed = inbox, on_tokens, inbox is None  # closed: none will come
        self.cancelled: set[int] = set()
        self.loads: dict[str, Load] = {}  # a server's: each live endpoint's last published Load
        self.posted: dict[int, list[str]] = {}  # a server's: request id -> its assignments' keys
        self._tokens_read = 0
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
                    (self.inbox.wait if self.inbox is not None else time.sleep)(self._pause(tries))
            if self._over():
                self.channel.put("all_done", time.time())
        except BaseException as e:  # reported by __exit__ on rank 0; groups then time out by name
            self.error = e

    def _over(self) -> bool:
        """Every request completed, and no other will come."""
        return self.closed and len(self.completions) == len(self.originals)

    # ---- a server's requests ----------------------------------------------------------------------
    def _intake(self) -> None:
        """What the server's inbox got since the last look: requests (arrived now), cancellations."""
        if self.inbox is None:
            return
        intake = self.inbox.take()
        for r in intake.requests:
            assert r.id not in self.originals, f"request id {r.id} submitted twice"
            self.originals[r.id] = dataclasses.replace(r, arrival=time.time() - self.start)
            self.pending.append(self.originals[r.id])
        for rid in intake.cancelled:
            self._cancel(rid)
        self.closed = intake.closed
        live = [e for e in self.groups + self.takers if self.channel.ready(f"load/{e}")]
        self.loads = {e: self.channel.get(f"load/{e}") for e in live}  # what the server's metrics show

    def _cancel(self, rid: int) -> None:
        """Request ``rid``'s client went away: one not placed yet completes here (``"abort"``);
        a placed one is cancelled at its group, which ends it at its next step and frees its KV
        (one whose group died meanwhile is ended where it would have moved, :meth:`_continued`)."""
        if rid in self.completions or rid not in self.originals:
            return
        self.cancelled.add(rid)
        if rid in self.where:
            self.channel.post(self.where[rid], Cancel(rid))
            return
        for waiting in (self.pending, self.handoffs, *self.held.values()):
            waiting[:] = [r for r in waiting if r.id != rid]
        self._complete(Completion(rid, list(self.originals[rid].prompt_ids), self.so_far.get(rid, []), "abort"))

    def _forget(self, rid: int) -> None:
        """A server's completed request: dropped here, its assignments deleted from the store
        (every one was taken: by its group's every rank before it could finish, or by none, dead)."""
        for kept in (self.completions, self.originals, self.first_token, self.so_far, self.routed):
            kept.pop(rid, None)
        self.cancelled.discard(rid)
        self.channel.clear(self.posted.pop(rid, []))

    def _pause(self, tries: int) -> float:
        until = self._next_arrival() - time.time()
        return min(backoff(tries), until) if until > 0 else backoff(tries)

    # ---- placement --------------------------------------------------------------------------------
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
            return self.groups[sum(self.sent.values()) % len(self.groups)]
        room = {g: self._room(g) for g in self.groups}
        if None in room.values():  # a group has not said how much room it has: wait for it to start
            return None
        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        fits = [g for g, (slots, tokens) in room.items() if slots >= 1 and tokens >= need]
        return max(fits, key=lambda g: room[g][1]) if fits else None

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
        taker = self.topology.successor(int(g.split(".")[0]), kv=False)
        endpoint = endpoint_of(taker, self.generations[taker])
        slots = self._slots(endpoint)
        if endpoint not in self.takers or (slots is not None and self._backlog(taker) >= 2 * slots):
            return (0, 0)
        return room

    def _slots(self, taker: str) -> int | None:
        """A taker's slots: the most it ever reported free (None: it has not reported)."""
        if self.channel.ready(f"load/{taker}"):
            self.capacity[taker] = max(self.capacity.get(taker, 0), self.channel.get(f"load/{taker}").free_slots)
        return self.capacity.get(taker)

    def _backlog(self, taker: int) -> int:
        """Requests at group ``taker``, or at the entries that stream to it, not yet finished."""
        upstream = {g for g in self.topology.entries if self.topology.successor(g, kv=False) == taker} | {taker}
        return sum(int(e.split(".")[0]) in upstream for e in self.where.values())

    def _send(self, g: str, request: Request) -> None:
        if self.takers and int(g.split(".")[0]) in self.topology.entries:
            request = prefill_only(request)  # an entry of a disaggregated job: its first token, then a hand-off
        k = self.channel.post(g, request)
        if self.inbox is not None:
            self.posted.setdefault(request.id, []).append(f"assign/{g}/{k}")
        self.sent[g] += 1
        self.sent_tokens[g].append(len(request.prompt_ids) + request.sampling.max_new_tokens)
        self.where[request.id] = g
        self.routed.setdefault(request.id, []).append(g)

    # ---- completions and hand-offs ----------------------------------------------------------------
    def _collect(self) -> None:
        """Completions published since the last look (a prefilled request's: its hand-off)."""
        if self.on_tokens is not None:  # before the completions: a request's last tokens come first
            for entry in self.channel.read_list("tokens", self._tokens_read):
                self.channel.clear([f"tokens/{self._tokens_read}"])  # (read by none but this router)
                self._tokens_read += 1
                self.on_tokens(entry)
        for c in self.channel.read_list("done", self._read):
            if self.inbox is not None:
                self.channel.clear([f"done/{self._read}"])
            self._read += 1
            if c.id not in self.originals:  # completed, and forgotten, already (a server's router)
                continue
            source = self.where.pop(c.id, None)
            if c.timing is not None and c.id not in self.first_token:
                self.first_token[c.id] = c.timing.first_token
            if self.topology.takers and not self._finished(c.id, c.output_ids, c.finish_reason):
                self._hand_off(c.id, c.output_ids, source)
                continue
            if c.timing is not None:  # migrated or handed off: its first token came earlier
                c.timing = dataclasses.replace(c.timing, first_token=self.first_token[c.id])
            self._complete(c)

    def _complete(self, c: Completion) -> None:
        self.completions[c.id] = c
        self.keep(c)
        if self.inbox is not None:  # a server's router runs without end: it forgets what it handed on
            self._forget(c.id)
        if self.die_after is not None and len(self.completions) >= self.die_after:
            die()  # fault injection: the router's process, with its supervisor's engine

    def _finished(self, rid: int, output: Seq[int], reason: str | None) -> bool:
        """Whether request ``rid`` ended with ``output`` (a prefilled request's ``length`` is its hand-off)."""
        done = reason is not None and len(output) >= self.originals[rid].sampling.max_new_tokens
        return reason in ("stop", "abort") or done

    def _hand_off(self, rid: int, tokens: Seq[int], source: str) -> None:
        """Request ``rid``, prefilled by entry ``source`` with ``tokens`` so far, to a taker: the
        one ``source`` streams its KV to if it is live, else the one with the most room (which
        prefills it again), else the first taker to come back."""
        o = self.originals[rid]
        if rid in self.cancelled:  # its client went away while its prompt was prefilled: it ends here
            self._complete(Completion(rid, list(o.prompt_ids), list(tokens), "abort"))
            return
        self.so_far[rid] = list(tokens)
        self.handoffs.append(dataclasses.replace(o.resume(list(tokens)), kv_source=source))
        self._hand_out()

    def _hand_out(self) -> None:
        while self.handoffs and self.takers:
            request = self.handoffs.pop(0)
            mirror = self.topology.successor(int(request.kv_source.split(".")[0]), self.migrate == "kv")
            paired = endpoint_of(mirror, self.generations[mirror])
            rooms = {e: self._room(e) or (0, 0) for e in self.takers}
            self._send(paired if paired in self.takers else max(rooms, key=lambda e: rooms[e][1]), request)

    # ---- failures -----------------------------------------------------------------------------------
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
                for m in self.migrations:
                    if m.endpoint.split(".")[0] == str(g) and m.rejoined is None and m.order < before:
                        m.steps_down = steps

    def _observe(self, what: str, endpoint: str) -> int:
        """Record that the router saw ``endpoint`` die or become ready; returns its place."""
        self.observed.append((what, endpoint))
        return len(self.observed) - 1

    def _steps(self) -> dict[str, int]:
        """The steps every endpoint has journaled: each group's current generation counted now,
        an earlier one as last counted (a dead generation's: every step it ran)."""
        for g, k in enumerate(self.generations):
            count_steps(self.channel, endpoint_of(g, k), self._journaled)
        return {e: n for e, (_, n) in self._journaled.items()}

    def _fail(self, g: int, generation: int) -> None:
        """Generation ``generation`` of group ``g`` died: its requests go on elsewhere."""
        from reshard.parallel.fault.journal import read_journal, tokens_by_request  # (the fault layer imports this one)

        dead = endpoint_of(g, generation)
        for live in (self.groups, self.takers):
            if dead in live:
                live.remove(dead)
        steps = self._steps()  # self.generations still names the dead one: its every step
        migration = Migration(dead, time.time() - self.start, self._observe("died", dead), steps, dict(steps))
        self.migrations.append(migration)
        journal = tokens_by_request(read_journal(self.channel, dead))
        moved = []
        for rid in [r for r, e in self.where.items() if e == dead]:
            del self.where[rid]
            request = self._continued(rid, journal.get(rid, ({}, None, None)), migration)
            if request is not None:
                moved.append(request)
        if self.migrate == "kv" and self.topology.hosted:  # its supervisors keep its KV for its next generation
            host = endpoint_of(self.topology.host)
            kept = [dataclasses.replace(r, kv_source=host) if r.resumed else r for r in moved]
            self.held.setdefault(g, []).extend(kept)
        elif self.migrate == "none":
            self.held.setdefault(g, []).extend(moved)
        elif self.migrate == "kv" and (holder := self._holder(g)) is not None:
            self._adopt(moved, dead, holder, migration)
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
        original, so_far = self.originals[rid], merged(self.so_far.get(rid, []), tokens)
        if first is not None and rid not in self.first_token:
            self.first_token[rid] = first - self.start
        prefilled = reason is not None and self.topology.takers and not self._finished(rid, so_far, reason)
        if prefilled:  # an entry of a disaggregated job ran it to its first token: its hand-off
            self._hand_off(rid, so_far, migration.endpoint)
            return None
        if reason is not None or rid in self.cancelled:  # (cancelled: its client is gone, it goes on nowhere)
            self._complete(Completion(rid, list(original.prompt_ids), so_far, reason or "abort"))
            migration.completed.append(rid)
            return None
        if not so_far:
            migration.restarted.append(rid)
            return original
        self.so_far[rid] = so_far
        migration.resumed.append(rid)
        migration.tokens[rid] = len(so_far)
        return original.resume(so_far)

    def _adopt(self, moved: list[Request], dead: str, holder: str, migration: Migration) -> None:
        """``migrate="kv"``: the dead endpoint's requests to ``holder``, which mirrors its KV (a
        request with no token yet is routed as any other)."""
        for request in moved:
            if request.resumed == 0:
                self.pending.insert(0, request)
                continue
            self._send(holder, dataclasses.replace(request, kv_source=dead))
            migration.adopted_by = holder

    def _rejoin(self, g: int, endpoint: str, order: int) -> None:
        """Group ``g``'s new generation ``endpoint`` is ready (observation ``order``): route to it."""
        (self.groups if g in self.topology.entries else self.takers).append(endpoint)
        self.sent.setdefault(endpoint, 0)
        self.sent_tokens.setdefault(endpoint, [])
        for m in self.migrations:
            if m.endpoint.split(".")[0] == str(g) and m.rejoined is None:
                m.rejoined, m.rejoined_order = time.time() - self.start, order
                m.adopted_by = endpoint if self.topology.hosted and self.migrate == "kv" else m.adopted_by
        for request in self.held.pop(g, []):  # migrate="none": they waited for this generation
            self._send(endpoint, request)
        self._hand_out()
