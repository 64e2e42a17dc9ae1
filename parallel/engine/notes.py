"""What an in-flight pipeline's first stage tells the later ones: each micro-batch step as a
:class:`StepNote`, sent down the stages over a :class:`NoteLink` (tag :data:`NOTE_TAG`) without
waiting, as vLLM's engine core hands its workers a ``SchedulerOutput``; a later stage's policy,
:class:`NotedSteps`, runs the steps its notes carry."""

from __future__ import annotations

import pickle
import weakref
from collections import Counter, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.parallel.engine.admission import Admission
from reshard.parallel.engine.policy import Policy, Step
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.engine.slots import check_fits

NOTE_TAG = 1  # P2P tags: activations use 0 (StageLink), tokens 2
KINDS = ("stop", "step", "abort")  # a note's kind on the wire


@dataclass(frozen=True)
class StepNote:
    """What a later stage needs to run one micro-batch's step: each sequence's request id, KV
    slot, computed tokens and tokens to compute; for the sequences new to the later stages (their
    first step) their index in the step and requests; on a paged cache, the blocks of each
    sequence whose blocks the later stages do not have yet (a new one's, which may start past a
    cached prefix; one that took a block since its last note); the requests the first stage
    aborted since its last note, each with the tokens it had generated (vLLM's
    ``finished_req_ids``): a later stage ends its sequence once it holds as many."""

    # "step" | "stop" (the loop's end) | "abort" (an idle first stage's); the last two carry only aborts
    kind: str
    ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    num_tokens: tuple[int, ...] = ()
    new: tuple[int, ...] = ()  # indices of the new sequences
    requests: tuple[Request, ...] = ()  # each new sequence's request
    tables: tuple[int, ...] = ()  # indices of the sequences whose blocks follow (paged)
    blocks: tuple[tuple[int, ...], ...] = ()  # each of those sequences' blocks
    aborted: tuple[tuple[int, int], ...] = ()  # (request id, tokens generated) of each request aborted
    cached: tuple[int | None, ...] = ()  # each new sequence's prefix-cache hits (its Completion's cached_tokens)

    @staticmethod
    def of(step: Step, noted: NotedSequences, aborted: tuple[tuple[int, int], ...] = ()) -> StepNote:
        """``step``'s note; ``noted``: what earlier notes carried (updated); ``aborted``: the
        requests aborted since the last note."""
        seqs = step.seqs
        new, tables = noted.update(seqs)
        return StepNote(
            "step",
            tuple(s.request.id for s in seqs),
            tuple(s.slot for s in seqs),
            tuple(s.num_computed_tokens for s in seqs),
            tuple(step.num_tokens),
            new,
            tuple(seqs[i].request for i in new),
            tables,
            tuple(tuple(seqs[i].blocks) for i in tables),
            aborted,
            tuple(seqs[i].cached_tokens for i in new),
        )

    @property
    def carried(self) -> tuple:
        """What rides beside the note's fixed fields (pickled): empty where it holds nothing."""
        fields = (self.new, self.requests, self.tables, self.blocks, self.aborted, self.cached)
        return fields if any(fields) else ()


