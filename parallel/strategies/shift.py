"""Shift Parallelism: Ulysses SP x TP for large steps, full TP for small ones, one KV cache.

``parallelize_shift`` loads an HF checkpoint in the base (SP x TP) layout and adds the full-TP
layout of attention and MLP weights (a copy, or views of the base shards) as the weight source
``SHIFT_WEIGHTS``. :func:`shift_engine` runs it on the engine loop with two runners over one KV
cache, ``"sp"`` (tokens split over ``sp``, base weights) and ``"tp"`` (shift weights), and
:class:`ShiftPolicy` picks one per step from the step's token count: ``tokens > threshold`` runs
SP, otherwise TP. Both modes give each rank the same head block
(:func:`head_block`), so nothing moves at a switch.

Mixture-of-experts models (SP x EP, which the paper leaves open): the experts are spread over all
``sp * tp`` ranks in one layout both modes use, and tokens reach them by all-to-all — in SP mode
each rank dispatches its share of its sp shard's tokens, in TP mode its share of all of them
(:func:`reshard.parallel.model.plans.shift_token_replicas`); the router is replicated and a shared
expert is a dense FFN with a full-TP source like the others. The switch still moves 0 bytes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from reshard.layers.moe import feed_forward
from reshard.layers.ulysses import SHIFT_WEIGHTS, ShiftMeshes, UlyssesAttention
from reshard.mesh import cached_mesh
from reshard.parallel.engine import (
    ContinuousBatching,
    Engine,
    EngineConfig,
    EngineStats,
    ModelRunner,
    Strategy,
    TokenSplit,
    register_strategy,
)
from reshard.parallel.engine.batching import batching_options
from reshard.parallel.engine.registry import PAGED_BLOCK_SIZE
from reshard.parallel.model.dims import ParallelDims, rank_grid
from reshard.parallel.model.info import parallel_info, update_info
from reshard.parallel.model.parallelize import parallelize
from reshard.parallel.model.plans import (
    BuildContext,
    ColwiseGather,
    FFNParallel,
    MeshOf,
    ParallelStyle,
    ReplicatedNorm,
    VocabParallel,
    _sliding_window,
    position_scheme,
)

log = logging.getLogger(__name__)
BASE = (Replicate(), Shard(0))  # replicated over sp, split over tp


class ShiftAttentionStyle:
    """:class:`UlyssesAttention` on :func:`shift_meshes`: base weights ``(Replicate(), Shard)`` on
    the ``(sp, tp)`` base mesh (the full-TP layouts are added after loading)."""

    def build(self, module: nn.Module, ctx: BuildContext) -> nn.Module:
        cfg = ctx.config
        return UlyssesAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            module.head_dim,
            meshes=shift_meshes(ctx.dims, cfg.num_key_value_heads),
            layer_idx=ctx.layer_idx,
            qkv_bias=module.q_proj.bias is not None,
            o_bias=module.o_proj.bias is not None,
            qk_norm=hasattr(module, "q_norm"),
            rms_norm_eps=cfg.rms_norm_eps,
            sliding_window=_sliding_window(module, cfg, ctx.layer_idx),
            position_scheme=position_scheme(cfg, ctx.layer_idx),
            **ctx.kw,
        )


def shift_plan() -> dict[str, ParallelStyle]:
    """The TP plan's styles in the base layout ``BASE = (Replicate(), Shard(0))``, for modules on
    the ``(sp, tp)`` base mesh (build with ``mesh_of=`` :func:`base_mesh_of`); attention and MLP
    also get the full-TP layout after loading (:func:`parallelize_shift`)."""
    return {
        "model.embed_tokens": VocabParallel(BASE),
        "model.layers.*.self_attn": ShiftAttentionStyle(),
        "model.layers.*.mlp": FFNParallel(BASE, experts="token_replicas"),
        "model.layers.*.feed_forward": FFNParallel(BASE, experts="token_replicas"),  # (Llama 4's name)
        "model.layers.*.input_layernorm": ReplicatedNorm(),
        "model.layers.*.post_attention_layernorm": ReplicatedNorm(),
        "model.norm": ReplicatedNorm(),
        "lm_head": ColwiseGather(BASE),
    }


# ---- Shift parallelism: one head-block map for SP and TP -------------------------------------------
def head_block(dims: ParallelDims, sp_rank: int, tp_rank: int) -> int:
    """The head block rank ``(sp_rank, tp_rank)`` attends over, in both Shift modes.

    The base (SP x TP) layout splits heads over tp, then the SP all-to-all splits each tp
    shard over sp, so the block is ``tp_rank * sp + sp_rank``. The shift (full TP) layout
    must give each rank that same block so the KV cache is shared (the paper's Figure 7).
    """
    return tp_rank * dims.sp + sp_rank


def base_mesh(dims: ParallelDims) -> DeviceMesh:
    """2-D ``(sp, tp)`` mesh of this rank's SP x TP group (the base layout)."""
    return dims.world_mesh()["sp", "tp"]


def base_mesh_of(dims: ParallelDims) -> MeshOf:
    """Every module on :func:`base_mesh` (the ``mesh_of`` of :func:`shift_plan`)."""
    mesh = base_mesh(dims)
    return lambda name: mesh


def shift_mesh(dims: ParallelDims) -> DeviceMesh:
    """The same ranks as a ``(tp, sp)`` mesh: ``(Shard(d), Shard(d))`` on it nests tp then sp,
    so rank ``(s, t)`` holds chunk :func:`head_block` ``(s, t)`` — full TP in block order."""
    return _derived(_block_grid(dims), ("shift_tp", "shift_sp"))


def block_mesh(dims: ParallelDims, groups: int) -> DeviceMesh:
    """Ranks in head-block order split into ``(groups, sp * tp // groups)`` — for KV heads that
    the shift layout replicates over consecutive blocks (``groups`` = KV heads)."""
    grid = _block_grid(dims).flatten(-2).unflatten(-1, (groups, -1))
    return _derived(grid, ("kv_block", "kv_rep"))


def sp_split_mesh(dims: ParallelDims, kv_groups: int) -> DeviceMesh:
    """The sp axis split into ``(kv_groups, sp // kv_groups)`` for the paper's Algorithm 1:
    all-to-all along ``sp_aa`` (one rank per GQA group), all-gather along ``sp_ag``."""
    grid = rank_grid(dims).unflatten(2, (kv_groups, -1))
    grid = grid.permute(0, 1, 4, 2, 3)  # (dp, pp, tp, sp_aa, sp_ag)
    return _derived(grid, ("sp_aa", "sp_ag"))


def shift_meshes(dims: ParallelDims, num_kv_heads: int) -> ShiftMeshes:
    """Every mesh :class:`layers.ulysses.UlyssesAttention` needs for ``num_kv_heads`` KV heads."""
    p = dims.sp * dims.tp
    kv_per_tp = num_kv_heads // dims.tp if num_kv_heads % dims.tp == 0 else 0
    replicate_shift = num_kv_heads < p and p % num_kv_heads == 0
    replicate_sp = 0 < kv_per_tp < dims.sp and dims.sp % kv_per_tp == 0
    return ShiftMeshes(
        base=base_mesh(dims),
        shift=shift_mesh(dims),
        shift_kv=block_mesh(dims, num_kv_heads) if replicate_shift else None,
        sp_split=sp_split_mesh(dims, kv_per_tp) if replicate_sp else None,
    )


def _block_grid(dims: ParallelDims) -> torch.Tensor:
    return rank_grid(dims).transpose(2, 3)  # (dp, pp, tp, sp)


def _derived(grid: torch.Tensor, names: tuple[str, str]) -> DeviceMesh:
    """A mesh over the whole world with ``grid``'s last two axes named ``names``; this rank's 2-D slice."""
    lead = tuple(f"_lead{i}" for i in range(grid.dim() - 2))
    return cached_mesh(grid, lead + names)[names]


def parallelize_shift(
    path: str | os.PathLike,
    dims: ParallelDims,
    *,
    shift_weights: str = "copy",
    dtype: torch.dtype | None = None,
    allow_unused: bool = False,
) -> nn.Module:
    """Load ``path`` for Shift parallelism on ``dims`` (``sp * tp`` ranks).

    ``shift_weights``: ``"copy"`` keeps separate full-TP shards beside the base weights (the
    paper's "separate models"; extra memory ~1/sp of the base), ``"slice"`` takes views of the base
    shards. ``model.parallel_info`` reports this rank's extra bytes (``extra_weight_bytes``) and
    how many ranks hold each KV head (``kv_replication``).
    """
    if shift_weights not in ("copy", "slice"):
        raise ValueError(f"shift_weights must be 'copy' or 'slice', got {shift_weights!r}")
    if dims.dp != 1 or dims.pp != 1:
        raise ValueError(f"Shift parallelism runs on sp x tp ranks; got dp({dims.dp}), pp({dims.pp})")
    model = parallelize(
        path, dims, plan=shift_plan(), dtype=dtype, mesh_of=base_mesh_of(dims), allow_unused=allow_unused
    )
    copy, extra = shift_weights == "copy", 0
    for layer in model.model.layers:
        extra += layer.self_attn.add_shift_layouts(copy=copy)
        extra += feed_forward(layer).add_source(SHIFT_WEIGHTS, shift_mesh(dims), (Shard(0), Shard(0)), copy=copy)
    info = update_info(model, extra_weight_bytes=extra, kv_replication=model.model.layers[0].self_attn.kv_replication)
    log.info(
        "shift parallelism: sp=%d tp=%d, KV-head replication x%d, shift weights %s (+%d bytes)",
        dims.sp,
        dims.tp,
        info.kv_replication,
        shift_weights,
        extra,
    )
    return model


# ---- the engine: two runners over one KV cache, a threshold policy ----------------------------
@dataclass
class ShiftStats(EngineStats):
    steps_by_mode: dict = field(default_factory=lambda: {"sp": 0, "tp": 0})
    mode_switches: int = 0
    switch_bytes: int = 0  # bytes moved at switches: nothing moves, the KV cache is shared
    kv_storage: list = field(default_factory=list)  # KV data pointers seen at each switch

    def summary(self) -> dict:
        return {
            "mode_switches": self.mode_switches,
            "steps_by_mode": dict(self.steps_by_mode),
            "switch_bytes": self.switch_bytes,
        }


class ShiftPolicy(ContinuousBatching):
    """Continuous batching; a step with more than ``threshold`` tokens runs SP, the others TP
    (the paper's Algorithm 3), decided on the step's real tokens."""

    stats_cls = ShiftStats

    def __init__(self, threshold: int, **batching) -> None:
        """``batching``: :class:`ContinuousBatching`'s options (the token budget, admission,
        mixed steps, preemption, the prefix cache)."""
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        super().__init__("sp", **batching)
        self.threshold = threshold

    @property
    def initial_layout(self) -> None:
        return None

    def layout_for(self, seqs: list, num_tokens: list[int]) -> str:
        tokens = sum(num_tokens)
        mode = "sp" if tokens > self.threshold else "tp"
        self.stats.steps_by_mode[mode] += 1
        return mode

    def on_switch(self, old: str | None, new: str) -> None:
        """Nothing moves: both modes read and write the same KV cache (recorded to show it)."""
        if old is not None:
            self.stats.mode_switches += 1
            self.stats.kv_storage.append([k.data_ptr() for k in self.runner_info[old].kv.k])


def shift_engine(model: nn.Module, config: EngineConfig | None = None, *, threshold: int) -> Engine:
    """The loop over ``model`` (from :func:`parallelize_shift`) with runners ``"sp"`` (tokens
    split over sp, base weights) and ``"tp"`` (all tokens, shift weights) sharing one KV cache
    (``config``'s; its batching options go to :class:`ShiftPolicy`: the token budget, mixed
    prompt and decode tokens in a step, the prefix cache on a paged cache,
    :func:`batching_options`)."""
    config = config if config is not None else EngineConfig()
    dims = parallel_info(model).dims
    sp = ModelRunner(model, config, dims=dims, split=TokenSplit(base_mesh(dims), 0))
    tp = ModelRunner(model, config, dims=dims, kv=sp.kv, weights=SHIFT_WEIGHTS)
    policy = ShiftPolicy(threshold, **batching_options(config, [sp, tp]))
    return Engine(runners={"sp": sp, "tp": tp}, policy=policy, config=config)


@register_strategy("shift")
@dataclass
class ShiftStrategy(Strategy):
    """Shift parallelism: Ulysses SP x TP for big steps, full TP over the same ranks for small ones."""

    sp: int = 2  # Ulysses degree of the base layout
    tp: int | None = None  # null: world size / sp
    threshold: int = 64  # steps with more tokens than this run SP, the others TP
    shift_weights: str = "copy"  # copy | slice

    def __post_init__(self) -> None:
        for name in ("tp", "sp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")
        if self.threshold < 0:
            raise ValueError(f"parallel.threshold must be >= 0, got {self.threshold}")
        if self.shift_weights not in ("copy", "slice"):
            raise ValueError(f"parallel.shift_weights must be copy or slice, got {self.shift_weights!r}")

    def dims(self, world_size: int) -> ParallelDims:
        if self.tp is None and world_size % self.sp != 0:
            raise ValueError(f"parallel.sp ({self.sp}) must divide the world size ({world_size})")
        tp = self.tp or world_size // self.sp
        if self.sp * tp != world_size:
            raise ValueError(f"parallel.sp ({self.sp}) x parallel.tp ({tp}) must equal the world size ({world_size})")
        return ParallelDims(sp=self.sp, tp=tp, world_size=world_size)

    def default_kv_block_size(self) -> int | None:
        """Paged: both modes share one paged cache and its prefix cache."""
        return PAGED_BLOCK_SIZE

    def layouts(self, world_size: int) -> dict[str, ParallelDims]:
        """Big steps in the base layout (``sp`` x ``tp``), small ones in full TP over the same ranks."""
        base = self.dims(world_size)
        return {"sp": base, "tp": ParallelDims(tp=world_size, world_size=world_size)}

    def build_model(self, path, dims: ParallelDims, config: EngineConfig) -> nn.Module:
        return parallelize_shift(
            path, dims, shift_weights=self.shift_weights, dtype=config.torch_dtype, allow_unused=config.allow_unused
        )

    def build_engine(self, model: nn.Module, config: EngineConfig) -> Engine:
        return shift_engine(model, config, threshold=self.threshold)

    def summary(self, engine: Engine) -> dict:
        return {
            **engine.stats.summary(),
            "threshold": self.threshold,
            "shift_extra_bytes": parallel_info(engine.model).extra_weight_bytes,
            "kv_replication": parallel_info(engine.model).kv_replication,
        }

    def report(self, s: dict) -> list[str]:
        return [
            f"shift: steps by mode {s['steps_by_mode']}, {s['mode_switches']} switches, "
            f"{s['switch_bytes']} bytes moved at switches"
        ]
