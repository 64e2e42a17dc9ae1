"""Requests that arrive while a job runs (a server's clients), and the tokens that leave it
before their requests complete.

- :class:`Inbox`: what a front end (``reshard serve``'s HTTP server) hands the job's router:
  new requests, cancellations (a client went away) and the end of the input (a drain). Thread
  safe: the front end's thread puts, the router's thread takes.
- :func:`publish_tokens`: an engine group's leader sends each step's new tokens to the front end:
  through the channel's ``tokens`` list, which the router reads, or straight to it where the router
  lives in the leader's process (a stream sends a token the step it is agreed, not when its
  request completes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.parallel.engine.request import NO_TOKEN, Request

# one step's new tokens of one group: (request id, output index, token id, its TokenLogprobs or None)
StreamedToken = tuple[int, int, int, object]


@dataclass
class Intake:
    """What an :class:`Inbox` held when the router took it."""

    requests: list[Request] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    closed: bool = False  # no request will come after these


class Inbox:
    """New requests and cancellations for the router, in the order they were put; ``close()``
    ends the input (nothing may be submitted after it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intake = Intake()
        self._put = threading.Event()  # set by every put, cleared by take: the router sleeps on it

    def submit(self, request: Request) -> None:
        with self._lock:
            assert not self._intake.closed, f"request {request.id} submitted after the inbox closed"
            self._intake.requests.append(request)
        self._put.set()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._intake.cancelled.append(request_id)
        self._put.set()

    def close(self) -> None:
        with self._lock:
            self._intake.closed = True
        self._put.set()

    def take(self) -> Intake:
        """Everything put since the last take (``closed`` stays set once set)."""
        with self._lock:
            out, self._intake = self._intake, Intake(closed=self._intake.closed)
            self._put.clear()
        return out

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if something is put meanwhile (a new request is placed
        at once, not after the router's backoff)."""
        self._put.wait(seconds)


def publish_tokens(engine, send: Callable[[list], None]) -> None:
    """On this rank (an engine group's leader): after every step, ``send`` its new tokens as one
    entry, a list of :data:`StreamedToken` (``functools.partial(channel.append, "tokens")``: to the
    router through the store; the front end's own ``tokens`` where the router lives in this
    process, no store hop). The output index counts a resumed request's earlier output (a migrated
    or handed-off request's tokens keep their indices wherever it continues)."""

    def hook(index: int, step, tokens: list[int]) -> None:
        new = [
            (s.request.id, len(s.generated) - 1, t, s.logprobs[-1] if s.request.sampling.logprobs is not None else None)
            for s, t in zip(step.seqs, tokens)
            if t != NO_TOKEN
        ]
        if new:
            send(new)

    engine.events.on("step_agreed", hook)
