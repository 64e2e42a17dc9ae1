"""Request migration in a supervised job: a failed engine group's requests go on elsewhere.

Two halves, both on the engine's core hooks:

- in each engine child, :class:`GroupJournal` appends every step's agreed tokens (with their
  finish reasons and the wall-clock time) to the group's journal in the job's store (one append
  per step, by the group's leader), and fires the failure injection (``fault.kill_at``);
- in rank 0's supervisor, :class:`SupervisedRouter` (a :class:`Router` that outlives every
  engine) watches the groups' generations (:mod:`reshard.parallel.fault.supervisor`). When one
  moves on, the old incarnation's in-flight requests are rebuilt from its journal: a request that
  finished there (its completion not yet published) is completed from the journal; the others
  are re-admitted with prompt + tokens so far, re-prefilled (:meth:`Request.resume`; a seeded
  generator skips the draws already made, so tokens equal a failure-free run's). With
  ``migrate="reprefill"`` they go to any live group at once; with ``"none"`` they wait for their
  own group's next generation; with ``"kv"`` they go, as :class:`Migrated` requests, to the
  group that mirrors the dead one's KV. The router stops handing the dead group work and takes
  it back once its new generation is ready.

DejaVu under supervision (:meth:`Topology.disaggregated`): prompt groups get each request up to
its first token; its completion there is a *hand-off*, which the router sends on as a
:class:`Migrated` request to the token group that mirrors that prompt group's KV (one
mechanism: a hand-off is a migration whose source lives on). A dead prompt group's prompts are
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

from reshard.parallel.engine import Engine
from reshard.parallel.engine.policy import NO_TOKEN
from reshard.parallel.engine.request import Completion, Migrated, Request
from reshard.parallel.engine.router import Channel, Router, backoff
from reshard.parallel.fault.inject import die, inject_kill
from reshard.parallel.fault.supervisor import ChildSpec

MIGRATE = ("kv", "reprefill", "none")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The engine groups of a supervised job and where their KV is mirrored.

    ``entries`` take new requests: every group (data-parallel groups), or DejaVu's prompt
    groups, whose every prefilled request is handed, with its first token, to a *taker* (a
    token group) as a :class:`Migrated` request: a hand-off is a migration whose source lives
    on. An entry's KV streams to its taker (``entries[i]`` to ``takers[i % T]``: the hand-off's
    transport, always); with ``kv`` mirrors, each group of the ring (the takers, or every group
    when there are none) streams to the next.
    """

    groups: int
    entries: tuple[int, ...]

    @classmethod
    def ring(cls, groups: int) -> Topology:
        return cls(groups, tuple(range(groups)))

    @classmethod
    def disaggregated(cls, prompt: int, token: int) -> Topology:
        return cls(prompt + token, tuple(range(prompt)))

    @property
    def takers(self) -> tuple[int, ...]:
        return tuple(g for g in range(self.groups) if g not in self.entries)

    def successor(self, g: int, kv: bool) -> int | None:
        """The group ``g``'s KV streams to (None: nowhere)."""
        if g in self.entries and self.takers:
            return self.takers[self.entries.index(g) % len(self.takers)]
        ring = self.takers or self.entries
        nxt = ring[(ring.index(g) + 1) % len(ring)]
        return nxt if kv and nxt != g else None

    def sources(self, g: int, kv: bool) -> tuple[int, ...]:
        """The groups whose KV ``g`` keeps."""
        return tuple(h for h in range(self.groups) if self.successor(h, kv) == g)


@dataclasses.dataclass(frozen=True)
class JournalEntry:
    """One step of a group: when it was agreed and each emitted ``(request id, index in the
    request's output, token, finish reason or None)`` (an index, not an append: a group that
    adopted a sequence may generate again tokens its KV did not cover)."""

    time: float
    tokens: tuple[tuple[int, int, int, str | None], ...]  # (request id, output index, token, finish reason)


class GroupJournal:
    """The journal, heartbeat and failure injection of one engine child (``spec``), on
    ``engine``'s events.

    The group's ``leader`` journals every step and beats (``beat/<endpoint>``, the time, at most
    every ``beat_s`` seconds) before each step and while it waits for requests (:meth:`beat`);
    its supervisors read it (:func:`silent_for`). ``kill_step``: SIGKILL this rank before that
    step of this generation (None: never; ``hang``: stop it there for good instead).
    """

    def __init__(
        self,
        engine: Engine,
        channel: Channel,
        spec: ChildSpec,
        kill_step: int | None = None,
        *,
        leader: bool,
        hang: bool = False,
        beat_s: float = 0.5,
    ) -> None:
        self.channel, self.key, self.beat_key = channel, f"journal/{spec.endpoint}", f"beat/{spec.endpoint}"
        self.leader, self.beat_s, self.last_beat = leader, beat_s, 0.0
        if self.leader:
            engine.events.on("step_agreed", self._record)
            engine.events.on("step_ready", lambda index, step: self.beat())
            engine.events.on("step_agreed", lambda index, step, tokens: self.beat())
        if kill_step is not None:
            engine.events.on("step_ready", inject_kill((spec.rank, kill_step), hang=hang))

    def beat(self) -> None:
        """The group is alive (the leader's steps and waits call it; others' calls do nothing)."""
        now = time.time()
        if self.leader and now - self.last_beat >= self.beat_s:
            self.channel.put(self.beat_key, now)
            self.last_beat = now

    def _record(self, index: int, step, tokens: list[int]) -> None:
        emitted = tuple(
            (s.request.id, s.request.resumed + len(s.output) - 1, t, s.finish_reason)
            for s, t in zip(step.seqs, tokens)
            if t != NO_TOKEN
        )
        if emitted:
            self.channel.store.append(self.key, pickle.dumps(JournalEntry(time.time(), emitted)))


