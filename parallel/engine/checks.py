"""What the engine refuses before it runs anything: requests it cannot serve and configurations its
default policy cannot run, and request lists that differ between the ranks that run them. Each
check raises one ``ValueError`` naming the request or the values, alike on every rank and before
any collective of the run (:func:`check_same_requests` is one itself)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import torch.distributed as dist
from torch import nn

from reshard.mesh import all_gather_objects
from reshard.parallel.engine.request import Request
from reshard.parallel.engine.sampling import fresh_seed, needs_seed, resolve_seeds
from reshard.parallel.model.info import parallel_info


def check_requests(requests: Seq[Request], *, vocab_size: int, max_seq_len: int, has_tokenizer: bool) -> None:
    """Repeated ids, then each request (:func:`check_request`)."""
    seen: set = set()
    for r in requests:
        if r.id in seen:
            raise ValueError(f"request id {r.id!r} appears more than once; ids must be unique")
        seen.add(r.id)
        check_request(r, vocab_size=vocab_size, max_seq_len=max_seq_len, has_tokenizer=has_tokenizer)


def check_request(r: Request, *, vocab_size: int, max_seq_len: int, has_tokenizer: bool) -> None:
    """Empty, too long or out-of-vocabulary prompts, token ids that are not ints, and what the
    engine cannot honour (stop strings without a tokenizer)."""
    n, m = len(r.prompt_ids), r.sampling.max_new_tokens
    if n == 0:
        raise ValueError(f"request {r.id}: empty prompt")
    not_int = [t for t in r.prompt_ids if type(t) is not int]  # bools and floats are not token ids
    if not_int:
        raise ValueError(f"request {r.id}: token ids must be ints, got {not_int[:5]}")
    _check_carried(r, has_tokenizer=has_tokenizer)
    if m is None:
        raise ValueError(
            f"request {r.id}: max_new_tokens=None (vLLM's max_tokens=None: to the end of the model's context) is "
            "resolved by reshard.LLM; give the engine a number"
        )
    if r.sampling.prompt_logprobs is not None:
        raise ValueError(
            f"request {r.id}: prompt_logprobs are computed by reshard.LLM (or Engine.prompt_logits), not per request"
        )
    if r.sampling.n != 1:
        raise ValueError(
            f"request {r.id}: SamplingParams.n={r.sampling.n}: the engine runs one sample per request "
            "(reshard.LLM makes n requests of a prompt; here give n requests)"
        )
    if n + m > max_seq_len:
        raise ValueError(
            f"request {r.id}: prompt length ({n}) + max_new_tokens ({m}) = {n + m} exceeds max_seq_len ({max_seq_len})"
        )
    bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {r.id}: prompt token ids {bad[:5]} outside the vocabulary of {vocab_size} tokens")
    stops = [t for t in r.sampling.stop_token_ids or () if not t < vocab_size]
    if stops:
        raise ValueError(
            f"request {r.id}: stop_token_ids {stops[:5]} outside the vocabulary of {vocab_size} tokens "
            "(they could never be sampled)"
        )


def _check_carried(r: Request, *, has_tokenizer: bool) -> None:
    if r.sampling.stop and not has_tokenizer:
        raise ValueError(
            f"request {r.id}: stop strings {r.sampling.stop!r} are matched in decoded text and the engine has "
            "no tokenizer: give Engine(..., tokenizer=) one (the recipe takes the checkpoint's)"
        )


def check_same_requests(requests: Seq[Request], group: dist.ProcessGroup | None) -> None:
    """``ValueError`` on every rank of ``group`` unless each passed the same requests (ids, prompts,
    sampling, arrivals): ranks that step together on different lists would pair one rank's
    completions with another's prompts. One small all-gather of digests (a second one, of each
    request's digest, names the first request that differs)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digests = [_digest(r) for r in requests]
    whole = all_gather_objects((len(digests), hashlib.sha256(b"".join(digests)).digest()), group)
    if any(w != whole[0] for w in whole):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        _refuse(all_gather_objects(digests, group), ranks, requests)


