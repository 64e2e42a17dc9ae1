"""A DejaVu prompt group's prompts kept in their slots after their step (:class:`RetainedPrompts`):
a later request whose prompt begins the same way computes only the rest. The prompt side's cache
is contiguous, so prompts are matched whole or by their longest common prefix, not by blocks
(the paged cache's :mod:`reshard.parallel.engine.prefix`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from reshard.parallel.engine.request import Sequence
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
    """Retained prompts, least recently used first: prompt -> the sequence that computed it (its
    slot holds the prompt's KV, every position). Those of :data:`MIN_SHARED` tokens or more are
    also indexed by their first :data:`MIN_SHARED`, so a lookup compares only prompts that can
    share that many (a dict lookup where none does)."""

    def __init__(self) -> None:
        self.by_prompt: OrderedDict[tuple[int, ...], Sequence] = OrderedDict()
        self.by_head: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}  # first MIN_SHARED -> prompts

    def __len__(self) -> int:
        return len(self.by_prompt)

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

    def slot_of(self, prompt: tuple[int, ...]) -> int:
        """The slot of retained ``prompt``, now the most recently used."""
        self.by_prompt.move_to_end(prompt)
        return self.by_prompt[prompt].slot

    def take(self, prompt: tuple[int, ...]) -> Sequence:
        """Retained ``prompt``'s sequence, no longer retained (its slot passes to the caller)."""
        heads = self.by_head.get(prompt[:MIN_SHARED], {})
        heads.pop(prompt, None)
        if not heads:
            self.by_head.pop(prompt[:MIN_SHARED], None)
        return self.by_prompt.pop(prompt)

    def keep(self, seq: Sequence) -> bool:
        """Retain ``seq``'s prompt (of two tokens or more, not retained already); whether it was."""
        prompt = tuple(seq.request.prompt_ids)
        if len(prompt) < 2 or prompt in self.by_prompt:
            return False
        self.by_prompt[prompt] = seq
        if len(prompt) >= MIN_SHARED:
            self.by_head.setdefault(prompt[:MIN_SHARED], {})[prompt] = None
        return True

    def evict(self, busy: set[tuple[int, ...]] = frozenset()) -> Sequence | None:
        """The least recently used retained prompt not in ``busy``, no longer retained (None: none)."""
        prompt = next((p for p in self.by_prompt if p not in busy), None)
        return None if prompt is None else self.take(prompt)

    def clear(self) -> list[Sequence]:
        """Every retained prompt's sequence, none retained any more."""
        seqs = list(self.by_prompt.values())
        self.by_prompt.clear()
        self.by_head.clear()
        return seqs
