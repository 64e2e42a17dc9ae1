"""Parallelization plans: HF module names -> the drop-in layer (and layout) that replaces them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import Shard

from layers import ParallelAttention, check_head_split, ParallelLinear, RMSNorm, SwiGLUMLP, VocabParallelEmbedding

from .dims import ParallelDims


@dataclass
class BuildContext:
    """What a style needs to build a layer in place of an HF module."""

    config: object  # transformers PretrainedConfig
    dims: ParallelDims
    dtype: torch.dtype
    device: torch.device | str
    layer_idx: int = 0
    name: str = ""  # the HF module being replaced
    stage_meshes: list | None = None  # pipeline: the tp mesh of every stage

    @property
    def tp_mesh(self):
        """The tp mesh the module lives on: this rank's, or its pipeline stage's."""
        if self.stage_meshes is None:
            return self.dims.mesh("tp")
        from .layouts import stage_of_module

        layers = self.config.num_hidden_layers
        return self.stage_meshes[stage_of_module(self.name, layers, len(self.stage_meshes))]

    @property
    def kw(self) -> dict:
        return dict(dtype=self.dtype, device=self.device)


class ParallelStyle(Protocol):
    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module: ...


class VocabParallel:
    """Embedding rows split over tp (Shard(0)), all-reduced lookups."""

    def build(self, module: nn.Embedding, ctx: BuildContext) -> nn.Module:
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim,
                                      module.padding_idx, mesh=ctx.tp_mesh, **ctx.kw)


class HeadParallel:
    """Attention heads split over tp; KV heads replicated when tp exceeds them."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        cfg = ctx.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        tp = ctx.dims.tp
        check_head_split(heads, kv_heads, tp)
        if ctx.stage_meshes is not None and kv_heads < tp:
            raise ValueError(f"pipeline stages with KV-head replication (KV heads {kv_heads} < tp {tp}) "
                             f"are not supported yet")
        kv_mesh = ctx.dims.kv_head_mesh(kv_heads) if 1 < tp and kv_heads < tp else None
        return ParallelAttention(
            cfg.hidden_size, heads, kv_heads, module.head_dim, mesh=ctx.tp_mesh, kv_mesh=kv_mesh,
            layer_idx=ctx.layer_idx, qkv_bias=module.q_proj.bias is not None,
            o_bias=module.o_proj.bias is not None, qk_norm=hasattr(module, "q_norm"),
            rms_norm_eps=cfg.rms_norm_eps, sliding_window=_sliding_window(module, cfg), **ctx.kw)


class FFNParallel:
    """gate/up colwise, down rowwise over tp."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return SwiGLUMLP(module.gate_proj.in_features, module.gate_proj.out_features,
                         mesh=ctx.tp_mesh, hidden_act=ctx.config.hidden_act,
                         bias=module.gate_proj.bias is not None, **ctx.kw)


class ReplicatedNorm:
    """RMSNorm with its weight replicated over tp."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return RMSNorm(module.weight.shape[0], module.variance_epsilon, mesh=ctx.tp_mesh, **ctx.kw)


class ColwiseGather:
    """LM head rows (vocab) split over tp, logits all-gathered so every rank samples the same."""

    def build(self, module: nn.Linear, ctx: BuildContext) -> nn.Module:
        return ParallelLinear(module.in_features, module.out_features, module.bias is not None,
                              mesh=ctx.tp_mesh, placements=(Shard(0),), gather_output=True,
                              **ctx.kw)


def _sliding_window(module: nn.Module, cfg) -> int | None:
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(cfg, "sliding_window", None)


def tp_plan() -> dict[str, ParallelStyle]:
    """Tensor parallelism for Llama/Qwen2/Qwen3/Mistral decoder models, keyed by HF module names."""
    return {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": HeadParallel(),
        "model.layers.*.mlp": FFNParallel(),
        "model.layers.*.input_layernorm": ReplicatedNorm(),
        "model.layers.*.post_attention_layernorm": ReplicatedNorm(),
        "model.norm": ReplicatedNorm(),
        "lm_head": ColwiseGather(),
    }


__all__ = ["BuildContext", "ColwiseGather", "FFNParallel", "HeadParallel", "ParallelStyle",
           "ReplicatedNorm", "VocabParallel", "tp_plan"]
