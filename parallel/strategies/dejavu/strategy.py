"""The ``dejavu`` strategy: its config (:class:`DejaVuStrategy`, :class:`SideConfig`), the engines
over its two sides (:func:`dejavu_groups_engine`, :func:`dejavu_engine`) and the appendix-D split
(planned before the run, measured after it)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from reshard.kv.stream import KVStreamer
from reshard.kv.stream_plan import plan_stream, world_layouts
from reshard.mesh import cached_group, device_type, from_rank0
from reshard.parallel.cost.dejavu_planner import best_split, plan_disaggregation
from reshard.parallel.cost.profiles import hardware, model_from_config
from reshard.parallel.cost.roofline import ParallelConfig, decode_stage_time, prefill_stage_time
from reshard.parallel.engine import (
    Engine,
    EngineConfig,
    ModelRunner,
    Strategy,
    WorkloadShape,
    make_strategy,
    register_strategy,
)
from reshard.parallel.engine.channel import GroupLayout, Topology
from reshard.parallel.model.checkpoint import resolve_checkpoint
from reshard.parallel.model.dims import ParallelDims, rank_grid
from reshard.parallel.model.pipeline import build_model
from reshard.parallel.strategies.dejavu.connector import StreamedKV
from reshard.parallel.strategies.dejavu.prompt import PromptSide
from reshard.parallel.strategies.dejavu.sides import AbsentRunner, DejaVuStats, LockstepSides, TokenSide


def dejavu_groups_engine(
    prompt: nn.Module,
    token: nn.Module,
    prompt_dims: ParallelDims,
    token_dims: ParallelDims,
    config: EngineConfig | None = None,
) -> Engine:
    """The disaggregated engine with each side's replicas as engine groups that run at the same
    time: prompt groups ``0..P-1`` (the router hands them requests), token groups ``P..P+T-1``
    (they take prefilled prompts). Collective over the job: every rank calls it. ``config``: both
    sides' slots and sequence length, the prompt side's ``max_prefill_tokens``, the router's
    ``routing``."""
    config = DejaVuStrategy.settled(config if config is not None else EngineConfig())
    groups = _side_groups(prompt_dims) + _side_groups(token_dims)
    pgs = [cached_group(ranks, purpose="engine-group") for ranks in groups]  # collective, in order
    runners = {
        name: _runner(model, dims, replace(config, replicas="groups"))
        for name, model, dims in (("prompt", prompt, prompt_dims), ("token", token, token_dims))
    }
    layouts = {name: world_layouts(r.kv) for name, r in runners.items()}  # collective, every rank
    entries = tuple(range(prompt_dims.dp))
    side = "prompt" if dist.get_rank() in prompt_dims.ranks else "token"
    index = next(i for i, ranks in enumerate(groups) if dist.get_rank() in ranks)
    layout = GroupLayout(index, len(groups), groups[index], entries, "dejavu", None)
    streamers = _streamers(layouts, groups, index, entries)
    if side == "prompt":
        tokens = [g for g in range(len(groups)) if g not in entries]
        policy = PromptSide(streamers, index, tokens, config.max_prefill_tokens, config.prefix_caching, _kept(config))
    else:
        token_runner = runners["token"]
        kept = _kept(config) * len(streamers)  # (every prompt group's)
        streamed = StreamedKV(streamers, token_runner.kv, token.config.num_hidden_layers, len(groups[index]), kept=kept)
        policy = TokenSide(streamed, chunked=config.chunked_prefill)
    engine = Engine(runners=runners, policy=policy, config=config, group=pgs[index], engine_group=layout)
    if side == "prompt":
        engine.events.on("layer_after", policy.stream_layer, layout="prompt")
    return engine


def _job_stats(engine: Engine) -> tuple[DejaVuStats, tuple[float, float, float]]:
    """The counters over the job, and its mean prompt and token step seconds and streamed bytes:
    summed over the groups (the same on every rank), or over the ranks of a lockstep engine."""
    if engine.group_stats:
        s = DejaVuStats.total(engine.group_stats)
        return s, (
            s.prefill_seconds / max(s.prefill_steps, 1),
            s.decode_seconds / max(s.decode_steps, 1),
            s.streamed_bytes,
        )
    s = engine.stats
    times = torch.tensor(
        [s.prefill_seconds / max(s.prefill_steps, 1), s.decode_seconds / max(s.decode_steps, 1), s.streamed_bytes],
        dtype=torch.float64,
        device=device_type(),
    )
    dist.all_reduce(times[2:])
    dist.all_reduce(times[:2], op=dist.ReduceOp.MAX)
    return s, tuple(times.tolist())


def _side_groups(dims: ParallelDims) -> list[tuple[int, ...]]:
    """The ranks of each data-parallel replica of a side (every replica is a group)."""
    return [tuple(r.flatten().tolist()) for r in rank_grid(dims)]


def _streamers(layouts: dict, groups: list, index: int, entries: tuple[int, ...]) -> dict[int, KVStreamer]:
    """This group's streamer to (prompt side) or from (token side) each group of the other side."""
    peers = [g for g in range(len(groups)) if (g in entries) != (index in entries)]
    out = {}
    for g in peers:
        p, t = (index, g) if index in entries else (g, index)
        src = {r: lay for r, lay in layouts["prompt"].items() if r in groups[p]}
        dst = {r: lay for r, lay in layouts["token"].items() if r in groups[t]}
        out[g] = KVStreamer(plan_stream(src, dst))
    return out


