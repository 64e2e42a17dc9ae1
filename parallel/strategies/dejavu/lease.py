"""Prompt KV a DejaVu token group keeps for the prompt group that streamed it (a lease): a later
hand-off of the same prompt (one of ``n`` samples not in its prompt's step, a prompt sent again)
or of one that begins with it (a chat's next turn) streams only what follows.

The prompt group decides and the token group follows. Per token group, a prompt group keeps a
book of the prompts it left there (:class:`LeaseBook`, least recently used first, at most
``capacity``). For each hand-off it plans (:meth:`LeaseBook.plan`):

- each streamed prompt's longest common prefix with a kept prompt (the same prompt, or at least
  :data:`~reshard.parallel.engine.retained.MIN_SHARED` tokens: the retained-prompt lookup,
  :class:`~reshard.parallel.engine.retained.RetainedPrompts`), whose positions it does not stream;
- which of the hand-off's prompts the token group keeps, and which kept prompts it frees.

The plan travels in the hand-off (:class:`Lease`). The token group's connector
(:class:`reshard.parallel.strategies.dejavu.connector.StreamedKV`) copies each shared prefix
from the kept prompt's staging slot, receives the rest, then keeps and frees as told. It checks
every kept prompt it copies from: the same weights (the prompt group's prefix-cache epoch), the
same leading tokens, every position present. Where one fails (books that disagree),
that request computes its prompt on the token group instead: slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.parallel.engine.retained import RetainedPrompts

NONE = (-1, 0)  # a streamed prompt that starts from no kept prompt: (serial, shared positions)


@dataclass(frozen=True)
class Lease:
    """A hand-off's plan for its token group's kept prompts, one entry per streamed request (in
    the stream's order): ``shared``, the serial of the kept prompt its first positions are
    copied from and how many (:data:`NONE`: none; the rest is streamed); ``keep``, the serial
    under which the token group keeps its prompt (-1: not kept, its prompt already is);
    ``drop``, serials the token group frees once it copied. ``epoch``: the prompt group's
    weights (its prefix-cache resets); KV kept under other weights is never copied."""

    epoch: int
    shared: tuple[tuple[int, int], ...]
    keep: tuple[int, ...]
    drop: tuple[int, ...]


class LeaseBook:
    """The prompts one prompt group keeps at one token group, least recently used first (the
    retained-prompt lookup, each prompt's handle its serial)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kept = RetainedPrompts()  # prompt -> its serial
        self.serial = 0  # serials handed out (a serial names one kept prompt, never reused)
        self.epoch = 0

    def plan(self, prompts: list[tuple[int, ...]]) -> Lease:
        """The lease of a hand-off streaming ``prompts`` (in the stream's order): matches against
        the prompts kept before it (a prompt of the same hand-off lands with it), then keeps."""
        shared = tuple(self._match(p) for p in prompts)
        keep = tuple(self._keep(p) for p in prompts)
        drop = []
        while len(self.kept) > self.capacity:
            drop.append(self.kept.evict())
        return Lease(self.epoch, shared, keep, tuple(drop))

    def _match(self, prompt: tuple[int, ...]) -> tuple[int, int]:
        """The kept prompt sharing the most leading tokens with ``prompt`` (now the most recently
        used) and how many: all of it where it is the same prompt, else at least ``MIN_SHARED``
        (:data:`NONE`: none)."""
        reuse = self.kept.match(prompt)
        if reuse is None:
            return NONE
        return self.kept.use(reuse.source), len(prompt) if reuse.same else reuse.shared

    def _keep(self, prompt: tuple[int, ...]) -> int:
        """Keep ``prompt`` (the most recently used); its new serial, -1 where it is not kept anew
        (kept already, or of one token: nothing to share)."""
        if prompt in self.kept:
            self.kept.use(prompt)
            return -1
        if not self.kept.keep(prompt, self.serial + 1):
            return -1
        self.serial += 1
        return self.serial

    def reset(self, epoch: int) -> None:
        """The prompt group's weights were written: nothing kept is copied from any more (the
        token group frees what it kept once a hand-off of the new ``epoch`` reaches it)."""
        self.kept.clear()
        self.epoch = epoch
