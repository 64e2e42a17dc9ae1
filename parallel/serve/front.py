"""The server's side of the job: requests accepted from clients, their streams, back-pressure and
the drain (:class:`Front`).

The HTTP handlers (an asyncio loop's thread) call :meth:`Front.accept` and read each choice's
:class:`Stream`; the job's router (its own thread) calls :meth:`Front.tokens` with each step's new
tokens and :meth:`Front.complete` with each completion, which wake the handlers through the loop.
A completion is authoritative: a stream sends the tokens published before it, in output order,
and then whatever of the completion's output it has not sent (so a request that moved to another
group after a failure sends no token twice and none is missing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.parallel.engine.inbox import Inbox
from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.engine.sampling import fresh_seed
from reshard.parallel.serve.metrics import Metrics
from reshard.parallel.serve.protocol import BadRequest, Parsed


@dataclass(frozen=True)
class ServeLimits:
    """Back-pressure: at most ``max_waiting`` accepted requests without a first token (more is a
    429 with ``Retry-After: retry_after_s``); a drain waits ``grace_s`` for running requests."""

    max_waiting: int = 256
    retry_after_s: int = 1
    grace_s: float = 30.0


@dataclass
class Stream:
    """One choice of one client request: request ``rid`` and what has arrived of it."""

    rid: int
    index: int  # its choice index
    arrival: float  # wall clock: accepted
    streamed: bool  # its client reads tokens as they come (else: woken only by the completion)
    tokens: dict[int, tuple[int, object]] = field(default_factory=dict)  # output index -> (token, logprobs)
    completion: Completion | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ordered: list[tuple[int, object]] = field(default_factory=list)  # the published tokens up to the first gap

    def ready(self, c: Completion | None) -> list[tuple[int, object]]:
        """Its output in order as far as it is known: the completion's (``c``, its completion as
        the caller read it), else the published tokens up to the first gap (a list that grows
        with each call: only the new ones are looked up)."""
        if c is not None:
            lps = c.logprobs or [None] * len(c.output_ids)
            return list(zip(c.output_ids, lps))
        while len(self.ordered) in self.tokens:
            self.ordered.append(self.tokens[len(self.ordered)])
        return self.ordered


class Front:
    """Accepted requests and their streams (see the module docstring); ``loop``: the HTTP
    server's event loop (set once it runs), ``clock``: wall-clock time of the job's start."""

    def __init__(self, limits: ServeLimits, metrics: Metrics, check: Callable[[Request], None] | None = None) -> None:
        self.limits, self.metrics, self.check = limits, metrics, check
        self.inbox = Inbox()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[int, Stream] = {}  # request id -> its stream, until it completes
        self.start = time.time()  # the router's start (job clock 0), set by the job
        self.draining = False
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # ---- the HTTP side (the event loop's thread) --------------------------------------------------
    def accept(self, parsed: Parsed) -> list[Stream]:
        """The streams of ``parsed``'s choices, their requests handed to the router; 503 while
        draining, 429 (``Retry-After``) when too many accepted requests wait for a first token."""
        count = len(parsed.prompts) * parsed.n
        if count > self.limits.max_waiting:  # (never accepted: a 400, not a 429 to retry)
            raise BadRequest(
                f"{len(parsed.prompts)} prompt(s) x n={parsed.n} = {count} requests exceed serve.max_waiting="
                f"{self.limits.max_waiting}",
                "n" if parsed.n > 1 else "prompt",
            )
        waiting = self.metrics.waiting
        if waiting + count > self.limits.max_waiting:
            raise BadRequest(
                f"{waiting} requests are waiting for a first token (serve.max_waiting={self.limits.max_waiting}); "
                f"retry after {self.limits.retry_after_s} s",
                None,
                429,
            )
        seed = parsed.sampling.seed if parsed.sampling.seed is not None else fresh_seed()
        requests = [
            Request(
                next(self._ids), list(ids), parsed.sampling if parsed.sampling.greedy else _seeded(parsed, seed + k)
            )
            for ids in parsed.prompts
            for k in range(parsed.n)
        ]
        for r in requests if self.check is not None else ():
            try:
                self.check(r)
            except ValueError as e:
                raise BadRequest(str(e).replace(f"request {r.id}: ", "")) from None
        now, wake = time.time(), asyncio.Event()  # one event wakes the client's handler
        streams = [Stream(r.id, i, now, parsed.stream, wake=wake) for i, r in enumerate(requests)]
        with self._lock:  # a drain sets ``draining`` under it: no request gets in after the drain began
            if self.draining:
                raise BadRequest("the server is shutting down: it takes no new requests", None, 503)
            for r, stream in zip(requests, streams):
                self.streams[r.id] = stream
                self.metrics.accepted(len(r.prompt_ids))
                self.inbox.submit(r)
        return streams

    def cancel(self, streams: list[Stream]) -> None:
        """The client went away: its unfinished requests are cancelled (their KV freed)."""
        for s in streams:
            if s.completion is None:
                self.inbox.cancel(s.rid)

    # ---- the router's side (its thread) -------------------------------------------------------
    def tokens(self, entry: list) -> None:
        """One step's new tokens of one group (:func:`reshard.parallel.engine.inbox.publish_tokens`)."""
        with self._lock:
            woken = []
            for rid, index, token, lps in entry:
                stream = self.streams.get(rid)
                if stream is None or index in stream.tokens:  # done, or published before a migration
                    continue
                if not stream.tokens:
                    self.metrics.first_token()
                stream.tokens[index] = (token, lps)
                if stream.streamed:
                    woken.append(stream)
        self._wake(woken)

    def complete(self, c: Completion) -> None:
        with self._lock:
            stream = self.streams.pop(c.id, None)
        if stream is None:
            return
        stream.completion = c
        self.metrics.completed(c, had_token=bool(stream.tokens))
        self._wake([stream])

    def _wake(self, streams: list[Stream]) -> None:
        if self.loop is not None and streams:
            self.loop.call_soon_threadsafe(_set_all, streams)

    # ---- the drain ------------------------------------------------------------------------------
    def drain(self, stopped: Callable[[], bool] = lambda: False) -> int:
        """Stop accepting (503), wait up to ``grace_s`` for every accepted request, cancel the rest,
        end the router's input. Returns how many were cancelled."""
        with self._lock:
            self.draining = True
        deadline = time.monotonic() + self.limits.grace_s
        while self.streams and time.monotonic() < deadline and not stopped():
            time.sleep(0.05)
        with self._lock:
            left = list(self.streams.values())
        self.cancel(left)
        self.inbox.close()
        return len(left)


def _seeded(parsed: Parsed, seed: int):
    """A sampled choice's params: its own seed (choice ``k`` of a request seeded ``s``: ``s + k``)."""
    return dataclasses.replace(parsed.sampling, seed=seed % 2**63)


def _set_all(streams: list[Stream]) -> None:
    for s in streams:
        s.wake.set()