def dejavu_engine(
    prompt: nn.Module,
    token: nn.Module,
    prompt_dims: ParallelDims,
    token_dims: ParallelDims,
    config: EngineConfig | None = None,
) -> Engine:
    """The disaggregated engine with both sides in one loop (collective over the job: every rank
    calls it). ``config``: both sides' slots and sequence length, the prompt side's
    ``max_prefill_tokens``."""
    config = DejaVuStrategy.settled(config if config is not None else EngineConfig())
    runners = {
        name: _runner(model, dims, replace(config, replicas="lockstep"))
        for name, model, dims in (("prompt", prompt, prompt_dims), ("token", token, token_dims))
    }
    plan = plan_stream(world_layouts(runners["prompt"].kv), world_layouts(runners["token"].kv))
    streamer, token_runner = KVStreamer(plan), runners["token"]
    prompt_side = PromptSide({1: streamer}, 0, [1], config.max_prefill_tokens, config.prefix_caching, _kept(config))
    streamed = StreamedKV(
        {0: streamer},
        token_runner.kv,
        token.config.num_hidden_layers,
        dist.get_world_size(),
        token_runner.max_batch_size,
        kept=_kept(config),
    )
    policy = LockstepSides(prompt_side, TokenSide(streamed, chunked=config.chunked_prefill))
    # tokens are agreed over the whole job: both layouts take part in every step
    engine = Engine(runners=runners, policy=policy, config=config, group=dist.group.WORLD)
    if runners["prompt"].kv is not None:
        engine.events.on("layer_after", prompt_side.stream_layer, layout="prompt")
    return engine


KEPT_SHARE = 4  # a token group keeps one prompt per this many of its slots for each prompt group


