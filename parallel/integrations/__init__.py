"""Adapters that let RL frameworks drive :class:`reshard.LLM` through their own interfaces
(``reshard.integrations.trl``, ``reshard.integrations.verl``), and the one translation of the
sampling names they share (vLLM's) into :class:`SamplingParams`."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from reshard.parallel.engine.sampling import SamplingParams

_RENAMED = MappingProxyType({"max_tokens": "max_new_tokens"})  # vLLM's names -> ours
_KNOWN = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"n"}


def vllm_sampling(given: dict, where: str) -> SamplingParams:
    """vLLM-named sampling keys (``max_tokens``, ``temperature``, ``top_k`` with -1 for off,
    ``logprobs`` as a bool or a count, ...) as :class:`SamplingParams`; a key the engine cannot
    honour is a ``ValueError`` naming it and ``where`` it came from (a request, a config)."""
    kw = {}
    for key, value in given.items():
        name = _RENAMED.get(key, key)
        if name not in _KNOWN:
            raise ValueError(f"{where}: sampling parameter {key!r} is not one reshard honours")
        kw[name] = value
    if isinstance(kw.get("logprobs"), bool):
        kw["logprobs"] = 0 if kw["logprobs"] else None
    if kw.get("top_k") in (-1, None):  # vLLM's and verl's "off" (TRL's None)
        kw["top_k"] = 0
    if kw.get("min_p") is None and "min_p" in kw:
        kw["min_p"] = 0.0
    return SamplingParams(**kw)
