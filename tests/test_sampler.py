"""The sampler over a step's rows: the warpers once per group of rows sharing a value, HF's
processors row by row, each row's token what it would be alone, draws that follow the softmax."""

from __future__ import annotations

import random

import pytest
import torch

from reshard.parallel.engine.penalties import PenaltyTokens
from reshard.parallel.engine.sampling import (
    Row,
    SamplingParams,
    make_generator,
    process_logits,
    sample_tokens,
    skip_draws,
)


def _mixed_rows(batch: int, vocab: int, seed: int) -> tuple[list[SamplingParams], list[Row]]:
    """A step's worth of requests: greedy and sampled, shared and own warper values, penalties, bans."""
    rng = random.Random(seed)
    params, rows = [], []
    for _ in range(batch):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.0, 1.0, 0.7, 0.7, 1.3]),  # (two groups warped apart)
                top_k=rng.choice([0, 0, 5]),
                top_p=rng.choice([1.0, 0.9, 0.9]),
                min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.2]),
                presence_penalty=rng.choice([0.0, 0.5]),
                frequency_penalty=rng.choice([0.0, 0.3]),
                seed=rng.randrange(10_000),
            )
        )
        banned = frozenset(rng.sample(range(vocab), 3)) if rng.random() < 0.3 else frozenset()
        output = [rng.randrange(vocab) for _ in range(3)]
        rows.append(Row(banned, PenaltyTokens([rng.randrange(vocab) for _ in range(4)] + output, output)))
    return params, rows


