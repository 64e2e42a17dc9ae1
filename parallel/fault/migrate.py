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
  own group's next generation. The router stops handing the dead group work and takes it back
  once its new generation reports in.
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
from reshard.parallel.fault.inject import inject_kill
from reshard.parallel.fault.supervisor import ChildSpec

MIGRATE = ("kv", "reprefill", "none")


@dataclasses.dataclass(frozen=True)
class JournalEntry:
    """One step of a group: when it was agreed and each emitted ``(request id, index in the
    request's output, token, finish reason or None)`` (an index, not an append: a group that
    adopted a sequence may generate again tokens its KV did not cover)."""

    time: float
    tokens: tuple[tuple[int, int, int, str | None], ...]  # (request id, output index, token, finish reason)


class GroupJournal:
    """The journal and failure injection of one engine child (``spec``), on ``engine``'s events.

    ``kill_step``: SIGKILL this rank before that step of this generation (None: never).
    """

    def __init__(self, engine: Engine, channel: Channel, spec: ChildSpec, kill_step: int | None = None) -> None:
        self.channel, self.key = channel, f"journal/{spec.endpoint}"
        self.leader = engine.engine_group.is_leader
        if self.leader:
            engine.events.on("step_agreed", self._record)
        if kill_step is not None:
            engine.events.on("step_ready", inject_kill((spec.rank, kill_step)))

    def _record(self, index: int, step, tokens: list[int]) -> None:
        emitted = tuple(
            (s.request.id, s.request.resumed + len(s.output) - 1, t, s.finish_reason)
            for s, t in zip(step.seqs, tokens)
            if t != NO_TOKEN
        )
        if emitted:
            self.channel.store.append(self.key, pickle.dumps(JournalEntry(time.time(), emitted)))


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
    rejoined: float | None = None  # when the group's next generation reported in (job clock)
    adopted_by: str | None = None  # migrate="kv": the endpoint that adopted its requests with their KV
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # request id -> tokens it had generated


class SupervisedRouter(Router):
    """The router of a supervised job: hands requests to the live generation of each of
    ``groups`` engine groups, collects every completion, migrates a failed generation's requests
    (``migrate``) and, when every request has completed, sets ``all_done`` in the channel.

    ``generation(g)``: group ``g``'s current generation (the supervisors' count in the store).
    """

    def __init__(
        self,
        channel: Channel,
        requests: Seq[Request],
        groups: int,
        start: float,
        routing: str,
        migrate: str,
        generation: Callable[[int], int],
    ) -> None:
        if migrate not in MIGRATE:
            raise ValueError(f"fault.migrate must be one of {MIGRATE}, got {migrate!r}")
        super().__init__(channel, requests, [f"{g}.0" for g in range(groups)], start, routing)
        self.originals = {r.id: r for r in requests}
        self.migrate, self.generation = migrate, generation
        self.generations = [0] * groups
        self.where: dict[int, str] = {}  # request id -> the endpoint it was last sent to
        self.so_far: dict[int, list[int]] = {}  # request id -> its output before that endpoint
        self.first_token: dict[int, float] = {}  # request id -> job-clock time of its first token (journaled)
        self.held: dict[int, list[Request]] = {}  # group -> requests waiting for its next generation
        self.completions: dict[int, Completion] = {}
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

    def _send(self, g: str, request: Request | None) -> None:
        super()._send(g, request)
        if request is not None:
            self.where[request.id] = g
            self.routed.setdefault(request.id, []).append(g)

    def _collect(self) -> None:
        """Completions published since the last look."""
        for c in self.channel.read_list("done", self._read):
            self._read += 1
            self.where.pop(c.id, None)
            if c.id in self.first_token and c.timing is not None:  # migrated: its first token came earlier
                c.timing = dataclasses.replace(c.timing, first_token=self.first_token[c.id])
            self.completions[c.id] = c

    def _watch(self) -> None:
        """Groups whose generation moved on: migrate the old one's requests; groups whose new
        generation reported in: route to it again."""
        for g, known in enumerate(self.generations):
            current = self.generation(g)
            if current > known:
                self._collect()  # whatever the dead generation published before it died
                self._fail(g, known)
                self.generations[g] = current
            endpoint = f"{g}.{self.generations[g]}"
            if endpoint not in self.groups and self.channel.ready(f"load/{endpoint}"):
                self._rejoin(g, endpoint)

    def _fail(self, g: int, generation: int) -> None:
        """Generation ``generation`` of group ``g`` died: its requests go on elsewhere."""
        dead = f"{g}.{generation}"
        if dead in self.groups:
            self.groups.remove(dead)
        migration = Migration(dead, time.time() - self.start)
        self.migrations.append(migration)
        journal = _tokens_by_request(read_journal(self.channel, dead))
        moved = []
        for rid in [r for r, e in self.where.items() if e == dead]:
            del self.where[rid]
            request = self._continued(rid, journal.get(rid, ({}, None, None)), migration)
            if request is not None:
                moved.append(request)
        holder = (g + 1) % len(self.generations)
        holder_endpoint = f"{holder}.{self.generations[holder]}"
        if self.migrate == "none":
            self.held.setdefault(g, []).extend(moved)
        elif self.migrate == "kv" and holder != g and holder_endpoint in self.groups:
            self._adopt(moved, dead, holder_endpoint, migration)
        else:  # reprefill (or no live group holds its KV)
            migration.reprefilled_tokens += sum(r.resumed for r in moved)
            self.pending[:0] = moved  # arrived already: ahead of the rest

    def _continued(self, rid: int, journaled: tuple, migration: Migration) -> Request | None:
        """Request ``rid`` continued after its tokens in the dead generation's journal
        (``(tokens, finish reason, first token time)``); None when the journal finished it."""
        tokens, reason, first = journaled
        original, so_far = self.originals[rid], _merged(self.so_far.get(rid, []), tokens)
        if first is not None and rid not in self.first_token:
            self.first_token[rid] = first - self.start
        if reason is not None:
            self.completions[rid] = Completion(rid, list(original.prompt_ids), so_far, reason)
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
        self.groups.append(endpoint)
        self.sent.setdefault(endpoint, 0)
        self.sent_tokens.setdefault(endpoint, [])
        for m in self.migrations:
            if m.endpoint.split(".")[0] == str(g) and m.rejoined is None:
                m.rejoined = time.time() - self.start
        for request in self.held.pop(g, []):  # migrate="none": they waited for this generation
            self._send(endpoint, request)


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
