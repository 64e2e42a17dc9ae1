"""Drop-in parallel layers; every parameter is a DTensor and every layer has ``redistribute()``."""
from reshard.kv import AttentionContext

from .attention import ParallelAttention, check_head_split, kv_replication
from .embedding import VocabParallelEmbedding
from .linear import ParallelLinear
from .mlp import SwiGLUMLP
from .norm import RMSNorm

__all__ = ["AttentionContext", "ParallelAttention", "ParallelLinear", "RMSNorm", "SwiGLUMLP",
           "VocabParallelEmbedding", "check_head_split", "kv_replication"]
