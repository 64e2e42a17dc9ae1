"""KV storage: the cache, its per-step attention view, the CPU tier and background swapping."""

from reshard.kv.cache import KVCache, KVLayout, KVSpec
from reshard.kv.context import AttentionContext, Chunked, DecodeInputs
from reshard.kv.swap import KVSwapper
from reshard.kv.tier import CPUKVTier, TierSpec

__all__ = [
    "AttentionContext",
    "CPUKVTier",
    "Chunked",
    "DecodeInputs",
    "KVCache",
    "KVLayout",
    "KVSpec",
    "KVSwapper",
    "TierSpec",
]
