"""``ParallelInfo``: the one record of how a model was parallelized, and the accessor that finds it.

:func:`parallelize` attaches it as ``model.parallel_info``; a strategy that adds to the model
(Shift's full-TP weights, SiDP's FFN pool) fills fields of the same record through
:func:`update_info`. Nothing else is attached to the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from reshard.parallel.model.dims import ParallelDims
from reshard.sync import WeightVersion


@dataclass
class LoadStats:
    """Bytes this rank read from the checkpoint, against the checkpoint's total tensor bytes."""

    bytes_read: int
    checkpoint_bytes: int
    path: str | None = None


@dataclass(frozen=True)
class ParallelInfo:
    """How a model was laid out on the ranks, and what that cost this rank.

    ``weight_version`` is the one mutable part: a :class:`reshard.sync.WeightSync` writes the step
    of the weights it installs (the engine refuses to generate while a sync is pending). Records
    made from this one by :func:`update_info` share it.
    """

    dims: ParallelDims  # the layout the engine's runners read
    load_stats: LoadStats | None = None  # bytes read from a checkpoint (None: built from a model object)
    extra_weight_bytes: int = 0  # bytes this rank holds beyond its own shards (Shift's full-TP copies)
    kv_replication: int | None = None  # ranks holding each KV head (Shift; None: not reported)
    replicated_ffn_bytes: int | None = None  # SiDP: FFN bytes a rank would hold with every FFN replicated
    kv_tokens_asked: int | None = None  # SiDP: paged KV tokens asked for, before the freed FFN bytes ...
    kv_tokens_added: int = 0  # ... added this many (every replica the same)
    weight_version: WeightVersion = field(default_factory=WeightVersion)


def parallel_info(model: nn.Module) -> ParallelInfo:
    """The record :func:`parallelize` attached to ``model``; ``ValueError`` for a model it did not build."""
    info = getattr(model, "parallel_info", None)
    if not isinstance(info, ParallelInfo):
        raise ValueError(
            f"{type(model).__name__} has no parallel_info (got {type(info).__name__}): "
            f"build it with reshard.parallel.parallelize (or a strategy's loader)"
        )
    return info


def update_info(model: nn.Module, **fields) -> ParallelInfo:
    """Replace ``fields`` of ``model``'s record (a new frozen record, same weight version); returns it."""
    model.parallel_info = dataclasses.replace(parallel_info(model), **fields)
    return model.parallel_info
