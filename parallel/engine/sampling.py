"""Token selection: greedy, or seeded sampling with temperature, top-k and top-p.

Sampling draws Gumbel noise from a per-request generator seeded by ``(seed, request id)``, so a
request's tokens do not depend on which other requests share its batch or on the world size.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most top log-probabilities a token reports (vLLM's default cap)

# one generated token's log-probability and the top ones: (logprob, ((token id, logprob), ...))
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's EOS ids
    min_tokens: int = 0  # the stop tokens are masked (never sampled) until this many new tokens (HF min_new_tokens)
    ignore_eos: bool = False  # the model's EOS ids do not stop the request (stop_token_ids still do)
    # strings that end the request when the decoded output comes to hold one (HF ``stop_strings``;
    # checked from ``min_tokens`` on; the engine needs a tokenizer)
    stop: tuple[str, ...] = ()
    # log-probabilities of each sampled token and of the ``logprobs`` most likely ones (None: off);
    # of the model's raw distribution (log-softmax of the logits, before temperature, top-k/p)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and not (type(self.logprobs) is int and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS} or None, got {self.logprobs!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, request_id: int) -> torch.Generator | None:
    if params.greedy:
        return None
    return torch.Generator().manual_seed((params.seed * 1_000_003 + request_id) % (2**63))


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Collection[int]] = (),
) -> torch.Tensor:
    """``(B, V)`` fp32 logits -> ``(B,)`` token ids on the CPU; ``banned[i]``: token ids row ``i``
    may not take (a sequence short of its ``min_tokens``: its stop tokens), as HF's
    ``MinNewTokensLengthLogitsProcessor`` masks them."""
    if any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    greedy = logits.argmax(-1).cpu()
    if all(p.greedy for p in params):
        return greedy
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            greedy[i] = _sample_one(logits[i].cpu(), p, g)
    return greedy


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, V)`` fp32 logits and the ``(B,)`` sampled tokens -> ``(B, 1 + 2k)`` fp32: each row's
    sampled token's log-probability, then the ids and log-probabilities of its ``k`` most likely
    tokens (ids as floats: exact below 2**24)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k, dim=-1)
    picked = lp.gather(1, tokens.to(lp.device).view(-1, 1))
    return torch.cat([picked, top.indices.float(), top.values], dim=1).cpu()


def unpack_logprobs(row: Sequence[float], k: int) -> TokenLogprobs:
    """A row of :func:`token_logprobs` (its first ``k`` top entries) as :data:`TokenLogprobs`."""
    width = (len(row) - 1) // 2
    ids, values = row[1 : 1 + width], row[1 + width :]
    return float(row[0]), tuple((int(ids[i]), float(values[i])) for i in range(k))


def skip_draws(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], vocab_size: int) -> None:
    """Advance each sampling generator past the draw :func:`sample_tokens` makes for one token
    (for ranks that learn the token from another rank instead of sampling it)."""
    for p, g in zip(params, generators):
        if not p.greedy:
            torch.rand(vocab_size, generator=g, device=g.device)


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    x = logits / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = torch.cumsum(probs, -1) - probs > p.top_p  # keeps at least the top token
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    u = torch.rand(x.shape, generator=gen, device=gen.device).clamp_(1e-20, 1.0)
    return int(torch.argmax(x - torch.log(-torch.log(u))))
