"""When to prefill and when to decode, for engines whose two phases run in different layouts.

Each phase change costs a re-sharding transition (Seesaw), so the policy trades transitions
against the decode batch size. A policy sees a :class:`SchedState` snapshot and answers two
questions: which phase runs next, and how many prefilled requests it wants waiting for decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedState:
    queued: int  # requests not yet prefilled
    next_fits_tier: bool  # the next queued prompt fits the CPU KV tier now
    buffered: int  # prefilled, KV in the CPU tier, waiting for a decode slot
    running: int  # holding a decode slot
    free_slots: int  # decode slots not held by a running request


class Scheduler:
    name = ""

    def buffer_target(self, s: SchedState) -> float:
        """How many requests prefill should leave buffered before decoding."""
        raise NotImplementedError

    def leave_decode(self, s: SchedState) -> bool:
        """Whether to switch from decode to prefill now (``s.queued > 0`` is checked by the caller)."""
        raise NotImplementedError

    def next_phase(self, phase: str, s: SchedState) -> str:
        """``"prefill"`` or ``"decode"`` for the next step, given the current ``phase``."""
        if phase == "prefill":
            keep = s.queued and s.next_fits_tier and s.buffered < self.buffer_target(s)
            return "prefill" if keep else "decode"
        if s.queued and s.next_fits_tier and self.leave_decode(s):
            return "prefill"
        return "decode"


class TransitionMinimizing(Scheduler):
    """Seesaw's policy: prefill until the CPU tier is full (or the queue empty); decode, feeding
    free slots from the tier, until the tier is empty and a slot falls idle; then back."""

    name = "transition_minimizing"

    def buffer_target(self, s: SchedState) -> float:
        return math.inf

    def leave_decode(self, s: SchedState) -> bool:
        return s.buffered == 0 and s.free_slots > 0


class PrefillPrioritizing(Scheduler):
    """vLLM-style: prefill new requests whenever a decode slot is free (many transitions)."""

    name = "prefill_prioritizing"

    def buffer_target(self, s: SchedState) -> float:
        return s.free_slots

    def leave_decode(self, s: SchedState) -> bool:
        return s.free_slots > s.buffered


class DecodePrioritizing(Scheduler):
    """Prefill a batch that fills the decode slots, decode it to the end, repeat (small batches
    towards each batch's end)."""

    name = "decode_prioritizing"

    def buffer_target(self, s: SchedState) -> float:
        return s.free_slots

    def leave_decode(self, s: SchedState) -> bool:
        return s.running == 0 and s.buffered == 0


SCHEDULERS = {cls.name: cls for cls in (TransitionMinimizing, PrefillPrioritizing, DecodePrioritizing)}


def make_scheduler(name: str) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is not one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name]()
