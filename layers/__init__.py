"""Drop-in parallel layers; every parameter is a DTensor and every layer has ``redistribute()``."""

from reshard.kv import AttentionContext
from reshard.layers.attention import ParallelAttention, check_head_split, kv_replication
from reshard.layers.embedding import VocabParallelEmbedding
from reshard.layers.linear import ParallelLinear
from reshard.layers.mlp import SwiGLUMLP
from reshard.layers.moe import GroupedExperts, SparseMoE, TopKGate
from reshard.layers.norm import RMSNorm

__all__ = [
    "AttentionContext",
    "GroupedExperts",
    "ParallelAttention",
    "ParallelLinear",
    "RMSNorm",
    "SparseMoE",
    "SwiGLUMLP",
    "TopKGate",
    "VocabParallelEmbedding",
    "check_head_split",
    "kv_replication",
]
