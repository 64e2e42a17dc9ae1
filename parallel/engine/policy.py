"""Policies: what the loop runs next, as plain data (which sequences, how many tokens each, which
layout, which moves to make first). A policy holds no engine reference.

The contract between the engine and a policy (in the spirit of vLLM v1's EngineCore/Scheduler):

- Once, at construction, the engine calls :meth:`Policy.setup` with a :class:`PolicyContext`:
  each layout's :class:`RunnerInfo` (slots, replicas, micro-batches, its KV cache), the stats
  object the engine fills (the policy adds its own counters to it) and the ``new_sequence``
  factory. That is all a policy knows of the engine.
- Each step, :meth:`Policy.next_step` returns a :class:`Step`: the sequences (every replica's;
  the same list on every rank), the tokens each computes from its ``num_computed_tokens`` on
  (a whole prompt, a prompt chunk and a decode token are the same thing: a count; there is no
  prefill or decode phase, and the runner picks its path from the counts), the layout (runner)
  that runs it, ``moves`` and ``agree``. The engine then

  1. makes the step's cache moves itself (:class:`~reshard.parallel.engine.step.CacheMove`: a
     layout's KV cache memory given up or allocated again, Seesaw's phases), then enters the
     layout: if it is not the active one, ``policy.on_switch(old, new)`` moves what must move
     between layouts (Seesaw's weights) -- a transition is named by the layout alone;
  2. makes the step's other ``moves`` in order by calling ``policy.make(move)`` -- each move is
     a small frozen dataclass (:class:`Move`) naming what to start before the step (SiDP's
     start of the step's FFN fetches; KV from elsewhere comes through the engine's connectors);
  3. computes this replica's share, samples, and agrees on the tokens in **one** all-reduce that
     also sums the step's ``agree`` integers over the agreement group (SiDP's mode proposal);
  4. calls ``policy.after_step(step, output)`` with a :class:`StepOutput` (the tokens and the
     agreed sums), then ``policy.retire(seq)`` for finished sequences.

No callback reaches from the policy into the engine; what the policy wants done is in the data
it returns, and what happened comes back as data.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from reshard.kv import KVCache
from reshard.parallel.engine.channel import Load
from reshard.parallel.engine.connector import KVConnector
from reshard.parallel.engine.request import EngineStats, Request, Sequence
from reshard.parallel.engine.runner import Replica
from reshard.parallel.engine.step import Move, Step, StepOutput


@dataclass(frozen=True)
class RunnerInfo:
    """What a policy knows of one layout's runner."""

    max_batch_size: int  # KV slots per replica
    replica: Replica  # this rank's replica (rank -1: the rank is not in the layout)
    num_microbatches: int
    num_layers: int  # decoder layers of the whole model
    kv: KVCache | None  # the layout's cache on this rank (shared by runners that share it); None: none

    @staticmethod
    def of(runner) -> RunnerInfo:
        return RunnerInfo(
            runner.max_batch_size,
            runner.replica,
            runner.num_microbatches,
            runner.model.config.num_hidden_layers,
            runner.kv,
        )


@dataclass(frozen=True)
class PolicyContext:
    """Everything the engine hands its policy, once."""

    runner_info: Mapping[str, RunnerInfo]  # layout -> what the policy knows of its runner
    stats: EngineStats  # the engine's counters (of the policy's ``stats_cls``), identical on every rank
    new_sequence: Callable[[Request], Sequence]
    connector: KVConnector = field(default_factory=KVConnector)  # KV from elsewhere (the engine's connectors)


class Policy:
    """Decides each step of the loop (see the module docstring for the contract). Every rank runs
    the same policy on the same state, so steps agree without messages. Subclasses override
    :meth:`next_step` and the methods they need."""

    stats_cls: type = EngineStats

    def setup(self, ctx: PolicyContext) -> None:
        """Called once by the engine that runs this policy."""
        self.runner_info = ctx.runner_info
        self.stats = ctx.stats
        self.new_sequence = ctx.new_sequence
        self.connector = ctx.connector

    @property
    def initial_layout(self) -> str | None:
        """The layout whose weights are in place before the first step (None: not known)."""
        return None

    @property
    def kv_layout(self) -> str | None:
        """The layout whose KV cache holds every running request's KV (a fault mirror follows
        it; KV another layout writes reaches it through a connector). Default: the initial one."""
        return self.initial_layout

    def validate(self, requests: Seq[Request]) -> None:
        """``ValueError`` for requests this policy can never run."""

    def start(self, queue: deque) -> None:
        """A new ``generate`` call begins with ``queue`` (may reorder it)."""

    def next_step(self, queue: deque) -> Step:
        raise NotImplementedError

    def on_switch(self, old: str | None, new: str) -> None:
        """The next step runs in layout ``new`` after ``old``: move what must move."""

    def make(self, move: Move) -> None:
        """Make ``move``, one of the moves of the step about to run."""
        raise NotImplementedError(f"{type(self).__name__} names a {type(move).__name__} move it cannot make")

    def after_step(self, step: Step, output: StepOutput):
        """The step's tokens are appended; finished sequences are retired after this. May return
        :class:`reshard.parallel.engine.channel.Handoff` s: sequences that leave this group for
        another (the engine posts them; ``None``: none), or, where :attr:`hands_off_to_itself`,
        for its own other layout (the engine receives them into this group)."""

    def retire(self, seq: Sequence) -> None:
        """``seq`` finished: release what it holds."""

    schedules_ahead = False  # whether ahead / confirm run (async scheduling)
    hands_off_to_itself = False  # its hand-offs are its own group's (DejaVu's lockstep sides, Seesaw)

    def requeue_unstarted(self, queue: deque) -> None:
        """The weights changed: a request admitted onto cached KV that no step has run yet goes
        back to the queue (policies with a prefix cache)."""

    def withdraw(self, request_ids: set[int]) -> list[Request]:
        """The requests of ``request_ids`` waiting in this policy's own queues (not the engine's),
        taken out with whatever they hold here: an abort ends them now. None by default."""
        return []

    def waiting(self) -> Seq[Request]:
        """The requests waiting in this policy's own queues (not the engine's), which a request's
        status reads. None by default."""
        return ()

    def is_running(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds KV here between steps and :meth:`retire` may end it now (an
        abort frees its KV at once; where False, it ends at its next token)."""
        return False

    def ends_now(self, seq: Sequence) -> bool:
        """Whether an aborted ``seq`` may end between these steps, its KV freed now (where False,
        it ends at its next token, or between later steps): where it is running."""
        return self.is_running(seq)

    def reset_prefix_cache(self, version: int) -> None:
        """The KV its cache holds is stale (weights of ``version`` now, or the cache overwritten
        or freed): no cached prefix may be shared any more."""

    def room(self) -> tuple[int, int] | None:
        """(free slots, free KV tokens) for new requests, for a router that places them by load
        (``None``: the policy does not say; a router then only round-robins to it)."""
        return None

    def load(self, queue: Seq) -> Load | None:
        """The :meth:`room` left once ``queue`` is admitted (what the group's leader publishes)."""
        room = self.room()
        if room is None:
            return None
        need = sum(len(r.prompt_ids) + r.sampling.max_new_tokens for r in queue if isinstance(r, Request))
        s = self.stats
        return Load(room[0] - len(queue), room[1] - need, 0, s.prefix_cache_queries, s.prefix_cache_hits)

    def finish(self) -> None:
        """Nothing is queued, running or arriving any more (the end of a ``generate`` call or of
        a group's input): the policy's last counts."""

    def close(self) -> None:
        """Release threads and shared memory (not collective)."""
