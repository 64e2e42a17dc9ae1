"""The router's book of requests (:class:`Ledger`): every request it was given, where each was
sent, its output so far and its first token's time, and how it ended.

Completions come back through the job's ``done`` list, which every group's leader appends to;
the ledger reads it, keeps each completion (and tells ``keep``, so that a lost router loses
none) and, for a server's router, which runs without end, forgets each request once it is done.
Where a request goes next (a hand-off, a migration) is the router's to decide
(:mod:`reshard.parallel.engine.router`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from reshard.parallel.engine.channel import Channel
from reshard.parallel.engine.intake import ServerIntake
from reshard.parallel.engine.migration import merged
from reshard.parallel.engine.request import Completion, Request
from reshard.parallel.fault.inject import die


class Ledger:
    """Every request the router knows of and what became of it.

    ``kept``: completions an earlier attempt of the job finished (not run again); ``keep(c)``:
    told of each completion as it is made; ``die_after``: fault injection, SIGKILL this process
    (the router's) once that many requests have completed; ``server``: a server's side, whose
    requests are forgotten (and their store keys deleted) once they complete.
    """

    def __init__(
        self,
        requests: Seq[Request],
        kept: Seq[Completion] = (),
        *,
        keep: Callable[[Completion], None] | None = None,
        die_after: int | None = None,
        server: ServerIntake | None = None,
    ) -> None:
        self.originals = {r.id: r for r in requests}
        self.completions: dict[int, Completion] = {c.id: c for c in kept}
        self.kept = len(self.completions)

        self.so_far: dict[int, list[int]] = {}  # request id -> its output before its last move
        self.first_token: dict[int, float] = {}  # request id -> its first token's time (job clock)
        self.routed: dict[int, list[str]] = {}  # request id -> every endpoint it was sent to
        self.cancelled: set[int] = set()  # requests whose client went away

        self.keep, self.die_after, self.server = keep or (lambda c: None), die_after, server
        self.read = 0  # ``done`` entries read

    def unfinished(self) -> list[Request]:
        """The requests still to run, earliest arrival first."""
        left = (r for r in self.originals.values() if r.id not in self.completions)
        return sorted(left, key=lambda r: r.arrival)

    def arrive(self, request: Request) -> None:
        """A server's new request."""
        assert request.id not in self.originals, f"request id {request.id} submitted twice"
        self.originals[request.id] = request

    def over(self, closed: bool) -> bool:
        """Every request completed, and (``closed``) no other will come."""
        return closed and len(self.completions) == len(self.originals)

    def sent(self, rid: int, endpoint: str, key: str) -> None:
        """Request ``rid`` was posted to ``endpoint`` as store ``key``."""
        self.routed.setdefault(rid, []).append(endpoint)
        if self.server is not None:
            self.server.posted_as(rid, key)

    def cancel(self, rid: int) -> bool:
        """Request ``rid``'s client went away: whether it is still to complete (then it is
        marked cancelled; the router ends it)."""
        if rid in self.completions or rid not in self.originals:
            return False

        self.cancelled.add(rid)
        return True

    def collect(self, channel: Channel) -> Iterator[Completion]:
        """The completions ``channel``'s ``done`` list got since the last look, each request's
        first token's time noted. A server's entries are deleted once read; an entry of a
        request completed (and forgotten) already is skipped."""
        for c in channel.read_list("done", self.read):
            if self.server is not None:
                self.server.consumed("done", self.read)
            self.read += 1

            if c.id not in self.originals:
                continue
            if c.timing is not None and c.id not in self.first_token:
                self.first_token[c.id] = c.timing.first_token
            yield c

    def journaled(self, rid: int, tokens: dict[int, int], first: float | None) -> list[int]:
        """Request ``rid``'s output so far with ``tokens`` (by output index) from a dead
        generation's journal merged in; ``first``: its first token's time there (job clock)."""
        if first is not None and rid not in self.first_token:
            self.first_token[rid] = first

        self.so_far[rid] = merged(self.so_far.get(rid, []), tokens)
        return list(self.so_far[rid])

    def finished(self, rid: int, output: Seq[int], reason: str | None) -> bool:
        """Whether request ``rid`` ended with ``output`` (a prefilled request's ``length`` is its
        hand-off, not its end)."""
        done = reason is not None and len(output) >= self.originals[rid].sampling.max_new_tokens
        return reason in ("stop", "abort") or done

    def complete(self, c: Completion) -> None:
        """Request ``c.id`` ended with ``c``: kept and told to ``keep``. Its first token's time is
        its first run's (a migrated or handed-off request made it earlier, elsewhere)."""
        if c.timing is not None:
            c.timing = dataclasses.replace(c.timing, first_token=self.first_token[c.id])

        self.completions[c.id] = c
        self.keep(c)
        if self.server is not None:  # a server's router runs without end: it forgets what it handed on
            self.forget(c.id)

        if self.die_after is not None and len(self.completions) >= self.die_after:
            die()  # fault injection: the router's process, with its supervisor's engine

    def abort(self, rid: int, output: Seq[int] | None = None) -> None:
        """Request ``rid`` ends here, cancelled, with ``output`` (default: its output so far)."""
        tokens = list(self.so_far.get(rid, []) if output is None else output)
        self.complete(Completion(rid, list(self.originals[rid].prompt_ids), tokens, "abort"))

    def forget(self, rid: int) -> None:
        """A server's completed request: dropped here, its store keys deleted."""
        for kept in (self.completions, self.originals, self.first_token, self.so_far, self.routed):
            kept.pop(rid, None)
        self.cancelled.discard(rid)
        self.server.release(rid)
