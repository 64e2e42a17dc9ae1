"""Policies: what the loop runs next (which sequences, which phase, which layout).

The loop asks its policy for one :class:`Step` at a time. The policy admits requests from the
queue, gives them KV slots (and data-parallel replicas), and names the layout (runner) that runs
the step; the loop switches layouts, runs the step, samples and retires. Continuous batching is
the default; Shift's token threshold and Seesaw's schedulers are policies too.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

from .request import EngineStats, Request, Sequence

if TYPE_CHECKING:
    from .loop import Engine

PHASES = ("prefill", "decode")
ADMISSION = ("fifo", "longest_first")


@dataclass
class Step:
    """One step: every sequence of it over all replicas (the same list on every rank)."""

    phase: str  # "prefill": whole prompts | "decode": one token each
    seqs: list[Sequence]
    layout: str  # the runner that runs it

    @property
    def num_tokens(self) -> int:
        return sum(s.prompt_len for s in self.seqs) if self.phase == "prefill" else len(self.seqs)


class SlotPool:
    """Free KV slots of every data-parallel replica of one layout (the same on every rank).

    Slots are handed out alternating over the replicas, so replicas stay balanced.
    """

    def __init__(self, slots_per_replica: int, replicas: int) -> None:
        self.per = slots_per_replica
        self.free = [g * slots_per_replica + i for i in reversed(range(slots_per_replica))
                     for g in reversed(range(replicas))]

    def __len__(self) -> int:
        return len(self.free)

    def take(self, seq: Sequence) -> None:
        seq.replica, seq.slot = divmod(self.free.pop(), self.per)

    def give(self, seq: Sequence) -> None:
        self.free.append(seq.replica * self.per + seq.slot)


class Policy:
    """Decides each step of the loop. Every rank runs the same policy on the same state, so
    steps agree without messages. Subclasses override :meth:`next_step` and the hooks they need."""

    stats_cls: type = EngineStats

    def bind(self, engine: "Engine") -> None:
        """Called once by the engine that runs this policy."""
        self.engine = engine

    @property
    def initial_layout(self) -> str | None:
        """The layout whose weights are in place before the first step (None: not known)."""
        return None

    def validate(self, requests: Seq[Request]) -> None:
        """``ValueError`` for requests this policy can never run."""

    def start(self, queue: deque) -> None:
        """A new ``generate`` call begins with ``queue`` (may reorder it)."""

    def next_step(self, queue: deque) -> Step:
        raise NotImplementedError

    def on_switch(self, old: str | None, new: str) -> None:
        """The next step runs in layout ``new`` after ``old``: move what must move."""

    def after_step(self, step: Step) -> None:
        """The step's tokens are appended; finished sequences are retired after this."""

    def retire(self, seq: Sequence) -> None:
        """``seq`` finished: release what it holds."""

    def close(self) -> None:
        """Release threads and shared memory (not collective)."""


class ContinuousBatching(Policy):
    """Admit queued requests into free KV slots (prefill), then decode every running sequence;
    a finished sequence's slot is refilled at the next prefill. With data-parallel replicas,
    slots (and so sequences) alternate over the replicas.

    ``layout``: the runner whose cache holds the slots; :meth:`layout_for` may pick another
    runner sharing that cache per step (Shift). ``admission``: ``"fifo"`` (request order) or
    ``"longest_first"`` (largest ``max_new_tokens`` first: for offline batches, fewer decode steps
    at a small batch at the end; results per request are the same in any order).
    """

    def __init__(self, layout: str, *, max_prefill_tokens: int = 4096, admission: str = "fifo") -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        self.layout, self.max_prefill_tokens, self.admission = layout, max_prefill_tokens, admission

    @property
    def initial_layout(self) -> str | None:
        return self.layout

    def start(self, queue: deque) -> None:
        if self.admission == "longest_first":  # stable: ties keep request order
            ordered = sorted(queue, key=lambda r: -r.sampling.max_new_tokens)
            queue.clear()
            queue.extend(ordered)
        runner = self.engine.runners[self.layout]
        self.slots = SlotPool(runner.max_batch_size, runner.replica.size)
        self.running: dict[int, Sequence] = {}
        self._last = None

    def next_step(self, queue: deque) -> Step:
        if queue and len(self.slots) and not (self._last == "prefill" and self.running):
            seqs, self._last = self._admit(queue), "prefill"
        else:
            seqs, self._last = list(self.running.values()), "decode"
        return Step(self._last, seqs, self.layout_for(self._last, seqs))

    def layout_for(self, phase: str, seqs: list[Sequence]) -> str:
        """The runner of a step (subclasses choose per step)."""
        return self.layout

    def _admit(self, queue: deque) -> list[Sequence]:
        budget = self.max_prefill_tokens * self.engine.runners[self.layout].replica.size
        admitted: list[Sequence] = []
        while queue and len(self.slots) and (not admitted or len(queue[0].prompt_ids) <= budget):
            seq = self.engine.new_sequence(queue.popleft())
            budget -= seq.prompt_len
            self.slots.take(seq)
            self.running[seq.request.id] = seq
            admitted.append(seq)
        return admitted

    def retire(self, seq: Sequence) -> None:
        self.running.pop(seq.request.id)
        self.slots.give(seq)