def silent_for(channel: Channel, endpoint: str) -> float | None:
    """Seconds since ``endpoint``'s last heartbeat (None: it has not beaten yet)."""
    key = f"beat/{endpoint}"
    return time.time() - channel.get(key) if channel.ready(key) else None


def read_journal(channel: Channel, endpoint: str) -> list[JournalEntry]:
    """Every step ``endpoint`` journaled (none if it never ran one)."""
    key = f"journal/{endpoint}"
    if not channel.ready(key):
        return []
    stream, out = io.BytesIO(channel.store.get(key)), []
    while stream.tell() < len(stream.getbuffer()):
        out.append(pickle.load(stream))
    return out


@dataclasses.dataclass
class Migration:
    """What the router did when ``endpoint`` failed (``seen``: when it noticed, job clock)."""

    endpoint: str
    seen: float
    resumed: list[int] = dataclasses.field(default_factory=list)  # request ids re-admitted with tokens so far
    restarted: list[int] = dataclasses.field(default_factory=list)  # ... with none yet
    completed: list[int] = dataclasses.field(default_factory=list)  # finished there, completed from the journal
    reprefilled_tokens: int = 0  # generated tokens prefilled again (reprefill; kv: by the adopter, if it had to)
    rejoined: float | None = None  # when the group's next generation was ready (job clock)
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
        self.handoffs: list[Migrated] = []  # waiting for a live taker
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
        self.handoffs.append(Migrated(o.id, o.prompt_ids, o.sampling, o.arrival, tokens=tuple(tokens), source=source))
        self._hand_out()

    def _hand_out(self) -> None:
        while self.handoffs and self.takers:
            request = self.handoffs.pop(0)
            mirror = self.topology.successor(int(request.source.split(".")[0]), self.migrate == "kv")
            paired = f"{mirror}.{self.generations[mirror]}"
            rooms = {e: self._room(e) or (0, 0) for e in self.takers}
            self._send(paired if paired in self.takers else max(rooms, key=lambda e: rooms[e][1]), request)

    def _watch(self) -> None:
        """Groups whose generation moved on: migrate the old one's requests; groups whose new
        generation is ready: route to it again."""
        for g, known in enumerate(self.generations):
            current = self.generation(g)
            if current > known:
                self._collect()  # whatever the dead generation published before it died
                self._fail(g, known)
                self.generations[g] = current
            endpoint = f"{g}.{self.generations[g]}"
            if endpoint not in self.groups + self.takers and self.channel.ready(f"ready/{endpoint}"):
                self._rejoin(g, endpoint)

    def _fail(self, g: int, generation: int) -> None:
        """Generation ``generation`` of group ``g`` died: its requests go on elsewhere."""
        dead = f"{g}.{generation}"
        for live in (self.groups, self.takers):
            if dead in live:
                live.remove(dead)
        migration = Migration(dead, time.time() - self.start)
        self.migrations.append(migration)
        journal = _tokens_by_request(read_journal(self.channel, dead))
        moved = []
        for rid in [r for r, e in self.where.items() if e == dead]:
            del self.where[rid]
            request = self._continued(rid, journal.get(rid, ({}, None, None)), migration)
            if request is not None:
                moved.append(request)
        holder = self._holder(g)
        if self.migrate == "none":
            self.held.setdefault(g, []).extend(moved)
        elif self.migrate == "kv" and holder is not None:
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
            o = self.originals[request.id]
            tokens = tuple(self.so_far[request.id])
            self._send(holder, Migrated(o.id, o.prompt_ids, o.sampling, o.arrival, tokens=tokens, source=dead))
            migration.adopted_by = holder

    def _rejoin(self, g: int, endpoint: str) -> None:
        (self.groups if g in self.topology.entries else self.takers).append(endpoint)
        self.sent.setdefault(endpoint, 0)
        self.sent_tokens.setdefault(endpoint, [])
        for m in self.migrations:
            if m.endpoint.split(".")[0] == str(g) and m.rejoined is None:
                m.rejoined = time.time() - self.start
        for request in self.held.pop(g, []):  # migrate="none": they waited for this generation
            self._send(endpoint, request)
        self._hand_out()


def _prefill_only(request: Request) -> Request:
    """``request`` as an entry of a disaggregated job runs it: up to its first token."""
    first = dataclasses.replace(request.sampling, max_new_tokens=1, min_tokens=min(request.sampling.min_tokens, 1))
    return dataclasses.replace(request, sampling=first)


def _tokens_by_request(journal: list[JournalEntry]) -> dict[int, tuple[dict[int, int], str | None, float | None]]:
    """Each request's tokens in ``journal`` by output index, its finish reason there (None:
    still running) and the time of its first journaled token."""
    out: dict[int, tuple[dict[int, int], str | None, float | None]] = {}
    for entry in journal:
        for rid, index, token, reason in entry.tokens:
            tokens, _, first = out.get(rid, ({}, None, entry.time))
            out[rid] = ({**tokens, index: token}, reason, first)
    return out


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