class NotedSequences:
    """The first stage's record of what its notes carried: the sequences, by identity (a
    sequence leaves it once nothing holds it, and a request admitted again is a new one), and
    how many blocks each had when last noted (a paged sequence takes more as it grows)."""

    def __init__(self) -> None:
        self.seqs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(seq) -> seq
        self.blocks: dict[int, int] = {}  # id(seq) -> its blocks at its last note

    def clear(self) -> None:
        self.seqs.clear()
        self.blocks.clear()

    def update(self, seqs: list[Sequence]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The indices in ``seqs`` of the sequences not noted before, and of those whose blocks
        the later stages lack (the new ones with blocks among them); both recorded as noted."""
        new = tuple(i for i, s in enumerate(seqs) if self.seqs.get(id(s)) is not s)
        for i in new:
            self.seqs[id(seqs[i])], self.blocks[id(seqs[i])] = seqs[i], 0
        tables = tuple(i for i, s in enumerate(seqs) if len(s.blocks) != self.blocks[id(s)])
        for i in tables:
            self.blocks[id(seqs[i])] = len(seqs[i].blocks)
        if len(self.blocks) > 2 * len(self.seqs) + 64:  # (the counts of sequences gone)
            self.blocks = {k: n for k, n in self.blocks.items() if k in self.seqs}
        return new, tables


class NoteLink:
    """Notes between neighbouring stages on tag :data:`NOTE_TAG`: one ``int64`` tensor of fixed
    size ``(3 + 4 * capacity,)`` (kind, count, payload bytes, then ids, slots, computed tokens,
    tokens to compute), and where it carries requests, blocks or aborts, those pickled as ``uint8``, all
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
        extra = pickle.dumps(note.carried) if note.carried else b""
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
        carried = ((), (), (), (), (), ())  # new, requests, tables, blocks, aborted, cached
        if size:
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.recv(payload, self.prev, tag=NOTE_TAG)
            carried = pickle.loads(payload.cpu().numpy().tobytes())
        return StepNote(KINDS[code], *fields, *carried)


class NotedSteps(Policy):
    """A later stage's policy: the steps the first stage notes, in note order (forwarded to the
    next stage as they arrive); sequences made for new requests at their noted slots, with the
    blocks the notes carry. A request the first stage preempted comes again as a new one: its
    sequence goes on from the last one's log-probabilities and times, as the first stage's does.
    A request the first stage aborted ends here once its steps landed, with as many tokens.
    :meth:`admission` is where its loop's requests come from: the notes too."""

    def __init__(self, layout: str, notes: NoteLink) -> None:
        self.layout, self.notes = layout, notes
        self.pending: StepNote | None = None
        self.noted: StepNote | None = None  # the note of the last step handed out
        self.slots: dict[int, Sequence] = {}  # slot -> this stage's sequence in it
        self.live: dict[int, Sequence] = {}  # request id -> its last sequence here, until it finishes
        self.flying: Counter[int] = Counter()  # id() of each sequence -> its steps handed out, not landed
        self.ending: dict[int, int] = {}  # request id -> the tokens it had when the first stage aborted it
        self.taken, self.stopped = 0, False

    @property
    def initial_layout(self) -> str | None:
        return self.layout

    def validate(self, requests) -> None:
        check_fits(requests, self.runner_info[self.layout].kv)  # as the first stage refuses them

    def start(self, queue: deque) -> None:
        assert not queue, "a later stage's requests come in notes"
        self.slots, self.live, self.taken, self.stopped = {}, {}, 0, False
        self.flying, self.ending = Counter(), {}

    def receive(self) -> None:
        """Wait for the next note (forwarding it down first)."""
        assert self.pending is None and not self.stopped
        note = self.notes.recv()
        if self.notes.next is not None:
            self.notes.send(note)
        self.stopped = note.kind == "stop"
        self.taken += sum(r.id not in self.live for r in note.requests)  # (not one preempted after a note)
        self._abort(note.aborted)
        self.pending = note if note.kind == "step" else None

    def _abort(self, aborted: tuple[tuple[int, int], ...]) -> None:
        """The first stage aborted these requests (each with the tokens it had generated): each
        one's sequence here is marked, to end once no step of it is in flight (where its last
        step is, at that step's token). One this stage never saw is ignored."""
        for rid, generated in aborted:
            seq = self.live.get(rid)
            if seq is not None:
                seq.cancelled = True
                self.ending[rid] = generated

    def next_step(self, queue: deque) -> Step | None:
        if self.pending is None and not self.stopped:
            self.receive()
        note, self.pending = self.pending, None
        if note is None:
            return None
        self.noted = note
        step = Step(self._sequences(note), list(note.num_tokens), self.layout)
        self.flying.update(map(id, step.seqs))
        return step

    def _sequences(self, note: StepNote) -> list[Sequence]:
        """This stage's sequences of ``note`` (made for the new ones); the blocks it carries
        given to theirs, with the cache table rows of those past their first positions (a
        cached prefix, a grown sequence) written now, as the first stage wrote its own."""
        for i, request, cached in zip(note.new, note.requests, note.cached):
            seq = self.new_sequence(request)
            seq.slot, seq.num_computed_tokens = note.slots[i], note.num_computed_tokens[i]
            seq.cached_tokens = cached  # (the first stage's admission's: every stage's completion says it)
            earlier = self.live.get(request.id)
            if earlier is not None:  # preempted on the first stage: what it had goes on, not its slot
                seq.logprobs, seq.times = earlier.logprobs, earlier.times
                self.retire(earlier)
            self.slots[seq.slot] = self.live[request.id] = seq
        seqs = [self.slots[slot] for slot in note.slots]
        kv = self.runner_info[self.layout].kv
        for i, blocks in zip(note.tables, note.blocks):
            seqs[i].blocks = list(blocks)
            if note.num_computed_tokens[i]:  # (the first stage's count: a middle stage's may lag, its step not landed)
                kv.assign(seqs[i].slot, seqs[i].blocks)
        return seqs

    def check(self, step: Step) -> None:
        """Before ``step`` (the last noted) runs, once the steps holding its sequences landed:
        this stage's sequences are where the first stage's were when it noted the step."""
        here = [(s.request.id, s.num_computed_tokens) for s in step.seqs]
        assert here == list(zip(self.noted.ids, self.noted.num_computed_tokens)), (here, self.noted)

    def after_step(self, step: Step, output) -> None:
        self.flying.subtract(map(id, step.seqs))
        self.flying = +self.flying  # (those at 0 gone)

    def only_aborted_left(self) -> bool:
        """Whether every request left here is one the first stage aborted (each ends between
        this stage's next steps)."""
        return all(s.cancelled for s in self.live.values())

    def ends_now(self, seq: Sequence) -> bool:
        """An aborted sequence ends once no step of it is in flight here."""
        return self.live.get(seq.request.id) is seq and not self.flying[id(seq)]

    def retire(self, seq: Sequence) -> None:
        if self.slots.get(seq.slot) is seq:  # a new sequence may hold its slot already
            del self.slots[seq.slot]
        if self.live.get(seq.request.id) is seq:
            del self.live[seq.request.id]
        generated = self.ending.pop(seq.request.id, len(seq.generated))
        assert len(seq.generated) == generated, (seq.request.id, len(seq.generated), generated)

    def admission(self) -> Admission:
        return _NotedAdmission(self)


class _NotedAdmission(Admission):
    """A later stage's requests: those of the notes (taken as they are noted)."""

    def __init__(self, steps: NotedSteps) -> None:
        self.steps = steps

    @property
    def taken(self) -> int:
        return self.steps.taken

    @property
    def exhausted(self) -> bool:
        return self.steps.stopped

    def wait_next(self) -> list[Request]:
        if not self.steps.stopped:  # (stopped: the last aborts it carried just ended here)
            self.steps.receive()
        return []
