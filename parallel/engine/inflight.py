"""Pipelines that stay full: micro-batches in flight across decode steps.

Placement: one pipeline of ``p`` stages, one rank per stage (tp = sp = 1 per stage; data-parallel
replicas as engine groups). Micro-batch ``k`` owns the KV slots of range ``k`` of
``split_ranges(max_batch_size, p)`` on every stage.

Every stage runs the engine's one loop and the same step (:class:`BatchQueue`: run this
stage's layers of a step, land its tokens):

- The **first stage** schedules: it decides each micro-batch's next step
  (:class:`InflightBatching`), sends its :class:`StepNote` down the stages with the activations
  and keeps up to ``p`` micro-batches in flight. A micro-batch's next step starts as soon as its
  tokens land, not when a whole step drains.
- **Later stages** take their steps from the notes (:class:`NotedSteps`, the policy of their
  loop, forwarding each note as it arrives): the scheduler's output handed to every worker, as
  vLLM's engine core hands its workers a ``SchedulerOutput``.
- The **last stage** samples each step's tokens and log-probabilities with the engine's sampler
  and sends them to every other stage; every stage records them alike (one source per sequence,
  as in the drained loop's agreement), so stop strings, finish reasons and log-probabilities are
  the same on every stage.
- Every send is posted without waiting (``isend``), and a stage posts a step's token receive
  right after its activations (in the order the last stage issues the matching operations, as
  NCCL needs); no stage waits in a cycle. A later stage lands a step's tokens before it runs the
  next step of the same sequences.
- The loop ends with a ``"stop"`` note down the stages. Aborts ride on the next note; a first
  stage about to wait for requests sends them in a note of their own (``"abort"``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.parallel.engine.agree import payload_size, read_payload, sample_payload
from reshard.parallel.engine.batching import ContinuousBatching
from reshard.parallel.engine.notes import NotedSequences, NotedSteps, NoteLink, StepNote
from reshard.parallel.engine.policy import Policy, Step
from reshard.parallel.engine.request import NO_TOKEN, Completion, Sequence
from reshard.parallel.engine.runner import ModelRunner
from reshard.parallel.engine.splits import split_ranges

PIPELINES = ("inflight", "drain")
TOKEN_TAG = 2  # P2P tags: activations use 0 (StageLink), notes 1 (NOTE_TAG)


@dataclass
class Flight:
    """One micro-batch's step between its launch on this stage and its tokens' landing."""

    step: Step
    payload: torch.Tensor  # int64 (payload_size(step.seqs),): tokens, then log-probability rows
    work: dist.Work | None  # the receive from the last stage (None: sampled on this stage)
    launched: float  # time.time() at launch
    clock: float  # time.perf_counter() at launch

    @property
    def sampled_here(self) -> bool:
        """Whether this stage sampled the step's tokens (the last stage: landing it will not wait)."""
        return self.work is None


@dataclass
class PipelineRecord:
    """What a stage saw: steps it ran, how many micro-batches were in flight (``overlapped``:
    launches while another micro-batch was in flight; ``peak``: most at once); ``busy``: seconds
    in forward bodies; ``wall``: seconds from the first launch to the end."""

    steps: int = 0
    overlapped: int = 0
    peak: int = 0
    busy: float = 0.0
    wall: float = 0.0

    @property
    def idle(self) -> float:
        """Fraction of the wall time this stage computed nothing."""
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0


