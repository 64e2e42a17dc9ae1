"""Tensor parallelism over ``tp`` ranks (in ``pp`` pipeline stages), the rest of the world as
data-parallel replicas.

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
    tp: int | None = None  # null: the whole world / pp
    pp: int = 1  # pipeline stages (micro-batched, one micro-batch per stage)

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")

    def dims(self, world_size: int) -> ParallelDims:
        tp = self.tp or max(world_size // self.pp, 1)
        if world_size % (tp * self.pp) != 0:
            what = f"parallel.tp ({tp})" + (f" x parallel.pp ({self.pp})" if self.pp > 1 else "")
            raise ValueError(f"{what} must divide the world size ({world_size})")
        return ParallelDims(dp=world_size // (tp * self.pp), pp=self.pp, tp=tp, world_size=world_size)

    def build(self, path: str | os.PathLike, args: EngineArgs) -> Engine:
        from .pipeline import parallelize_pipeline

        dims = self.dims(_world())
        load = parallelize_pipeline if self.pp > 1 else parallelize
        model = load(path, dims, dtype=args.dtype, allow_unused=args.allow_unused)
        return Engine(model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                      max_prefill_tokens=args.max_prefill_tokens, compile=args.compile,
                      admission=args.admission, num_microbatches=self.pp, **args.kv)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
