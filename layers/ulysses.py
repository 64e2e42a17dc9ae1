"""Ulysses sequence-parallel attention that shares one KV cache with full tensor parallelism.

Shift Parallelism (``../shared/seeds/001``): the base mode ``"sp"`` splits the step's tokens over the
``sp`` axis and heads over ``tp``; one fused QKV all-to-all turns token-parallel into head-parallel
before attention and one all-to-all turns it back. The shift mode ``"tp"`` runs full TP over all
``sp x tp`` ranks. Both give rank ``(s, t)`` the same head block ``t * sp + s`` (see
``parallel.shift.head_block``), so the KV cache written in one mode is read unchanged in the other.

The caller chooses the mode per forward: ``sequence_parallel=True`` with this rank's share of the
tokens, or ``False`` with every token under the weight source :data:`SHIFT_WEIGHTS` (see
:mod:`layers.weights`). The layer itself keeps no mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from reshard.kv import Chunked
from reshard.layers._comm import all_gather, all_to_all
from reshard.layers.attention import ROPE, AttentionContext, ParallelAttention, PositionScheme
from reshard.layers.linear import ParallelLinear
from reshard.layers.norm import RMSNorm

SHIFT_WEIGHTS = "shift"  # the weight source name of the full-TP (shift) layout


@dataclass(frozen=True)
class ShiftMeshes:
    """Meshes of one SP x TP group (built by ``parallel.shift.shift_meshes``)."""

    base: DeviceMesh  # (sp, tp)
    shift: DeviceMesh  # (tp, sp): the same ranks in head-block order
    shift_kv: DeviceMesh | None  # (kv_block, kv_rep) when the shift mode replicates KV heads
    sp_split: DeviceMesh | None  # (sp_aa, sp_ag) when SP replicates KV heads (Algorithm 1)

    @property
    def sp(self) -> int:
        return self.base.size(0)

    @property
    def tp(self) -> int:
        return self.base.size(1)


def check_shift_heads(num_heads: int, num_kv_heads: int, sp: int, tp: int) -> None:
    """``ValueError`` naming the values unless SP x TP can split these heads."""
    p = sp * tp
    if num_heads % p != 0:
        raise ValueError(f"query heads ({num_heads}) must be divisible by SP x TP ({sp} x {tp} = {p})")
    if num_kv_heads % tp != 0:
        raise ValueError(f"KV heads ({num_kv_heads}) must be divisible by tp ({tp}) in the SP x TP layout")
    per_tp = num_kv_heads // tp
    if per_tp % sp != 0 and sp % per_tp != 0:
        raise ValueError(f"KV heads per tp shard ({per_tp}) and SP ({sp}) divide neither way")
    if num_kv_heads % p != 0 and p % num_kv_heads != 0:
        raise ValueError(f"KV heads ({num_kv_heads}) and SP x TP ({p}) divide neither way")


class UlyssesAttention(ParallelAttention):
    """Attention run per forward as Ulysses SP x TP (``sequence_parallel=True``) or full TP.

    Base weights (the parameters, HF state-dict keys) are ``(Replicate(), Shard)`` on the
    ``(sp, tp)`` mesh. :meth:`add_shift_layouts` adds the full-TP layout in head-block order as
    weight source :data:`SHIFT_WEIGHTS`: a separate copy (``copy=True``, 1/sp extra memory) or
    views of the base shards.

    Sequence parallel: the input is this rank's tokens ``(1, N / sp, D)`` (the caller pads ``N``),
    with the base weights. Full TP: all ``(1, N, D)`` tokens, with the shift weights selected
    (under the base weights it is plain TP over ``tp``, replicated over ``sp``: correct without a
    KV cache, but the cache layout is the shift layout's). Output has the input's shape.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        meshes: ShiftMeshes,
        layer_idx: int = 0,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        sliding_window: int | Chunked | None = None,
        position_scheme: PositionScheme = ROPE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        check_shift_heads(num_heads, num_kv_heads, meshes.sp, meshes.tp)
        torch.nn.Module.__init__(self)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.sliding_window, self.position_scheme = sliding_window, position_scheme
        self.scaling = head_dim**-0.5
        self.meshes = meshes
        kw = dict(mesh=meshes.base, dtype=dtype, device=device)
        col, row = (Replicate(), Shard(0)), (Replicate(), Shard(1))
        self.q_proj = ParallelLinear(hidden_size, num_heads * head_dim, qkv_bias, placements=col, **kw)
        self.k_proj = ParallelLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, placements=col, **kw)
        self.v_proj = ParallelLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, placements=col, **kw)
        self.o_proj = ParallelLinear(num_heads * head_dim, hidden_size, o_bias, placements=row, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, **kw)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, **kw)

    # ---- layouts ---------------------------------------------------------------------------------
    def add_shift_layouts(self, *, copy: bool) -> int:
        """Add the full-TP (head-block order) layout as source :data:`SHIFT_WEIGHTS`; returns the
        extra bytes on this rank."""
        m, name = self.meshes, SHIFT_WEIGHTS
        kv_mesh, kv_pl = (
            (m.shift, (Shard(0), Shard(0))) if m.shift_kv is None else (m.shift_kv, (Shard(0), Replicate()))
        )
        extra = self.q_proj.add_source(name, m.shift, (Shard(0), Shard(0)), copy=copy)
        for proj in (self.k_proj, self.v_proj):  # replicas serve different query heads
            extra += proj.add_source(name, kv_mesh, kv_pl, copy=copy, input_grad="all")
        return extra + self.o_proj.add_source(name, m.shift, (Shard(1), Shard(1)), copy=copy)

    @property
    def kv_replication(self) -> int:
        """Ranks sharing each KV head (1 = KV heads are split, no replication)."""
        return max(self.meshes.sp * self.meshes.tp // self.num_kv_heads, 1)

    @property
    def local_kv_heads(self) -> int:
        """KV heads of this rank's head block — the KV cache layout of both modes."""
        return max(self.num_kv_heads // (self.meshes.sp * self.meshes.tp), 1)

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """Global KV heads of this rank's head block ``tp_rank * sp + sp_rank`` (both modes)."""
        s, t = self.meshes.base.get_coordinate()
        block, p = t * self.meshes.sp + s, self.meshes.sp * self.meshes.tp
        start = block * self.local_kv_heads if self.num_kv_heads >= p else block // (p // self.num_kv_heads)
        return start, start + self.local_kv_heads

    # ---- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        *,
        attn_context: AttentionContext | None = None,
        sequence_parallel: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if not sequence_parallel:
            return super().forward(
                hidden_states, position_embeddings, attention_mask, past_key_values, attn_context=attn_context, **kwargs
            )
        return self._forward_sp(hidden_states, position_embeddings, attn_context, kwargs.get("token_positions")), None

    def _forward_sp(
        self, x: torch.Tensor, position_embeddings, ctx: AttentionContext | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """``positions``: this rank's tokens' (the runner's split of the step), for the position
        scheme's query temperature; RoPE comes in ``position_embeddings``, already split."""
        b, t, _ = x.shape  # (1, N / sp, D): this rank's tokens
        assert b == 1, "SP mode runs on the flattened token batch (1, N, D)"
        q = self.q_proj(x).view(b, t, -1, self.head_dim)  # (1, Nl, Hq / tp, hd)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)  # (1, Nl, Hkv / tp, hd)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.position_scheme.apply(q, k, position_embeddings, lambda: positions)
        q, k, v = self._to_head_parallel(q[0], k[0], v[0])  # (N_pad, heads of my block, hd)
        n = int(ctx.positions.numel()) if ctx is not None else q.shape[0]
        if ctx is not None:
            out = ctx.attend(
                self.layer_idx, q[None, :n], k[None, :n], v[None, :n], scaling=self.scaling, window=self.sliding_window
            )[0]
        else:
            out = self._dense(q[None], k[None], v[None], None, None)[0]
        out = F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - out.shape[0]))  # padding rows back
        out = self._to_token_parallel(out)  # (Nl, Hq / tp, hd)
        return self.o_proj(out.reshape(b, t, -1))

    def _to_head_parallel(self, q, k, v):
        """(Nl, H, hd) token shards -> (N_pad, H / sp, hd) head shards; KV replicated if needed."""
        sp = self.meshes.sp
        if self.meshes.sp_split is None and k.shape[1] % sp == 0:
            nl = q.shape[0]
            hq = q.shape[1] // sp
            hk = k.shape[1] // sp
            fused = torch.cat([t.view(nl, sp, -1, self.head_dim) for t in (q, k, v)], 2)  # (Nl, sp, c, hd)
            fused = all_to_all(fused.transpose(0, 1), self.meshes.base, 0)  # (sp, Nl, c, hd)
            fused = fused.reshape(sp * nl, -1, self.head_dim)
            return fused.split([hq, hk, hk], dim=1)
        return _heads_a2a(q, self.meshes.base, sp), *self._replicate_kv(k, v)

    def _replicate_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1: all-to-all across GQA groups, all-gather within them, restore token order.

        ``k``/``v``: (Nl, kv, hd) with kv < sp. Returns (N_pad, 1, hd): all tokens of the KV head
        this rank's query heads use.
        """
        split = self.meshes.sp_split
        kvh, nl = k.shape[1], k.shape[0]
        kv = torch.stack([k, v], 2).transpose(0, 1)  # (kv, Nl, 2, hd)
        kv = all_to_all(kv, split, 0) if split is not None else kv  # (kv, Nl, 2, hd): my head
        rep = self.meshes.sp // kvh
        kv = all_gather(kv, split if split is not None else self.meshes.base, 1 if split is not None else 0)
        kv = kv.view(rep, kvh, nl, 2, self.head_dim).transpose(0, 1)  # [g'][r'] -> rank g' * rep + r'
        kv = kv.reshape(rep * kvh * nl, 2, self.head_dim)
        return kv[:, :1], kv[:, 1:]

    def _to_token_parallel(self, out: torch.Tensor) -> torch.Tensor:
        """(N_pad, h, hd) head shards -> (Nl, sp * h, hd) token shards."""
        sp = self.meshes.sp
        out = all_to_all(out.view(sp, -1, *out.shape[1:]), self.meshes.base, 0)  # (sp, Nl, h, hd)
        return out.transpose(0, 1).reshape(out.shape[1], -1, self.head_dim)


def _heads_a2a(x: torch.Tensor, mesh: DeviceMesh, sp: int) -> torch.Tensor:
    """(Nl, H, hd) -> (sp * Nl, H / sp, hd) over the sp axis (axis 0 of ``mesh``)."""
    nl = x.shape[0]
    x = all_to_all(x.view(nl, sp, -1, x.shape[-1]).transpose(0, 1), mesh, 0)  # (sp, Nl, H/sp, hd)
    return x.reshape(sp * nl, -1, x.shape[-1])
