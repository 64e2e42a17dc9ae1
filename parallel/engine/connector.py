"""KV connectors: where a request's KV comes from when the engine does not compute it (vLLM
v1's ``KVConnector``, a scheduler half and a worker half).

A request that resumes elsewhere (a migration after its group failed, a hand-off from a prompt
group to a token group) is an ordinary :class:`reshard.parallel.engine.request.Request`: its
tokens so far are in its prompt (:meth:`Request.resume`) and ``kv_source`` names where its KV
may be; it enters its group as any request does, through ``EngineCore.add_request`` with that
KV source (a hand-off's requests are those :meth:`KVConnector.receive` resumes). The scheduler
(the policy) gives it a slot and asks the engine's connector

- :meth:`KVConnector.matched_tokens`: how many of its first positions' KV the connector can
  supply (the same answer on every rank of the group: a connector agrees over the group before
  it answers), or ``None`` while that is not known yet (the request is *awaiting KV*: it keeps
  its place and is asked again next step);

A connector whose KV arrives in the background agrees on it with the step's tokens: it adds
integers to the step's agreement (:meth:`KVConnector.agree`, read after this rank's compute: "my
share landed") and reads their sums over the group back (:meth:`KVConnector.agreed`), so every
rank answers alike without a collective of its own. With nothing else to run, the policy blocks
in :meth:`KVConnector.wait_for` until this rank's share of the awaited KV is in, and asks again.

For a match, the worker half :meth:`KVConnector.load` writes those positions' KV
into the sequence's slot (this rank's shard), ``num_computed_tokens`` becomes the match and the
step computes the rest: its tail, as a prompt chunk (at least its last token: the step that
emits its next token). Nothing special follows: no request kinds, no adoption event.

After each step the engine hands this rank's share of it to :meth:`KVConnector.save` (a mirror
streams the entries the step wrote). :class:`KVConnectors` is the engine's: the connectors a
job adds, asked in order (each one's creator owns it and closes it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.request import Request, Sequence


class KVConnector:
    """The interface (a connector that supplies nothing: every request is computed whole)."""

    def matched_tokens(self, seq: Sequence) -> int | None:
        """Positions ``0..n-1`` of ``seq`` whose KV this connector can load (``n``, below the
        sequence's prompt length; the same on every rank of the group), 0: none, ``None``: not
        known yet (awaiting KV). Called once ``seq`` holds its slot (and blocks)."""
        return 0

    def agree(self) -> dict[str, Callable[[], int]]:
        """Integers this rank adds to the step's agreement (each read after its compute), summed
        over the group and handed back to :meth:`agreed`."""
        return {}

    def agreed(self, sums: Mapping[str, int]) -> None:
        """The group's sums of this connector's :meth:`agree` entries for the step just agreed."""

    def wait_for(self, request: Request) -> None:
        """Nothing runs until ``request``'s KV is in: block until this rank's share of it is.
        Every rank of the group calls it at the same point (the policy's state is the same on
        every rank), so a connector whose ranks each block until their share is in may count it
        in on every rank at once; otherwise a step's agreement tells them."""

    def receive(self, handoff: Handoff) -> list[tuple[Request, str]] | None:
        """``handoff`` reached this group: its requests that run on, resumed, each with the KV
        source to add it with (None: this connector takes no hand-offs)."""
        return None

    def forget(self, request: Request) -> None:
        """``request``, added with this connector's KV source, ended before its KV was loaded (an
        abort): what it holds here goes back (its KV still lands, awaited by no one)."""

    def carried(self, request_id: int) -> tuple[tuple, tuple] | None:
        """The wall-clock marks and log-probabilities a request received here (a hand-off's)
        carried from where it began, once, when it is admitted: its sequence continues them
        (None: none, or asked already)."""
        return None

    def arriving(self) -> bool:
        """Whether KV is still on its way that no queued request awaits (a hand-off whose
        sequences all finished at their first token): the group lands it before it ends."""
        return False

    def land_arriving(self) -> None:
        """Nothing is queued or running: block until what :meth:`arriving` names has landed (every
        rank of the group at the same point)."""

    def load(self, seq: Sequence, num_tokens: int) -> None:
        """Write the KV of ``seq``'s first ``num_tokens`` positions into its slot (this rank's share)."""
        raise NotImplementedError(f"{type(self).__name__} matched tokens it cannot load")

    def save(self, step, seqs: list[Sequence]) -> None:
        """This rank computed ``seqs`` (its share of ``step``; positions not yet counted in
        ``num_computed_tokens``): keep what the step wrote, if this connector keeps KV."""

    def released_caches(self) -> list:
        """The KV caches this connector owns, which the engine frees now (``Engine.release_memory``;
        ``Engine.ready`` restores them zeroed): it holds nothing in them any more."""
        return []

    def close(self) -> None:
        """Release threads and links (not collective; safe on an error path)."""


class KVConnectors(KVConnector):
    """The engine's connectors, asked in order: the first that matches a sequence (or awaits
    its KV) supplies it; every one saves every step."""

    def __init__(self, refused: str | None = None) -> None:
        self.members: list[KVConnector] = []
        self._supplier: dict[int, KVConnector] = {}  # request id -> the member that matched it
        self.refused = refused  # why this engine takes no connector (None: it takes them)

    @classmethod
    def of(cls, runners: Mapping) -> KVConnectors:
        """An engine's connectors, given its runners (layout name -> runner): none where a runner
        swaps micro-batches (a connector's KV would land in its device regions instead of its
        host cache)."""
        swapping = [name for name, r in runners.items() if r.swap is not None]
        if not swapping:
            return cls()
        return cls(f"engine.kv_swap=True keeps the KV of layout {swapping[0]!r} in host memory")

    def add(self, connector: KVConnector) -> None:
        if self.refused is not None:
            name = type(connector).__name__
            raise ValueError(f"a KV connector ({name}) cannot load into this engine: {self.refused}")
        self.members.append(connector)

    def matched_tokens(self, seq: Sequence) -> int | None:
        self._supplier.pop(seq.request.id, None)  # an earlier ask's answer (awaited) is stale now
        for c in self.members:
            n = c.matched_tokens(seq)
            if n != 0:
                assert n is None or 0 < n < seq.prompt_len, (seq.request.id, n, seq.prompt_len)
                self._supplier[seq.request.id] = c
                return n
        return 0

    def agree(self) -> dict[str, Callable[[], int]]:
        return {f"kv{i}/{k}": v for i, c in enumerate(self.members) for k, v in c.agree().items()}

    def agreed(self, sums: Mapping[str, int]) -> None:
        for i, c in enumerate(self.members):
            prefix = f"kv{i}/"
            c.agreed({k[len(prefix) :]: v for k, v in sums.items() if k.startswith(prefix)})

    def wait_for(self, request: Request) -> None:
        for c in self.members:
            c.wait_for(request)

    def receive(self, handoff: Handoff) -> list[tuple[Request, str]]:
        """The first member that takes ``handoff``'s answer."""
        for c in self.members:
            resumed = c.receive(handoff)
            if resumed is not None:
                return resumed
        raise ValueError(f"engine group {handoff.target} has no KV connector for group {handoff.source}'s hand-offs")

    def forget(self, request: Request) -> None:
        for c in self.members:
            c.forget(request)

    def carried(self, request_id: int) -> tuple[tuple, tuple] | None:
        return next((m for m in (c.carried(request_id) for c in self.members) if m is not None), None)

    def arriving(self) -> bool:
        return any(c.arriving() for c in self.members)

    def released_caches(self) -> list:
        return [kv for c in self.members for kv in c.released_caches()]

    def land_arriving(self) -> None:
        for c in self.members:
            c.land_arriving()

    def load(self, seq: Sequence, num_tokens: int) -> None:
        """Load through the connector that matched ``seq``."""
        self._supplier.pop(seq.request.id).load(seq, num_tokens)

    def save(self, step, seqs: list[Sequence]) -> None:
        for c in self.members:
            c.save(step, seqs)