def check_posted_requests(requests: Seq[Request], channel, ranks: Seq[int], timeout=None) -> None:
    """:func:`check_same_requests` for engine groups, which share no collective before they start:
    each rank posts its requests' digests to ``channel`` (a :class:`~reshard.parallel.engine.router.Channel`)
    and reads every other rank's (waiting up to ``timeout``)."""
    digests = [_digest(r) for r in requests]
    channel.put(f"requests/{dist.get_rank()}", digests)
    for rank in ranks:
        channel.wait(f"requests/{rank}", f"rank {dist.get_rank()} waiting for rank {rank}'s request digests", timeout)
    everyone = [channel.get(f"requests/{rank}") for rank in ranks]
    differ = any(d != everyone[0] for d in everyone)
    if channel.add("requests/read", 1) == len(ranks):  # the last reader clears them (and a refused call's start)
        channel.clear([f"requests/{rank}" for rank in ranks] + ["requests/read"] + ["seed", "start"] * differ)
    if differ:
        _refuse(everyone, ranks, requests)


def _refuse(everyone: list[list[bytes]], ranks: Seq[int], requests: Seq[Request]) -> None:
    """The one ``ValueError`` for request lists that differ (``everyone``: each rank's digests)."""
    first = next(k for k in range(len(everyone)) if everyone[k] != everyone[0])
    a, b = everyone[0], everyone[first]
    if len(a) != len(b):
        raise ValueError(
            f"ranks passed different requests to generate: rank {ranks[0]} passed {len(a)}, rank "
            f"{ranks[first]} passed {len(b)}; every rank of the engine must pass the same list (reshard.LLM(..., "
            'dp_prompts="local"): each rank its own prompts)'
        )
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    raise ValueError(
        f"ranks passed different requests to generate: request {i} (id {requests[i].id!r} on rank "
        f"{dist.get_rank()}) differs between rank {ranks[0]} and rank {ranks[first]} (prompt, sampling or "
        'arrival); every rank of the engine must pass the same list (reshard.LLM(..., dp_prompts="local"): each '
        "rank its own prompts)"
    )


def _digest(r: Request) -> bytes:
    """A request's identity across processes: every field (id, prompt, sampling, arrival, ...)."""
    return hashlib.sha256(repr(r).encode()).digest()  # the dataclass's fields, its kind (Migrated...) too


def check_chunked(prefill_chunk: int, *, model: nn.Module | None, policy: object | None) -> None:
    """Chunked prefill runs in the default continuous-batching policy of a model without pipeline
    stages (:class:`EngineConfig` checks the config alone)."""
    if model is None or policy is not None:
        raise ValueError(
            f"prefill_chunk ({prefill_chunk}) runs in the default continuous-batching policy of "
            f"Engine(model, ...); got runners/policy {type(policy).__name__}"
        )
    pp = parallel_info(model).dims.pp
    if pp > 1:
        raise ValueError(f"prefill_chunk ({prefill_chunk}) cannot be combined with pipeline stages (pp={pp})")


def seeded(requests: Seq[Request], seed: int | None, group: dist.ProcessGroup | None) -> list[Request]:
    """``requests`` with every sampled one that names no seed given one from the call's ``seed``
    and its position (:func:`~reshard.parallel.engine.sampling.resolve_seeds`); ``seed=None``:
    a fresh one, the first rank's of ``group`` (one small all-gather, made whatever the requests,
    so ranks never differ in collectives; engine groups, which share none before they start, give
    the seed their first rank posted)."""
    if seed is None:
        seed = fresh_seed()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            seed = all_gather_objects(seed, group)[0]
    return resolve_seeds(requests, seed) if needs_seed(requests) else list(requests)


def check_one_microbatch(config) -> None:
    """Experts over the replicas pair every replica's MoE collectives, one forward per step each:
    ``ValueError`` for micro-batches (each replica would split its own tokens its own way)."""
    if config.num_microbatches not in (None, 1):
        raise ValueError(
            f"engine.num_microbatches ({config.num_microbatches}) must be 1 with the experts over the replicas "
            "(data-parallel attention x EP, SiDP's expert pool): every replica runs one forward per step"
        )
