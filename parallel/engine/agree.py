"""Sampling a step's next tokens and the one agreement on them (and on a policy's per-step integers)."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.distributed as dist

from reshard.parallel.engine.request import NO_TOKEN, Sequence
from reshard.parallel.engine.sampling import (
    Row,
    TokenLogprobs,
    sample_tokens,
    skip_draws,
    token_logprobs,
    unpack_logprobs,
)
from reshard.parallel.model.dims import device_type


def agree_tokens(
    tokens: torch.Tensor,
    is_source: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    extras: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank continues with, for each sequence, the token its one source rank sampled.

    ``tokens`` ``(B,)`` are this rank's candidates, ``is_source`` ``(B,)`` marks the sequences
    this rank is the source of; exactly one rank of the job is the source of each sequence (the
    first rank of the last pipeline stage of the data-parallel replica that ran it). ``extras``
    ``(E,)`` int64: every rank's contribution to per-step values a policy agrees on (summed).
    One sum all-reduce over ``group`` (the layout's ranks; default: the job) carries both;
    returns the agreed ``(B,)`` tokens and ``(E,)`` sums on the device of ``tokens`` (the host,
    where a step's tokens are agreed).
    """
    extras = torch.zeros(0, dtype=torch.long, device=tokens.device) if extras is None else extras
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tokens, extras
    chosen = torch.where(is_source, tokens, torch.zeros_like(tokens))
    both = torch.cat([chosen, extras]).to(device_type())
    dist.all_reduce(both, group=group)
    both = both.to(tokens.device)
    return both[: len(tokens)], both[len(tokens) :]


def sample_step(
    seqs: list[Sequence],
    mine: list[Sequence],
    logits: torch.Tensor | None,
    is_source: bool,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    extras: Mapping[str, int] | None = None,
) -> tuple[list[int], dict[str, int], list[TokenLogprobs | None]]:
    """The next token of every sequence of a step, the same on every rank, the sums of
    ``extras`` (a policy's per-step integers: every rank names the same keys) over ``group``, and
    each sequence's :data:`TokenLogprobs` (None where its request asks for none).

    ``mine`` (a sub-list of ``seqs``) ran on this rank, which holds their ``logits`` on the last
    stage. Every rank advances each sampling generator by exactly one draw: it samples where it
    has logits and skips the draw elsewhere, so generators stay in step across layouts. The
    log-probabilities travel, as fp32 bit patterns, in the tokens' one all-reduce.
    """
    if logits is not None and is_source and _alone_with(mine, seqs, group):  # nothing to agree on
        tokens, logprobs = read_payload(seqs, sample_payload(seqs, logits))
        return tokens, {k: int(extras[k]) for k in sorted(extras or {})}, logprobs
    index = {id(s): i for i, s in enumerate(seqs)}
    tokens = torch.zeros(len(seqs), dtype=torch.long)
    source = torch.zeros(len(seqs), dtype=torch.bool)
    want, width = logprob_rows(seqs)
    lp = torch.zeros(len(seqs), width) if want else None  # (B, 1 + 2k): the rows this rank is the source of
    sampled = set()
    if logits is not None:
        rows = torch.tensor([index[id(s)] for s in mine], dtype=torch.long)
        tokens[rows], picked = _sample(mine, logits, width if want and is_source else 0)
        source[rows] = is_source
        if picked is not None:
            lp[rows] = picked
        sampled = {id(s) for s in mine}
    others = [s for s in seqs if id(s) not in sampled]
    skip_draws([s.request.sampling for s in others], [s.generator for s in others], vocab_size)
    keys = sorted(extras or {})
    values = torch.tensor([int(extras[k]) for k in keys], dtype=torch.long)
    if want:  # one source per row: the sum is its fp32 bits
        values = torch.cat([values, lp[want].view(torch.int32).long().flatten()])
    agreed, sums = agree_tokens(tokens, source, group, values)
    logprobs = _unpack_rows(seqs, want, width, sums[len(keys) :])
    return agreed.tolist(), dict(zip(keys, sums[: len(keys)].tolist())), logprobs


