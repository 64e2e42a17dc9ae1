"""What an in-flight pipeline's first stage tells the later ones: each micro-batch step as a
:class:`StepNote`, sent down the stages over a :class:`NoteLink` (tag :data:`NOTE_TAG`) without
waiting, as vLLM's engine core hands its workers a ``SchedulerOutput``."""

from __future__ import annotations

import pickle
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.parallel.engine.policy import Step
from reshard.parallel.engine.request import Request, Sequence

NOTE_TAG = 1  # P2P tags: activations use 0 (StageLink), tokens 2
KINDS = ("stop", "new", "running")  # a note's kind on the wire


@dataclass(frozen=True)
class StepNote:
    """What a later stage needs to run one micro-batch's step: each sequence's request id, KV
    slot, computed tokens and tokens to compute; for the sequences new to the later stages (their
    first step) their index in the step and requests; on a paged cache, the blocks of each
    sequence whose blocks the later stages do not have yet (a new one's, which may start past a
    cached prefix; one that took a block since its last note)."""

    kind: str  # "new": it carries requests or blocks | "running": neither | "stop"
    ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    num_tokens: tuple[int, ...] = ()
    new: tuple[int, ...] = ()  # indices of the new sequences
    requests: tuple[Request, ...] = ()  # each new sequence's request
    tables: tuple[int, ...] = ()  # indices of the sequences whose blocks follow (paged)
    blocks: tuple[tuple[int, ...], ...] = ()  # each of those sequences' blocks

    @staticmethod
    def of(step: Step, noted: NotedSequences) -> StepNote:
        """``step``'s note; ``noted``: what earlier notes carried (updated)."""
        seqs = step.seqs
        new, tables = noted.update(seqs)
        return StepNote(
            "new" if new or tables else "running",
            tuple(s.request.id for s in seqs),
            tuple(s.slot for s in seqs),
            tuple(s.num_computed_tokens for s in seqs),
            tuple(step.num_tokens),
            new,
            tuple(seqs[i].request for i in new),
            tables,
            tuple(tuple(seqs[i].blocks) for i in tables),
        )


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
    tokens to compute), and where it carries requests or blocks, those pickled as ``uint8``, all
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
        extra = pickle.dumps((note.new, note.requests, note.tables, note.blocks)) if note.kind == "new" else b""
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
        carried = ((), (), (), ())  # new, requests, tables, blocks
        if size:
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.recv(payload, self.prev, tag=NOTE_TAG)
            carried = pickle.loads(payload.cpu().numpy().tobytes())
        return StepNote(KINDS[code], *fields, *carried)
