"""reshard: layouts and planned, accounted movement of tensors between them."""

from reshard.api import MoveHandle, plan_for, redistribute, redistribute_module
from reshard.dtensor import empty_dtensor, slice_to_dtensor, wrap_local
from reshard.executor import CommStats, execute
from reshard.kv import AttentionContext, KVCache, KVLayout, KVSpec
from reshard.layout import Layout, chunk_range
from reshard.plan import Plan, plan_transfer

__all__ = [
    "AttentionContext",
    "CommStats",
    "KVCache",
    "KVLayout",
    "KVSpec",
    "Layout",
    "MoveHandle",
    "Plan",
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
