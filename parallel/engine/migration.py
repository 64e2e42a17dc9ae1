"""What the router records of a failed group (:class:`Migration`), the request arithmetic of
its moves (a prefill-only request of a disaggregated job's entry, a journal's tokens merged in),
its count of the steps each group journaled (:class:`StepCount`), and a disaggregated job's
hand-offs (:class:`Handoffs`): a request moving from the prompt group that ran it to its first
token to a token group, a migration whose source lives on."""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from reshard.parallel.engine.admission import Endpoint, endpoint_of
from reshard.parallel.engine.channel import Channel, Topology
from reshard.parallel.engine.request import Request


@dataclasses.dataclass
class Migration:
    """What the router did when ``endpoint`` failed (``seen``: when it noticed, job clock).

    Ordered facts, no clock (tests assert on them): ``order``, its place in
    :attr:`Router.observed`; ``steps``, the steps every endpoint had journaled when the
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
    rejoined_order: int | None = None  # that observation's place in Router.observed
    adopted_by: str | None = None  # migrate="kv": the endpoint that adopted its requests with their KV
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # request id -> tokens it had generated

    def continued(self, original: Request, so_far: list[int]) -> Request:
        """``original`` going on elsewhere after ``so_far``, its output when the endpoint died:
        restarted (no token yet) or resumed after them."""
        if not so_far:
            self.restarted.append(original.id)
            return original

        self.resumed.append(original.id)
        self.tokens[original.id] = len(so_far)
        return original.resume(so_far)


def group_of(endpoint: str) -> int:
    """The engine group of ``endpoint`` (``<group>.<generation>``)."""
    return Endpoint(endpoint).group


def prefill_only(request: Request) -> Request:
    """``request`` as an entry of a disaggregated job runs it: up to its first token."""
    first = dataclasses.replace(request.sampling, max_new_tokens=1, min_tokens=min(request.sampling.min_tokens, 1))
    return dataclasses.replace(request, sampling=first)


def merged(before: list[int], tokens: dict[int, int]) -> list[int]:
    """``before`` (a request's output known so far) with ``tokens`` (by output index) written in
    and everything after the last of them dropped."""
    if not tokens:
        return list(before)
    out = list(before[: max(tokens) + 1])
    out += [0] * (max(tokens) + 1 - len(out))
    for i, t in tokens.items():
        out[i] = t
    return out


class StepCount:
    """The steps each endpoint has journaled, counted as its journal grows: each count reads
    only what was appended since the last (the router counts while groups are down)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.counted: dict[str, tuple[int, int]] = {}  # endpoint -> (bytes of its journal counted, steps in them)

    def count(self, endpoints: Iterable[str]) -> dict[str, int]:
        """The steps every endpoint ever counted has journaled, ``endpoints`` counted again now
        (one left out keeps its last count: a dead generation's, every step it ran)."""
        for endpoint in endpoints:
            self._count(endpoint)
        return {e: steps for e, (_, steps) in self.counted.items()}

    def _count(self, endpoint: str) -> None:
        """Count the steps appended to ``endpoint``'s journal since its last count."""
        key = f"journal/{endpoint}"
        if not self.channel.ready(key):
            return

        blob = self.channel.store.get(key)
        done, steps = self.counted.get(endpoint, (0, 0))
        stream = io.BytesIO(blob)
        stream.seek(done)
        while stream.tell() < len(blob):
            pickle.load(stream)
            steps += 1
        self.counted[endpoint] = (len(blob), steps)


class Handoffs:
    """A disaggregated job's hand-offs (DejaVu under supervision): each request an entry (a
    prompt group) ran to its first token goes on at a taker (a token group), resumed with
    ``kv_source`` naming the entry. ``kv`` (``migrate="kv"``): a request goes to the taker that
    mirrors its entry's KV, else to the one its entry streams to; that one down, to the taker
    with the most room (which prefills it again).
    """

    def __init__(self, channel: Channel, topology: Topology, kv: bool) -> None:
        self.channel, self.topology, self.kv = channel, topology, kv
        self.waiting: list[Request] = []  # resumed from an entry's KV, waiting for a live taker
        self.capacity: dict[str, int] = {}  # taker endpoint -> its slots (see _slots)

    def add(self, original: Request, tokens: Seq[int], source: str) -> None:
        """``original``, run by entry ``source`` to ``tokens``, waits for a taker."""
        resumed = original.resume(list(tokens))
        self.waiting.append(dataclasses.replace(resumed, kv_source=source))

    def taker_for(
        self,
        request: Request,
        takers: Seq[str],
        generations: Seq[int],
        room: Callable[[str], tuple[int, int] | None],
    ) -> str:
        """The live taker (one of ``takers``) for a waiting ``request``; ``room(e)``: endpoint
        ``e``'s free (slots, KV tokens), None if it has not said."""
        mirror = self.topology.successor(group_of(request.kv_source), self.kv)
        paired = endpoint_of(mirror, generations[mirror])
        if paired in takers:
            return paired

        rooms = {e: room(e) or (0, 0) for e in takers}
        return max(rooms, key=lambda e: rooms[e][1])

    def blocked(self, entry: str, takers: Seq[str], generations: Seq[int], where: dict[int, str]) -> bool:
        """Whether ``entry`` may take no new request: the taker it streams to is down (its
        prompts' KV would have nowhere to go) or has a backlog of twice its slots (prompt
        groups run ahead of token groups no further than their mirrors hold). ``where``:
        request id -> the endpoint it runs at."""
        taker = self.topology.successor(group_of(entry), kv=False)
        endpoint = endpoint_of(taker, generations[taker])
        slots = self._slots(endpoint)
        if endpoint not in takers:
            return True
        return slots is not None and self._backlog(taker, where) >= 2 * slots

    def _slots(self, taker: str) -> int | None:
        """A taker's slots: the most it ever reported free (None: it has not reported)."""
        if self.channel.ready(f"load/{taker}"):
            free = self.channel.get(f"load/{taker}").free_slots
            self.capacity[taker] = max(self.capacity.get(taker, 0), free)
        return self.capacity.get(taker)

    def _backlog(self, taker: int, where: dict[int, str]) -> int:
        """Requests at group ``taker``, or at the entries that stream to it, not yet finished."""
        entries = self.topology.entries
        upstream = {g for g in entries if self.topology.successor(g, kv=False) == taker} | {taker}
        return sum(group_of(e) in upstream for e in where.values())
