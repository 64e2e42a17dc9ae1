"""Tensor parallelism over ``tp`` ranks (in ``pp`` pipeline stages), the rest of the world as
data-parallel replicas.

The default strategy: one layout (:func:`parallelize` with the TP plan), continuous batching; the
loop alternates the running sequences over the replicas.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from torch import nn

from reshard.parallel.engine import Engine, EngineConfig, Strategy, register_strategy
from reshard.parallel.engine.channel import Topology
from reshard.parallel.engine.checks import check_one_microbatch
from reshard.parallel.engine.registry import PAGED_BLOCK_SIZE
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.pipeline import build_model


@register_strategy("tp")
@dataclass
class TPStrategy(Strategy):
    tp: int | None = None  # null: the whole world / pp
    pp: int = 1  # pipeline stages (micro-batched, one micro-batch per stage)
    ep: int = 1  # mixture-of-experts layers: experts over ep groups of the tp ranks, each expert TP over tp // ep

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")

    def dims(self, world_size: int) -> ParallelDims:
        tp = self.tp or max(world_size // self.pp, 1)
        if world_size % (tp * self.pp) != 0:
            what = f"parallel.tp ({tp})" + (f" x parallel.pp ({self.pp})" if self.pp > 1 else "")
            raise ValueError(f"{what} must divide the world size ({world_size})")
        dp = world_size // (tp * self.pp)
        if tp % self.ep != 0 and not (self.ep == dp and tp == self.pp == 1):
            raise ValueError(
                f"parallel.ep ({self.ep}) must divide parallel.tp ({tp}) (experts split in the tp group), or "
                f"equal the data-parallel replicas ({dp}) with parallel.tp=1 (data-parallel attention)"
            )
        return ParallelDims(dp=dp, pp=self.pp, tp=tp, ep=self.ep, world_size=world_size)

    def supervised_layout(self, world: int, migrate: str) -> tuple[int, Topology]:
        """The data-parallel groups, of ``pp x tp`` ranks each: a ring of them, or one group of
        every rank whose supervisors keep its KV (``kv``; a pipeline's later stages take none)."""
        dims = self.dims(world)
        if dims.pp > 1 and migrate == "kv":
            raise ValueError(
                f"fault.migrate=kv adopts KV on every rank of a group in its step, which a pipeline's later stages "
                f"do not take; parallel.pp={dims.pp} (use fault.migrate=reprefill or none)"
            )
        if dims.dp == 1:
            return dims.tp * dims.pp, Topology.lockstep(hosted=migrate == "kv")
        return dims.tp * dims.pp, Topology.ring(dims.dp)

    @property
    def replica_groups(self) -> bool:
        """The data-parallel groups are replicas of one layout."""
        return True

    def default_kv_block_size(self) -> int | None:
        """Paged, pipeline stages included: ``n`` samples and chat turns compute their prompt once,
        and a request that runs out of blocks is preempted (a PP2 rollout of 8 prompts x ``n=8``
        ran 1.54x contiguous slots' tokens/s; decode without shared prompts 0.90-0.98x,
        ``bench/prefix_cache.py --pp``, ``bench/pipeline.py``, 2026-11-30)."""
        return PAGED_BLOCK_SIZE

    def check_prefill_chunk(self, prefill_chunk: int) -> None:
        """Chunked prefill runs in one pipeline stage (the mixed step is one eager micro-batch)."""
        if self.pp > 1:
            raise ValueError(
                f"engine.prefill_chunk ({prefill_chunk}) cannot be combined with pipeline stages "
                f"(parallel.pp ({self.pp})); set one of them to its default"
            )

    def build_model(self, path: str | os.PathLike, dims: ParallelDims, config: EngineConfig) -> nn.Module:
        """TP x DP by the TP plan, or pipeline stages of TP when ``pp > 1``."""
        return build_model(
            path, dims, dtype=config.torch_dtype, load_weights=config.load_weights, allow_unused=config.allow_unused
        )

    def build_engine(self, model: nn.Module, config: EngineConfig) -> Engine:
        """Continuous batching over the model (``pp > 1``: one micro-batch per stage unless
        ``config.num_microbatches`` says otherwise; data-parallel attention with experts over the
        replicas: the replicas step in lockstep, their MoE layers exchange tokens every step)."""
        if parallel_info(model).dims.expert_dispatch:
            check_one_microbatch(config)
            config = dataclasses.replace(config, replicas="lockstep")
        return Engine(model, config)
