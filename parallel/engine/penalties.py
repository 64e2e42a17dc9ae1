"""The penalties and bans of a step's rows, before the warpers (:mod:`.sampling`): the repetition
penalty over each sequence's prompt and output, presence and frequency penalties over its output
(OpenAI's), its stop tokens banned short of ``min_tokens``; each once for the step's rows, over
what each sequence keeps of its tokens a token at a time (:class:`PenaltyTokens`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from reshard.parallel.engine.sampling import SamplingParams


class Growing:
    """A host int64 tensor grown a value at a time (capacity doubled as needed): :meth:`view`
    is the values so far, read without a copy."""

    def __init__(self, values: Sequence[int]) -> None:
        self.size = len(values)
        self._buffer = torch.zeros(self.size + 64, dtype=torch.long)  # (then doubled when full)
        self._buffer[: self.size] = torch.tensor(list(values), dtype=torch.long)

    def append(self, value: int) -> None:
        if self.size == len(self._buffer):
            self._buffer = torch.cat([self._buffer, torch.zeros_like(self._buffer)])
        self._buffer[self.size] = value
        self.size += 1

    def add(self, index: int, value: int) -> None:
        self._buffer[index] += value

    def view(self) -> torch.Tensor:
        return self._buffer[: self.size]


class PenaltyTokens:
    """A sequence's tokens as its penalties read them, kept up to date a token at a time: the
    distinct ids of its prompt and output (the repetition penalty's) and the distinct ids of its
    output with their counts (presence and frequency penalties'), as host tensors."""

    def __init__(self, context: Sequence[int], output: Sequence[int]) -> None:
        counts = Counter(output)
        self._seen = dict.fromkeys(context)  # (insertion-ordered, distinct)
        self._place = {t: i for i, t in enumerate(counts)}  # output id -> its index in ids and counts
        self._context = Growing(list(self._seen))
        self._ids, self._counts = Growing(list(counts)), Growing(list(counts.values()))

    def add(self, token: int) -> None:
        """The sequence's next output token."""
        if token not in self._seen:
            self._seen[token] = None
            self._context.append(token)
        if token in self._place:
            self._counts.add(self._place[token], 1)
        else:
            self._place[token] = len(self._place)
            self._ids.append(token)
            self._counts.append(1)

    @property
    def context(self) -> torch.Tensor:
        """``(U,)``: the distinct ids of prompt and output."""
        return self._context.view()

    @property
    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K,)`` distinct output ids and ``(K,)`` their counts."""
        return self._ids.view(), self._counts.view()


@dataclass(frozen=True)
class Row:
    """What the processors of one row of a step's logits read besides its params: the token ids
    its stop tokens ban now (``min_tokens``) and its tokens as its penalties read them (None
    where it has no penalty)."""

    banned: Collection[int] = ()
    tokens: PenaltyTokens | None = None


def restrict(x: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Row]) -> torch.Tensor:
    """``x`` ``(B, V)`` (a copy the caller owns) after each row's penalties, then its bans, in
    place (HF's order); returns it."""
    _repetition(x, params, rows)
    _presence_frequency(x, params, rows)
    _ban(x, rows)
    return x


def _entries(parts: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, ids (n,))`` pairs -> the flat ``(N,)`` row and column index of every entry (no
    device sync: the count is the host's)."""
    lengths = [len(ids) for _, ids in parts]
    index = torch.tensor([i for i, _ in parts], device=device)
    rows = torch.repeat_interleave(index, torch.tensor(lengths, device=device), output_size=sum(lengths))
    return rows, torch.cat([ids for _, ids in parts]).to(device)


def _penalized(params: Sequence[SamplingParams], rows: Sequence[Row], key, off: tuple) -> dict[tuple, list[int]]:
    """The rows with tokens whose ``key(params)`` (a tuple of penalties) is not ``off``, by that
    value: each value applies once, as a scalar (HF's arithmetic on every device: on CUDA a
    division by a scalar is not a division by a tensor of it, bit for bit)."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, row) in enumerate(zip(params, rows)):
        value = key(p)
        if row.tokens is not None and value != off:
            groups.setdefault(value, []).append(i)
    return groups


def _repetition(x: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Row]) -> None:
    """In place: the repetition penalty over each row's prompt and output (a seen token's logit
    divided by it where positive, multiplied where negative: HF's)."""
    for (penalty,), chosen in _penalized(params, rows, _repetition_penalty, (1.0,)).items():
        parts = [(i, rows[i].tokens.context) for i in chosen]
        r, c = _entries(parts, x.device)
        score = x[r, c]
        x[r, c] = torch.where(score < 0, score * penalty, score / penalty)


def _presence_frequency(x: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Row]) -> None:
    """In place: ``logit -= presence + frequency * count`` over each row's output (OpenAI's)."""
    for (presence, frequency), chosen in _penalized(params, rows, _presence_and_frequency, (0.0, 0.0)).items():
        outputs = [rows[i].tokens.output for i in chosen]
        r, c = _entries([(i, ids) for i, (ids, _) in zip(chosen, outputs)], x.device)
        counts = torch.cat([n for _, n in outputs]).to(device=x.device, dtype=x.dtype)
        x[r, c] = x[r, c] - (presence + frequency * counts)


def _repetition_penalty(p: SamplingParams) -> tuple[float]:
    return (p.repetition_penalty,)


def _presence_and_frequency(p: SamplingParams) -> tuple[float, float]:
    return p.presence_penalty, p.frequency_penalty


def _ban(x: torch.Tensor, rows: Sequence[Row]) -> None:
    """In place: each row's banned ids (its stop tokens short of ``min_tokens``) to -inf."""
    parts = [(i, torch.tensor(sorted(row.banned), device=x.device)) for i, row in enumerate(rows) if row.banned]
    if parts:
        x[_entries(parts, x.device)] = float("-inf")
