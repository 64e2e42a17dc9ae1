"""Parallelization plans: HF module names -> the drop-in layer (and layout) that replaces them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from reshard.kv import Chunked
from reshard.layers import (
    GroupedExperts,
    ParallelAttention,
    ParallelLinear,
    RMSNorm,
    SparseMoE,
    SwiGLUMLP,
    TopKGate,
    VocabParallelEmbedding,
    check_head_split,
)
from reshard.layers.attention import PositionScheme
from reshard.layers.ulysses import SHIFT_WEIGHTS
from reshard.mesh import cached_mesh
from reshard.parallel.model.dims import ParallelDims, rank_grid

TP = (Shard(0),)  # split over the 1-D tp mesh
MeshOf = Callable[[str], DeviceMesh]  # HF module name -> the mesh that module lives on


@dataclass
class BuildContext:
    """What a style needs to build a layer in place of an HF module."""

    config: object  # transformers PretrainedConfig
    dims: ParallelDims
    dtype: torch.dtype
    device: torch.device | str
    layer_idx: int = 0
    name: str = ""  # the HF module being replaced
    mesh_of: MeshOf | None = None  # None: every module on this rank's tp mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh the module lives on: ``mesh_of(name)`` (a pipeline stage's tp mesh, Shift's
        ``(sp, tp)`` base mesh, ...), else this rank's tp mesh."""
        return self.mesh_of(self.name) if self.mesh_of is not None else self.dims.mesh("tp")

    @property
    def kw(self) -> dict:
        return dict(dtype=self.dtype, device=self.device)


class ParallelStyle(Protocol):
    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module: ...


@dataclass(frozen=True)
class VocabParallel:
    """Embedding rows (vocab) with ``placements`` on the module's mesh (default Shard(0) over tp),
    lookups all-reduced over the sharded axes; output replicated."""

    placements: tuple[Placement, ...] = TP

    def build(self, module: nn.Embedding, ctx: BuildContext) -> nn.Module:
        return VocabParallelEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            mesh=ctx.mesh,
            placements=self.placements,
            **ctx.kw,
        )


@dataclass(frozen=True)
class HeadParallel:
    """Attention heads Shard(0) over the module's 1-D tp mesh (o_proj Shard(1)); when tp exceeds the
    KV heads, k/v are ``(Shard(0), Replicate())`` on that mesh's ``(tp_kv, tp_rep)`` view."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        cfg, mesh = ctx.config, ctx.mesh
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        check_head_split(heads, kv_heads, mesh.size())
        kv_mesh = kv_head_mesh(ctx.dims, kv_heads, mesh) if kv_heads < mesh.size() else None
        return ParallelAttention(
            cfg.hidden_size,
            heads,
            kv_heads,
            module.head_dim,
            mesh=mesh,
            kv_mesh=kv_mesh,
            layer_idx=ctx.layer_idx,
            qkv_bias=module.q_proj.bias is not None,
            o_bias=module.o_proj.bias is not None,
            qk_norm=hasattr(module, "q_norm"),
            rms_norm_eps=cfg.rms_norm_eps,
            sliding_window=_sliding_window(module, cfg, ctx.layer_idx),
            position_scheme=position_scheme(cfg, ctx.layer_idx),
            **ctx.kw,
        )


def position_scheme(cfg, layer_idx: int) -> PositionScheme:
    """Llama 4's NoPE layers (``no_rope_layers[i] == 0``) with their query temperature, and the L2
    q/k norm of its RoPE layers; every other family's default RoPE."""
    if cfg.model_type != "llama4_text":
        return PositionScheme()
    rope = bool(cfg.no_rope_layers[layer_idx])
    temperature = (cfg.attn_scale, cfg.floor_scale) if cfg.attn_temperature_tuning and not rope else None
    return PositionScheme(rope=rope, l2_norm=rope and cfg.use_qk_norm, eps=cfg.rms_norm_eps, temperature=temperature)