class BatchQueue:
    """This stage's micro-batch steps in flight (at most ``num_microbatches``), on every stage.

    :meth:`launch` runs this stage's layers of one step: the first stage sends the step's
    :class:`StepNote` down first (the later stages' :class:`NotedSteps` hand it to their loop);
    the last stage samples the step's tokens and log-probabilities with the engine's sampler
    (:func:`sample_payload`) and sends them to every other stage; the other stages post the
    receive of them. :meth:`land` hands back the oldest step's tokens, so every stage records the
    same tokens in the same order (stop strings, finish reasons and log-probabilities alike).
    """

    def __init__(self, runner: ModelRunner) -> None:
        link = runner.link
        self.runner = runner
        prev = None if link.is_first else link.peers[link.stage - 1]
        nxt = None if link.is_last else link.peers[link.stage + 1]
        self.notes = NoteLink(prev, nxt, _note_capacity(runner), runner.device)
        self.first, self.last, self.others = link.is_first, link.peers[-1], link.peers[:-1]
        self.flights: deque[Flight] = deque()
        self.noted = NotedSequences()  # (the first stage's)
        self.unnoted: list[tuple[int, int]] = []  # (the first stage's) aborts its next note carries
        self.sent: deque[tuple[dist.Work, torch.Tensor]] = deque()  # token sends (last stage), with buffers
        self.record = PipelineRecord()
        self._t0 = self._busy0 = 0.0

    def policy(self, layout: str, options: dict) -> Policy:
        """This stage's policy over ``layout``: the first stage schedules (:class:`InflightBatching`,
        with :class:`ContinuousBatching`'s ``options``); a later stage runs the steps its notes
        carry (:class:`NotedSteps`)."""
        if self.first:
            return InflightBatching(layout, **options)
        return NotedSteps(layout, self.notes)

    def begin(self) -> None:
        """A new ``generate``: clear the record."""
        self.record = PipelineRecord()
        self.noted.clear()
        self.unnoted = []
        self._t0, self._busy0 = time.perf_counter(), self.runner.busy_seconds

    def launch(self, step: Step, layers=None) -> None:
        """Run this stage's part of ``step`` (the first stage notes it down the stages first)."""
        launched, clock = time.time(), time.perf_counter()
        if self.first:
            self.notes.send(StepNote.of(step, self.noted, self._take_unnoted()))
        logits = self.runner.run(step.seqs, step.num_tokens, layers, microbatches=1)
        emitting, rows = _emitting(step)  # (a prompt chunk short of its prompt's end samples nothing)
        if logits is None:  # not the last stage: (B + R * W,) tokens and log-probabilities come from it
            payload = torch.empty(payload_size(emitting), dtype=torch.long, device=self.runner.device)
            work = dist.irecv(payload, self.last, tag=TOKEN_TAG) if emitting else None
        else:
            payload, work = torch.empty(0, dtype=torch.long, device=self.runner.device), None  # (no token)
            if emitting:
                picked = logits if len(rows) == len(step.seqs) else logits[torch.tensor(rows, device=logits.device)]
                payload = self._send(sample_payload(emitting, picked))
        self.record.overlapped += bool(self.flights)
        self.flights.append(Flight(step, payload, work, launched, clock))
        self.record.peak = max(self.record.peak, len(self.flights))
        self.record.steps += 1

    def _send(self, payload: torch.Tensor) -> torch.Tensor:
        """Post the last stage's sampled ``payload`` to every other stage without waiting."""
        payload = payload.to(device=self.runner.device, dtype=torch.long).contiguous()
        for peer in self.others:
            self.sent.append((dist.isend(payload, peer, tag=TOKEN_TAG), payload))
        while self.sent and self.sent[0][0].is_completed():
            self.sent.popleft()
        return payload

    def aborted(self, completions: list[Completion]) -> None:
        """Requests that just finished here: on the first stage, those aborted go in its next
        note (or its ``"stop"``), each with the tokens it had generated."""
        if self.first:
            self.unnoted += [(c.id, len(c.output_ids)) for c in completions if c.finish_reason == "abort"]

    def note_aborts(self) -> None:
        """On the first stage, about to wait for requests with nothing in flight: the aborts not
        noted yet go down now in a note of their own (``"abort"``), so the later stages free those
        sequences at once, not when the next request's step is noted."""
        if self.first and self.unnoted and not self.flights:
            self.notes.send(StepNote("abort", aborted=self._take_unnoted()))

    def _take_unnoted(self) -> tuple[tuple[int, int], ...]:
        taken, self.unnoted = tuple(self.unnoted), []
        return taken

    def holding(self, step: Step) -> int:
        """How many of the oldest flights must land before ``step`` runs: up to the newest one
        holding a sequence of ``step`` (its tokens are recorded first)."""
        mine = {id(s) for s in step.seqs}
        held = [i for i, f in enumerate(self.flights) if any(id(s) in mine for s in f.step.seqs)]
        return held[-1] + 1 if held else 0

    def land(self) -> tuple[Flight, list[int], list]:
        """The oldest step, its tokens and log-probabilities (waits for the last stage's send):
        :data:`NO_TOKEN` and None for a prompt chunk short of its prompt's end."""
        assert self.flights, "nothing in flight to land"
        flight = self.flights.popleft()
        if flight.work is not None:
            flight.work.wait()
        emitting, rows = _emitting(flight.step)
        tokens, logprobs = read_payload(emitting, flight.payload)
        if len(rows) == len(flight.step.seqs):
            return flight, tokens, logprobs
        out, lps = [NO_TOKEN] * len(flight.step.seqs), [None] * len(flight.step.seqs)
        for i, token, lp in zip(rows, tokens, logprobs):
            out[i], lps[i] = token, lp
        return flight, out, lps

    def finish(self) -> None:
        """Every step landed: the first stage sends ``"stop"`` down; every send completes."""
        assert not self.flights, f"{len(self.flights)} micro-batches still in flight"
        if self.first:
            self.notes.send(StepNote("stop", aborted=self._take_unnoted()))
        self.notes.flush()
        while self.sent:
            self.sent.popleft()[0].wait()
        self.record.wall = time.perf_counter() - self._t0
        self.record.busy = self.runner.busy_seconds - self._busy0


