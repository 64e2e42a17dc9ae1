"""The RL rollout loop's config behind conf/rollout.yaml (checked by Hydra: :mod:`reshard.recipes.schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType

POLICY_NAME = "tiny-policy-seed0-v1"
POLICY = MappingProxyType(
    dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.02,
    )
)


@dataclass
class PolicyConfig:
    path: str | None = None  # null: the built-in tiny policy (seeded, created on first use)
    cache_dir: str | None = None


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RolloutLayoutConfig:
    layout: str = "tp"  # tp | shift
    tp: int | None = None  # tp layout: TP degree (null: all rollout ranks; the rest are replicas)
    sp: int = 2  # shift layout: Ulysses degree (x the rest as TP)
    threshold: int = 64  # shift layout: steps of more tokens than this run SP, the others TP
    colocated: bool = True  # true: every rank trains and rolls out; false: split ranks
    train_ranks: int | None = None  # split: how many (the first) ranks train; null: half
    max_batch_size: int = 64
    dtype: str | None = None  # the rollout weights' dtype: float32 | bfloat16 | float16 (null: the checkpoint's)

    def __post_init__(self) -> None:
        from reshard.parallel.strategies.rollout import rollout_layouts

        if self.layout not in rollout_layouts():
            raise ValueError(f"rollout.layout must be one of {rollout_layouts()}, got {self.layout!r}")
        if self.dtype is not None and self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype must be one of {list(ROLLOUT_DTYPES)} or null, got {self.dtype!r}")
        for key in ("tp", "sp", "threshold", "max_batch_size", "train_ranks"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {value}")
        if self.colocated and self.train_ranks is not None:
            raise ValueError(
                f"rollout.train_ranks={self.train_ranks} splits the ranks between training and rollout; "
                "rollout.colocated=true trains and rolls out on every rank (set rollout.colocated=false or unset it)"
            )


@dataclass
class SyncConfig:
    method: str = "planned"  # planned (ours) | full_tensor | broadcast (baselines)
    bucket_mb: float = 64.0  # staging budget: a round's send + receive buffers per rank
    verify_every: int = 10  # check the synced weights against the source every N iterations (0: never)
    delta: bool = False  # send only the elements that changed since the last sync (planned method only)

    def __post_init__(self) -> None:
        from reshard.sync import SYNC_METHODS

        if self.method not in SYNC_METHODS:
            raise ValueError(f"sync.method must be one of {list(SYNC_METHODS)}, got {self.method!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"sync.bucket_mb must be > 0, got {self.bucket_mb}")
        if not (type(self.verify_every) is int and self.verify_every >= 0):
            raise ValueError(f"sync.verify_every must be an int >= 0 (0: never), got {self.verify_every!r}")
        if self.delta and self.method != "planned":
            raise ValueError(f"sync.delta=true runs the planned method only, got sync.method={self.method!r}")


@dataclass
class TrainConfig:
    layout: str = "fsdp"  # fsdp | fsdp_tp (2-D: TP of train.tp ranks inside FSDP2) | hsdp (replicated FSDP2 groups)
    tp: int = 2  # fsdp_tp: the TP degree (FSDP2 over the rest of the training ranks)
    shard_group: int = 2  # hsdp: ranks each FSDP2 group shards over (replicated across the groups)
    iterations: int = 30
    prompts: int = 8  # prompts per iteration
    group_size: int = 8  # sampled completions per prompt (GRPO's group)
    prompt_len: int = 6
    max_new_tokens: int = 8
    temperature: float = 1.0
    learning_rate: float = 3e-3
    seed: int = 0
    prompts_file: str | None = None  # JSONL of prompts (ids, text or chat) and other fields; null: the toy task
    prompts_dataset: str | None = None  # a `datasets` dataset read offline (a saved directory or a cached name)
    prompts_split: str = "train"  # prompts_dataset's split
    reward: str | None = None  # package.module:function, called as TRL calls reward functions; null: the toy reward

    def __post_init__(self) -> None:
        from reshard.parallel.strategies.rollout import TRAIN_LAYOUTS

        if self.layout not in TRAIN_LAYOUTS:
            raise ValueError(f"train.layout must be one of {list(TRAIN_LAYOUTS)}, got {self.layout!r}")
        for f in fields(self):
            numeric = f.name not in ("seed", "layout", "reward") and not f.name.startswith("prompts_")
            if numeric and not getattr(self, f.name) > 0:
                raise ValueError(f"train.{f.name} must be > 0, got {getattr(self, f.name)}")
        if self.prompts_file is not None and self.prompts_dataset is not None:
            raise ValueError(
                f"train.prompts_file={self.prompts_file} and train.prompts_dataset={self.prompts_dataset}: give one"
            )
        if self.group_size < 2:
            raise ValueError(
                f"train.group_size must be >= 2 (advantages are relative to the group), got {self.group_size}"
            )

    @property
    def inner(self) -> int:
        """Ranks of one inner group of the layout: the TP degree (fsdp_tp) or the shard group (hsdp)."""
        return self.tp if self.layout == "fsdp_tp" else self.shard_group

    def data_shards(self, train_ranks: int) -> int:
        """Distinct shares of the batch: one per data-parallel rank (a TP group shares one)."""
        return train_ranks // self.tp if self.layout == "fsdp_tp" else train_ranks


@dataclass
class RolloutJobConfig:
    model: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutLayoutConfig = field(default_factory=RolloutLayoutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    progress: bool = True