def _kept(config: EngineConfig) -> int:
    """Prompts a token group keeps for each prompt group (:mod:`.lease`), where prompts are shared
    at all (``prefix_caching``): a quarter of its slots (rounded up; their staging slots are
    memory beside its cache), so ``n`` samples of the prompts a batch holds (``n`` >= 4) and as
    many chat sessions stream each prompt once."""
    return -(-config.max_batch_size // KEPT_SHARE) if config.prefix_caching else 0


def _runner(model: nn.Module, dims: ParallelDims, config: EngineConfig):
    if dist.get_rank() not in dims.ranks:
        return AbsentRunner(model, dims, config)
    return ModelRunner(model, config, dims=dims)


# ---- the strategy -------------------------------------------------------------------------------
def _predicted_or_none(path, world_size: int, workload: WorkloadShape, hardware_name: str) -> tuple | None:
    """:func:`predicted_step_ms`, or None with a line saying why when this machine's calibration
    fails (its gloo probes time out on a loaded machine): the caller then splits the job in half."""
    try:
        return predicted_step_ms(path, world_size, workload, hardware_name)
    except (subprocess.SubprocessError, RuntimeError) as e:
        print(
            f"dejavu: calibrating {hardware_name} for the appendix-D split failed ({type(e).__name__}); "
            f"prompts on half the job. Set parallel.prompt_ranks or parallel.prefill_ms/decode_ms."
        )
        return None


def predicted_step_ms(
    path: str | os.PathLike, world_size: int, workload: WorkloadShape, hardware_name: str
) -> tuple[float, float]:
    """The planner's ``Y`` and ``t`` (ms) as the roofline cost model predicts them for the
    checkpoint's shape on profile ``hardware_name`` (``this_machine``: calibrated once, cached): a
    micro-batch of ``workload.batch`` prompts through ``world_size`` pipeline stages, and a token
    step of it at the mean context."""
    config = json.loads((resolve_checkpoint(path) / "config.json").read_text())
    shape = model_from_config(config, name=str(path))
    hw = hardware(hardware_name)
    layout, b = ParallelConfig(pp=world_size), workload.batch
    Y = world_size * prefill_stage_time(shape, hw, layout, b, workload.prompt_len)
    t = world_size * decode_stage_time(shape, hw, layout, b, workload.prompt_len + workload.new_tokens / 2)
    return 1e3 * Y, 1e3 * t


@dataclass
class SideConfig:
    """One side's layout: replicas (each an engine group), TP degree and pipeline depth (their
    product is the side's ranks), and how a mixture-of-experts model's experts split over the TP
    ranks (``ep``)."""

    tp: int | None = None  # null: the side's ranks / (dp x pp)
    pp: int = 1
    dp: int = 1  # replicas of the side, each its own engine group
    ep: int = 1  # mixture-of-experts models: experts over ep groups of the side's tp ranks

    def dims(self, ranks: range, where: str) -> ParallelDims:
        for axis in ("tp", "pp", "dp", "ep"):
            if getattr(self, axis) is not None and getattr(self, axis) < 1:
                raise ValueError(f"{where}.{axis} must be >= 1, got {getattr(self, axis)}")
        n = len(ranks)
        tp = self.tp if self.tp is not None else max(n // (self.dp * self.pp), 1)
        if n != self.dp * tp * self.pp:
            raise ValueError(f"{where}: dp ({self.dp}) x tp ({tp}) x pp ({self.pp}) must equal its {n} ranks")
        if tp % self.ep != 0:  # (data-parallel attention x EP steps in lockstep: the tp strategy's)
            raise ValueError(f"{where}.ep ({self.ep}) must divide {where}.tp ({tp}): experts split in the tp group")
        return ParallelDims(dp=self.dp, pp=self.pp, tp=tp, ep=self.ep, world_size=n, first_rank=ranks[0])


@register_strategy("dejavu")
@dataclass
class DejaVuStrategy(Strategy):
    """Prompt processing on the first ``prompt_ranks`` ranks, token generation on the rest."""

    compiles_decode: ClassVar[bool] = False  # (its sides stream KV between layers, eagerly)

    prompt: SideConfig = field(default_factory=SideConfig)
    token: SideConfig = field(default_factory=SideConfig)
    prompt_ranks: int | None = None  # null: the appendix-D planner's D_p (see planned())
    overhead: float = 1.0  # the planner's m: prompt time with streaming / without
    prefill_ms: float | None = None  # the planner's Y: a micro-batch's prompt on the job as one pipeline
    decode_ms: float | None = None  # the planner's t: a token step of it (both null: predicted)
    hardware: str = "this_machine"  # the cost model's profile predicting Y and t (calibrated here)

    def __post_init__(self) -> None:
        if self.overhead < 1:
            raise ValueError(f"parallel.overhead must be >= 1, got {self.overhead}")
        if (self.prefill_ms is None) != (self.decode_ms is None):
            raise ValueError(
                f"give both parallel.prefill_ms and parallel.decode_ms or neither, "
                f"got {self.prefill_ms} and {self.decode_ms}"
            )
        if self.hardware != "this_machine":  # (that one is measured, once, when it is needed)
            hardware(self.hardware)  # ValueError naming the profiles
        for key in ("prefill_ms", "decode_ms"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"parallel.{key} must be > 0 ms, got {getattr(self, key)}")

    def planned(self, path: str | os.PathLike, world_size: int, workload: WorkloadShape) -> DejaVuStrategy:
        """``prompt_ranks`` from the appendix-D planner when unset: the split the sides accept with
        the lowest ``I_dis``, from ``prefill_ms``/``decode_ms`` or, when unset, the cost model's
        prediction on ``hardware`` (rank 0 predicts, every rank takes its answer)."""
        if self.prompt_ranks is not None:
            return self
        splits = [d for d in range(1, world_size) if self._accepts(d, world_size)]
        if len(splits) <= 1:  # nothing to choose (none: sides() names the misfit)
            return replace(self, prompt_ranks=splits[0] if splits else None)
        if self.prefill_ms is not None:
            times = (self.prefill_ms, self.decode_ms)
        else:
            times = from_rank0(lambda: _predicted_or_none(path, world_size, workload, self.hardware))
        if times is None:
            return replace(self, prompt_ranks=world_size // 2)
        D_t = best_split(world_size, *times, workload.new_tokens, self.overhead, [world_size - d for d in splits])
        return replace(self, prompt_ranks=world_size - D_t)

    def _accepts(self, prompt_ranks: int, world_size: int) -> bool:
        try:
            replace(self, prompt_ranks=prompt_ranks).sides(world_size)
        except ValueError:
            return False
        return True

    def sides(self, world: int) -> tuple[ParallelDims, ParallelDims]:
        """The two sides' layouts (``prompt_ranks`` unset and not :meth:`planned`: half the job)."""
        n = self.prompt_ranks if self.prompt_ranks is not None else world // 2
        if not 0 < n < world:
            raise ValueError(f"parallel.prompt_ranks must be in 1..{world - 1} (the job has {world} ranks), got {n}")
        return self.prompt.dims(range(0, n), "parallel.prompt"), self.token.dims(range(n, world), "parallel.token")

    def layouts(self, world_size: int) -> dict[str, ParallelDims]:
        """The prompt side (the first ``prompt_ranks`` ranks) and the token side (the rest)."""
        prompt, token = self.sides(world_size)
        return {"prompt": prompt, "token": token}

    def supervised_layout(self, world: int, migrate: str) -> tuple[int, Topology]:
        """The prompt and the token groups, of ``tp`` ranks each, alike on both sides (an entry's
        KV lands on a taker's rank of the same position), without pipeline stages."""
        prompt, token = self.sides(world)
        if (prompt.tp, prompt.pp) != (token.tp, token.pp) or prompt.pp > 1:
            raise ValueError(
                f"fault.migrate={migrate} runs DejaVu's sides as groups of one layout without pipeline stages: "
                f"parallel.prompt is tp={prompt.tp} pp={prompt.pp}, parallel.token tp={token.tp} pp={token.pp}"
            )
        return prompt.tp, Topology.disaggregated(prompt.dp, token.dp)

    def group_strategy(self, path: str | os.PathLike, world: int, workload: WorkloadShape) -> Strategy:
        """The tp strategy over each side's group of ``tp`` ranks."""
        return make_strategy({"strategy": "tp", "tp": self.sides(world)[0].tp})

    @property
    def replica_groups(self) -> bool:
        """The sides' groups are replicas of one layout (:meth:`supervised_layout` holds them to it)."""
        return True

    def check_args(self, config: EngineConfig) -> None:
        super().check_args(config)
        if config.kv_block_size is not None or config.compile or config.kv_swap:
            raise ValueError(
                f"parallel=dejavu runs contiguous, eager KV caches on the device; got engine.kv_block_size="
                f"{config.kv_block_size}, compile={config.compile} and kv_swap={config.kv_swap} "
                "(set them to null, false and false)"
            )

    def build(self, path: str | os.PathLike, config: EngineConfig) -> Engine:
        self.check_args(config)
        config = self.settled(config)
        prompt_dims, token_dims = self.sides(dist.get_world_size())
        kw = dict(dtype=config.torch_dtype, allow_unused=config.allow_unused)
        prompt, token = build_model(path, prompt_dims, **kw), build_model(path, token_dims, **kw)
        if config.replicas == "lockstep":  # both sides in one loop (fault tolerance's ring follows it)
            if prompt_dims.dp > 1 or token_dims.dp > 1:
                raise ValueError(
                    f"lockstep DejaVu runs one replica per side, got parallel.prompt.dp={prompt_dims.dp}, "
                    f"parallel.token.dp={token_dims.dp}"
                )
            build = dejavu_engine
        else:
            build = dejavu_groups_engine
        return build(prompt, token, prompt_dims, token_dims, config)

    def summary(self, engine: Engine) -> dict:
        s, (prefill_s, decode_s, streamed) = _job_stats(engine)
        new_tokens = s.decode_tokens / max(s.prefill_tokens and s.prefill_steps, 1)
        plan = plan_disaggregation(
            dist.get_world_size(), max(prefill_s, 1e-9), max(decode_s, 1e-9), max(new_tokens, 1.0), self.overhead
        )
        return {
            "streamed_bytes": int(streamed),
            "stream_wait_seconds": s.stream_wait_seconds,
            "handoffs_loaded": s.handoffs_loaded,
            "streamed_tokens": s.streamed_tokens,
            "kept_tokens_reused": s.kept_tokens_reused,
            "kept_misses": s.kept_misses,
            "dejavu_plan": plan.as_dict(),
        }

    def report(self, s: dict) -> list[str]:
        plan = s["dejavu_plan"]
        verdict = "would pay" if plan["plan_pays"] else "would not pay"
        return [
            f"dejavu: streamed {s['streamed_tokens']} positions of prompt KV ({s['kept_tokens_reused']} more copied "
            f"from prompts the token side kept); on this run's step times the "
            f"appendix-D planner splits {plan['D']} ranks as {plan['D_p']} prompt + {plan['D_t']} token, which "
            f"{verdict} against the same ranks without disaggregation (I_dis {plan['I_dis']:.3g} vs I_c "
            f"{plan['I_c']:.3g}; the ideal real split {'would' if plan['pays'] else 'would not'})"
        ]
