"""The ``seesaw`` strategy: its config (one layout per phase) and how it builds its engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from reshard.mesh import device_type
from reshard.parallel.engine import (
    Engine,
    EngineConfig,
    Strategy,
    register_strategy,
)
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.strategies.seesaw.policy import check_microbatches, seesaw_engine
from reshard.parallel.strategies.seesaw.switch import WEIGHT_MODES, LayoutSwitch


# ---- the strategy -------------------------------------------------------------------------------
@dataclass
class LayoutConfig:
    """One Seesaw phase's layout; at most one degree may be null (= the rest of the world)."""

    dp: int | None = 1
    pp: int | None = 1
    tp: int | None = 1
    ep: int = 1  # mixture-of-experts layers: experts over ep groups of the tp ranks (ep divides tp)

    def resolve(self, world: int, where: str) -> ParallelDims:
        """Dims with the null degree filled in; ``ValueError`` unless they multiply to ``world``,
        or unless ``ep`` divides ``tp`` (the experts of a phase live in its tp groups)."""
        degrees = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        for axis, value in degrees.items():
            if value is not None and value < 1:
                raise ValueError(f"{where}.{axis} must be >= 1, got {value}")
        unknown = [a for a, v in degrees.items() if v is None]
        if len(unknown) > 1:
            raise ValueError(f"{where}: at most one of dp, pp, tp may be null, got {unknown}")
        known = math.prod(v for v in degrees.values() if v is not None)
        if unknown:
            if world % known:
                raise ValueError(f"{where}: {degrees} cannot cover the world size ({world})")
            degrees[unknown[0]] = world // known
        if math.prod(degrees.values()) != world:
            raise ValueError(
                f"{where}: dp({degrees['dp']}) * pp({degrees['pp']}) * tp({degrees['tp']}) != world size ({world})"
            )
        if self.ep < 1 or degrees["tp"] % self.ep:
            raise ValueError(f"{where}.ep ({self.ep}) must divide {where}.tp ({degrees['tp']}): experts in tp groups")
        return ParallelDims(**degrees, ep=self.ep, world_size=world)


@register_strategy("seesaw")
@dataclass
class SeesawStrategy(Strategy):
    """Prefill in one layout (pipeline / data parallel), decode in another (tensor parallel)."""

    compiles_decode: ClassVar[bool] = False  # (each transition moves the decode layout's KV and weights)

    prefill: LayoutConfig = field(default_factory=lambda: LayoutConfig(pp=None))
    decode: LayoutConfig = field(default_factory=lambda: LayoutConfig(tp=None))
    cpu_kv_budget: int = 8192  # CPU KV tier capacity in tokens
    weights: str = "move"  # move | reload
    scheduler: str = "transition_minimizing"
    num_microbatches: int = 2  # pipeline micro-batches per step

    def __post_init__(self) -> None:
        from reshard.parallel.strategies.seesaw.schedulers import SCHEDULERS

        for name in ("cpu_kv_budget", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"parallel.weights must be move or reload, got {self.weights!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"parallel.scheduler {self.scheduler!r} is not one of {sorted(SCHEDULERS)}")

    def _check_heads(self, path, layouts: dict[str, ParallelDims]) -> None:
        """``ValueError`` before loading when a layout's TP degree cannot split the model's heads,
        naming the key (and, when it was null, that it took the rest of the world)."""
        from transformers import AutoConfig

        from reshard.layers import check_head_split
        from reshard.parallel import resolve_checkpoint

        config = AutoConfig.from_pretrained(resolve_checkpoint(path))
        heads = config.num_attention_heads
        for name, dims in layouts.items():
            try:
                check_head_split(heads, getattr(config, "num_key_value_heads", None) or heads, dims.tp)
            except ValueError as e:
                null = getattr(self, name).tp is None
                how = f"null, so the rest of the {dims.world_size} ranks: {dims.tp}" if null else str(dims.tp)
                raise ValueError(f"parallel.{name}.tp is {how}; {e} (set parallel.{name}.tp)") from None

    def layouts(self, world_size: int) -> dict[str, ParallelDims]:
        """The prefill and the decode layout, each over the whole job."""
        return {
            "prefill": self.prefill.resolve(world_size, "parallel.prefill"),
            "decode": self.decode.resolve(world_size, "parallel.decode"),
        }

    def unhosted_reason(self, world: int) -> str | None:
        """A mirror agrees per group and adopts on every rank in its step: decode in one TP layout."""
        decode = self.layouts(world)["decode"]
        if decode.dp > 1 or decode.pp > 1:
            return f"decodes in {decode.dp} replicas x {decode.pp} pipeline stages (parallel.decode.dp/pp must be 1)"
        return None

    def check_args(self, config: EngineConfig) -> None:
        super().check_args(config)
        check_microbatches(config, self.num_microbatches)

    def build(self, path, config: EngineConfig) -> Engine:
        self.check_args(config)
        layouts = self.layouts(dist.get_world_size())
        self._check_heads(path, layouts)
        prefill, decode = layouts["prefill"], layouts["decode"]
        switch = LayoutSwitch(
            path, prefill, decode, weights=self.weights, dtype=config.torch_dtype, allow_unused=config.allow_unused
        )
        return seesaw_engine(
            switch,
            config,
            cpu_kv_budget=self.cpu_kv_budget,
            scheduler=self.scheduler,
            num_microbatches=self.num_microbatches,
        )

    def summary(self, engine: Engine) -> dict:
        s, switch = engine.stats, engine.policy.switch
        swap = torch.tensor([s.swap_seconds], dtype=torch.float64, device=device_type())
        dist.all_reduce(swap, op=dist.ReduceOp.MAX)
        return {
            "transitions": s.transitions,
            "reshard_bytes": s.reshard_bytes,
            "reshard_lower_bound_bytes": s.reshard_lower_bound_bytes,
            "reshard_seconds": s.reshard_seconds,
            "swap_seconds": swap.item(),
            "scheduler": self.scheduler,
            "weights": switch.weights,
            "peak_weight_bytes": max((h.peak_weight_bytes for h in s.history), default=0),
        }

    def report(self, s: dict) -> list[str]:
        return [
            f"seesaw: {s['transitions']} transitions, "
            f"re-shard {s['reshard_seconds']:.3f} s ({s['reshard_bytes']} bytes, lower "
            f"bound {s['reshard_lower_bound_bytes']}), swap {s['swap_seconds']:.3f} s"
        ]
