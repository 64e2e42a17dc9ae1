"""SiDP: data parallelism whose FFN weights live in an owner pool (:mod:`layers.owner_pool`),
fetched by SiDP's scheduler (:mod:`.fetch`), or, for a mixture-of-experts model, whose experts live
in an expert pool (:mod:`layers.expert_pool`; :mod:`.pools`).

Each rank is a data-parallel replica with its own sequences; attention, norms and embeddings
are replicated, each decoder layer's FFN is owned by one rank. Two runners share one KV cache:
``"was"`` (non-owned FFNs fetched into cache slots ahead of use) and ``"cas"`` (activations
shipped to the owner). The orchestrator (:func:`choose_mode`) picks the mode from the group's
effective batch size against a threshold ``b*`` with hysteresis, at coarse boundaries (every
``interval`` steps). The group agrees on it without a collective of its own: the step before a
boundary carries every rank's proposal in the token agreement (CaS if any rank proposes it), and
the boundary step runs the agreed mode. A replica with no sequence in a step runs a dummy step:
it computes nothing of its own, and in CaS still serves the layers it owns (the runner's ``idle``,
layer by layer: :meth:`PooledMLP.idle`, :meth:`PooledMoE.idle`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from reshard.layers.owner_pool import CAS, WAS
from reshard.mesh import device_type
from reshard.parallel.engine import (
    ContinuousBatching,
    Engine,
    EngineConfig,
    EngineStats,
    ModelRunner,
    Move,
    Step,
    StepOutput,
    Strategy,
    register_strategy,
)
from reshard.parallel.engine.batching import batching_options
from reshard.parallel.engine.checks import check_one_microbatch
from reshard.parallel.engine.request import batch_kind
from reshard.parallel.model.checkpoint import resolve_checkpoint
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.model.info import parallel_info, update_info
from reshard.parallel.model.parallelize import parallelize
from reshard.parallel.strategies.sidp.pools import Pools, _fetched_layers, ffn_bytes, pool_model, profile_threshold

MODES = ("auto", "was", "cas")
PROPOSES_CAS = "sidp.proposes_cas"  # the policy's field of the token agreement: ranks proposing CaS


def choose_mode(batch: float, current: str | None, threshold: float, hysteresis: float) -> str:
    """WaS above ``threshold`` live sequences per replica (fetched weights amortized over many
    rows), CaS below (shipping a few rows is cheaper than a layer's weights).
    Inside the band ``threshold * (1 -+ hysteresis)``
    the current mode stays, so a batch size hovering near ``b*`` never flaps."""
    if current is None:
        return WAS if batch >= threshold else CAS
    if batch > threshold * (1 + hysteresis):
        return WAS
    if batch < threshold * (1 - hysteresis):
        return CAS
    return current


@dataclass
class SiDPStats(EngineStats):
    mode_steps: dict = field(default_factory=lambda: {"was": 0, "cas": 0})
    mode_switches: int = 0
    dummy_steps: int = 0  # (replica, step) pairs where a replica had no sequence
    modes: list = field(default_factory=list)  # the mode of every step, in order

    def summary(self) -> dict:
        return {
            "mode_steps": dict(self.mode_steps),
            "mode_switches": self.mode_switches,
            "dummy_steps": self.dummy_steps,
        }


@dataclass(frozen=True)
class BeginStep(Move):
    """The pool's step starts: ``rows[g]`` FFN input rows on replica ``g`` (0: a dummy step), in
    ``mode`` (WaS: the housekeeper starts fetching this rank's non-owned layers)."""

    rows: tuple[int, ...]
    mode: str


class SiDPPolicy(ContinuousBatching):
    """Continuous batching over the replicas; each step's mode from the orchestrator, decided
    every ``interval`` steps on the proposals the group agreed with the previous step's tokens
    (the first step's mode from its own batch: every rank plans it from the same requests);
    ``pools``' fetcher fetches the step's dense FFNs (WaS)."""

    stats_cls = SiDPStats

    def __init__(
        self,
        pools: Pools,
        *,
        mode: str,
        threshold: float,
        hysteresis: float,
        interval: int,
        **batching,
    ) -> None:
        super().__init__("was", **batching)
        self.pools, self.pool, self.fetcher = pools, pools.dense, pools.fetcher
        self.fixed = None if mode == "auto" else (WAS if mode == "was" else CAS)
        self.threshold = threshold
        self.hysteresis = hysteresis
        self.interval = interval
        self.current: str | None = None
        self._steps = 0
        self._agreed: str | None = None  # the mode the group agreed with the last step's tokens

    @property
    def initial_layout(self) -> None:
        return None

    def next_step(self, queue) -> Step:
        """The step, its :class:`BeginStep` move and (mode ``auto``) this rank's proposal for the
        next decision, agreed with the step's tokens."""
        step = super().next_step(queue)
        mode = WAS if step.layout == "was" else CAS
        begin = BeginStep(tuple(self._rows(step.seqs, step.num_tokens)), mode)
        agree = {} if self.fixed is not None else {PROPOSES_CAS: int(self._proposal() == CAS)}
        return dataclasses.replace(step, moves=(*step.moves, begin), agree=agree)

    def layout_for(self, seqs: list, num_tokens: list[int]) -> str:
        tokens = self._tokens(seqs, num_tokens)
        mode = self._mode()
        stats = self.stats
        stats.mode_steps["was" if mode == WAS else "cas"] += 1
        stats.dummy_steps += sum(1 for t in tokens if t == 0)
        stats.modes.append(mode)
        return "was" if mode == WAS else "cas"

    def _tokens(self, seqs: list, num_tokens: list[int]) -> list[int]:
        """Tokens each replica computes this step."""
        tokens = [0] * self.pools.G
        for s, n in zip(seqs, num_tokens):
            tokens[s.replica] += n
        return tokens

    def _rows(self, seqs: list, num_tokens: list[int]) -> list[int]:
        """FFN input rows of each replica: its tokens, or, where its share of the step is decode
        tokens only (its runner's decode runs all slots), every slot of its cache -- 0 for a
        replica without sequences (a dummy step). Each replica's runner picks its path from its
        own share (:func:`batch_kind`: a mixed step's decode-only replica decodes), so these do."""
        slots = self.runner_info["was"].max_batch_size
        rows = []
        for g in range(self.pools.G):
            mine = [(s, n) for s, n in zip(seqs, num_tokens) if s.replica == g]
            kind = batch_kind([s for s, _ in mine], [n for _, n in mine])
            rows.append(slots if kind == "decode" else sum(n for _, n in mine))
        return rows

    def _proposal(self) -> str:
        """This rank's mode for the live sequences per replica (either phase)."""
        return choose_mode(len(self.running) / self.pools.G, self.current, self.threshold, self.hysteresis)

    def _mode(self) -> str:
        if self.fixed is not None:
            return self.fixed
        if self.current is None:
            self.current = self._proposal()
        elif self._steps % self.interval == 0:
            if self._agreed != self.current:
                self.stats.mode_switches += 1
            self.current = self._agreed
        self._steps += 1
        return self.current

    def make(self, move: Move) -> None:
        assert isinstance(move, BeginStep), move
        if self.fetcher is not None:
            self.fetcher.begin_step(list(move.rows), move.mode)

    def after_step(self, step: Step, output: StepOutput) -> None:
        """The pool's step ends; the group's agreed proposal is the mode at the next decision."""
        super().after_step(step, output)  # (the step's computed blocks may be shared)
        if self.fetcher is not None:
            self.fetcher.end_step()
        if step.agree:
            assert output.agreed is not None, step.agree
            self._agreed = CAS if output.agreed[PROPOSES_CAS] > 0 else WAS

    def close(self) -> None:
        """Join the fetcher's housekeeper thread (not collective)."""
        if self.fetcher is not None:
            self.fetcher.close()


def sidp_engine(
    model: nn.Module,
    pools: Pools,
    config: EngineConfig | None = None,
    *,
    mode: str = "auto",
    threshold: float = 8.0,
    hysteresis: float = 0.25,
    interval: int = 4,
) -> Engine:
    """The loop over a :func:`pool_model` model with runners ``"was"`` and ``"cas"`` sharing one
    KV cache (``config``'s; the replicas share every step, whatever ``config.replicas`` says: the
    policy splits each step over them); ``config``'s batching options (the token budget, chunked
    prefill, the prefix cache: :func:`batching_options`) go to :class:`SiDPPolicy`."""
    config = SiDPStrategy.settled(config if config is not None else EngineConfig())
    lockstep = dataclasses.replace(config, replicas="lockstep")
    was = ModelRunner(model, lockstep, weights=WAS)
    cas = ModelRunner(model, lockstep, kv=was.kv, weights=CAS, every_slot=True)  # (fixed-size row blocks)
    policy = SiDPPolicy(
        pools,
        mode=mode,
        threshold=threshold,
        hysteresis=hysteresis,
        interval=interval,
        **batching_options(config, [was, cas]),
    )
    return Engine(runners={"was": was, "cas": cas}, policy=policy, config=config)


# ---- the strategy -------------------------------------------------------------------------------
@register_strategy("sidp")
@dataclass
class SiDPStrategy(Strategy):
    """Data parallel over every rank with SiDP's FFN owner pool."""

    compiles_decode: ClassVar[bool] = False  # (its decode fetches FFN weights between layers, eagerly)

    dp: int | None = None  # null: the whole job
    prefetch_depth: int | None = None  # layers a rank fetches ahead (WaS); null: 2, at most one fewer than it fetches
    slots: int | None = None  # cache slots for fetched layers; null: max(prefetch_depth, dp - 1)
    peak_shifting: bool = True
    threshold: float | None = 8.0  # b*: rows per replica above which WaS beats CaS; null: profiled here
    hysteresis: float = 0.25
    interval: int = 4  # steps between orchestrator decisions
    mode: str = "auto"  # auto | was | cas

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"parallel.mode must be one of {list(MODES)}, got {self.mode!r}")
        for name in ("dp", "prefetch_depth", "slots", "interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")
        if (self.threshold is not None and not self.threshold > 0) or not 0 <= self.hysteresis < 1:
            raise ValueError(
                f"need parallel.threshold > 0 and 0 <= parallel.hysteresis < 1, got "
                f"{self.threshold} and {self.hysteresis}"
            )

    def dims(self, world_size: int, experts: bool = False) -> ParallelDims:
        """One replica per rank; a mixture-of-experts model's experts over the replicas (``ep = dp``:
        an owner per expert group)."""
        dp = self.dp or world_size
        if dp != world_size:
            raise ValueError(f"parallel.dp ({dp}) must equal the world size ({world_size}): one replica per rank")
        return ParallelDims(dp=dp, ep=dp if experts else 1, world_size=world_size)

    def unhosted_reason(self, world: int) -> str | None:
        """A replica per rank: the supervisors keep one lockstep group's KV."""
        return "runs a replica per rank"

    def check_args(self, config: EngineConfig) -> None:
        super().check_args(config)
        if config.compile:
            raise ValueError(
                "compile=true is not supported by parallel=sidp: its decode step fetches FFN weights from the "
                "owner pool between layers, which runs eagerly (set compile=false)"
            )

    def build(self, path: str | os.PathLike, config: EngineConfig) -> Engine:
        self.check_args(config)
        config = self.settled(config)
        dims = self.dims(dist.get_world_size(), _has_experts(path))
        if dims.expert_dispatch:
            check_one_microbatch(config)
        model = parallelize(path, dims, dtype=config.torch_dtype, allow_unused=config.allow_unused)
        full_ffn = ffn_bytes(model)
        # default look-ahead: 2, but one slot fewer than the layers a rank fetches, so the pool
        # keeps less FFN per rank than replication and the freed bytes become KV (where it can)
        depth = self.prefetch_depth or max(1, min(2, _fetched_layers(model, dims.dp) - 1))
        slots = self.slots or max(depth, dims.dp - 1)
        pools = pool_model(
            model,
            list(range(dims.dp)),
            slots=slots,
            prefetch_depth=depth,
            peak_shifting=self.peak_shifting,
        )
        update_info(model, replicated_ffn_bytes=full_ffn)
        self.profiled = self.threshold is None
        if self.threshold is None and pools.fetcher is None:
            raise ValueError(
                f"parallel.threshold=null profiles b* on the dense FFN pool; {model.config.model_type} pools its "
                "experts instead: give parallel.threshold (rows per replica above which WaS runs)"
            )
        if self.threshold is None:
            self.threshold = profile_threshold(pools.fetcher)
        return sidp_engine(
            model,
            pools,
            self._kv(config, model, pools),
            mode=self.mode,
            threshold=self.threshold,
            hysteresis=self.hysteresis,
            interval=self.interval,
        )

    def _kv(self, config: EngineConfig, model: nn.Module, pools: Pools) -> EngineConfig:
        """``config`` with a paged cache grown by the tokens the freed FFN bytes hold (the memory a
        replicated DP replica spends on FFN weights goes to KV instead); contiguous slots stay as
        asked."""
        if config.kv_block_size is None:
            return config
        freed = parallel_info(model).replicated_ffn_bytes - sum(pools.held_bytes(model))
        cfg, size = model.config, model.model.embed_tokens.weight.element_size()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * size
        extra = torch.tensor(
            [max(freed, 0) // per_token // config.kv_block_size * config.kv_block_size], device=device_type()
        )
        dist.all_reduce(extra, op=dist.ReduceOp.MIN)  # every replica admits by the same pool size
        extra = int(extra.item())
        asked = config.paged_tokens(config.seq_len(model.config))
        update_info(model, kv_tokens_asked=asked, kv_tokens_added=extra)
        return dataclasses.replace(config, kv_tokens=asked + extra)

    def summary(self, engine: Engine) -> dict:
        pools = engine.policy.pools
        fetched = torch.tensor([pools.fetched_bytes()], dtype=torch.float64, device=device_type())
        dist.all_reduce(fetched)
        info = parallel_info(engine.model)
        held, slots = pools.held_bytes(engine.model)
        freed = info.replicated_ffn_bytes - held - slots
        readers = pools.fetcher.counters.max_concurrent_readers if pools.fetcher is not None else 0
        return {
            **engine.stats.summary(),
            "ffn_bytes_per_rank": held,
            "slot_bytes": slots,
            "ffn_bytes_replicated": info.replicated_ffn_bytes,
            "kv_capacity_tokens": engine.kv.spec.capacity_tokens,
            "kv_tokens_asked": engine.kv.spec.capacity_tokens if info.kv_tokens_asked is None else info.kv_tokens_asked,
            "kv_tokens_gained": max(freed, 0) // kv_bytes_per_token(engine.kv.spec),
            "fetch_bytes": int(fetched.item()),
            "max_concurrent_readers": readers,
            "mode": self.mode,
            "threshold": self.threshold,
            "threshold_profiled": getattr(self, "profiled", False),
        }

    def report(self, s: dict) -> list[str]:
        mib = 1 << 20
        held = (s["ffn_bytes_per_rank"] + s["slot_bytes"]) / mib
        return [
            f"sidp {s['mode']}: steps {s['mode_steps']}, {s['mode_switches']} switches, {s['dummy_steps']} dummy; "
            f"fetched {s['fetch_bytes'] / mib:.1f} MiB, at most {s['max_concurrent_readers']} readers per owner",
            f"FFN per rank {s['ffn_bytes_per_rank'] / mib:.1f} MiB owned + {s['slot_bytes'] / mib:.1f} MiB slots "
            f"= {held:.1f} MiB vs {s['ffn_bytes_replicated'] / mib:.1f} MiB replicated: {_gain_line(s)}",
        ]


def _gain_line(s: dict) -> str:
    """What the freed FFN bytes bought: KV tokens, allocated (a paged cache grows) or not."""
    gained = s["kv_tokens_gained"]
    if gained <= 0:
        return "no KV gained (the slots and owned layers hold as much as replication: fewer slots leave a gain)"
    if s["kv_capacity_tokens"] > s["kv_tokens_asked"]:
        return f"+{gained} KV tokens, allocated ({s['kv_tokens_asked']} asked -> {s['kv_capacity_tokens']})"
    return f"+{gained} KV tokens at equal memory (allocated with a paged cache: engine.kv_block_size, engine.kv_tokens)"


def _has_experts(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at ``path`` is a mixture-of-experts model (its config names experts)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_checkpoint(path))
    return any(getattr(cfg, key, None) for key in ("num_experts", "num_local_experts"))


def kv_bytes_per_token(spec) -> int:
    """KV bytes one token takes in a cache of ``spec`` (K and V, every layer and head held)."""
    return 2 * spec.num_layers * spec.num_heads * spec.head_dim * torch.empty((), dtype=spec.dtype).element_size()
