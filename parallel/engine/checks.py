"""What the engine refuses before it runs anything: requests it cannot serve and configurations its
default policy cannot run. Each check raises one ``ValueError`` naming the request or the values,
alike on every rank and before any collective."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from torch import nn

from reshard.parallel.engine.request import Request
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
    if n + m > max_seq_len:
        raise ValueError(
            f"request {r.id}: prompt length ({n}) + max_new_tokens ({m}) = {n + m} exceeds max_seq_len ({max_seq_len})"
        )
    bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {r.id}: token ids {bad[:5]} outside vocab [0, {vocab_size})")


def _check_carried(r: Request, *, has_tokenizer: bool) -> None:
    if r.sampling.stop and not has_tokenizer:
        raise ValueError(
            f"request {r.id}: stop strings {r.sampling.stop!r} are matched in decoded text and the engine has "
            "no tokenizer: give Engine(..., tokenizer=) one (the recipe takes the checkpoint's)"
        )


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
