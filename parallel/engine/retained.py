"""Computed prompts kept whole after their step (:class:`RetainedPrompts`), where a contiguous
cache or a tier holds them: a later request whose prompt begins the same way computes only the
rest. Prompts are matched whole or by their longest common prefix, not by blocks (the paged
cache's :mod:`reshard.parallel.engine.prefix`). Two callers: a DejaVu prompt group's prompts in
their slots, and Seesaw's prompts in its CPU tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from reshard.parallel.engine.step import Move

MIN_SHARED = 16  # common prefix worth a step of reused prompts (its KV copied to another slot)


@dataclass(frozen=True)
class Reuse:
    """How a request starts from a retained prompt ``source``: its first ``shared`` positions'
    KV is that prompt's; ``same``: the prompts are equal (the request takes the slot over)."""

    source: tuple[int, ...]
    shared: int
    same: bool


@dataclass(frozen=True)
class CopyPrefix(Move):
    """Copy the first ``tokens`` positions of slot ``src`` into slot ``dst``, every layer this
    rank holds, before the step runs."""

    src: int
    dst: int
    tokens: int


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share (a binary search over slice comparisons, which
    run in C, not a Python loop over the tokens)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RetainedPrompts:
    """Retained prompts, least recently used first: prompt -> where its KV is (the caller's
    handle: a slot's sequence, a tier entry), every position. Those of :data:`MIN_SHARED` tokens
    or more are also indexed by their first :data:`MIN_SHARED`, so a lookup compares only prompts
    that can share that many (a dict lookup where none does)."""

    def __init__(self) -> None:
        self.by_prompt: OrderedDict[tuple[int, ...], Hashable] = OrderedDict()
        self.by_head: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}  # first MIN_SHARED -> prompts

    def __len__(self) -> int:
        return len(self.by_prompt)

    def __contains__(self, prompt: tuple[int, ...]) -> bool:
        return prompt in self.by_prompt

    def match(self, prompt: list[int] | tuple[int, ...]) -> Reuse | None:
        """The retained prompt sharing the most of ``prompt`` (all but its last position at
        most: that one is fed, for its logits); None where none shares :data:`MIN_SHARED`
        tokens and none is the same prompt."""
        prompt = tuple(prompt)
        if prompt in self.by_prompt and len(prompt) > 1:  # (the most any can share)
            return Reuse(prompt, len(prompt) - 1, True)
        best = None
        for source in self.by_head.get(prompt[:MIN_SHARED], {}) if len(prompt) > MIN_SHARED else ():
            shared = min(common_prefix(prompt, source), len(prompt) - 1)
            if shared >= MIN_SHARED and (best is None or shared > best.shared):
                best = Reuse(source, shared, False)
        return best

    def use(self, prompt: tuple[int, ...]) -> Hashable:
        """Retained ``prompt``'s handle, the prompt now the most recently used."""
        self.by_prompt.move_to_end(prompt)
        return self.by_prompt[prompt]

    def take(self, prompt: tuple[int, ...]) -> Hashable:
        """Retained ``prompt``'s handle, no longer retained (what it names passes to the caller)."""
        heads = self.by_head.get(prompt[:MIN_SHARED], {})
        heads.pop(prompt, None)
        if not heads:
            self.by_head.pop(prompt[:MIN_SHARED], None)
        return self.by_prompt.pop(prompt)

    def keep(self, prompt: tuple[int, ...], handle: Hashable) -> bool:
        """Retain ``prompt`` (of two tokens or more, not retained already) with ``handle``;
        whether it was."""
        if len(prompt) < 2 or prompt in self.by_prompt:
            return False
        self.by_prompt[prompt] = handle
        if len(prompt) >= MIN_SHARED:
            self.by_head.setdefault(prompt[:MIN_SHARED], {})[prompt] = None
        return True

    def evict(self, busy: set[tuple[int, ...]] = frozenset()) -> Hashable | None:
        """The least recently used retained prompt not in ``busy``, no longer retained: its
        handle (None: none)."""
        prompt = next((p for p in self.by_prompt if p not in busy), None)
        return None if prompt is None else self.take(prompt)

    def handles(self) -> list[Hashable]:
        """Every retained prompt's handle, least recently used first."""
        return list(self.by_prompt.values())

    def clear(self) -> list[Hashable]:
        """Every retained prompt's handle, none retained any more."""
        handles = self.handles()
        self.by_prompt.clear()
        self.by_head.clear()
        return handles
