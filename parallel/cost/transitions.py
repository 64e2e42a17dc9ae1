"""Seesaw's weight moves between two layouts of the same GPUs, from the movement core's lower
bound (:func:`reshard.plan.lower_bound_bytes`) on :class:`reshard.Layout` objects of the model's
parameters, as ``layers/`` shards them: attention and dense MLPs tensor parallel over ``tp``,
replicated over ``dp``; a MoE layer's experts on an ``(ep, tp / ep)`` view of the tp group
(``Shard(0)`` over experts, each expert's intermediate dim over ``tp / ep``), over the
replicas with data-parallel attention, or over all ``sp * tp`` GPUs under Shift
(:mod:`parallel.cost.moe`). Also what a Shift switch moves of the experts (:func:`expert_switch_bytes`).
Units: bytes, seconds.
"""

from __future__ import annotations

from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.parallel.cost.collectives import send_time
from reshard.parallel.cost.profiles import Hardware, ModelShape

if TYPE_CHECKING:
    from reshard.parallel.cost.roofline import ParallelConfig

_DTYPES = MappingProxyType({1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32})
Kind = tuple[tuple[int, ...], "int | None", int, bool]  # (shape, TP shard dim or None, count, expert)


def _param_kinds(m: ModelShape, *, sparse: bool) -> list[Kind]:
    """(shape, TP shard dim or None, count, expert) of each parameter kind of a dense or MoE layer."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    attn = [((q, m.hidden), 0, 1, False), ((kv, m.hidden), 0, 2, False), ((m.hidden, q), 1, 1, False)]
    norms = [((m.hidden,), None, 2, False)]
    if not sparse:
        return attn + _mlp(m.intermediate, m.hidden) + norms
    shared = _mlp(m.shared_intermediate, m.hidden) if m.shared_intermediate else []
    e, i = m.experts, m.expert_intermediate
    experts = [((e, i, m.hidden), 1, 2, True), ((e, m.hidden, i), 2, 1, True)]  # gate + up, down
    return attn + shared + [((e, m.hidden), None, 1, False)] + experts + norms  # router: replicated


def _mlp(width: int, hidden: int) -> list[Kind]:
    return [((width, hidden), 0, 2, False), ((hidden, width), 1, 1, False)]  # gate + up colwise, down rowwise


def _layout(cfg: ParallelConfig, stage: int, shape: tuple[int, ...], dim: int | None, dtype: torch.dtype, expert: bool):
    """The :class:`reshard.Layout` of a parameter of ``stage`` under ``cfg``: a (dp * sp, tp) mesh
    of the ascending (dp, pp, sp, tp) grid, replicated over dp and sp, ``Shard(dim)`` (or
    replicated) over tp; an expert tensor ``Shard(0)`` over ep and ``Shard(dim)`` inside each
    expert, on :func:`_expert_grid`."""
    from reshard import Layout

    grid = torch.arange(cfg.gpus).view(cfg.dp, cfg.pp, cfg.sp, cfg.tp)[:, stage].reshape(-1, cfg.tp)  # (dp*sp, tp)
    if expert:
        return Layout(_nested(_expert_grid(cfg, grid)), (Replicate(), Shard(0), Shard(dim)), shape, dtype)
    placements = (Replicate(), Shard(dim) if dim is not None else Replicate())
    return Layout(_nested(grid), placements, shape, dtype)


def _expert_grid(cfg: ParallelConfig, grid: torch.Tensor) -> torch.Tensor:
    """A stage's ``(dp * sp, tp)`` ranks as the experts' (replicas, ep, tp / ep) mesh: ``(1, dp, 1)``
    over data-parallel replicas, ``(1, sp * tp, 1)`` under Shift (its sp-major (sp, tp) base mesh
    flattened, as ``parallel.model.plans`` places them in both modes), else ``(dp * sp, ep, tp / ep)``."""
    if cfg.shift_ep or cfg.dispatch:
        return grid.reshape(1, -1, 1)
    return grid.reshape(-1, cfg.ep, cfg.tp // cfg.ep)


def _nested(grid: torch.Tensor) -> tuple:
    return tuple(_nested(g) if g.dim() else int(g) for g in grid)


@cache
def _lower_bound(a: ParallelConfig, sa: int, b: ParallelConfig, sb: int, kind: Kind, dtype: torch.dtype) -> int:
    from reshard.plan import lower_bound_bytes

    shape, dim, _, expert = kind
    return lower_bound_bytes(_layout(a, sa, shape, dim, dtype, expert), _layout(b, sb, shape, dim, dtype, expert))


@cache
def transition_bytes(m: ModelShape, a: ParallelConfig, b: ParallelConfig) -> int:
    """Bytes the movement core must move to re-shard the weights from ``a`` to ``b`` (its lower
    bound, summed over receiving GPUs); layers grouped by (stage in a, stage in b, MoE or not)."""
    from reshard.parallel.model.layouts import stage_of_layer

    if a.gpus != b.gpus or a.sp > 1 or b.sp > 1:
        raise ValueError(
            f"Seesaw transitions need two D/T/P layouts of the same GPUs, got {a.notation} -> {b.notation}"
        )
    dtype, sparse = _DTYPES[m.dtype_bytes], set(m.moe_layers)
    groups: dict[tuple[int, int, bool], int] = {}
    for layer in range(m.layers):
        key = (stage_of_layer(layer, m.layers, a.pp), stage_of_layer(layer, m.layers, b.pp), layer in sparse)
        groups[key] = groups.get(key, 0) + 1
    total = sum(
        n * kind[2] * _lower_bound(a, sa, b, sb, kind, dtype)
        for (sa, sb, moe), n in groups.items()
        for kind in _param_kinds(m, sparse=moe)
    )
    ends = [(0, 0), (a.pp - 1, b.pp - 1)]  # embedding with the first stage, LM head with the last
    head = ((m.vocab, m.hidden), 0, 1, False)
    return total + sum(_lower_bound(a, sa, b, sb, head, dtype) for sa, sb in ends)


def expert_switch_bytes(m: ModelShape, a: ParallelConfig, b: ParallelConfig) -> int:
    """Bytes the movement core must move for the routed experts between two one-stage layouts of
    the same GPUs, both ways (``a -> b`` plus ``b -> a``), summed over the MoE layers: what a Shift
    switch between its base and full TP would move of them (0 when both hold them alike)."""
    if a.gpus != b.gpus or a.pp > 1 or b.pp > 1:
        raise ValueError(f"a switch needs two one-stage layouts of the same GPUs, got {a.notation} -> {b.notation}")
    if not m.moe:
        return 0
    dtype = _DTYPES[m.dtype_bytes]
    kinds = [kind for kind in _param_kinds(m, sparse=True) if kind[3]]
    there = sum(kind[2] * _lower_bound(a, 0, b, 0, kind, dtype) for kind in kinds)
    back = sum(kind[2] * _lower_bound(b, 0, a, 0, kind, dtype) for kind in kinds)
    return len(m.moe_layers) * (there + back)


def transition_time(m: ModelShape, hw: Hardware, a: ParallelConfig, b: ParallelConfig) -> float:
    """Seconds to move :func:`transition_bytes`, spread evenly over every GPU's link (assumed),
    at the level of the topology that holds all of them."""
    nbytes = transition_bytes(m, a, b)
    return 0.0 if nbytes == 0 else send_time(hw, nbytes / a.gpus, a.gpus)
