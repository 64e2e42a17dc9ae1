"""A server's side of the job's router (``reshard serve``): :class:`ServerIntake`.

A server's router runs without end: requests come from the front end's :class:`Inbox` as
clients send them, each group's streamed tokens go back to the front end step by step, and
every store key a request used is deleted once it completes (the store would otherwise grow
with every request the server ever ran). The router itself places requests and watches the
groups (:mod:`reshard.parallel.engine.router`); this is what it asks of the server.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from reshard.parallel.engine.channel import Channel, Load
from reshard.parallel.engine.inbox import Inbox, Intake
from reshard.parallel.engine.request import Request


class ServerIntake:
    """The front end's requests in, its streamed tokens out, and the store's keys cleaned up.

    ``inbox``: the front end's requests and cancellations; ``on_tokens``: told of each entry of
    the groups' ``tokens`` list (one step's new tokens of one group) as the router reads it;
    ``start``: the job clock's zero (wall-clock seconds), which a new request's arrival counts
    from. ``loads``: each live endpoint's last published :class:`Load` (the server's metrics).
    """

    def __init__(
        self,
        channel: Channel,
        inbox: Inbox,
        start: float,
        on_tokens: Callable[[list], None] | None = None,
    ) -> None:
        self.channel, self.inbox, self.start = channel, inbox, start
        self.on_tokens = on_tokens
        self.loads: dict[str, Load] = {}
        self.posted: dict[int, list[str]] = {}  # request id -> its assignments' keys
        self.tokens_read = 0  # entries of ``tokens`` read

    def take(self, endpoints: Seq[str]) -> Intake:
        """What the inbox got since the last look, each new request arriving now (job clock),
        and the loads of the live ``endpoints`` read again."""
        intake = self.inbox.take()
        intake.requests = [self._arrived(r) for r in intake.requests]

        live = [e for e in endpoints if self.channel.ready(f"load/{e}")]
        self.loads = {e: self.channel.get(f"load/{e}") for e in live}
        return intake

    def _arrived(self, request: Request) -> Request:
        """``request`` with its arrival now (job clock): a client's request is due at once."""
        return dataclasses.replace(request, arrival=time.time() - self.start)

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if the front end puts something meanwhile."""
        self.inbox.wait(seconds)

    def relay(self) -> None:
        """Hand ``on_tokens`` every entry of the groups' ``tokens`` list appended since the last
        look, in order; each entry is deleted once read (none but this router reads it)."""
        if self.on_tokens is None:
            return

        for entry in self.channel.read_list("tokens", self.tokens_read):
            self.consumed("tokens", self.tokens_read)
            self.tokens_read += 1
            self.on_tokens(entry)

    def posted_as(self, rid: int, key: str) -> None:
        """Request ``rid``'s assignment was posted as store ``key`` (deleted by :meth:`release`)."""
        self.posted.setdefault(rid, []).append(key)

    def release(self, rid: int) -> None:
        """Request ``rid`` completed: its assignments' keys deleted from the store. Every one
        was taken, by its group's every rank before it could finish, or by none (dead)."""
        self.channel.clear(self.posted.pop(rid, []))

    def consumed(self, name: str, index: int) -> None:
        """Entry ``index`` of the store's list ``name`` was read: deleted (none reads it again)."""
        self.channel.clear([f"{name}/{index}"])