def kv_head_mesh(dims: ParallelDims, num_kv_heads: int, tp_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 2-D ``(tp_kv, tp_rep)`` view of ``tp_mesh`` (default: this rank's tp mesh) for KV-head
    replication: tp rank ``r`` holds KV head ``r // (tp // num_kv_heads)``.

    ``tp_mesh`` may be any tp group of the world, e.g. a pipeline stage this rank is not in. The
    views of every tp group (each ``(dp, pp, sp)`` coordinate, ranks ascending) are created on
    every rank in the same order, since mesh creation is collective over the world.
    """
    if dims.tp % num_kv_heads != 0:
        raise ValueError(
            f"tensor parallel size ({dims.tp}) must be divisible by KV heads ({num_kv_heads}) to replicate them"
        )
    return tp_view(dims, num_kv_heads, ("tp_kv", "tp_rep"), tp_mesh)


def expert_mesh(dims: ParallelDims, tp_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 2-D ``(ep, etp)`` mesh experts live on: the view of ``tp_mesh`` (default: this rank's tp
    mesh) as ``dims.ep`` groups of experts, each expert tensor parallel over ``tp // ep`` ranks; with
    data-parallel attention (``dims.expert_dispatch``) every replica's rank as one expert group."""
    if dims.expert_dispatch:
        return cached_mesh(rank_grid(dims).view(dims.dp, 1), ("ep", "etp"))
    return tp_view(dims, dims.ep, ("ep", "etp"), tp_mesh)


def tp_view(dims: ParallelDims, outer: int, names: tuple[str, str], tp_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 2-D ``(outer, tp // outer)`` view of ``tp_mesh``, any tp group of the world. The views
    of every tp group (each ``(dp, pp, sp)`` coordinate, ranks ascending) are created on every rank
    in the same order, since mesh creation is collective over the world."""
    tp_mesh = tp_mesh if tp_mesh is not None else dims.mesh("tp")
    groups = rank_grid(dims).view(-1, outer, dims.tp // outer)  # (dp*pp*sp, outer, inner)
    views = [cached_mesh(g, names) for g in groups]
    ranks = tp_mesh.mesh.flatten().tolist()
    for view in views:
        if view.mesh.flatten().tolist() == ranks:
            return view
    raise ValueError(f"mesh over ranks {ranks} is not a tp group of {dims}")


@dataclass(frozen=True)
class FFNParallel:
    """gate/up colwise, down rowwise: ``placements`` per axis of the module's mesh (default Shard(0)
    over tp; ``Replicate()`` on an axis keeps the weights whole along it). A sparse MoE block's
    experts: ``experts="tp"`` on the tp group's ``(ep, etp)`` view (:func:`expert_mesh`),
    ``"token_replicas"`` over every rank of an ``(sp, tp)`` base mesh whose tp ranks hold the same
    tokens (Shift's: :func:`shift_token_replicas`)."""

    placements: tuple[Placement, ...] = TP
    experts: str = "tp"

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        if hasattr(module, "experts"):  # a sparse MoE block (HF's, of any family)
            return _moe(module, ctx, self.placements, shift=self.experts == "token_replicas")
        return SwiGLUMLP(
            module.gate_proj.in_features,
            module.gate_proj.out_features,
            mesh=ctx.mesh,
            hidden_act=ctx.config.hidden_act,
            bias=module.gate_proj.bias is not None,
            placements=self.placements,
            **ctx.kw,
        )


def _moe(module: nn.Module, ctx: BuildContext, placements: tuple[Placement, ...], *, shift: bool) -> SparseMoE:
    """HF's sparse MoE block as :class:`SparseMoE` on the module's mesh: the router and the shared
    expert's gate replicated, the shared expert an FFN of ``placements``; the experts on the tp
    group's ``(ep, etp)`` view, or (``shift``) over all ranks of Shift's base mesh with the tokens
    dispatched by all-to-all in both modes. Llama 4's routing weight scales the expert's input."""
    cfg, mesh, llama4 = ctx.config, ctx.mesh, ctx.config.model_type == "llama4_text"
    num_experts, hidden, intermediate = expert_shape(module.experts.gate_up_proj, llama4)
    gate = _router(module, num_experts, hidden, mesh, ctx, llama4)
    experts = GroupedExperts(
        num_experts, hidden, intermediate, mesh=_shift_experts(mesh) if shift else expert_mesh(ctx.dims, mesh),
        hidden_act=cfg.hidden_act, scale_input=llama4, **ctx.kw,
    )  # fmt: skip
    kw = dict(
        dispatch=shift or ctx.dims.expert_dispatch,
        token_replicas=shift_token_replicas(mesh) if shift else None,
        router_name="router" if llama4 else "gate",
        tuple_output=llama4,
    )
    shared = getattr(module, "shared_expert", None)
    if shared is None:
        return SparseMoE(gate, experts, mesh, **kw)
    mlp = SwiGLUMLP(
        hidden, shared.gate_proj.out_features, mesh=mesh, hidden_act=cfg.hidden_act, placements=placements, **ctx.kw
    )
    whole = (Replicate(),) * mesh.ndim
    gated = None if llama4 else ParallelLinear(hidden, 1, False, mesh=mesh, placements=whole, **ctx.kw)
    return SparseMoE(gate, experts, mesh, mlp, gated, **kw)


def _router(module: nn.Module, num_experts: int, hidden: int, mesh: DeviceMesh, ctx: BuildContext, llama4: bool):
    """The block's :class:`TopKGate`, replicated: Qwen's and Mixtral's softmax routers (``gate``;
    ``norm_topk_prob``, Mixtral always renormalizing in fp32), Llama 4's sigmoid one (``router``)."""
    router = module.router if llama4 else module.gate
    return TopKGate(
        hidden,
        num_experts,
        router.top_k,
        mesh=mesh,
        renormalize=getattr(router, "norm_topk_prob", True),
        cast_back=llama4 or hasattr(router, "norm_topk_prob"),
        scoring="sigmoid" if llama4 else "softmax",
        **ctx.kw,
    )


def _shift_experts(base: DeviceMesh) -> DeviceMesh:
    """Shift's experts: every rank of the ``(sp, tp)`` base mesh its own group of experts, as an
    ``(ep, etp) = (sp * tp, 1)`` mesh — one layout for both modes, so nothing moves at a switch."""
    return cached_mesh(base.mesh.reshape(-1, 1), ("ep", "etp"))


def shift_token_replicas(base: DeviceMesh) -> dict[str | None, tuple[DeviceMesh, int]]:
    """Per weight source (Shift's mode), the ranks holding the same tokens as this one: in SP mode
    (own weights) the tp axis of the base mesh (tokens split over sp, replicated over tp), in TP
    mode (:data:`SHIFT_WEIGHTS`) every rank. Each rank dispatches its share of them."""
    return {None: (base, 1), SHIFT_WEIGHTS: (_shift_experts(base), 0)}


def expert_shape(gate_up: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """``(experts, hidden, intermediate)`` of transformers' fused ``gate_up_proj``: ``(E, 2I, D)``,
    or ``(E, D, 2I)`` where ``transposed`` (Llama 4 stores its experts input-major)."""
    num_experts, a, b = gate_up.shape
    return (num_experts, a, b // 2) if transposed else (num_experts, b, a // 2)


@dataclass(frozen=True)
class ReplicatedNorm:
    """RMSNorm with its weight Replicate() on every axis of the module's mesh."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        eps = getattr(module, "variance_epsilon", None) or module.eps  # (Llama 4's RMSNorm: eps)
        return RMSNorm(module.weight.shape[0], eps, mesh=ctx.mesh, **ctx.kw)


@dataclass(frozen=True)
class ColwiseGather:
    """LM head rows (vocab) with ``placements`` on the module's mesh (default Shard(0) over tp),
    logits all-gathered so every rank samples the same."""

    placements: tuple[Placement, ...] = TP

    def build(self, module: nn.Linear, ctx: BuildContext) -> nn.Module:
        return ParallelLinear(
            module.in_features,
            module.out_features,
            module.bias is not None,
            mesh=ctx.mesh,
            placements=self.placements,
            gather_output=True,
            **ctx.kw,
        )


def _sliding_window(module: nn.Module, cfg, layer_idx: int) -> int | Chunked | None:
    """The layer's attention window: its module's, else the config's for a ``sliding_attention``
    layer (``layer_types``; Llama 4's ``chunked_attention``: :class:`Chunked`), else
    ``sliding_window`` unless ``use_sliding_window`` is off; None: full."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[layer_idx] == "chunked_attention":
        return Chunked(cfg.attention_chunk_size)
    if types is not None:
        return cfg.sliding_window if types[layer_idx] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return getattr(cfg, "sliding_window", None) or None


def tp_plan() -> dict[str, ParallelStyle]:
    """Tensor parallelism for Llama/Qwen2/Qwen3/Mistral decoder models, keyed by HF module names."""
    return {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": HeadParallel(),
        "model.layers.*.mlp": FFNParallel(),
        "model.layers.*.feed_forward": FFNParallel(),  # (Llama 4's name)
        "model.layers.*.input_layernorm": ReplicatedNorm(),
        "model.layers.*.post_attention_layernorm": ReplicatedNorm(),
        "model.norm": ReplicatedNorm(),
        "lm_head": ColwiseGather(),
    }


__all__ = [
    "BuildContext",
    "ColwiseGather",
    "FFNParallel",
    "HeadParallel",
    "MeshOf",
    "ParallelStyle",
    "ReplicatedNorm",
    "VocabParallel",
    "expert_mesh",
    "kv_head_mesh",
    "tp_plan",
    "tp_view",
]