def _hf_processed(logits: torch.Tensor, p: SamplingParams, row: Row) -> torch.Tensor:
    """One row through HF's own processors, in ``generate``'s order (the reference)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    context = torch.tensor([row.tokens.context.tolist()])
    x = logits[None].clone()
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(context, x)
    if p.presence_penalty or p.frequency_penalty:  # (OpenAI's, over the output: no HF processor)
        ids, counts = row.tokens.output
        x[0, ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    if row.banned:  # (after the penalty, before the warpers: HF's min-length processor's place)
        x[0, sorted(row.banned)] = float("-inf")
    if p.greedy:
        return x[0]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    warpers += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    warpers += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    warpers += [MinPLogitsWarper(p.min_p)] if p.min_p else []
    return warpers(context, x)[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_rows_token_is_what_it_would_be_alone_and_its_logits_hfs(seed):
    params, rows = _mixed_rows(24, 300, seed)
    logits = torch.randn(24, 300, generator=torch.Generator().manual_seed(seed)) * 3

    tokens, processed = sample_tokens(logits, params, [make_generator(p) for p in params], rows)
    for i, (p, row) in enumerate(zip(params, rows)):
        alone, alone_x = sample_tokens(logits[i : i + 1], [p], [make_generator(p)], [row])
        assert int(alone[0]) == int(tokens[i]) and torch.equal(alone_x[0], processed[i]), i
        ref = _hf_processed(logits[i], p, row)
        assert torch.equal(torch.isinf(ref), torch.isinf(processed[i])), i  # the same tokens kept
        kept = torch.isfinite(ref)
        torch.testing.assert_close(processed[i][kept], ref[kept], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(processed[i][tokens[i]]), i  # never a token its processors removed
    assert torch.equal(logits, torch.randn(24, 300, generator=torch.Generator().manual_seed(seed)) * 3)  # unwritten
    plain = [SamplingParams(temperature=t, top_p=0.9, seed=0) for t in (0.7, 1.3, 0.0)]  # no penalty copies first
    before = logits[:3].clone()
    process_logits(logits[:3], plain, [Row()] * 3)
    assert torch.equal(logits[:3], before)


def test_a_sequences_penalty_tokens_kept_a_token_at_a_time_are_what_its_lists_hold():
    from reshard.parallel import Request
    from reshard.parallel.engine.request import Sequence

    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, temperature=1.0, seed=0, max_tokens=64)
    seq = Sequence.of(Request(0, [5, 9, 5, 11], params).resume([9, 9]), (), 50)
    first = seq.row.tokens
    for token in [7, 9, 7, 12] + list(range(40)):  # (past its first buffer's 16 places)
        seq.append(token)
    assert seq.row.tokens is first  # one object, kept up to date: no list rebuilt a step
    fresh = PenaltyTokens([*seq.request.prompt_ids, *seq.output], seq.generated)
    assert sorted(first.context.tolist()) == sorted(set(seq.request.prompt_ids + seq.output))
    assert sorted(first.context.tolist()) == sorted(fresh.context.tolist())
    counts = dict(zip(*(t.tolist() for t in first.output)))
    assert counts == dict(zip(*(t.tolist() for t in fresh.output))) and counts[9] == 4 and counts[7] == 3


def test_each_warper_runs_once_for_the_rows_that_share_its_value(monkeypatch):
    """32 rows sharing temperature 0.7 and top-p 0.9: each warper once for all of them (row by
    row, the sampler sorted 32 times a step, the costliest part of a sampled step)."""
    from reshard.parallel.engine import sampling

    calls = []

    def counted(warp, name):
        return lambda x, value: calls.append((name, value, len(x))) or warp(x, value), name

    monkeypatch.setattr(sampling, "WARPERS", tuple(counted(*w) for w in sampling.WARPERS))
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(32)]
    process_logits(torch.randn(32, 100), params, [Row()] * 32)
    assert calls == [("temperature", 0.7, 32), ("top_p", 0.9, 32)]
    calls.clear()
    params[5] = SamplingParams(temperature=0.7, top_p=0.5, seed=5)  # a group of its own
    process_logits(torch.randn(32, 100), params, [Row()] * 32)
    assert calls == [("temperature", 0.7, 32), ("top_p", 0.9, 31), ("top_p", 0.5, 1)]


def test_top_p_looks_past_its_first_candidates_for_a_flat_rows_nucleus(monkeypatch):
    """A row whose nucleus outgrows the first candidates is looked for among more, to the whole
    vocabulary, alone: the tokens kept are those a full sort keeps, whatever its neighbours."""
    from reshard.parallel.engine import sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 4)
    peaked = torch.tensor([9.0, 8.0, 7.0] + [0.0] * 67)  # its 0.97 nucleus: three tokens
    flat = torch.linspace(0.1, 0.0, 70)  # its nucleus: most of the vocabulary (4, 16, 64, then all 70)
    warped = sampling._top_p(torch.stack([flat, peaked, flat.flip(0)]), 0.97)
    for row, out in zip((flat, peaked, flat.flip(0)), warped):
        probs, order = torch.sort(torch.softmax(row.double(), -1), descending=True)
        kept = order[(torch.cumsum(probs, -1) - probs) <= 0.97]
        assert torch.equal(torch.isfinite(out).nonzero()[:, 0].sort().values, kept.sort().values)
        assert torch.equal(sampling._top_p(row[None], 0.97)[0], out)
    assert torch.isfinite(warped[0]).sum() > 64 and torch.isfinite(warped[1]).sum() == 3


def test_a_sampled_rows_token_is_the_gumbel_max_of_its_own_draw_and_follows_the_softmax():
    """Each sampled row: the argmax of its logits plus Gumbel noise from one ``torch.rand(V)`` of
    its generator (the seeded tokens of before the rows were batched), greedy rows beside it
    their argmax; over many seeds the draws follow the softmax, never a removed token."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=0.0 if i == 2 else 1.0, seed=i) for i in range(6)]
    tokens, _ = sample_tokens(logits, params, [make_generator(p) for p in params])
    for i, p in enumerate(params):
        g = make_generator(p)
        noise = 0 if g is None else -torch.log(-torch.log(torch.rand(40, generator=g).clamp_(1e-20, 1.0)))
        assert int(tokens[i]) == int(torch.argmax(logits[i] + noise)), i

    row = torch.tensor([2.0, 1.0, float("-inf"), 0.0, -1.0, float("-inf")])
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(6000)]
    drawn, _ = sample_tokens(row.repeat(6000, 1), params, [make_generator(p) for p in params])
    freq = torch.bincount(drawn, minlength=6).double() / 6000
    torch.testing.assert_close(freq, torch.softmax(row.double(), -1), atol=0.02, rtol=0)
    assert freq[2] == 0 and freq[5] == 0

    # a skipped draw moves a generator as far as a sampled token does (resumed requests, other ranks)
    p = SamplingParams(temperature=1.0, seed=3)
    sampled, skipped = make_generator(p), make_generator(p)
    sample_tokens(torch.randn(1, 50), [p], [sampled])
    skip_draws([p], [skipped], 50)
    assert torch.equal(sampled.get_state(), skipped.get_state())
