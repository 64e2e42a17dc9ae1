"""reshard: layouts and planned, accounted movement of tensors between them; ``reshard.LLM`` and
``reshard.SamplingParams``, the engine's front door.

Every name here is imported on first use (PEP 562): ``import reshard`` costs nothing, so a
command's entry point (``reshard``, a rank's) is in control before torch is imported.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

_HOMES = MappingProxyType(
    {
        "LLM": "reshard.parallel.llm",
        "CompletionOutput": "reshard.parallel.vllm_api",
        "Logprob": "reshard.parallel.vllm_api",
        "RequestOutput": "reshard.parallel.vllm_api",
        "TextPrompt": "reshard.parallel.vllm_api",
        "TokensPrompt": "reshard.parallel.vllm_api",
        "SamplingParams": "reshard.parallel.engine.sampling",
        "MoveHandle": "reshard.api",
        "plan_for": "reshard.api",
        "redistribute": "reshard.api",
        "redistribute_module": "reshard.api",
        "empty_dtensor": "reshard.dtensor",
        "slice_to_dtensor": "reshard.dtensor",
        "wrap_local": "reshard.dtensor",
        "CommStats": "reshard.executor",
        "execute": "reshard.executor",
        "AttentionContext": "reshard.kv",
        "KVCache": "reshard.kv",
        "KVLayout": "reshard.kv",
        "KVSpec": "reshard.kv",
        "Layout": "reshard.layout",
        "chunk_range": "reshard.layout",
        "Plan": "reshard.plan",
        "plan_transfer": "reshard.plan",
    }
)

__all__ = [
    "LLM",
    "AttentionContext",
    "CommStats",
    "CompletionOutput",
    "KVCache",
    "KVLayout",
    "KVSpec",
    "Layout",
    "Logprob",
    "MoveHandle",
    "Plan",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "chunk_range",
    "empty_dtensor",
    "execute",
    "plan_for",
    "plan_transfer",
    "redistribute",
    "redistribute_module",
    "slice_to_dtensor",
    "wrap_local",
]
assert sorted(__all__) == sorted(_HOMES)

if TYPE_CHECKING:
    from reshard.api import MoveHandle, plan_for, redistribute, redistribute_module
    from reshard.dtensor import empty_dtensor, slice_to_dtensor, wrap_local
    from reshard.executor import CommStats, execute
    from reshard.kv import AttentionContext, KVCache, KVLayout, KVSpec
    from reshard.layout import Layout, chunk_range
    from reshard.parallel.engine.sampling import SamplingParams
    from reshard.parallel.llm import LLM
    from reshard.parallel.vllm_api import CompletionOutput, Logprob, RequestOutput, TextPrompt, TokensPrompt
    from reshard.plan import Plan, plan_transfer


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
