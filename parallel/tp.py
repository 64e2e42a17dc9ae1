"""Tensor parallelism over ``tp`` ranks, the rest of the world as data-parallel replicas.

The default strategy: one layout (:func:`parallelize` with the TP plan), continuous batching; the
loop alternates the running sequences over the replicas.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .engine import Engine, EngineArgs, Strategy, register_strategy
from .dims import ParallelDims
from .parallelize import parallelize


@register_strategy("tp")
@dataclass
class TPStrategy(Strategy):
    tp: int | None = None  # null: the whole world

    def __post_init__(self) -> None:
        if self.tp is not None and self.tp < 1:
            raise ValueError(f"parallel.tp must be >= 1, got {self.tp}")

    def dims(self, world_size: int) -> ParallelDims:
        tp = self.tp or world_size
        if world_size % tp != 0:
            raise ValueError(f"parallel.tp ({tp}) must divide the world size ({world_size})")
        return ParallelDims(dp=world_size // tp, tp=tp, world_size=world_size)

    def build(self, path: str | os.PathLike, args: EngineArgs) -> Engine:
        model = parallelize(path, self.dims(_world()), dtype=args.dtype, allow_unused=args.allow_unused)
        return Engine(model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                      max_prefill_tokens=args.max_prefill_tokens, compile=args.compile,
                      admission=args.admission, **args.kv)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
