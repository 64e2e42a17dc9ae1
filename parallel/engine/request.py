"""Requests, the sequences the engine loop runs for them, completions and step statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from reshard.parallel.engine.penalties import PenaltyTokens, Row
from reshard.parallel.engine.sampling import SamplingParams, TokenLogprobs, make_generator, skip_draws

NO_TOKEN = -1  # a step's token of a sequence whose prompt chunk stops short of the prompt's end
LATEST_ARRIVAL_S = 1e8  # three years after the start: a later arrival is a clock's reading, not an offset


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0  # seconds after the start of ``generate`` (online workloads); 0: there at once
    # the last ``resumed`` prompt tokens are output an earlier engine generated (a migration
    # after it failed, a hand-off after a prefill): counted as output, prefilled unless a KV
    # connector supplies their KV
    resumed: int = 0
    # where this request's KV may be (a failed or prefilling group's endpoint): a KV connector
    # that holds it supplies it (:mod:`reshard.parallel.engine.connector`); "": nowhere
    kv_source: str = ""
    # queued again by its scheduler, whose KV went to older requests (recomputed when it runs)
    preempted: bool = False

    def __post_init__(self) -> None:
        if not self.arrival >= 0:  # also refuses NaN
            raise ValueError(f"request {self.id}: arrival must be >= 0 seconds, got {self.arrival}")
        if self.arrival >= LATEST_ARRIVAL_S:  # (the loop would sleep until then: years, for a clock's time)
            raise ValueError(
                f"request {self.id}: arrival is seconds after the start, got {self.arrival} (a wall-clock time?)"
            )
        if not isinstance(self.prompt_ids, list):  # (a text's bytes or a tensor would be misread)
            ids = self.prompt_ids
            raise ValueError(
                f"request {self.id}: prompt_ids must be a list of ints, got {type(ids).__name__} {ids!r:.60}"
            )
        if not self.prompt_ids:
            raise ValueError(f"request {self.id}: empty prompt (a request needs at least one token)")
        if not 0 <= self.resumed < len(self.prompt_ids):
            raise ValueError(
                f"request {self.id}: resumed ({self.resumed}) must be >= 0 and below the prompt length "
                f"({len(self.prompt_ids)})"
            )

    def aborted(self) -> Completion:
        """This request ended before it ran again: its prompt as given and, resumed, the output it
        had (which rides at its prompt's end)."""
        cut = len(self.prompt_ids) - self.resumed
        return Completion(self.id, self.prompt_ids[:cut], self.prompt_ids[cut:], "abort")

    def resume(self, output: list[int]) -> Request:
        """This request continued after ``output`` (its tokens so far): prompt and output are
        prefilled, ``max_new_tokens`` counts what is left (``output`` must leave some)."""
        prompt = self.prompt_ids[: len(self.prompt_ids) - self.resumed]
        so_far = [*self.prompt_ids[len(prompt) :], *output]
        left = self.sampling.max_new_tokens + self.resumed - len(so_far)
        assert left > 0, (self.id, len(so_far), self.sampling.max_new_tokens)
        least = max(0, self.sampling.min_tokens + self.resumed - len(so_far))  # min_tokens also counts what is left
        sampling = dataclasses.replace(self.sampling, max_new_tokens=left, min_tokens=least)
        return Request(self.id, [*prompt, *so_far], sampling, self.arrival, resumed=len(so_far))


@dataclass(frozen=True)
class Timing:
    """When a request's milestones happened, in seconds after the start of ``generate`` (wall
    clock, taken by the rank that ran it)."""

    arrival: float
    started: float  # its first step began (prefill)
    first_token: float
    finished: float
    tokens: int  # generated

    @property
    def queued(self) -> float:
        return self.started - self.arrival

    @property
    def ttft(self) -> float:
        """Time to first token (from arrival)."""
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for one token)."""
        return (self.finished - self.first_token) / max(self.tokens - 1, 1)

    @property
    def latency(self) -> float:
        """End to end, from arrival."""
        return self.finished - self.arrival

    @property
    def normalized(self) -> float:
        """Seconds per generated token, end to end (DejaVu's normalized latency)."""
        return self.latency / max(self.tokens, 1)


@dataclass
class Completion:
    id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" (cancelled: its client went away)
    timing: Timing | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, where the request asked (``logprobs``)
    # what stopped it (finish_reason "stop"): its last token's id (EOS or a stop_token_ids entry) or
    # the stop string its last token completed; None where not known (rebuilt from a journal)
    stopped_by: int | str | None = None
    # prompt tokens whose KV its first admission found in the prefix cache: vLLM's num_cached_tokens;
    # None where none was looked up (no paged prefix cache: Seesaw's and DejaVu's own reuse included)
    cached_tokens: int | None = None


@dataclass
class Sequence:
    """A request in flight: its tokens so far, where its KV lives and which replica runs it."""

    request: Request
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    slot: int = -1  # KV-cache slot in its replica's cache of the layout that runs it
    replica: int = 0  # data-parallel replica (of that layout) that computes it
    blocks: list[int] = field(default_factory=list)  # paged KV: its blocks in its replica's pool
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (written by the engine loop only)
    finish_reason: str | None = None
    times: list[float] = field(default_factory=list)  # wall clock: first step began, first token, finished
    decode: Callable[[list[int]], str] | None = None  # token ids -> text (the request's stop strings)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, where the request asks
    cancelled: bool = False  # set by the loop when its request is cancelled: its next token ends it ("abort")
    block_keys: list[int] = field(default_factory=list)  # prefix cache: keys of its full blocks (engine/prefix.py)
    short_banned: frozenset[int] = frozenset()  # the ids it may not sample short of min_tokens (EOS, stop ids)
    stopped_by: int | str | None = None  # the stop token or string that ended it (finish_reason "stop")
    lead: tuple[list[int], int] | None = None  # (its prompt's last tokens, their text's length): see _lead
    cached_tokens: int | None = None  # its prompt's tokens found cached at its first admission (Completion's)
    penalty_tokens: PenaltyTokens | None = None  # its tokens as its penalties read them (made at its first row)

    @staticmethod
    def of(
        request: Request,
        eos_ids: tuple[int, ...],
        vocab_size: int = 0,
        decode: Callable[[list[int]], str] | None = None,
        device: torch.device | None = None,
    ) -> Sequence:
        """A new sequence; a resumed request's generator skips the draws of its earlier output
        (``vocab_size``: the draw's size, needed then); ``decode``: the tokenizer's, for stop
        strings; ``device``: where its noise is drawn (:func:`make_generator`)."""
        assert decode is not None or not request.sampling.stop, f"request {request.id}: stop strings need decode"
        stop, generator = request.sampling.stop_token_ids, make_generator(request.sampling, device)
        if request.resumed and generator is not None:
            assert vocab_size > 0, "a resumed, sampled request needs the vocabulary size"
            skip_draws([request.sampling] * request.resumed, [generator] * request.resumed, vocab_size)
        eos = () if request.sampling.ignore_eos else eos_ids  # stop_token_ids end a request besides EOS (vLLM's)
        # (short of min_tokens no stop token is sampled, EOS included where it is ignored: vLLM's)
        banned = frozenset((*(stop or ()), *eos_ids)) if request.sampling.min_tokens else frozenset()
        return Sequence(request, generator, frozenset((*(stop or ()), *eos)), decode=decode, short_banned=banned)

    @property
    def banned(self) -> frozenset[int]:
        """Token ids the next sample may not take: the stop ids while short of ``min_tokens``."""
        short = len(self.output) < self.request.sampling.min_tokens  # a resumed request's counts what is left
        return self.short_banned if short else frozenset()

    @property
    def generated(self) -> list[int]:
        """Its output so far (a resumed request's earlier output, at its prompt's end, included)."""
        r = self.request
        return [*r.prompt_ids[len(r.prompt_ids) - r.resumed :], *self.output]

    @property
    def row(self) -> Row:
        """What the logits processors read of it for its next token (:class:`Row`); empty where
        its request has no penalty (nothing to copy)."""
        if not self.request.sampling.penalized:
            return Row(self.banned)
        if self.penalty_tokens is None:  # (then kept a token at a time: append)
            self.penalty_tokens = PenaltyTokens([*self.request.prompt_ids, *self.output], self.generated)
        return Row(self.banned, self.penalty_tokens)

    @property
    def last_token(self) -> int:
        """The token its next decode feeds (a resumed request's last earlier output, before its own)."""
        return self.output[-1] if self.output else self.request.prompt_ids[-1]

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def append(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """The next token (and its log-probabilities: where the request asks, with every token)."""
        assert (logprobs is None) == (self.request.sampling.logprobs is None), (self.request.id, logprobs)
        self.output.append(token)
        if self.penalty_tokens is not None:
            self.penalty_tokens.add(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stop_ids:
            self.finish_reason, self.stopped_by = "stop", token
        elif (stop := self._stop_string_ended()) is not None:
            self.finish_reason, self.stopped_by = "stop", stop
        elif len(self.output) >= self.request.sampling.max_new_tokens:
            self.finish_reason = "length"
        elif self.cancelled:  # (a token that ends it anyway says so: every stage of a pipeline sees it)
            self.finish_reason = "abort"

    def _stop_string_ended(self) -> str | None:
        """The first of the request's stop strings the newest token completed (None: none did): one
        that ends in the text it added to the decoded output (past ``min_tokens`` tokens, as vLLM; a
        string may span tokens and overhang either end, as HF's ``StopStringCriteria`` catches)."""
        stops = self.request.sampling.stop
        if not stops or len(self.output) <= self.request.sampling.min_tokens:  # (vLLM's: past min_tokens)
            return None
        generated = self.generated  # a resumed request's too
        # enough tokens to hold the longest stop string (a token decodes to a character or more,
        # a few byte tokens to one character: four per character covers UTF-8)
        size = 4 * max(map(len, stops)) + 1
        # an output that short is decoded after its prompt's last tokens, as its text is (a
        # SentencePiece tokenizer keeps its leading space); a string must lie in the output's text
        lead, floor = self._lead() if len(generated) < size else ([], 0)
        window = [*lead, *generated[-size:]]
        text, before = self.decode(window), self.decode(window[:-1])
        start = new_text_start(text, before)  # (where the newest token's text begins)
        return next((s for s in stops if text.find(s, max(floor, start - len(s) + 1)) >= 0), None)

    def _lead(self) -> tuple[list[int], int]:
        """The prompt's last tokens its output is decoded after, and the length of their text
        (found once: :func:`prompt_suffix`)."""
        if self.lead is None:
            r = self.request
            tokens = prompt_suffix(self.decode, r.prompt_ids[: len(r.prompt_ids) - r.resumed])
            self.lead = (tokens, len(self.decode(tokens)) if tokens else 0)
        return self.lead

    def completion(self, start: float | None = None) -> Completion:
        """The finished request; with the wall-clock ``start`` of ``generate``, its :class:`Timing`."""
        r = self.request
        cut = len(r.prompt_ids) - r.resumed  # a resumed request's earlier output is in its prompt
        prompt, output = r.prompt_ids[:cut], [*r.prompt_ids[cut:], *self.output]
        timing = None
        if start is not None and len(self.times) == 3:
            timing = Timing(r.arrival, *(t - start for t in self.times), tokens=len(output))
        logprobs = None if r.sampling.logprobs is None else list(self.logprobs)
        cached = None if self.cached_tokens is None else min(self.cached_tokens, cut)
        return Completion(r.id, list(prompt), output, self.finish_reason, timing, logprobs, self.stopped_by, cached)


def batch_kind(seqs: list[Sequence], num_tokens: list[int]) -> str:
    """What a batch is, sequence ``i`` computing ``num_tokens[i]`` tokens from its
    ``num_computed_tokens`` on: ``"wait"`` (no sequences), ``"decode"`` (one token each, every
    prompt already computed; a resumed request's prompt ends in its earlier output, whose last
    token decodes), ``"prefill"`` (every whole prompt, from position 0) or ``"mixed"``
    (anything else: prompt chunks, beside decode tokens or not). A label for statistics and the
    runner's choice of path; a scheduler gives token counts, never a kind."""
    assert len(seqs) == len(num_tokens), (len(seqs), len(num_tokens))
    if not seqs:
        return "wait"
    if all(n == 1 and _decodes(s) for s, n in zip(seqs, num_tokens)):
        return "decode"
    if all(s.num_computed_tokens == 0 and n == s.prompt_len for s, n in zip(seqs, num_tokens)):
        return "prefill"
    return "mixed"


def _decodes(seq: Sequence) -> bool:
    """Whether ``seq`` feeding one token is a decode: its prompt is computed (a resumed request's
    but for its last token, its earlier output's last)."""
    return seq.num_computed_tokens >= seq.prompt_len - (seq.request.resumed > 0)


@dataclass
class EngineStats:
    """Counters of the loop over all replicas (identical on every rank); strategies extend it.
    ``per_rank``: the fields that are this rank's share instead (a group's figure sums its ranks')."""

    per_rank: ClassVar[tuple[str, ...]] = ()

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch_sum: int = 0
    mixed_steps: int = 0  # chunked prefill: steps that fed prompt chunks (beside decode tokens or not)
    mixed_tokens: int = 0
    mixed_seconds: float = 0.0
    kv_blocks_allocated: int = 0  # paged KV: blocks handed to sequences (all replicas)
    kv_blocks_freed: int = 0  # ... and returned when they finished
    kv_blocks_peak: int = 0  # most blocks in use at once in one replica
    preemptions: int = 0  # running requests whose KV went to older ones (computed again later)
    prompt_tokens_computed: int = 0  # prompt tokens whose KV steps computed (not a prefix cache's, not a connector's)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # ... of them whose KV cached blocks held (not computed)
    kv_bytes_released: int = 0  # KV cache memory the steps' cache moves gave up (this rank)

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_sum / max(self.decode_steps, 1)

    def add_step(self, kind: str, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """Count a step of ``kind`` (:func:`batch_kind`: the label it is counted under)."""
        if kind == "wait":  # a step that only agreed (e.g. on KV that landed): no tokens
            return
        if kind == "mixed":
            self.mixed_tokens += num_tokens
            self.mixed_steps += 1
            self.mixed_seconds += seconds
        elif kind == "prefill":
            self.prefill_tokens += num_tokens
            self.prefill_steps += 1
            self.prefill_seconds += seconds
        else:
            self.decode_tokens += num_tokens
            self.decode_steps += 1
            self.decode_batch_sum += num_seqs
            self.decode_seconds += seconds

    def summary(self) -> dict:
        """Keys a strategy adds to ``summary.json`` (none for the base counters)."""
        return {}

    def with_ranks(self, ranks: list[EngineStats]) -> EngineStats:
        """These counters (a group leader's) with each :attr:`per_rank` field summed over the
        group's ``ranks``' stats."""
        sums = {name: sum(getattr(r, name) for r in ranks) for name in self.per_rank}
        return dataclasses.replace(self, **sums)

    @classmethod
    def total(cls, groups: list[EngineStats]) -> EngineStats:
        """The counters of several engine groups as one: sums, and the largest of ``*_peak``."""
        out = cls()
        for f in dataclasses.fields(cls):
            values = [getattr(g, f.name) for g in groups]
            if values and isinstance(values[0], (int, float)):
                setattr(out, f.name, max(values) if f.name.endswith("_peak") else sum(values))
        return out


def record_times(seq: Sequence, started: float, now: float, *, emitted: bool = True) -> None:
    """A sequence's wall-clock milestones: its first step began (a first prompt chunk counts),
    its first token, its end."""
    if not seq.times:
        seq.times.append(started)
    if len(seq.times) == 1 and emitted:
        seq.times.append(now)
    if seq.finish_reason is not None and len(seq.times) == 2:
        seq.times.append(now)


def new_text_start(text: str, before: str) -> int:
    """Where the last token's text begins in ``text`` (``before``: the text without that token):
    the first character the two differ in (a token that completes a character rewrites the
    replacement character before it). Their common prefix's length, found by comparing slices (a
    stream's texts grow long: no loop over their characters)."""
    if text.startswith(before):
        return len(before)
    lo, hi = 0, min(len(text), len(before))  # text[:lo] == before[:lo]; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if text[:mid] == before[:mid] else (lo, mid - 1)
    return lo


def prompt_suffix(decode: Callable[[list[int]], str], prompt: Sequence[int]) -> list[int]:
    """The prompt's last tokens vLLM primes its detokenizer with: the fewest of its last 4 to 23
    whose text holds no replacement character (else its last 23)."""
    prompt = list(prompt)
    for k in range(4, min(len(prompt) + 1, 24)):
        if "\ufffd" not in decode(prompt[-k:]):
            return prompt[-k:]
    return prompt[-23:]  # (vLLM's whole prompt: the text after it is the same but mid-character)


def model_eos_ids(model) -> tuple[int, ...]:
    """The ids that end ``model``'s requests (unless they ignore EOS): its config's
    ``eos_token_id`` and its generation config's (``generation_config.json``, which HF ``generate``
    and vLLM read: an instruct model's end-of-turn token is often only there)."""
    generation = getattr(model, "generation_config", None)
    ids = (*eos_ids(model.config.eos_token_id), *eos_ids(getattr(generation, "eos_token_id", None)))
    return tuple(dict.fromkeys(ids))


def eos_ids(eos) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (None, an id or a list of them) as a tuple of ids."""
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
