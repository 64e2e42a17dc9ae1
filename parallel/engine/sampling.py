"""Token selection: greedy, or seeded sampling, after HF's logits processors.

A step's logits go through, in HF ``generate``'s order: the repetition penalty (over prompt and
output), presence and frequency penalties (over the output, as OpenAI's), the stop tokens banned
short of ``min_tokens``, then (sampled requests) temperature, top-k, top-p and min-p. Greedy
takes the argmax of what is left; sampling draws Gumbel noise from the request's own generator,
seeded by its ``seed`` alone, so its tokens depend neither on the batch it shares, nor on the
world size, nor on its id. A step's rows are processed together: each warper once for the rows
sharing its value, the noise added and the argmax taken once for all sampled rows. A call's
requests without a seed get one each from the call's seed and their position in the call
(:func:`resolve_seeds`); a call without a seed draws a fresh one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from reshard.parallel.engine.penalties import Row, restrict

MAX_LOGPROBS = 20  # the most top log-probabilities a token reports (vLLM's default cap)
LOGPROBS_MODES = ("raw", "processed")
UNSET = object()  # SamplingParams' max_tokens not given (None is vLLM's "to the context's end")

# one generated token's log-probability and the top ones: (logprob, ((token id, logprob), ...))
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class SamplingFields:
    """:class:`SamplingParams`' stored fields, one name each (construct :class:`SamplingParams`)."""

    temperature: float = 0.0  # 0 = greedy (vLLM's default is 1.0: say temperature= to sample)
    top_k: int = 0  # 0 = off (vLLM's -1 too)
    top_p: float = 1.0
    # vLLM's max_tokens (either name is taken; its default is 16); None: up to the end of the model's
    # context (vLLM's max_tokens=None), which reshard.LLM resolves per prompt (the engine takes a number)
    max_new_tokens: int | None = 32
    # this request's noise (None: one from its call's seed and its position in the call, a fresh
    # one per call where the call names none); ``n`` samples take seeds ``seed``, ``seed + 1``, ...
    seed: int | None = None
    # token ids that end the request besides the model's EOS ids (vLLM's meaning; a list or tuple)
    stop_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0  # the stop tokens are masked (never sampled) until this many new tokens (HF min_new_tokens)
    ignore_eos: bool = False  # the model's EOS ids do not stop the request (stop_token_ids still do)
    # strings that end the request when the decoded output comes to hold one (HF ``stop_strings``;
    # a string or a list; checked from ``min_tokens`` on; the engine needs a tokenizer)
    stop: tuple[str, ...] = ()
    # log-probabilities of each sampled token and of the ``logprobs`` most likely ones (None: off),
    # of the distribution ``logprobs_mode`` names: "raw" (log-softmax of the model's logits) or
    # "processed" (of the logits the token was drawn from: after penalties, bans, temperature,
    # top-k, top-p and min-p; vLLM's ``processed_logprobs``)
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability (after temperature); 0 = off
    repetition_penalty: float = 1.0  # HF's / CTRL's, over prompt and output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI's, over output tokens: subtracted once per token present
    frequency_penalty: float = 0.0  # OpenAI's, over output tokens: subtracted per occurrence
    n: int = 1  # samples of the prompt (reshard.LLM makes them n requests; the engine runs n=1 each)
    # reshard.LLM: each prompt token's log-probability under the model (raw) and the top this many
    prompt_logprobs: int | None = None
    # the text of an output keeps the stop string that ended it (vLLM's; the tokens always do)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the output text leaves special tokens out (vLLM's)
    detokenize: bool = True  # False: no output text (token ids only; vLLM's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_stops(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _as_token_ids(self.stop_token_ids))
        if self.top_k == -1:  # vLLM's and verl's "off"
            object.__setattr__(self, "top_k", 0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in 0..{MAX_LOGPROBS} or None, got {value!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        m = self.max_new_tokens
        if not (m is None or (type(m) is int and m >= 1)):
            raise ValueError(f"max_new_tokens must be >= 1, got {m!r}")
        low = self.min_tokens
        if not (type(low) is int and 0 <= low <= (low if m is None else m)):
            raise ValueError(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {low!r}")
        if self.seed is not None and not (type(self.seed) is int and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in 0..2**63-1 or None, got {self.seed!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {self.stop!r} are matched in the output's text: they need detokenize=True")
        if not (type(self.n) is int and self.n >= 1):
            raise ValueError(f"n must be an int >= 1 (samples of the prompt), got {self.n!r}")
        self._check_ranges()
        self._check_switches()

    def _check_switches(self) -> None:
        """The on/off fields take bools only: a text such as "false" is true to Python (the
        opposite of what it says, silently)."""
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_ranges(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if type(self.top_k) is not int:
            raise ValueError(f"top_k must be an int (0 or -1: off), got {self.top_k!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (OpenAI's range), got {getattr(self, name)}")

    @property
    def max_tokens(self) -> int:
        """vLLM's name of :attr:`max_new_tokens`."""
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class SamplingParams(SamplingFields):
    """How a request samples, under vLLM's names (``max_tokens``, ``stop`` as a string or a list,
    ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``top_k=-1``, ...)
    or ours where we had one (``max_new_tokens``, HF's): either name of a pair is taken, both is
    a ``ValueError``. Keyword arguments only. Defaults that differ from vLLM's: ``temperature``
    0 (greedy; vLLM's 1.0) and ``max_tokens`` 32 (vLLM's 16)."""

    def __init__(self, *, max_tokens: int | object | None = UNSET, **fields) -> None:
        _vllm_values(fields)
        if max_tokens is not UNSET:
            if "max_new_tokens" in fields:
                raise ValueError(
                    f"SamplingParams got max_tokens={max_tokens!r} and max_new_tokens={fields['max_new_tokens']!r}: "
                    "they are one setting (vLLM's name and HF's), give one"
                )
            fields["max_new_tokens"] = max_tokens
        super().__init__(**fields)


# vLLM's sampling keys reshard takes at their "off" value only (each other value: one ValueError)
VLLM_OFF = MappingProxyType(
    {
        "spaces_between_special_tokens": True,
        "logit_bias": None,
        "allowed_token_ids": None,
        "bad_words": None,
        "structured_outputs": None,
        "guided_decoding": None,
        "truncate_prompt_tokens": None,
    }
)


def _vllm_values(fields: dict) -> None:
    """vLLM's spellings of values in ``fields``, in place: ``stop=None`` (none), ``seed=-1`` (none),
    ``logprobs``/``prompt_logprobs`` as bools (Python's ints 1 and 0, as vLLM reads them); keys
    of :data:`VLLM_OFF` dropped at their "off" value (``ValueError`` naming any other)."""
    if "stop" in fields and fields["stop"] is None:
        fields["stop"] = ()
    if fields.get("seed") == -1:
        fields["seed"] = None
    for name in ("logprobs", "prompt_logprobs"):
        if isinstance(fields.get(name), bool):
            fields[name] = int(fields[name])
    for name, off in VLLM_OFF.items():
        if name in fields and fields.pop(name) != off:
            raise ValueError(f"SamplingParams: {name} is not one reshard honours (only its default, {off!r})")


_SWITCHES = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _as_stops(stop) -> tuple[str, ...]:
    """``stop`` (a string, or a list or tuple of them) as a tuple of non-empty strings."""
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return tuple(stops)


def _as_token_ids(ids) -> tuple[int, ...]:
    """``stop_token_ids`` (a list or tuple of ints >= 0) as a tuple."""
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}")
    return tuple(ids)


def make_generator(params: SamplingParams, device: torch.device | None = None) -> torch.Generator | None:
    """A sampled request's generator, seeded by its ``seed`` (resolved: :func:`resolve_seeds`), on
    ``device`` (default: the host), where its noise is drawn: an engine's own device, of one type
    on every rank of a job, so every rank draws or skips the same numbers; a CUDA job's seeded
    tokens are not a CPU job's (CUDA's Philox is not the CPU's Mersenne Twister), as vLLM's are
    not."""
    if params.greedy:
        return None
    assert params.seed is not None, "a sampled request's seed is resolved when its call begins"
    generator = torch.Generator() if device is None else torch.Generator(device=device)
    return generator.manual_seed(params.seed)


def call_seed(seed: int, position: int) -> int:
    """The seed of the request at ``position`` of a call seeded with ``seed``."""
    return (seed * 1_000_003 + position) % (2**63)


def fresh_seed() -> int:
    """A seed no earlier call used (from the OS's entropy)."""
    return int.from_bytes(os.urandom(8), "little") % (2**63)


def resolve_seeds(requests: Sequence, seed: int) -> list:
    """``requests`` with each sampled one that names no seed given :func:`call_seed` of
    ``seed`` and its position in the list (its id plays no part)."""
    return [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=call_seed(seed, i)))
        if not r.sampling.greedy and r.sampling.seed is None
        else r
        for i, r in enumerate(requests)
    ]


def needs_seed(requests: Sequence) -> bool:
    """Whether any of ``requests`` samples without a seed of its own."""
    return any(not r.sampling.greedy and r.sampling.seed is None for r in requests)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Row]) -> torch.Tensor:
    """``(B, V)`` fp32 logits -> the ``(B, V)`` logits each row's token is drawn from (greedy:
    its argmax), after its penalties, bans and, where it samples, its temperature, top-k, top-p
    and min-p (HF's processors, in ``generate``'s order). Each runs once for the step's rows
    (a warper once for every group of rows sharing its value), so a row's result is what it
    would be alone. Rows that change nothing are the input's own; ``logits`` is not written."""
    out = logits
    if any(p.penalized for p in params) or any(row.banned for row in rows):
        out = restrict(logits.clone(), params, rows)
    for warp, name in WARPERS:  # (each returns a new tensor: a whole batch's needs no copy first)
        for value, group in _groups(params, name).items():
            if len(group) == len(params):
                out = warp(out, value)
                continue
            out = logits.clone() if out is logits else out
            index = torch.tensor(group, device=out.device)
            out[index] = warp(out[index], value)  # (len(group), V)
    return out


def _groups(params: Sequence[SamplingParams], name: str) -> dict[float, list[int]]:
    """The sampled rows whose warper ``name`` does something, by its value (in row order)."""
    groups: dict[float, list[int]] = {}
    for i, p in enumerate(params):
        value = getattr(p, name)
        if not p.greedy and value != _OFF[name]:
            groups.setdefault(value, []).append(i)
    return groups


def _temperature(x: torch.Tensor, t: float) -> torch.Tensor:
    return x / t


def _top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` ``(R, V)`` with what is below each row's ``k``-th largest masked."""
    kth = torch.topk(x, min(k, x.shape[-1]), dim=-1).values[:, -1:]  # (R, 1)
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """``x`` ``(R, V)`` keeping each row's most likely tokens while the probability before a token
    is at most ``top_p`` (at least its top token). A row's tokens are looked for among its
    :data:`TOP_P_CANDIDATES` most likely, then 4x as many, up to the whole vocabulary, until the
    last candidate is past its nucleus: a partial sort, whose count each row settles alone."""
    probs = torch.softmax(x, -1)
    keep = torch.zeros_like(x, dtype=torch.bool)
    rows, k = torch.arange(len(x), device=x.device), min(TOP_P_CANDIDATES, x.shape[-1])
    while len(rows):
        values, index = torch.topk(probs[rows], k, dim=-1)  # (r, k), most likely first
        # (r, k): the probability ahead of each token, summed in fp64 (a parallel scan's rounding,
        # which on CUDA varies with the rows scanned, then moves no boundary)
        before = torch.cumsum(values.double(), -1) - values
        done = (before[:, -1] > top_p) | (k == x.shape[-1])  # (its nucleus ends inside its top k)
        keep[rows[done]] = keep[rows[done]].scatter(-1, index[done], before[done] <= top_p)
        rows, k = rows[~done], min(4 * k, x.shape[-1])
    return x.masked_fill(~keep, float("-inf"))


def _min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """``x`` ``(R, V)`` without the tokens under ``min_p`` times each row's top probability."""
    probs = torch.softmax(x, -1)
    return x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))  # the top token stays


TOP_P_CANDIDATES = 1024  # the most likely tokens a row's top-p nucleus is first looked for among

# HF's warpers in ``generate``'s order, by the field each reads, and each field's "off" value
WARPERS = ((_temperature, "temperature"), (_top_k, "top_k"), (_top_p, "top_p"), (_min_p, "min_p"))
_OFF = MappingProxyType({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0})


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    rows: Sequence[Row] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, V)`` fp32 logits -> ``(B,)`` token ids on the CPU and the ``(B, V)`` processed logits
    they were drawn from (:func:`process_logits`; ``rows``: each row's :class:`Row`, default
    none). Greedy rows take the argmax, sampled rows the Gumbel-max of one draw of their generator
    (a row's noise depends on its generator alone, not on its batch)."""
    x = process_logits(logits, params, rows or [Row()] * len(params))
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if len(sampled) == len(params):
        return _gumbel_max(x, generators).cpu(), x
    tokens = x.argmax(-1)
    if sampled:
        index = torch.tensor(sampled, device=x.device)
        tokens[index] = _gumbel_max(x[index], [generators[i] for i in sampled])
    return tokens.cpu(), x


def _gumbel_max(x: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Logits ``(S, V)`` -> ``(S,)``: each row's argmax after Gumbel noise from one uniform draw
    of its generator over the vocabulary (the draw ``torch.rand(V, generator=g)`` makes), so a
    row's token moves only where rounding-level changes of its logits swap its top scores. The
    noise is drawn where the generator lives (an engine's: its device, no copy of the logits) and
    moved to the logits where they differ (a caller's host generators beside device logits)."""
    u = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # (S, V)
    for row, g in zip(u, generators):
        if g.device == row.device:
            row.uniform_(generator=g)
        else:
            row.copy_(torch.rand(len(row), generator=g, device=g.device, dtype=torch.float32))
    return torch.argmax(x - torch.log(-torch.log(u.clamp_(1e-20, 1.0))), -1)


def token_logprobs(
    logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor, k: int, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """``(B, V)`` raw and processed logits and the ``(B,)`` sampled tokens -> ``(B, 1 + 2k)``
    fp32: each row's sampled token's log-probability, then the ids and log-probabilities of its
    ``k`` most likely tokens (ids as floats: exact below 2**24), of the distribution its
    ``logprobs_mode`` names."""
    mode = torch.tensor([p.logprobs_mode == "processed" for p in params], device=logits.device)
    lp = torch.log_softmax(torch.where(mode[:, None], processed, logits).float(), dim=-1)
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
            torch.rand(vocab_size, generator=g, device=g.device, dtype=torch.float32)
