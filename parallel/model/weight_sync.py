"""Weight sync between whole models: a training model (e.g. FSDP2) -> a rollout model of our layers.

The movement itself is :class:`reshard.sync.WeightSync`; this module only says which tensors of a
model take part: every parameter under its state-dict name (tied names included) and, on the
rollout side, every separate copy a layer holds of a weight (Shift's full-TP shards).
"""

from __future__ import annotations

import torch
from torch import nn

from reshard.executor import DEFAULT_BUCKET_BYTES
from reshard.layers.weights import weight_copies
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.sources import experts_transposed
from reshard.sync import WeightSync


def train_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` with tied parameters under each of their names, and transformers'
    fused experts split as our layers hold them (:func:`split_fused`)."""
    params = list(model.named_parameters(remove_duplicate=False))
    hf_fused = any(name.endswith(".experts.gate_up_proj") for name, _ in params)  # (not a model of our layers)
    transposed = hf_fused and hasattr(model, "config") and experts_transposed(model.config)
    return dict(pair for name, t in params for pair in split_fused(name, t, transposed))


def split_fused(name: str, t: torch.Tensor, transposed: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``(name, t)``, or for transformers' fused ``...experts.gate_up_proj (E, 2I, D)`` the views
    ``...experts.gate_proj`` (rows ``[0, I)`` of dim 1) and ``...experts.up_proj`` (``[I, 2I)``),
    the tensors our experts hold. ``transposed`` (Llama 4's input-major ``gate_up_proj (E, D, 2I)``,
    ``down_proj (E, I, D)``): the same views with dims 1 and 2 swapped. A DTensor sharded over the
    experts (FSDP2's dim 0) stays one: slicing or swapping dims 1-2 keeps its placements, so the
    sync plans the halves at the lower bound."""
    if transposed and name.endswith(".experts.down_proj"):
        return [(name, t.detach().transpose(1, 2))]
    if not name.endswith(".experts.gate_up_proj"):
        return [(name, t)]
    t = t.detach().transpose(1, 2) if transposed else t.detach()  # (E, 2I, D)
    base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
    return [(base + "gate_proj", t[:, :half]), (base + "up_proj", t[:, half:])]


def rollout_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and every layer's separate weight copies (written in place by a sync)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **weight_copies(model)}


def model_sync(
    train: nn.Module | None,
    rollout: nn.Module | None,
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    method: str = "planned",
    allow_unused: bool = False,
    delta: bool = False,
) -> WeightSync:
    """A :class:`WeightSync` from ``train`` to ``rollout`` (``None`` where this rank holds no such
    model). Collective over the world; the rollout model's ``parallel_info.weight_version`` tracks the step.
    ``delta``: send only what changed since the last sync (see :class:`WeightSync`)."""
    return WeightSync(
        train_tensors(train) if train is not None else None,
        rollout_tensors(rollout) if rollout is not None else None,
        version=parallel_info(rollout).weight_version if rollout is not None else None,
        bucket_bytes=bucket_bytes,
        method=method,
        allow_unused=allow_unused,
        delta=delta,
    )
