"""Whole-model layouts as target dicts for :func:`reshard.redistribute_module`.

Each function returns ``{parameter name: (mesh, placements)}`` for a model made of our layers.
Moving between any two of them is one coalesced, planned transfer (Seesaw's prefill <-> decode
re-sharding, the RL train -> rollout weight sync, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reshard import Layout
from reshard.layers import RMSNorm
from reshard.layers._base import Redistributable, Targets, prefixed
from reshard.layout import nested_tuple
from reshard.parallel.model.dims import ParallelDims


def _top_layers(model: nn.Module) -> list[tuple[str, Redistributable]]:
    """Our outermost layers (an attention's inner linears are covered by the attention)."""
    out: list[tuple[str, Redistributable]] = []
    for name, module in model.named_modules():
        if isinstance(module, Redistributable) and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, module))
    return out


def tp_layout(model: nn.Module, mesh: DeviceMesh) -> Targets:
    """Tensor parallel over the 1-D ``mesh``: heads / FFN columns / vocab split, norms replicated."""
    targets: Targets = {}
    for name, layer in _top_layers(model):
        placements = (Replicate(),) if isinstance(layer, RMSNorm) else (Shard(0),)
        targets.update(prefixed(name, layer.redistribute_targets(mesh, placements)))
    return targets


def replicate_over(targets: Targets, mesh: DeviceMesh) -> Targets:
    """Lift 1-D targets onto a 2-D ``(dp, tp)`` ``mesh``: replicas along dp, same layout along tp.

    Every 1-D target mesh must be this rank's tp row of ``mesh`` (e.g. from :func:`tp_layout` on
    ``mesh["tp"]``); KV-head-replicated attention (2-D kv meshes) cannot be lifted.
    """
    lifted: Targets = {}
    for name, (sub, placements) in targets.items():
        if sub.ndim != 1:
            raise ValueError(f"{name!r} is on a {sub.ndim}-D mesh; only 1-D targets can be lifted")
        lifted[name] = (mesh, (Replicate(),) + tuple(placements))
    return lifted


def fsdp_layout(model: nn.Module, mesh: DeviceMesh) -> Targets:
    """FSDP-style: every parameter Shard(0) over ``mesh`` (the training layout of FSDP2)."""
    return {name: (mesh, (Shard(0),)) for name, _ in model.named_parameters()}


def stage_layout(model: nn.Module, stage_meshes: Sequence[DeviceMesh]) -> Targets:
    """Pipeline stages: decoder layers split into contiguous blocks, one block per stage mesh.

    Stage ``s`` holds whole layers (replicated over its mesh); the embedding lives with the first
    stage, the final norm and LM head with the last.
    """
    num_layers, num_stages = len(model.model.layers), len(stage_meshes)
    if num_stages > num_layers:
        raise ValueError(f"pipeline stages ({num_stages}) exceed the model's layers ({num_layers})")
    targets: Targets = {}
    for name, _ in model.named_parameters():
        mesh = stage_meshes[stage_of_module(name, num_layers, num_stages)]
        targets[name] = (mesh, (Replicate(),) * mesh.ndim)
    return targets


def stage_of_module(name: str, num_layers: int, num_stages: int, stages: Sequence[int] | None = None) -> int:
    """Stage of a module or parameter name: its layer's, or first (embedding) / last (norm, head)."""
    parts = name.split(".")
    if "layers" in parts:
        return stage_of_layer(int(parts[parts.index("layers") + 1]), num_layers, num_stages, stages)
    return 0 if "embed_tokens" in name else num_stages - 1


def stage_of_layer(layer: int, num_layers: int, num_stages: int, stages: Sequence[int] | None = None) -> int:
    """Layers split into contiguous blocks of ``stages`` layers each (default: near-equal blocks,
    the first stages take the remainder)."""
    if stages is None:
        base, extra = divmod(num_layers, num_stages)
        stages = [base + (1 if s < extra else 0) for s in range(num_stages)]
    assert len(stages) == num_stages and sum(stages) == num_layers, (stages, num_stages, num_layers)
    bounds = list(itertools.accumulate(stages))
    return next(s for s, end in enumerate(bounds) if layer < end)


def global_layout(t: DTensor, dims: ParallelDims) -> Layout:
    """The layout of ``t`` over the whole world: its mesh repeated on every dp replica.

    A model built for ``dims`` holds each parameter on this dp replica's mesh (a stage's tp mesh,
    a ``(kv, rep)`` mesh, ...); the replicas hold the same values, so the world-wide layout adds a
    leading dp axis with ``Replicate()``. Every rank computes the same layout, so every rank plans
    the same transfer. Assumes the ascending ``(dp, pp, sp, tp)`` grid of :class:`ParallelDims`.
    """
    local = Layout.of_dtensor(t)
    d = dims.world_mesh().get_coordinate()[0]
    stride = dims.world_size // dims.dp
    ranks = local.grid
    grid = torch.stack([ranks + (i - d) * stride for i in range(dims.dp)])  # (dp, *mesh)
    return dataclasses.replace(local, ranks=nested_tuple(grid.tolist()), placements=(Replicate(),) + local.placements)
