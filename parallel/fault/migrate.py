"""Request migration in a supervised job: a failed engine group's requests go on elsewhere.

Two halves, both on the engine's core hooks:

- in each engine child, :class:`reshard.parallel.fault.journal.GroupJournal` appends every step's
  agreed tokens (with their finish reasons and the wall-clock time) to the group's journal in the
  job's store (one append per step, by the group's leader), and fires the failure injection
  (``fault.kill_at``);
- in rank 0's supervisor, :class:`SupervisedRouter` (a :class:`Router` that outlives every
  engine) watches the groups' generations (:mod:`reshard.parallel.fault.supervisor`). When one
  moves on, the old incarnation's in-flight requests are rebuilt from its journal: a request that
  finished there (its completion not yet published) is completed from the journal; the others
  are re-admitted with prompt + tokens so far, re-prefilled (:meth:`Request.resume`; a seeded
  generator skips the draws already made, so tokens equal a failure-free run's). With
  ``migrate="reprefill"`` they go to any live group at once; with ``"none"`` they wait for their
  own group's next generation; with ``"kv"`` they go to the group that mirrors the dead one's
  KV, resumed with ``kv_source`` naming it (that group's KV connector, its mirror, supplies
  what landed). The router stops handing the dead group work and takes
  it back once its new generation is ready.

DejaVu under supervision (:meth:`Topology.disaggregated`): prompt groups get each request up to
its first token; its completion there is a *hand-off*, which the router sends on, resumed with
``kv_source`` naming the prompt group, to the token group that mirrors that prompt group's KV
(one mechanism: a hand-off is a migration whose source lives on). A dead prompt group's prompts are
prefilled again by another; a dead token group's requests migrate as above (``reprefill``: to
a prompt group, and handed off again).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.engine.router import Channel, Router, backoff
from reshard.parallel.fault.inject import die
from reshard.parallel.fault.journal import read_journal, tokens_by_request

MIGRATE = ("kv", "reprefill", "none")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The engine groups of a supervised job and where their KV is mirrored.

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


@dataclasses.dataclass
class Migration:
    """What the router did when ``endpoint`` failed (``seen``: when it noticed, job clock).

    Ordered facts, no clock (tests assert on them): ``order``, its place in
    :attr:`SupervisedRouter.observed`; ``steps``, the steps every endpoint had journaled when the
    router saw the death (the dead one's: every step it ran); ``steps_down``, the same in the
    router's last count taken before it found the group's next generation ready (a count made
    while the group was still down).
    """

    endpoint: str
    seen: float
    order: int = 0
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    steps_down: dict[str, int] = dataclasses.field(default_factory=dict)
    resumed: list[int] = dataclasses.field(default_factory=list)  # request ids re-admitted with tokens so far
    restarted: list[int] = dataclasses.field(default_factory=list)  # ... with none yet
    completed: list[int] = dataclasses.field(default_factory=list)  # finished there, completed from the journal
    reprefilled_tokens: int = 0  # generated tokens prefilled again (reprefill; kv: by the adopter, if it had to)
    rejoined: float | None = None  # when the group's next generation was ready (job clock)
    rejoined_order: int | None = None  # that observation's place in SupervisedRouter.observed
    adopted_by: str | None = None  # migrate="kv": the endpoint that adopted its requests with their KV
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # request id -> tokens it had generated


class SupervisedRouter(Router):
    """The router of a supervised job: hands requests to the live generation of each entry
    group of ``topology``, collects every completion, hands each prefilled request on to a taker
    (disaggregated topologies), migrates a failed generation's requests (``migrate``) and, when
    every request has completed, sets ``all_done`` in the channel.

    ``generation(g)``: group ``g``'s current generation (the supervisors' count in the store);
    ``kept``: completions an earlier attempt of the job finished (not run again); ``keep(c)``:
    told of each completion as it arrives (so a lost router loses none); ``die_after``: fault
    injection, SIGKILL this process (the router's) once that many requests have completed.
    """

    def __init__(
        self,
        channel: Channel,
        requests: Seq[Request],
        topology: Topology,
        start: float,
        routing: str,
        migrate: str,
        generation: Callable[[int], int],
        *,
        kept: Seq[Completion] = (),
        keep: Callable[[Completion], None] | None = None,
        die_after: int | None = None,
    ) -> None:
        if migrate not in MIGRATE:
            raise ValueError(f"fault.migrate must be one of {MIGRATE}, got {migrate!r}")
        super().__init__(channel, requests, [f"{g}.0" for g in topology.entries], start, routing)
        self.topology = topology
        self.takers = [f"{g}.0" for g in topology.takers]  # the live takers' endpoints
        for e in self.takers:
            self.sent[e], self.sent_tokens[e] = 0, []
        self.handoffs: list[Request] = []  # resumed from an entry's KV, waiting for a live taker
        self.capacity: dict[str, int] = {}  # taker endpoint -> its slots (see _slots)
        self.originals = {r.id: r for r in requests}
        self.migrate, self.generation = migrate, generation
        self.generations = [0] * topology.groups
        self.where: dict[int, str] = {}  # request id -> the endpoint it was last sent to
        self.so_far: dict[int, list[int]] = {}  # request id -> its output before that endpoint
        self.first_token: dict[int, float] = {}  # request id -> job-clock time of its first token (journaled)
        self.held: dict[int, list[Request]] = {}  # group -> requests waiting for its next generation
        self.completions: dict[int, Completion] = {c.id: c for c in kept}
        self.kept = len(self.completions)
        self.pending = [r for r in self.pending if r.id not in self.completions]
        self.keep, self.die_after = keep or (lambda c: None), die_after
        self.migrations: list[Migration] = []
        # ("died" | "ready", endpoint) in the order the router saw them: tests check what happened
        # between two of them (the steps journaled meanwhile, see Migration), never how long it took
        self.observed: list[tuple[str, str]] = []
        self._journaled: dict[str, tuple[int, int]] = {}  # endpoint -> (bytes of its journal counted, steps in them)
        self.routed: dict[int, list[str]] = {}  # request id -> every endpoint it was sent to
        self._read = 0  # ``done`` entries read

    def _run(self) -> None:
        try:
            tries = 0
            while len(self.completions) < len(self.originals) and not self.stopped.is_set():
                self._collect()
                self._watch()
                tries = 0 if self._dispatch() else tries + 1
                if tries:
                    time.sleep(self._pause(tries))
            self.channel.put("all_done", time.time())
        except BaseException as e:  # reported by __exit__; the groups then time out by name
            self.error = e

    def _pause(self, tries: int) -> float:
        until = self._next_arrival() - time.time()
        return min(backoff(tries), until) if until > 0 else backoff(tries)

    def _choose(self, request: Request) -> str | None:
        return super()._choose(request) if self.groups else None  # every group down: wait

    def _room(self, g: str) -> tuple[int, int] | None:
        """An entry's room; none while the taker it streams to is down (its prompts' KV would
        have nowhere to go) or has a backlog of twice its slots (prompt groups run ahead of
        token groups no further than their mirrors hold)."""
        room = super()._room(g)
        if room is None or not self.takers or g in self.takers:
            return room
        taker = self.topology.successor(int(g.split(".")[0]), kv=False)
        endpoint = f"{taker}.{self.generations[taker]}"
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

    def _send(self, g: str, request: Request | None) -> None:
        if request is not None and self.takers and int(g.split(".")[0]) in self.topology.entries:
            request = _prefill_only(request)  # an entry of a disaggregated job: its first token, then a hand-off
        super()._send(g, request)
        if request is not None:
            self.where[request.id] = g
            self.routed.setdefault(request.id, []).append(g)

    def _collect(self) -> None:
        """Completions published since the last look (a prefilled request's: its hand-off)."""
        for c in self.channel.read_list("done", self._read):
            self._read += 1
            source = self.where.pop(c.id, None)
            if c.timing is not None and c.id not in self.first_token:
                self.first_token[c.id] = c.timing.first_token
            if not self._finished(c.id, c.output_ids, c.finish_reason):
                self._hand_off(c.id, c.output_ids, source)
                continue
            if c.timing is not None:  # migrated or handed off: its first token came earlier
                c.timing = dataclasses.replace(c.timing, first_token=self.first_token[c.id])
            self._complete(c)

    def _complete(self, c: Completion) -> None:
        self.completions[c.id] = c
        self.keep(c)
        if self.die_after is not None and len(self.completions) >= self.die_after:
            die()  # fault injection: the router's process, with its supervisor's engine

    def _finished(self, rid: int, output: Seq[int], reason: str | None) -> bool:
        """Whether request ``rid`` ended with ``output`` (a prefilled request's ``length`` is its hand-off)."""
        return reason == "stop" or (reason is not None and len(output) >= self.originals[rid].sampling.max_new_tokens)

    def _hand_off(self, rid: int, tokens: Seq[int], source: str) -> None:
        """Request ``rid``, prefilled by entry ``source`` with ``tokens`` so far, to a taker: the
        one ``source`` streams its KV to if it is live, else the one with the most room (which
        prefills it again), else the first taker to come back."""
        o = self.originals[rid]
        self.so_far[rid] = list(tokens)
        self.handoffs.append(dataclasses.replace(o.resume(list(tokens)), kv_source=source))
        self._hand_out()

    def _hand_out(self) -> None:
        while self.handoffs and self.takers:
            request = self.handoffs.pop(0)
            mirror = self.topology.successor(int(request.kv_source.split(".")[0]), self.migrate == "kv")
            paired = f"{mirror}.{self.generations[mirror]}"
            rooms = {e: self._room(e) or (0, 0) for e in self.takers}
            self._send(paired if paired in self.takers else max(rooms, key=lambda e: rooms[e][1]), request)

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
            endpoint = f"{g}.{self.generations[g]}"
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
            self._count(f"{g}.{k}")
        return {e: n for e, (_, n) in self._journaled.items()}

    def _count(self, endpoint: str) -> None:
        """Count the steps appended to ``endpoint``'s journal since the last count."""
        key = f"journal/{endpoint}"
        if not self.channel.ready(key):
            return
        blob = self.channel.store.get(key)
        counted, steps = self._journaled.get(endpoint, (0, 0))
        stream = io.BytesIO(blob)
        stream.seek(counted)
        while stream.tell() < len(blob):
            pickle.load(stream)
            steps += 1
        self._journaled[endpoint] = (len(blob), steps)

    def _fail(self, g: int, generation: int) -> None:
        """Generation ``generation`` of group ``g`` died: its requests go on elsewhere."""
        dead = f"{g}.{generation}"
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
            host = f"{self.topology.host}.0"
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
        endpoint = f"{h}.{self.generations[h]}"
        return endpoint if endpoint in self.groups + self.takers else None

    def _continued(self, rid: int, journaled: tuple, migration: Migration) -> Request | None:
        """Request ``rid`` continued after its tokens in the dead generation's journal
        (``(tokens, finish reason, first token time)``); None when the journal finished it."""
        tokens, reason, first = journaled
        original, so_far = self.originals[rid], _merged(self.so_far.get(rid, []), tokens)
        if first is not None and rid not in self.first_token:
            self.first_token[rid] = first - self.start
        if reason is not None and not self._finished(rid, so_far, reason):  # prefilled there: its hand-off
            self._hand_off(rid, so_far, migration.endpoint)
            return None
        if reason is not None:
            self._complete(Completion(rid, list(original.prompt_ids), so_far, reason))
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


def _prefill_only(request: Request) -> Request:
    """``request`` as an entry of a disaggregated job runs it: up to its first token."""
    first = dataclasses.replace(request.sampling, max_new_tokens=1, min_tokens=min(request.sampling.min_tokens, 1))
    return dataclasses.replace(request, sampling=first)


def _merged(before: list[int], tokens: dict[int, int]) -> list[int]:
    """``before`` (a request's output known so far) with ``tokens`` (by output index) written in
    and everything after the last of them dropped."""
    if not tokens:
        return list(before)
    out = list(before[: max(tokens) + 1])
    out += [0] * (max(tokens) + 1 - len(out))
    for i, t in tokens.items():
        out[i] = t
    return out
