"""Pipelines that stay full: micro-batches in flight across decode steps.

Placement: one pipeline of ``p`` stages, one rank per stage (tp = sp = 1 per stage; data-parallel
replicas as engine groups). Micro-batch ``k`` owns the KV slots of range ``k`` of
``split_ranges(max_batch_size, p)`` on every stage.

- The **first stage** runs the engine loop and owns every request's state. It decides each
  micro-batch's next step (:class:`InflightBatching`), sends a :class:`StepNote` with the
  activations down the stages and keeps up to ``p`` micro-batches in flight (:class:`Flight`).
  A micro-batch's next step starts as soon as its tokens land, not when a whole step drains.
- **Followers** (:class:`StageFollower`: every later stage) receive notes, forward them, run
  their layer span on the micro-batch and (the last stage) sample its tokens and send them
  straight back to the first stage: token agreement per micro-batch, one source per sequence
  (the last stage), as in the drained loop's agreement.
- Every send is posted without waiting (``isend``), and the first stage posts a micro-batch's
  token receive right after its activations (in the order the last stage issues the matching
  operations, as NCCL needs); no stage waits in a cycle.
- The loop ends with a ``"stop"`` note down the stages; the first stage then hands every
  completion to the followers (one broadcast over the pipeline's ranks).
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reshard.parallel.engine.policy import ContinuousBatching, Step
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.engine.runner import ModelRunner
from reshard.parallel.engine.sampling import sample_tokens
from reshard.parallel.engine.splits import split_ranges

PIPELINES = ("inflight", "drain")
NOTE_TAG = 1  # P2P tags: activations use 0 (StageLink)
TOKEN_TAG = 2
KINDS = ("stop", "new", "running")  # a note's kind on the wire


@dataclass(frozen=True)
class StepNote:
    """What a follower stage needs to run one micro-batch's step: each sequence's request id, KV
    slot, computed tokens and tokens to compute; for new sequences (a step of whole prompts) their
    requests (and paged blocks)."""

    kind: str  # "new": every sequence is new to the followers | "running": none is | "stop"
    ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    num_tokens: tuple[int, ...] = ()
    requests: tuple[Request, ...] = ()  # new: each sequence's request
    blocks: tuple[tuple[int, ...], ...] = ()  # new, on a paged cache: each sequence's blocks

    @staticmethod
    def of(step: Step) -> StepNote:
        seqs = step.seqs
        new = all(s.num_computed_tokens == 0 for s in seqs)  # in-flight steps: whole prompts or decodes
        return StepNote(
            "new" if new else "running",
            tuple(s.request.id for s in seqs),
            tuple(s.slot for s in seqs),
            tuple(s.num_computed_tokens for s in seqs),
            tuple(step.num_tokens),
            tuple(s.request for s in seqs) if new else (),
            tuple(tuple(s.blocks) for s in seqs) if new else (),
        )


class NoteLink:
    """Notes between neighbouring stages on tag :data:`NOTE_TAG`: one ``int64`` tensor of fixed
    size ``(3 + 4 * capacity,)`` (kind, count, payload bytes, then ids, slots, computed tokens,
    tokens to compute), and for new sequences the pickled requests and blocks as ``uint8``, all
    on ``device`` (the stage's: host with gloo, the GPU with NCCL). ``capacity``: the most
    sequences of one note (a micro-batch's slots)."""

    def __init__(self, prev: int | None, next: int | None, capacity: int, device: torch.device) -> None:
        self.prev, self.next, self.capacity, self.device = prev, next, capacity, device
        self.sent: deque[tuple[dist.Work, torch.Tensor]] = deque()  # sends in progress, with their buffers

    def send(self, note: StepNote) -> None:
        """Post ``note`` to the next stage without waiting for it to be received (gloo's send
        completes only once the receiver has posted its receive: a blocking send would hold this
        stage until the next one finished its current micro-batch)."""
        assert self.next is not None and len(note.ids) <= self.capacity, (len(note.ids), self.capacity)
        extra = pickle.dumps((note.requests, note.blocks)) if note.kind == "new" else b""
        pad = [0] * (self.capacity - len(note.ids))
        fields = [*note.ids, *pad, *note.slots, *pad, *note.num_computed_tokens, *pad, *note.num_tokens, *pad]
        head = [KINDS.index(note.kind), len(note.ids), len(extra), *fields]  # (3 + 4 * capacity,)
        self._post(torch.tensor(head, dtype=torch.long, device=self.device))
        if extra:
            self._post(torch.frombuffer(bytearray(extra), dtype=torch.uint8).to(self.device))

    def _post(self, buffer: torch.Tensor) -> None:
        self.sent.append((dist.isend(buffer, self.next, tag=NOTE_TAG), buffer))
        while self.sent and self.sent[0][0].is_completed():
            self.sent.popleft()

    def flush(self) -> None:
        """Wait until every posted note was received."""
        while self.sent:
            self.sent.popleft()[0].wait()

    def recv(self) -> StepNote:
        assert self.prev is not None
        head = torch.empty(3 + 4 * self.capacity, dtype=torch.long, device=self.device)
        dist.recv(head, self.prev, tag=NOTE_TAG)
        values = head.tolist()
        code, n, size = values[:3]
        c = self.capacity
        fields = [tuple(values[3 + k * c : 3 + k * c + n]) for k in range(4)]  # ids, slots, computed, counts
        requests, blocks = (), ()
        if size:
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.recv(payload, self.prev, tag=NOTE_TAG)
            requests, blocks = pickle.loads(payload.cpu().numpy().tobytes())
        return StepNote(KINDS[code], *fields, requests, blocks)


@dataclass
class Flight:
    """One micro-batch's step between its launch on the first stage and its tokens' landing."""

    step: Step
    tokens: torch.Tensor  # (len(step.seqs),) int64, filled by the last stage's send
    work: dist.Work
    launched: float  # time.time() at launch
    clock: float  # time.perf_counter() at launch


@dataclass
class PipelineRecord:
    """What a stage saw: steps it ran, and on the first stage how many micro-batches were in
    flight (``overlapped``: launches while another micro-batch was in flight; ``peak``: most at
    once); ``busy``: seconds in forward bodies; ``wall``: seconds from first note to stop."""

    steps: int = 0
    overlapped: int = 0
    peak: int = 0
    busy: float = 0.0
    wall: float = 0.0

    @property
    def idle(self) -> float:
        """Fraction of the wall time this stage computed nothing."""
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0


@dataclass
class PipelineHead:
    """The first stage's side: launches micro-batch steps and lands their tokens."""

    runner: ModelRunner
    flights: deque[Flight] = field(default_factory=deque)
    record: PipelineRecord = field(default_factory=PipelineRecord)

    def __post_init__(self) -> None:
        peers = self.runner.link.peers
        self.notes = NoteLink(None, peers[1], _note_capacity(self.runner), self.runner.device)
        self.last = peers[-1]
        self._t0 = self._busy0 = 0.0

    def begin(self) -> None:
        """A new ``generate``: clear the record."""
        self.record = PipelineRecord()
        self._t0, self._busy0 = time.perf_counter(), self.runner.busy_seconds

    def launch(self, step: Step, layers=None) -> Flight:
        """Send ``step``'s note and activations down the pipeline, then post its token receive
        (after the activations: NCCL runs one pair's P2P in posting order, and with two stages the
        last stage is the next one, which sends the tokens only after it received them)."""
        launched, clock = time.time(), time.perf_counter()
        self.notes.send(StepNote.of(step))
        self.runner.run(step.seqs, step.num_tokens, layers)
        tokens = torch.empty(len(step.seqs), dtype=torch.long, device=self.runner.device)
        flight = Flight(step, tokens, dist.irecv(tokens, self.last, tag=TOKEN_TAG), launched, clock)
        self.record.overlapped += bool(self.flights)
        self.flights.append(flight)
        self.record.peak = max(self.record.peak, len(self.flights))
        self.record.steps += 1
        return flight

    def land(self) -> Flight:
        """The oldest micro-batch's tokens (waits for the last stage)."""
        assert self.flights, "nothing in flight to land"
        flight = self.flights.popleft()
        flight.work.wait()
        return flight

    def finish(self, done: dict) -> dict:
        """Stop the followers and hand them ``done`` (collective over the pipeline's ranks)."""
        assert not self.flights, f"{len(self.flights)} micro-batches still in flight"
        self.notes.send(StepNote("stop"))
        self.notes.flush()
        self.record.wall = time.perf_counter() - self._t0
        self.record.busy = self.runner.busy_seconds - self._busy0
        return _share(done, self.runner)


class StageFollower:
    """A later stage: runs each micro-batch step the first stage notes, in note order; the last
    stage samples the tokens and sends them to the first stage (the one source of each)."""

    def __init__(
        self, runner: ModelRunner, new_sequence: Callable[[Request], Sequence], ready: Callable | None = None
    ) -> None:
        link = runner.link
        self.runner, self.new_sequence = runner, new_sequence
        self.ready = ready or (lambda index, seqs, num_tokens: None)  # told before each step runs
        nxt = None if link.is_last else link.peers[link.stage + 1]
        self.notes = NoteLink(link.peers[link.stage - 1], nxt, _note_capacity(runner), runner.device)
        self.first = link.peers[0]
        self.record = PipelineRecord()

    def follow(self) -> dict:
        """Serve notes until ``"stop"``; returns the first stage's completions (collective)."""
        self.record = PipelineRecord()
        mirror: dict[int, Sequence] = {}  # slot -> this stage's copy of the sequence in it
        sends: deque[tuple[dist.Work, torch.Tensor]] = deque()  # token sends (and their buffers) not yet waited
        t0, busy0 = time.perf_counter(), self.runner.busy_seconds
        while True:
            note = self.notes.recv()
            if self.notes.next is not None:
                self.notes.send(note)
            if note.kind == "stop":
                break
            seqs = self._mirror(note, mirror)
            self.ready(self.record.steps, seqs, list(note.num_tokens))
            logits = self.runner.run(seqs, list(note.num_tokens))
            self.record.steps += 1
            if logits is not None:
                sends.append(self._answer(seqs, logits))
            else:  # a middle stage never reads a sequence's tokens (only the first stage embeds them)
                for seq in seqs:
                    seq.output.append(0)
            while len(sends) > self.runner.num_microbatches:  # its receive was posted: completes
                sends.popleft()[0].wait()
        self.notes.flush()
        for work, _ in sends:
            work.wait()
        self.record.wall = time.perf_counter() - t0
        self.record.busy = self.runner.busy_seconds - busy0
        return _share(None, self.runner)

    def _mirror(self, note: StepNote, mirror: dict[int, Sequence]) -> list[Sequence]:
        """This stage's sequences of ``note`` (made for new ones), at the noted positions."""
        if note.kind == "new":
            for request, slot, blocks in zip(note.requests, note.slots, note.blocks):
                seq = self.new_sequence(request)
                seq.slot, seq.blocks = slot, list(blocks)
                mirror[slot] = seq
        seqs = [mirror[slot] for slot in note.slots]
        for seq, rid, computed in zip(seqs, note.ids, note.num_computed_tokens):
            assert seq.request.id == rid, f"slot {seq.slot}: request {seq.request.id} noted as {rid}"
            seq.num_computed_tokens = computed
        return seqs

    def _answer(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[dist.Work, torch.Tensor]:
        """Sample ``seqs``' next tokens and send them to the first stage (the send, its buffer)."""
        tokens = sample_tokens(
            logits, [s.request.sampling for s in seqs], [s.generator for s in seqs], [s.banned for s in seqs]
        )
        for seq, token in zip(seqs, tokens.tolist()):
            seq.output.append(token)
        tokens = tokens.to(device=self.runner.device, dtype=torch.long).contiguous()  # (len(seqs),) where P2P runs
        return dist.isend(tokens, self.first, tag=TOKEN_TAG), tokens


def _note_capacity(runner: ModelRunner) -> int:
    """The most sequences one micro-batch holds: its slot range."""
    return max(b - a for a, b in split_ranges(runner.max_batch_size, runner.num_microbatches))


def _share(done: dict | None, runner: ModelRunner) -> dict:
    """The first stage's ``done`` on every rank of the pipeline."""
    box = [done]
    dist.broadcast_object_list(box, src=runner.link.peers[0], group=runner.group)
    return box[0]


class InflightBatching(ContinuousBatching):
    """Continuous batching per pipeline micro-batch: micro-batch ``k`` admits into and decodes
    the slots of range ``k``; :meth:`next_step` returns the next step of a micro-batch that is
    not in flight (round robin), or None when every one with work is in flight."""

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
                return step
        return None

    def _flight_step(self, k: int, queue: deque) -> Step | None:
        slots = self.flights[k]
        running = [s for s in self.running.values() if s.slot in slots]
        if queue and self._fits(queue[0], slots) and not (self.prefilled[k] and running):
            seqs, self.prefilled[k] = self._admit(queue, slots), True
            return Step(seqs, [s.prompt_len - s.num_computed_tokens for s in seqs], self.layout)
        if not running:
            return None
        self.prefilled[k] = False
        return Step(running, [1] * len(running), self.layout)

    def after_step(self, step: Step, output) -> None:
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


def use_inflight(pipeline: str | None, runner: ModelRunner | None, *, custom_policy: bool) -> bool:
    """Whether the engine keeps micro-batches in flight: ``"inflight"`` (checked), ``"drain"``, or
    None: in flight wherever it can run (a pipeline of one rank per stage, the default policy)."""
    if pipeline is not None and pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "drain":
        return False
    assert runner is not None
    try:
        check_inflight(runner, custom_policy=custom_policy)
    except ValueError:
        if pipeline == "inflight":
            raise
        return False
    return True
