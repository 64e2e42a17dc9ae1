"""reshard: layouts and planned movement of tensors between them."""
from .api import redistribute
from .dtensor import empty_dtensor, slice_to_dtensor, wrap_local
from .kv_cache import KVCache
from .layout import Layout, chunk_range

__all__ = ["KVCache", "Layout", "chunk_range", "empty_dtensor", "redistribute", "slice_to_dtensor",
           "wrap_local"]
