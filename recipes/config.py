"""Structured configs behind conf/*.yaml; validation with errors that name the override."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class ModelConfig:
    path: str | None = None
    cache_dir: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class WorkloadConfig:
    num_requests: int = 32
    prompt_len_min: int = 16
    prompt_len_max: int = 128
    seed: int = 0
    prompts_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"workload.num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(
                f"need 1 <= workload.prompt_len_min ({self.prompt_len_min}) <= "
                f"workload.prompt_len_max ({self.prompt_len_max})")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            self.sampling_params()
        except ValueError as e:  # SamplingParams names the field; add the config section
            raise ValueError(f"generation.{e}") from None

    def sampling_params(self):
        from parallel import SamplingParams

        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_seq_len: int = 512
    max_prefill_tokens: int = 4096

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"engine.{f.name} must be >= 1, got {getattr(self, f.name)}")


@dataclass
class LayoutConfig:
    """One Seesaw phase's layout; at most one degree may be null (= the rest of the world)."""

    dp: int | None = 1
    pp: int | None = 1
    tp: int | None = 1

    def resolve(self, world: int, where: str) -> dict[str, int]:
        """Degrees with the null one filled in; ``ValueError`` unless they multiply to ``world``."""
        degrees = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        for axis, value in degrees.items():
            if value is not None and value < 1:
                raise ValueError(f"{where}.{axis} must be >= 1, got {value}")
        unknown = [a for a, v in degrees.items() if v is None]
        if len(unknown) > 1:
            raise ValueError(f"{where}: at most one of dp, pp, tp may be null, got {unknown}")
        known = 1
        for value in degrees.values():
            known *= value or 1
        if unknown:
            if world % known:
                raise ValueError(f"{where}: {degrees} cannot cover the world size ({world})")
            degrees[unknown[0]] = world // known
        if degrees["dp"] * degrees["pp"] * degrees["tp"] != world:
            raise ValueError(f"{where}: dp({degrees['dp']}) * pp({degrees['pp']}) * tp({degrees['tp']}) "
                             f"!= world size ({world})")
        return degrees


@dataclass
class ParallelConfig:
    strategy: str = "tp"
    tp: int | None = None  # null: the rest of the world
    sp: int = 1  # shift: Ulysses degree of the base (SP x TP) layout
    threshold: int = 64  # shift: steps with more tokens run SP, the others TP
    shift_weights: str = "copy"  # shift: copy | slice
    prefill: LayoutConfig = field(default_factory=lambda: LayoutConfig(pp=None))  # seesaw
    decode: LayoutConfig = field(default_factory=lambda: LayoutConfig(tp=None))  # seesaw
    cpu_kv_budget: int = 8192  # seesaw: CPU KV tier capacity in tokens
    weights: str = "move"  # seesaw: move | reload
    scheduler: str = "transition_minimizing"  # seesaw
    num_microbatches: int = 2  # seesaw: pipeline micro-batches per step

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel.strategy {self.strategy!r} is not one of {sorted(STRATEGIES)}")
        for name in ("tp", "sp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")
        if self.threshold < 0:
            raise ValueError(f"parallel.threshold must be >= 0, got {self.threshold}")
        if self.shift_weights not in ("copy", "slice"):
            raise ValueError(f"parallel.shift_weights must be copy or slice, got {self.shift_weights!r}")
        self._check_seesaw()

    def _check_seesaw(self) -> None:
        from parallel.schedulers import SCHEDULERS

        for name in ("prefill", "decode"):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, _layout(getattr(self, name), f"parallel.{name}"))
        for name in ("cpu_kv_budget", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.weights not in ("move", "reload"):
            raise ValueError(f"parallel.weights must be move or reload, got {self.weights!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"parallel.scheduler {self.scheduler!r} is not one of {sorted(SCHEDULERS)}")


def _layout(d: dict, where: str) -> LayoutConfig:
    unknown = sorted(set(d) - {"dp", "pp", "tp"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: dp, pp, tp")
    return LayoutConfig(**d)


STRATEGIES = ("seesaw", "shift", "tp")


@dataclass
class GenerateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        longest = self.workload.prompt_len_max + self.generation.max_new_tokens
        if longest > self.engine.max_seq_len:
            raise ValueError(
                f"workload.prompt_len_max ({self.workload.prompt_len_max}) + "
                f"generation.max_new_tokens ({self.generation.max_new_tokens}) = {longest} exceeds "
                f"engine.max_seq_len ({self.engine.max_seq_len})")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "GenerateConfig":
        """Build from a plain dict (``OmegaConf.to_container(cfg)``); unknown keys are errors."""
        known = {f.name: f for f in fields(GenerateConfig)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
        sections = {"model": ModelConfig, "workload": WorkloadConfig, "generation": GenerationConfig,
                    "engine": EngineConfig, "parallel": ParallelConfig}
        kwargs = {k: (sections[k](**v) if k in sections else v) for k, v in d.items()}
        return GenerateConfig(**kwargs)