def _emitting(step: Step) -> tuple[list[Sequence], list[int]]:
    """The sequences of ``step`` that get a token (read before it is recorded) and their indices."""
    rows = [i for i, e in enumerate(step.emits()) if e]
    return [step.seqs[i] for i in rows], rows


def _note_capacity(runner: ModelRunner) -> int:
    """The most sequences one micro-batch holds: its slot range."""
    return max(b - a for a, b in split_ranges(runner.max_batch_size, runner.num_microbatches))


class InflightBatching(ContinuousBatching):
    """Continuous batching per pipeline micro-batch: micro-batch ``k`` admits into and decodes
    the slots of range ``k``; :meth:`next_step` returns the next step of a micro-batch that is
    not in flight (round robin), or None when every one with work is in flight. Mixed (the
    token budget, :class:`ContinuousBatching`'s ``mixed``): a micro-batch's step gives its
    running sequences their decode token and its prompts tokens while the budget lasts, prompt
    chunks beside decodes; else whole-prompt steps and decode steps alternate per micro-batch.
    On a paged cache a sequence takes blocks as its tokens need them (its notes carry them to
    the later stages); where too few are free, the newest running request is preempted, as the
    drained scheduler does, once no stage still computes it: while its micro-batch is in flight,
    this one waits for it to land. With the prefix cache a request starts past the cached blocks
    its prompt shares."""

    def start(self, queue: deque) -> None:
        super().start(queue)
        info = self.runner_info[self.layout]
        assert info.replica.size == 1, "in-flight micro-batches take one replica per engine group"
        self.flights = [range(a, b) for a, b in split_ranges(info.max_batch_size, info.num_microbatches)]
        self.busy: set[int] = set()
        self.prefilled = [False] * len(self.flights)  # micro-batch k's last step fed whole prompts
        self.turn = 0

    def flight_of(self, step: Step) -> int:
        return next(k for k, r in enumerate(self.flights) if step.seqs[0].slot in r)

    def next_step(self, queue: deque) -> Step | None:
        n = len(self.flights)
        for k in [(self.turn + i) % n for i in range(n)]:
            step = None if k in self.busy else self._flight_step(k, queue)
            if step is not None:
                self.busy.add(k)
                self.turn = (k + 1) % n
                for seq in step.seqs:  # launched now, in flight on later stages: never queued again
                    self.unstarted.pop(seq.request.id, None)
                return step
        return None

    def _flight_step(self, k: int, queue: deque) -> Step | None:
        """Micro-batch ``k``'s next step, with blocks for every token it writes (None: no work
        now; a step whose blocks wait for another micro-batch to land)."""
        prompts = None
        if self.mixed:
            step = self._budget_step(queue, self.flights[k])
        else:
            step, prompts = self._phase_step(k, queue)
        if step is not None and self.slots.grows:
            step = self._reserve(step, queue)
        if step is None or not step.seqs:
            return None
        if prompts is not None:  # (a decode step that waited for blocks still goes before new prompts)
            self.prefilled[k] = prompts
        return step

    def _phase_step(self, k: int, queue: deque) -> tuple[Step | None, bool]:
        """Whole prompts or decode tokens of micro-batch ``k``, alternating; whether it feeds prompts."""
        slots = self.flights[k]
        running = [s for s in self.running.values() if s.slot in slots]
        if queue and self._fits(queue[0], slots) and not (self.prefilled[k] and running):
            seqs = self._admit(queue, slots)
            return Step(seqs, [s.prompt_len - s.num_computed_tokens for s in seqs], self.layout), True
        if not running:
            return None, False
        return Step(running, [1] * len(running), self.layout), False

    def _preemptible(self, seq: Sequence) -> bool:
        """Not while ``seq``'s micro-batch is in flight: a later stage may still compute it."""
        return not any(seq.slot in self.flights[k] for k in self.busy)

    def ends_now(self, seq: Sequence) -> bool:
        """An aborted running ``seq`` ends between steps unless its micro-batch is in flight
        (then at the step's token); the next note tells the later stages."""
        return self.is_running(seq) and self._preemptible(seq)

    def after_step(self, step: Step, output) -> None:
        super().after_step(step, output)
        self.busy.discard(self.flight_of(step))


