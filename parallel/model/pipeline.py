"""Pipeline-parallel models: layers split into stages on the ``pp`` axis (combinable with dp and tp).

Each stage holds only its layers (parameters of other stages are DTensors with empty local
tensors on this rank). Execution is a runner variant of the engine core
(:class:`parallel.engine.ModelRunner` with ``dims.pp > 1``): a KV cache for the stage's layers,
micro-batches whose hidden states flow between stages by P2P, logits on the last stage.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from reshard.mesh import cached_mesh
from reshard.parallel.model.dims import ParallelDims, rank_grid
from reshard.parallel.model.layouts import stage_of_module
from reshard.parallel.model.parallelize import parallelize
from reshard.parallel.model.plans import MeshOf, tp_plan


def parallelize_pipeline(
    path: str | os.PathLike,
    dims: ParallelDims,
    *,
    dtype: torch.dtype | None = None,
    load_weights: bool = True,
    allow_unused: bool = False,
) -> nn.Module:
    """Load ``path`` with decoder layers split over ``dims.pp`` stages, each TP over ``dims.tp``.

    Every module lives on its stage's tp mesh (:func:`stage_mesh_of`); KV heads fewer than tp are
    replicated on the ``(tp_kv, tp_rep)`` view of that stage mesh (``plans.kv_head_mesh``).
    """
    layers = _num_layers(path)
    if dims.pp > layers:
        raise ValueError(f"pipeline stages ({dims.pp}) exceed the model's layers ({layers})")
    if dims.stages is not None and sum(dims.stages) != layers:
        raise ValueError(f"stages {dims.stages} hold {sum(dims.stages)} layers; the model has {layers}")
    return parallelize(
        path,
        dims,
        plan=tp_plan(),
        dtype=dtype,
        mesh_of=stage_mesh_of(dims, layers),
        load_weights=load_weights,
        allow_unused=allow_unused,
    )


def stage_meshes(dims: ParallelDims) -> list[DeviceMesh]:
    """The 1-D tp mesh of every pipeline stage of this rank's ``(dp, sp)`` group, stage order.

    Meshes of all groups are created on every rank in the same order, ranks ascending (mesh
    creation is collective over the world); this rank keeps its group's.
    """
    grid = rank_grid(dims)  # (dp, pp, sp, tp)
    rows = [
        [cached_mesh(grid[d, p, s], ("tp",)) for p in range(dims.pp)] for d in range(dims.dp) for s in range(dims.sp)
    ]
    coord = dims.world_mesh().get_coordinate()
    if coord is None:  # a rank outside the layout: any group's meshes (it holds no shard of them)
        return rows[0]
    d, _, s, _ = coord
    return rows[d * dims.sp + s]


def stage_mesh_of(dims: ParallelDims, num_layers: int) -> MeshOf:
    """Module name -> its stage's tp mesh (:func:`stage_of_module`: embedding first, head last)."""
    meshes = stage_meshes(dims)
    return lambda name: meshes[stage_of_module(name, num_layers, dims.pp, dims.stages)]


def balanced_stages(config, pp: int) -> tuple[int, ...]:
    """Layers per stage that minimize the slowest stage's weight reads, counting a decoder layer's
    parameters on every stage and the LM head's (``vocab x hidden``) on the last: the last stage
    takes fewer layers; the others split the rest near-equally (first stages take the remainder).
    ``config``: an HF config with ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``vocab_size``, ``num_attention_heads`` and ``num_key_value_heads``."""
    n, d = config.num_hidden_layers, config.hidden_size
    if not 1 <= pp <= n:
        raise ValueError(f"pipeline stages ({pp}) must be in 1..{n} (the model's layers)")
    kv = d * config.num_key_value_heads // config.num_attention_heads
    layer = 2 * d * d + 2 * d * kv + 3 * d * config.intermediate_size  # q, o, k, v; gate, up, down
    head = config.vocab_size * d

    def slowest(last: int) -> float:
        rest = n - last
        return max(-(-rest // max(pp - 1, 1)) * layer if pp > 1 else 0, last * layer + head)

    last = n if pp == 1 else min(range(1, n - pp + 2), key=lambda k: (slowest(k), -k))
    base, extra = divmod(n - last, max(pp - 1, 1))
    return (*(base + (1 if s < extra else 0) for s in range(pp - 1)), last)


def _num_layers(path) -> int:
    from transformers import AutoConfig

    from reshard.parallel.model.checkpoint import resolve_checkpoint

    return AutoConfig.from_pretrained(resolve_checkpoint(path)).num_hidden_layers


def build_model(
    path: str | os.PathLike,
    dims: ParallelDims,
    *,
    dtype: torch.dtype | None = None,
    load_weights: bool = True,
    allow_unused: bool = False,
) -> nn.Module:
    """The model in ``dims``' layout: pipeline stages when ``dims.pp > 1``, else TP x DP."""
    if dims.sp != 1:
        raise ValueError(f"build_model takes dp, pp and tp layouts, got sp={dims.sp}")
    if dims.pp > 1:
        return parallelize_pipeline(path, dims, dtype=dtype, load_weights=load_weights, allow_unused=allow_unused)
    return parallelize(path, dims, dtype=dtype, load_weights=load_weights, allow_unused=allow_unused)
