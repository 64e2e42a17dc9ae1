"""Shift Parallelism: Ulysses SP x TP for large steps, full TP for small ones, one KV cache.

``parallelize_shift`` loads an HF checkpoint in the base (SP x TP) layout and adds the full-TP
layout of attention and MLP weights (a copy, or views of the base shards). :class:`ShiftEngine`
picks the mode per forward from the step's token count: ``tokens > threshold`` runs SP (tokens
split over ``sp``), otherwise TP. Both modes give each rank the same head block
(``ParallelDims.head_block``), so nothing moves at a switch.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from layers import ParallelLinear, RMSNorm, SwiGLUMLP, VocabParallelEmbedding
from layers._comm import all_gather
from layers.attention import AttentionContext
from layers.mlp import add_shift_layout
from layers.ulysses import UlyssesAttention

from .dims import ParallelDims
from .engine import Engine
from .parallelize import parallelize
from .plans import BuildContext, _sliding_window

log = logging.getLogger(__name__)
BASE = (Replicate(), Shard(0))  # replicated over sp, split over tp


class ShiftAttentionStyle:
    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        cfg = ctx.config
        return UlyssesAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim,
            meshes=ctx.dims.shift_meshes(cfg.num_key_value_heads), layer_idx=ctx.layer_idx,
            qkv_bias=module.q_proj.bias is not None, o_bias=module.o_proj.bias is not None,
            qk_norm=hasattr(module, "q_norm"), rms_norm_eps=cfg.rms_norm_eps,
            sliding_window=_sliding_window(module, cfg), **ctx.kw)


class ShiftFFNStyle:
    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return SwiGLUMLP(module.gate_proj.in_features, module.gate_proj.out_features,
                         mesh=ctx.dims.base_mesh(), hidden_act=ctx.config.hidden_act,
                         bias=module.gate_proj.bias is not None, placements=BASE, **ctx.kw)


class BaseEmbeddingStyle:
    def build(self, module: nn.Embedding, ctx: BuildContext) -> nn.Module:
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                      mesh=ctx.dims.base_mesh(), placements=BASE, **ctx.kw)


class BaseNormStyle:
    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return RMSNorm(module.weight.shape[0], module.variance_epsilon, mesh=ctx.dims.base_mesh(), **ctx.kw)


class BaseLMHeadStyle:
    def build(self, module: nn.Linear, ctx: BuildContext) -> nn.Module:
        return ParallelLinear(module.in_features, module.out_features, module.bias is not None,
                              mesh=ctx.dims.base_mesh(), placements=BASE, gather_output=True, **ctx.kw)


def shift_plan() -> dict:
    """Base layout for every module; attention and MLP also get the full-TP layout after loading."""
    return {
        "model.embed_tokens": BaseEmbeddingStyle(),
        "model.layers.*.self_attn": ShiftAttentionStyle(),
        "model.layers.*.mlp": ShiftFFNStyle(),
        "model.layers.*.input_layernorm": BaseNormStyle(),
        "model.layers.*.post_attention_layernorm": BaseNormStyle(),
        "model.norm": BaseNormStyle(),
        "lm_head": BaseLMHeadStyle(),
    }


def parallelize_shift(path: str | os.PathLike, dims: ParallelDims, *, shift_weights: str = "copy",
                      dtype: torch.dtype | None = None) -> nn.Module:
    """Load ``path`` for Shift parallelism on ``dims`` (``sp * tp`` ranks).

    ``shift_weights``: ``"copy"`` keeps separate full-TP shards beside the base weights (the
    paper's "separate models"; extra memory ~1/sp of the base), ``"slice"`` takes views of the base
    shards. ``model.shift_extra_bytes`` reports this rank's extra bytes.
    """
    if shift_weights not in ("copy", "slice"):
        raise ValueError(f"shift_weights must be 'copy' or 'slice', got {shift_weights!r}")
    if dims.dp != 1 or dims.pp != 1:
        raise ValueError(f"Shift parallelism runs on sp x tp ranks; got dp({dims.dp}), pp({dims.pp})")
    model = parallelize(path, dims, plan=shift_plan(), dtype=dtype)
    copy, extra = shift_weights == "copy", 0
    for layer in model.model.layers:
        extra += layer.self_attn.add_shift_layouts(copy=copy)
        extra += add_shift_layout(layer.mlp, dims.shift_mesh(), copy=copy)
    model.shift_extra_bytes = extra
    attn = model.model.layers[0].self_attn
    log.info("shift parallelism: sp=%d tp=%d, KV-head replication x%d, shift weights %s (+%d bytes)",
             dims.sp, dims.tp, attn.kv_replication, shift_weights, extra)
    return model


def set_mode(model: nn.Module, mode: str) -> None:
    """Run the next forwards in ``mode`` (``"sp"`` or ``"tp"``): attention and MLP pick layouts."""
    for layer in model.model.layers:
        layer.self_attn.set_mode(mode)
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            proj.mode = "tp" if mode == "tp" else "base"


@dataclass
class ShiftStats:
    steps_by_mode: dict = field(default_factory=lambda: {"sp": 0, "tp": 0})
    mode_switches: int = 0
    switch_bytes: int = 0  # bytes moved at switches: nothing moves, the KV cache is shared
    kv_storage: list = field(default_factory=list)  # KV data pointers seen at each switch


class ShiftEngine(Engine):
    """The generation engine with a per-forward SP/TP choice by token count (Algorithm 3)."""

    def __init__(self, model: nn.Module, *, threshold: int, **kwargs) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        super().__init__(model, **kwargs)
        if self.compiled:  # one graph per mode: dynamo guards on self._mode
            self._compiled_mode = torch.compile(self._forward_mode)
            self._decode_forward = self._compiled_forward
        self.threshold = threshold
        self.mesh = model.model.embed_tokens.weight.device_mesh  # (sp, tp)
        self.shift = ShiftStats()
        self._mode: str | None = None

    def mode_for(self, num_tokens: int) -> str:
        return "sp" if num_tokens > self.threshold else "tp"

    def _forward(self, ids, positions, ctx: AttentionContext, last) -> torch.Tensor:
        mode = self.mode_for(int(ids.numel()))
        self._switch(mode)
        return self._forward_mode(ids, positions, ctx, last)

    def decode(self, seqs) -> None:
        self._active = len(seqs)  # the static compiled step pads to every slot; decide on real tokens
        super().decode(seqs)

    def _compiled_forward(self, ids, positions, ctx, last) -> torch.Tensor:
        self._switch(self.mode_for(self._active))
        return self._compiled_mode(ids, positions, ctx, last)

    def _forward_mode(self, ids, positions, ctx, last) -> torch.Tensor:
        if self._mode == "tp":
            return super()._forward(ids, positions, ctx, last)
        return self._forward_sp(ids, positions, ctx, last)

    def _switch(self, mode: str) -> None:
        if self._mode is not None and self.model.model.layers[0].self_attn.mode != self._mode:
            self._mode = None  # another engine on the same model changed its mode: set it again
        if mode != self._mode:
            if self._mode is not None:
                self.shift.mode_switches += 1
                self.shift.kv_storage.append([k.data_ptr() for k in self.kv.k])
            set_mode(self.model, mode)
            self._mode = mode
        self.shift.steps_by_mode[mode] += 1

    def _forward_sp(self, ids, positions, ctx, last) -> torch.Tensor:
        """Tokens split over sp (padded to a multiple of it); hidden states gathered at the end."""
        sp, s = self.mesh.size(0), self.mesh.get_coordinate()[0]
        n = ids.numel()
        local = -(-n // sp)
        ids = F.pad(ids, (0, local * sp - n))[s * local:(s + 1) * local]
        pos = F.pad(positions, (0, local * sp - n))[s * local:(s + 1) * local][None]
        m = self.model.model
        h = m.embed_tokens(ids[None])  # (1, N / sp, D)
        emb = m.rotary_emb(h, pos)
        for layer in m.layers:
            h = layer(h, position_embeddings=emb, position_ids=pos, attn_context=ctx)
        h = all_gather(h[0], self.mesh, 0)[:n]  # (N, D): every rank's tokens
        return self.model.lm_head(m.norm(h[last])[None])[0].float()
