"""Head-parallel attention with RoPE, GQA, optional q/k norm (Qwen3) and KV-head replication.

Drop-in for HF ``LlamaAttention`` / ``Qwen2Attention`` / ``Qwen3Attention`` / ``MistralAttention``:
same submodule names, state-dict keys and forward signature. Two ways to run it:

- HF-style (no ``attn_context``): dense causal attention, optionally through an HF ``Cache``, so an
  HF model whose attention was swapped still runs ``model(...)`` and ``model.generate(...)``.
- Engine-style (``attn_context=AttentionContext``, the per-step KV view owned by
  :mod:`reshard.kv`): the step's tokens of many requests are flattened into ``(1, N, D)``; K/V go
  to a preallocated :class:`reshard.KVCache` slot per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from reshard import Layout
from reshard.kv import AttentionContext, Chunked, KVLayout
from reshard.layers._base import Redistributable, Targets, prefixed
from reshard.layers.linear import ParallelLinear
from reshard.layers.norm import RMSNorm
from reshard.mesh import cached_mesh


def check_head_split(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` ranks can split the heads (replicating KV heads if needed)."""
    if num_heads % tp != 0:
        raise ValueError(f"Number of attention heads ({num_heads}) must be divisible by tensor parallel size ({tp}).")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"attention heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:
        raise ValueError(
            f"KV heads ({num_kv_heads}) and tensor parallel size ({tp}) divide neither way: "
            f"KV heads must be divisible by tp, or tp by KV heads (then KV heads are replicated)."
        )


