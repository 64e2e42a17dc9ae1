"""Sampling a step's next tokens and the one agreement on them over the whole job."""

from __future__ import annotations

import torch
import torch.distributed as dist

from reshard.parallel.engine.request import Sequence
from reshard.parallel.engine.sampling import sample_tokens, skip_draws
from reshard.parallel.model.dims import device_type


def agree_tokens(tokens: torch.Tensor, is_source: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank continues with, for each sequence, the token its one source rank sampled.

    ``tokens`` ``(B,)`` are this rank's candidates, ``is_source`` ``(B,)`` marks the sequences
    this rank is the source of; exactly one rank of the job is the source of each sequence (the
    first rank of the last pipeline stage of the data-parallel replica that ran it). One sum
    all-reduce over ``group`` (the layout's ranks; default: the job); returns the agreed ``(B,)``
    tokens on the device of ``tokens`` (the host, where tokens are sampled).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tokens
    chosen = torch.where(is_source, tokens, torch.zeros_like(tokens)).to(device_type())
    dist.all_reduce(chosen, group=group)
    return chosen.to(tokens.device)


def sample_step(
    seqs: list[Sequence],
    mine: list[Sequence],
    logits: torch.Tensor | None,
    is_source: bool,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """The next token of every sequence of a step, the same on every rank.

    ``mine`` (a sub-list of ``seqs``) ran on this rank, which holds their ``logits`` on the last
    stage. Every rank advances each sampling generator by exactly one draw: it samples where it
    has logits and skips the draw elsewhere, so generators stay in step across layouts.
    """
    index = {id(s): i for i, s in enumerate(seqs)}
    tokens = torch.zeros(len(seqs), dtype=torch.long)
    source = torch.zeros(len(seqs), dtype=torch.bool)
    sampled = set()
    if logits is not None:
        rows = torch.tensor([index[id(s)] for s in mine], dtype=torch.long)
        tokens[rows] = sample_tokens(logits, [s.request.sampling for s in mine], [s.generator for s in mine])
        source[rows] = is_source
        sampled = {id(s) for s in mine}
    others = [s for s in seqs if id(s) not in sampled]
    skip_draws([s.request.sampling for s in others], [s.generator for s in others], vocab_size)
    return agree_tokens(tokens, source, group).tolist()