def _alone_with(mine: list[Sequence], seqs: list[Sequence], group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is the whole of ``group`` (default: the job) and ran every sequence
    (``mine`` is ``seqs``, in order): its samples and integers are what the sum would leave."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        return False
    return mine is seqs or (len(mine) == len(seqs) and all(map(operator.is_, mine, seqs)))


def logprob_rows(seqs: list[Sequence]) -> tuple[list[int], int]:
    """The indices of ``seqs`` whose requests ask for log-probabilities and the width ``W = 1 + 2k``
    of their rows (``k``: the most top log-probabilities one asks for)."""
    want = [i for i, s in enumerate(seqs) if s.request.sampling.logprobs is not None]
    return want, 1 + 2 * max((seqs[i].request.sampling.logprobs for i in want), default=0)


def _unpack_rows(seqs: list[Sequence], want: list[int], width: int, bits: torch.Tensor) -> list:
    """``bits`` ``(len(want) * width,)`` int64 holding fp32 bit patterns -> each sequence's
    :data:`TokenLogprobs` (None where it asks for none; all None when ``want`` is empty)."""
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if not want:
        return logprobs
    rows = bits.int().view(torch.float32).view(len(want), width).tolist()
    for i, row in zip(want, rows):
        logprobs[i] = unpack_logprobs(row, seqs[i].request.sampling.logprobs)
    return logprobs


def sample_payload(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Sample every sequence of a step whose ``(B, V)`` ``logits`` this rank holds, as the int64
    payload it sends the ranks that do not (:func:`read_payload`): ``(B + R * W,)``, the ``B``
    tokens, then the ``(R, W)`` log-probability rows (:func:`logprob_rows`) as fp32 bit patterns.
    The same sampler and the same rows as :func:`sample_step`'s."""
    want, width = logprob_rows(seqs)
    tokens, rows = _sample(seqs, logits, width if want else 0)
    if not want:
        return tokens
    return torch.cat([tokens, rows[want].contiguous().view(torch.int32).long().flatten()])  # (B + R * W,)


def _sample(seqs: list[Sequence], logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``seqs``' next tokens from their ``(B, V)`` logits (each generator draws once) and, with
    ``width`` (``1 + 2k``), every row's ``(B, W)`` log-probabilities of the distribution its
    request's ``logprobs_mode`` names (None without)."""
    params = [s.request.sampling for s in seqs]
    empty = Row()  # (a row reads its sequence's tokens for penalties and min_tokens' bans only)
    rows = [s.row if p.penalized or p.min_tokens else empty for s, p in zip(seqs, params)]
    tokens, processed = sample_tokens(logits, params, [s.generator for s in seqs], rows)
    if not width:
        return tokens, None
    return tokens, token_logprobs(logits, processed, tokens, (width - 1) // 2, params)


def payload_size(seqs: list[Sequence]) -> int:
    """The length of :func:`sample_payload`'s payload for ``seqs``."""
    want, width = logprob_rows(seqs)
    return len(seqs) + len(want) * width


def read_payload(seqs: list[Sequence], payload: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
    """A :func:`sample_payload` payload -> every sequence's token and :data:`TokenLogprobs`."""
    want, width = logprob_rows(seqs)
    logprobs = _unpack_rows(seqs, want, width, payload[len(seqs) :])
    return payload[: len(seqs)].tolist(), logprobs


def sample_emitting(
    seqs: list[Sequence], emits: list[bool], mine: list[Sequence], logits: torch.Tensor | None, *args
) -> tuple[list[int], dict[str, int], list]:
    """:func:`sample_step` of the sequences of a step that emit a token (their generators draw; a
    prompt chunk short of its prompt's end does not): every sequence's token, :data:`NO_TOKEN`
    where none, the sums and the log-probabilities (None where none). ``logits``: ``(len(mine),
    vocab)`` of ``mine`` or None; ``args``: :func:`sample_step`'s rest."""
    emitting = [s for s, e in zip(seqs, emits) if e]
    ids = {id(s) for s in emitting}
    keep = [i for i, s in enumerate(mine) if id(s) in ids]
    picked = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)] if logits is not None and keep else None
    tokens, agreed, logprobs = sample_step(emitting, [mine[i] for i in keep], picked, *args)
    it, lps = iter(tokens), iter(logprobs)
    return [next(it) if e else NO_TOKEN for e in emits], agreed, [next(lps) if e else None for e in emits]