def kv_replication(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 when KV heads are split, tp // KV heads when replicated)."""
    return max(tp // num_kv_heads, 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


RotaryEmbedding = tuple[torch.Tensor, torch.Tensor] | torch.Tensor  # (cos, sin), or Llama 4's complex freqs


class RopeTables(tuple):
    """A step's rotary ``(cos, sin)``, each ``(B, T, hd)`` (a tuple, as HF's rotary module gives
    it), with what rotate-half RoPE multiplies by made once for all the step's layers: ``cos``
    and ``signed_sin``, ``(B, T, 1, hd)``, the latter ``sin`` with its first half negated.

    ``rotate_half(x) * sin`` is ``x.roll(hd / 2) * signed_sin`` bit for bit (a sign moves
    exactly between factors): per layer and q or k, a roll and three ops instead of seven.
    """

    def __new__(cls, emb: tuple[torch.Tensor, torch.Tensor]) -> RopeTables:
        tables = super().__new__(cls, emb)
        cos, sin = emb
        half = sin.shape[-1] // 2
        tables.cos = cos.unsqueeze(2)  # (B, T, 1, hd)
        tables.signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        return tables

    @classmethod
    def of(cls, emb: RotaryEmbedding) -> RotaryEmbedding:
        """A rotary module's output for a step's layers: ``(cos, sin)`` as tables (eager; a
        compiled step's graph fuses the ops anyway), anything else (Llama 4's) as it is."""
        if isinstance(emb, tuple) and len(emb) == 2 and not torch.compiler.is_compiling():
            return cls(emb)
        return emb


def apply_rope(q: torch.Tensor, k: torch.Tensor, emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``(B, T, H, hd)`` q/k, with HF's arithmetic for the rotary module's output ``emb``:
    ``(cos, sin)`` each ``(B, T, hd)`` (Llama's rotate-half; as :class:`RopeTables`, made once per
    step), or a complex ``freqs_cis (B, T, hd/2)`` (Llama 4's, over interleaved pairs of the head
    dimension)."""
    if isinstance(emb, torch.Tensor):
        return _rope_pairs(q, emb), _rope_pairs(k, emb)
    if isinstance(emb, RopeTables):
        half = q.shape[-1] // 2
        cos, sin = emb.cos, emb.signed_sin
        return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
    cos, sin = emb[0].unsqueeze(2), emb[1].unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x (B, T, H, hd)`` as ``hd/2`` complex pairs times ``freqs (B, T, hd/2)``, in fp32 (HF's)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, hd/2)
    return torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(3).type_as(x)


@dataclass(frozen=True)
class PositionScheme:
    """How a layer gives q/k their positions (HF's per-family variants; the default is Llama's).

    ``rope``: RoPE on q/k (False: a NoPE layer, Llama 4's every fourth); ``l2_norm``: q and k
    L2-normalized after RoPE, no weight (Llama 4's ``use_qk_norm``, with ``eps``); ``temperature``:
    ``(attn_scale, floor_scale)``, queries of a NoPE layer scaled by ``log1p(floor((pos + 1) /
    floor_scale)) * attn_scale + 1`` (Llama 4's ``attn_temperature_tuning``).
    """

    rope: bool = True
    l2_norm: bool = False
    eps: float = 1e-6
    temperature: tuple[float, float] | None = None

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, emb: RotaryEmbedding, positions: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``/``k (B, T, H, hd)``; ``positions()``: each token's position, ``(T,)`` (called
        only where the temperature needs it)."""
        if self.rope:
            q, k = apply_rope(q, k, emb)
        if self.l2_norm:
            q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        if self.temperature is not None:
            scale, floor = self.temperature
            pos = positions().float()  # (T,)
            q = (q * (torch.log1p(torch.floor((pos + 1.0) / floor)) * scale + 1.0)[None, :, None, None]).to(q.dtype)
        return q, k


ROPE = PositionScheme()  # every family but Llama 4: RoPE on every layer


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``Llama4TextL2Norm``: ``x / rms(x)`` over the head dim in fp32, no weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class ParallelAttention(Redistributable, nn.Module):
    """Multi-head attention with heads split over a 1-D ``mesh`` (the tp axis).

    q/k/v are colwise (Shard(0): each rank computes its heads), o_proj is rowwise (one all-reduce).
    When tp exceeds the KV heads, k/v weights live on ``kv_mesh``, a 2-D view ``(kv, rep)`` of the
    same ranks, with placements ``(Shard(0), Replicate())``: rank ``r`` holds KV head
    ``r // (tp // num_kv_heads)``, which its query heads use. Input/output ``(B, T, D)`` replicated.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        mesh: DeviceMesh,
        kv_mesh: DeviceMesh | None = None,
        layer_idx: int = 0,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        sliding_window: int | Chunked | None = None,
        position_scheme: PositionScheme = ROPE,
        placements: Sequence[Placement] = (Shard(0),),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx, self.sliding_window, self.position_scheme = layer_idx, sliding_window, position_scheme
        self.scaling = head_dim**-0.5
        self._mesh, self._kv_mesh = mesh, kv_mesh
        q_pl, kv_pl, o_pl, kv_m = self._placements(mesh, tuple(placements))
        kw = dict(dtype=dtype, device=device)
        self.q_proj = ParallelLinear(hidden_size, num_heads * head_dim, qkv_bias, mesh=mesh, placements=q_pl, **kw)
        self.k_proj = ParallelLinear(
            hidden_size,
            num_kv_heads * head_dim,
            qkv_bias,
            mesh=kv_m,
            placements=kv_pl,
            input_grad=_kv_input_grad(kv_pl),
            **kw,
        )
        self.v_proj = ParallelLinear(
            hidden_size,
            num_kv_heads * head_dim,
            qkv_bias,
            mesh=kv_m,
            placements=kv_pl,
            input_grad=_kv_input_grad(kv_pl),
            **kw,
        )
        self.o_proj = ParallelLinear(num_heads * head_dim, hidden_size, o_bias, mesh=mesh, placements=o_pl, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, mesh=mesh, **kw)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, mesh=mesh, **kw)

    def _placements(self, mesh: DeviceMesh, placements: tuple[Placement, ...]):
        """(q, kv, o placements, kv mesh) for a module-level ``(Shard(0),)`` or ``(Replicate(),)``."""
        if all(isinstance(p, Replicate) for p in placements):
            return placements, placements, placements, mesh
        if placements != (Shard(0),) or mesh.ndim != 1:
            raise ValueError(
                f"ParallelAttention supports (Shard(0),) or (Replicate(),) on a 1-D "
                f"mesh, got {placements} on {mesh.ndim} axes"
            )
        tp = mesh.size()
        check_head_split(self.num_heads, self.num_kv_heads, tp)
        if kv_replication(self.num_kv_heads, tp) == 1:
            return (Shard(0),), (Shard(0),), (Shard(1),), mesh
        kv_mesh = self._kv_mesh if self._kv_mesh is not None else _kv_head_mesh(mesh, self.num_kv_heads)
        return (Shard(0),), (Shard(0), Replicate()), (Shard(1),), kv_mesh

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        *,
        attn_context: AttentionContext | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """``hidden_states`` ``(B, T, D)`` replicated -> ``((B, T, D)`` replicated, ``None)``."""
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim)  # (B, T, Hq_local, hd)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim)  # (B, T, Hkv_local, hd)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim)
        if "q_norm" in self._modules:  # (not hasattr: a module's missing attribute raises, every step)
            q, k = self.q_norm(q), self.k_norm(k)
        cache = past_key_values if past_key_values is not None else kwargs.get("cache")
        given = kwargs.get("token_positions")  # (the engine's runner: this rank's tokens' positions)
        q, k = self.position_scheme.apply(
            q, k, position_embeddings, lambda: given if given is not None else _positions(t, attn_context, cache, self)
        )
        if attn_context is not None:
            out = attn_context.attend(self.layer_idx, q, k, v, scaling=self.scaling, window=self.sliding_window)
        else:
            out = self._dense(q, k, v, attention_mask, cache)
        return self.o_proj(out.reshape(b, t, -1)), None

    def _dense(self, q, k, v, attention_mask, cache) -> torch.Tensor:
        """Plain causal attention over ``(B, T, H, hd)`` inputs, through an HF cache if given."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        causal = attention_mask is None and q.shape[2] > 1
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=causal, scale=self.scaling, enable_gqa=True
        )
        return out.transpose(1, 2)  # (B, T, Hq, hd)

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """``(Shard(0),)``: heads split over ``mesh``; ``(Replicate(),)``: every rank all heads."""
        q_pl, kv_pl, o_pl, kv_m = self._placements(mesh, placements)
        targets = {
            **prefixed("q_proj", self.q_proj.redistribute_targets(mesh, q_pl)),
            **prefixed("k_proj", self.k_proj.redistribute_targets(kv_m, kv_pl)),
            **prefixed("v_proj", self.v_proj.redistribute_targets(kv_m, kv_pl)),
            **prefixed("o_proj", self.o_proj.redistribute_targets(mesh, o_pl)),
        }
        for name in ("q_norm", "k_norm"):
            if hasattr(self, name):
                replicated = (Replicate(),) * mesh.ndim
                targets.update(prefixed(name, getattr(self, name).redistribute_targets(mesh, replicated)))
        return targets

    def _after_redistribute(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
        self._mesh = mesh
        for proj in (self.k_proj, self.v_proj):
            proj.input_grad = _kv_input_grad(proj.weight.placements)

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """Global KV heads ``[start, stop)`` this rank holds (read off the layout, not the storage,
        so it holds for weights released between Seesaw phases); ``(0, 0)`` off the mesh."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        box = Layout.of_dtensor(self.k_proj.weight).box(rank)
        if box is None:
            return 0, 0
        return box[0][0] // self.head_dim, box[0][1] // self.head_dim

    @property
    def local_kv_heads(self) -> int:
        start, stop = self.kv_head_range
        return stop - start

    @property
    def kv_layout(self) -> KVLayout:
        """The KV this layer writes and reads on this rank: its layer, its KV-head range."""
        start, stop = self.kv_head_range
        return KVLayout(self.layer_idx, 1, start, stop - start, self.head_dim, self.q_proj.weight.dtype)


def _positions(t: int, ctx: AttentionContext | None, cache, layer: ParallelAttention) -> torch.Tensor:
    """The positions of a forward's ``t`` tokens: the engine step's, else after the HF cache's."""
    if ctx is not None:
        return ctx.positions
    past = cache.get_seq_length(layer.layer_idx) if cache is not None else 0
    return torch.arange(past, past + t, device=layer.q_proj.weight.device)


def _kv_input_grad(placements) -> str:
    """Replicated KV heads serve different query heads on each replica: sum input grads over all."""
    replicated_heads = any(isinstance(p, Shard) for p in placements) and any(
        isinstance(p, Replicate) for p in placements
    )
    return "all" if replicated_heads else "sharded"


def _kv_head_mesh(mesh: DeviceMesh, num_kv_heads: int) -> DeviceMesh:
    """2-D ``(tp_kv, tp_rep)`` view of a 1-D mesh that spans the whole world (cached per process group).

    A mesh over part of the world needs the views of every group built on every rank in the same
    order: pass ``kv_mesh`` from ``parallel.plans.kv_head_mesh(...)``.
    """
    ranks = mesh.mesh.flatten()
    if ranks.numel() != dist.get_world_size():
        raise ValueError(
            f"KV-head replication on a mesh of {ranks.numel()} of {dist.get_world_size()} ranks needs "
            f"kv_mesh from parallel.plans.kv_head_mesh(...)"
        )
    return cached_mesh(ranks.view(num_kv_heads, -1), ("tp_kv", "tp_rep"))  # (kv, rep)
