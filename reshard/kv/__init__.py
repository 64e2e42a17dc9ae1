"""KV storage: the cache, its per-step attention view, the CPU tier and background swapping."""
from .cache import KVCache, KVLayout, KVSpec
from .context import AttentionContext, DecodeInputs
from .swap import KVSwapper
from .tier import CPUKVTier, TierSpec

__all__ = ["AttentionContext", "CPUKVTier", "DecodeInputs", "KVCache", "KVLayout", "KVSpec", "KVSwapper",
           "TierSpec"]