def check_inflight(runner: ModelRunner, *, custom_policy: bool) -> None:
    """``ValueError`` naming what an in-flight pipeline cannot run on."""
    dims = runner.dims
    if runner.link is None:
        raise ValueError(f"pipeline='inflight' needs a pipeline layout (pp > 1), got pp={dims.pp}")
    if dims.tp != 1 or dims.sp != 1:
        raise ValueError(f"pipeline='inflight' runs one rank per stage (tp=1, sp=1), got tp={dims.tp}, sp={dims.sp}")
    if runner.replica.size != 1:
        raise ValueError("pipeline='inflight' takes data-parallel replicas as engine groups (replicas='groups')")
    if runner.swap is not None:
        raise ValueError("pipeline='inflight' does not combine with kv_swap (micro-batch swapping)")
    if custom_policy:
        raise ValueError(
            "pipeline='inflight' runs its own per-micro-batch continuous batching on the first stage, "
            "not a given policy nor lockstep replicas (every rank in every step)"
        )


def use_inflight(pipeline: str | None, runners: Mapping[str, ModelRunner], *, custom_policy: bool) -> bool:
    """Whether the engine keeps micro-batches in flight: ``"inflight"`` (checked), ``"drain"``, or
    None: in flight wherever it can run (one layout, a pipeline of one rank per stage, the default
    policy)."""
    if pipeline is not None and pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if len(runners) > 1 and pipeline == "inflight":
        raise ValueError(f"pipeline='inflight' runs one layout, got {sorted(runners)}")
    if pipeline == "drain" or len(runners) > 1:
        return False
    try:
        check_inflight(next(iter(runners.values())), custom_policy=custom_policy)
    except ValueError:
        if pipeline == "inflight":
            raise
        return False
    return True
