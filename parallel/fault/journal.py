"""Each engine group's journal in a supervised job: every step's agreed tokens (with their finish
reasons and the wall-clock time), appended to the job's store by the group's leader, and its
heartbeat; what the router reads back when a group dies (:mod:`reshard.parallel.engine.router`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time

from reshard.parallel.engine import Engine
from reshard.parallel.engine.channel import Channel
from reshard.parallel.engine.request import NO_TOKEN
from reshard.parallel.fault.inject import inject_kill
from reshard.parallel.fault.supervisor import ChildSpec


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


def tokens_by_request(journal: list[JournalEntry]) -> dict[int, tuple[dict[int, int], str | None, float | None]]:
    """Each request's tokens in ``journal`` by output index, its finish reason there (None:
    still running) and the time of its first journaled token."""
    out: dict[int, tuple[dict[int, int], str | None, float | None]] = {}
    for entry in journal:
        for rid, index, token, reason in entry.tokens:
            tokens, _, first = out.get(rid, ({}, None, entry.time))
            out[rid] = ({**tokens, index: token}, reason, first)
    return out
