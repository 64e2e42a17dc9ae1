"""DejaVu prompt/token disaggregation: prompts on some ranks, tokens on the others.

The prompt ranks and the token ranks are two meshes with their own layouts (TP degree and
pipeline depth may differ, e.g. prompt TP2 -> token PP2). A prefill step runs on the prompt
ranks; a ``layer_after`` listener of the prompt layout streams layer ``i``'s KV to the token ranks
while layer ``i + 1`` computes (DejaVu's layer-by-layer prompt streaming), re-sharded on the way
by the stream plan (:mod:`reshard.kv.stream`).

By default (``replicas="groups"``) each side is one or more engine groups running the one engine
loop at the same time (:func:`dejavu_groups_engine`): a prompt group (:class:`PromptSide`)
prefills what the router hands it and hands every prefilled prompt, with its first token and
timing, to a token group (:class:`TokenSide`), which takes it into free slots, fetches its KV and
decodes it once the KV has landed on every rank of the group. With ``replicas="lockstep"``
(fault tolerance's journal and ring need it) both sides step in one loop
(:class:`DejaVuPolicy`): the token ranks post the fetches when a prefill step ends and unpack
them before the first decode step that needs them (the step's :class:`ReceiveStreams` move);
ranks outside a step's layout only join the token agreement, which spans the whole job.

The appendix-D planner (:mod:`parallel.cost.dejavu_planner`) chooses the split when
``prompt_ranks`` is unset (:meth:`DejaVuStrategy.planned`), from configured step times or the cost
model's prediction; after the run it turns the measured prompt and token step times into the split
``D_p`` / ``D_t`` it would choose next time, reported in ``summary.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reshard.kv.stream import KVStreamer, StreamIn
from reshard.kv.stream_plan import Span, plan_stream, world_layouts
from reshard.mesh import cached_group, device_type, from_rank0
from reshard.parallel.cost.dejavu_planner import best_split, plan_disaggregation
from reshard.parallel.cost.profiles import hardware, model_from_config
from reshard.parallel.cost.roofline import ParallelConfig, decode_stage_time, prefill_stage_time
from reshard.parallel.engine import (
    Engine,
    EngineArgs,
    EngineStats,
    ModelRunner,
    Move,
    Policy,
    SlotPool,
    Step,
    StepOutput,
    Strategy,
    WorkloadShape,
    register_strategy,
)
from reshard.parallel.engine.router import GroupLayout, Handoff
from reshard.parallel.engine.runner import Replica, split_ranges
from reshard.parallel.engine.sampling import skip_draws
from reshard.parallel.model.checkpoint import resolve_checkpoint
from reshard.parallel.model.dims import ParallelDims, rank_grid
from reshard.parallel.model.pipeline import build_model


class AbsentRunner:
    """A layout this rank is not part of: it runs none of the layout's sequences and only joins
    the token agreement (over the whole job)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, max_batch_size: int, max_seq_len: int) -> None:
        self.model, self.dims = model, dims
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.num_microbatches = dims.pp
        self.replica = Replica(dims.dp, -1)
        self.is_source = False
        self.kv = None
        self.engine_group = None  # a rank outside a lockstep side's layout is in no group of it


@dataclass
class DejaVuStats(EngineStats):
    streamed_bytes: int = 0  # prompt KV received by the token ranks (all ranks, summed at the end)
    stream_wait_seconds: float = 0.0  # token ranks waiting for prompt KV before decoding

    def summary(self) -> dict:
        return {"streamed_bytes": self.streamed_bytes, "stream_wait_seconds": self.stream_wait_seconds}


@dataclass(frozen=True)
class ReceiveStreams(Move):
    """Before decoding: every streamed prompt is unpacked into the token cache, every flush is done."""

    kv = True


class DejaVuPolicy(Policy):
    """Prefill admitted prompts on the prompt layout (streaming their KV out layer by layer),
    then decode on the token layout; a request keeps a token slot from admission to the end."""

    stats_cls = DejaVuStats

    def __init__(self, streamer: KVStreamer, *, max_prefill_tokens: int = 4096) -> None:
        self.streamer, self.max_prefill_tokens = streamer, max_prefill_tokens
        self.incoming: list = []  # stream_in handles not yet unpacked
        self.outgoing: list = []  # flush jobs of the prompt side

    @property
    def initial_layout(self) -> str:
        return "prompt"

    def start(self, queue) -> None:
        prompt, token = self.runner_info["prompt"], self.runner_info["token"]
        self.prompt_slots = SlotPool(prompt.max_batch_size, prompt.replica.size)
        self.token_slots = SlotPool(token.max_batch_size, token.replica.size)
        self.running: dict[int, Any] = {}
        self.token_slot: dict[int, tuple[int, int]] = {}
        self._last, self._prefilling = None, []

    def next_step(self, queue) -> Step:
        if queue and len(self.token_slots) and (not self.running or self._last == "decode"):
            seqs, self._last = self._admit(queue), "prefill"
            return Step("prefill", seqs, "prompt")
        self._last = "decode"
        return Step("decode", list(self.running.values()), "token", moves=(ReceiveStreams(),))

    def _admit(self, queue) -> list:
        budget, admitted = self.max_prefill_tokens * self.runner_info["prompt"].replica.size, []
        while (
            queue
            and len(self.token_slots)
            and len(self.prompt_slots)
            and (not admitted or len(queue[0].prompt_ids) <= budget)
        ):
            seq = self.new_sequence(queue.popleft())
            budget -= seq.prompt_len
            self.token_slots.take(seq)
            self.token_slot[seq.request.id] = (seq.replica, seq.slot)
            self.prompt_slots.take(seq)  # the prefill runs in this slot of the prompt layout
            admitted.append(seq)
        self._prefilling, self._passes = admitted, {}
        return admitted

    def stream_layer(self, layer: int, h: torch.Tensor, ctx) -> None:
        """The prompt layout's ``layer_after`` listener: once every micro-batch of the step has
        passed layer ``layer``, its KV leaves (while the next layer computes)."""
        mine = self._mine(self._prefilling, "prompt")
        self._passes[layer] = self._passes.get(layer, 0) + 1
        if self._passes[layer] < len(split_ranges(len(mine), self.runner_info["prompt"].num_microbatches)):
            return
        spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in mine]
        self.outgoing += self.streamer.stream_out(self.runner_info["prompt"].kv, spans, layers=[layer], tag=self._tag())

    def after_step(self, step: Step, output: StepOutput) -> None:
        if step.phase != "prefill":
            return
        for seq in step.seqs:  # from now on the sequence lives in its token slot
            self.prompt_slots.give(seq)
            seq.replica, seq.slot = self.token_slot[seq.request.id]
            self.running[seq.request.id] = seq
        token = self.runner_info["token"]
        if token.kv is not None:
            spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in self._mine(step.seqs, "token")]
            for layer in range(token.num_layers):  # the order the prompt side sent
                self.incoming.append(self.streamer.stream_in(token.kv, spans, layers=[layer], tag=self._tag()))
        self.steps = getattr(self, "steps", 0) + 1

    def _tag(self) -> int:
        return getattr(self, "steps", 0)

    def _mine(self, seqs: list, layout: str) -> list:
        rank = self.runner_info[layout].replica.rank
        return [s for s in seqs if s.replica == rank]

    def make(self, move: Move) -> None:
        """:class:`ReceiveStreams`: wait for every stream in flight (this rank's side of it)."""
        assert isinstance(move, ReceiveStreams), move
        t0 = time.perf_counter()
        for handle in self.incoming:
            self.stats.streamed_bytes += handle.wait()
        for job in self.outgoing:
            job.wait(self.streamer.timeout)
        self.incoming, self.outgoing = [], []
        self.stats.stream_wait_seconds += time.perf_counter() - t0

    def retire(self, seq) -> None:
        self.running.pop(seq.request.id)
        self.token_slots.give(seq)

    def close(self) -> None:
        self.streamer.close()


# ---- the sides as engine groups (they run at the same time) ------------------------------------
@dataclass
class Pending:
    """A hand-off whose prompt KV is on its way into the token cache."""

    seqs: list  # its sequences still to decode (in token slots)
    held: list  # its sequences that finished at their first token (slots freed on landing)
    incoming: list[StreamIn]  # one per layer

    def landed(self) -> int:
        """1 once every layer's KV has arrived (a step's ``agree`` entry), else 0."""
        return int(all(handle.done() for handle in self.incoming))

    def wait(self) -> int:
        """Unpack every layer's KV as it arrives; returns the bytes."""
        return sum(handle.wait() for handle in self.incoming)


class PromptSide(Policy):
    """A prompt group: prefill admitted prompts (streaming each layer's KV out as it is written)
    and hand every prefilled prompt, with its first token, to a token group."""

    stats_cls = DejaVuStats

    def __init__(self, streamers: dict, group: int, token_groups: list[int], max_prefill_tokens: int) -> None:
        self.streamers = streamers  # token group -> streamer from this group's ranks to that group's
        self.group = group
        self.token_groups = token_groups
        self.max_prefill_tokens = max_prefill_tokens
        self.outgoing: list = []
        self.steps = 0

    @property
    def initial_layout(self) -> str:
        return "prompt"

    def start(self, queue) -> None:
        self.slots = SlotPool(self.runner_info["prompt"].max_batch_size, 1)

    def next_step(self, queue) -> Step:
        budget, admitted = self.max_prefill_tokens, []
        while queue and len(self.slots) and (not admitted or len(queue[0].prompt_ids) <= budget):
            seq = self.new_sequence(queue.popleft())
            budget -= seq.prompt_len
            self.slots.take(seq)
            admitted.append(seq)
        self._prefilling, self._passes = admitted, {}
        return Step("prefill", admitted, "prompt")

    @property
    def target(self) -> int:
        """The token group of this step's prompts (round robin over the steps)."""
        return self.token_groups[self.steps % len(self.token_groups)]

    def stream_layer(self, layer: int, h: torch.Tensor, ctx) -> None:
        """``layer_after``: once every micro-batch passed ``layer``, its KV leaves for the token group."""
        self._passes[layer] = self._passes.get(layer, 0) + 1
        if self._passes[layer] < len(split_ranges(len(self._prefilling), self.runner_info["prompt"].num_microbatches)):
            return
        spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in self._prefilling]
        kv = self.runner_info["prompt"].kv
        self.outgoing += self.streamers[self.target].stream_out(kv, spans, layers=[layer], tag=self.steps)

    def after_step(self, step: Step, output: StepOutput) -> list[Handoff]:
        for seq in step.seqs:
            self.slots.give(seq)
        self.outgoing = [job for job in self.outgoing if not job.done()]
        handoff = Handoff(
            self.group,
            self.target,
            self.steps,
            tuple(s.request for s in step.seqs),
            tuple(tuple(s.output) for s in step.seqs),
            tuple(s.finish_reason is not None for s in step.seqs),
            tuple(tuple(s.times) for s in step.seqs),
            tuple(tuple(s.logprobs) for s in step.seqs),
        )
        self.steps += 1
        return [handoff]

    def room(self) -> tuple[int, int]:
        return self.slots.room(self.runner_info["prompt"].kv.spec.max_seq_len)

    def close(self) -> None:
        for job in self.outgoing:
            job.wait(next(iter(self.streamers.values())).timeout)
        for streamer in self.streamers.values():
            streamer.close()


class TokenSide(Policy):
    """A token group: admit hand-offs into token slots as slots free up, fetch their streamed KV,
    and decode every sequence whose KV has landed on every rank of the group (agreed with the
    step's tokens); with nothing to decode, wait for the oldest hand-off's KV."""

    stats_cls = DejaVuStats

    def __init__(self, streamers: dict, group_size: int, vocab_size: int) -> None:
        self.streamers = streamers  # prompt group -> streamer from that group's ranks to this group's
        self.group_size = group_size
        self.vocab_size = vocab_size

    @property
    def initial_layout(self) -> str:
        return "token"

    def start(self, queue) -> None:
        self.slots = SlotPool(self.runner_info["token"].max_batch_size, 1)
        self.running: dict[int, Any] = {}
        self.pending: list[Pending] = []

    def next_step(self, queue) -> Step:
        while queue and len(self.slots) >= len(queue[0].requests):
            self.pending.append(self._receive(queue.popleft()))
        if not self.running and self.pending:  # nothing to decode: the oldest hand-off's KV, when it lands
            self._land(self.pending.pop(0))
        agree = {f"landed{i}": p.landed for i, p in enumerate(self.pending)}  # read after the step's compute
        phase = "decode" if self.running else "wait"  # wait: a hand-off whose prompts all finished landed
        return Step(phase, list(self.running.values()), "token", agree=agree)

    def _receive(self, handoff: Handoff) -> Pending:
        """Token slots for every sequence of ``handoff`` (in its order) and their KV's fetch."""
        seqs = []
        times = handoff.times or ((),) * len(handoff.requests)
        logprobs_all = handoff.logprobs or ((),) * len(handoff.requests)
        for request, tokens, marks, logprobs in zip(handoff.requests, handoff.tokens, times, logprobs_all):
            seq = self.new_sequence(request)
            seq.times = list(marks)  # the prompt group's: TTFT counts from its prefill
            skip_draws([request.sampling] * len(tokens), [seq.generator] * len(tokens), self.vocab_size)
            for token, lp in zip(tokens, logprobs or [None] * len(tokens)):
                seq.append(token, lp)
            seq.cached = seq.prompt_len + len(tokens) - 1
            self.slots.take(seq)
            seqs.append(seq)
        spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in seqs]
        token = self.runner_info["token"]
        streamer = self.streamers[handoff.source]
        incoming = [  # layer by layer, in the order the prompt side flushes them
            streamer.stream_in(token.kv, spans, layers=[layer], tag=handoff.tag) for layer in range(token.num_layers)
        ]
        held = [s for s in seqs if s.finish_reason is not None]
        return Pending([s for s in seqs if s.finish_reason is None], held, incoming)

    def _land(self, pending: Pending) -> None:
        t0 = time.perf_counter()
        self.stats.streamed_bytes += pending.wait()
        self.stats.stream_wait_seconds += time.perf_counter() - t0
        for seq in pending.held:
            self.slots.give(seq)
        self.running.update((s.request.id, s) for s in pending.seqs)

    def after_step(self, step: Step, output: StepOutput) -> None:
        agreed = output.agreed or {}
        landed = [p for i, p in enumerate(self.pending) if agreed.get(f"landed{i}") == self.group_size]
        for p in landed:
            self.pending.remove(p)
            self._land(p)

    def retire(self, seq) -> None:
        self.running.pop(seq.request.id)
        self.slots.give(seq)

    def close(self) -> None:
        for streamer in self.streamers.values():
            streamer.close()


def dejavu_groups_engine(
    prompt: nn.Module,
    token: nn.Module,
    prompt_dims: ParallelDims,
    token_dims: ParallelDims,
    *,
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    max_prefill_tokens: int = 4096,
) -> Engine:
    """The disaggregated engine with each side's replicas as engine groups that run at the same
    time: prompt groups ``0..P-1`` (the router hands them requests), token groups ``P..P+T-1``
    (they take prefilled prompts). Collective over the job: every rank calls it."""
    max_seq_len = max_seq_len or min(prompt.config.max_position_embeddings, 4096)
    groups = _side_groups(prompt_dims) + _side_groups(token_dims)
    pgs = [cached_group(ranks, purpose="engine-group") for ranks in groups]  # collective, in order
    runners = {
        name: _runner(model, dims, max_batch_size, max_seq_len, replicas="groups")
        for name, model, dims in (("prompt", prompt, prompt_dims), ("token", token, token_dims))
    }
    layouts = {name: world_layouts(r.kv) for name, r in runners.items()}  # collective, every rank
    entries = tuple(range(prompt_dims.dp))
    side = "prompt" if dist.get_rank() in prompt_dims.ranks else "token"
    index = next(i for i, ranks in enumerate(groups) if dist.get_rank() in ranks)
    layout = GroupLayout(
        index, len(groups), groups[index], entries, 1 if side == "prompt" else len(entries), "dejavu", None
    )
    streamers = _streamers(layouts, groups, index, entries)
    if side == "prompt":
        tokens = [g for g in range(len(groups)) if g not in entries]
        policy = PromptSide(streamers, index, tokens, max_prefill_tokens)
    else:
        policy = TokenSide(streamers, len(groups[index]), prompt.config.vocab_size)
    engine = Engine(runners=runners, policy=policy, group=pgs[index], engine_group=layout)
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
    *,
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    max_prefill_tokens: int = 4096,
) -> Engine:
    """The disaggregated engine (collective over the job: every rank calls it)."""
    max_seq_len = max_seq_len or min(prompt.config.max_position_embeddings, 4096)
    runners = {
        name: _runner(model, dims, max_batch_size, max_seq_len)
        for name, model, dims in (("prompt", prompt, prompt_dims), ("token", token, token_dims))
    }
    plan = plan_stream(world_layouts(runners["prompt"].kv), world_layouts(runners["token"].kv))
    policy = DejaVuPolicy(KVStreamer(plan), max_prefill_tokens=max_prefill_tokens)
    # tokens are agreed over the whole job: both layouts take part in every step
    engine = Engine(runners=runners, policy=policy, group=dist.group.WORLD)
    if runners["prompt"].kv is not None:
        engine.events.on("layer_after", policy.stream_layer, layout="prompt")
    return engine


def _runner(model: nn.Module, dims: ParallelDims, max_batch_size: int, max_seq_len: int, replicas: str = "lockstep"):
    if dist.get_rank() not in dims.ranks:
        return AbsentRunner(model, dims, max_batch_size, max_seq_len)
    return ModelRunner(
        model,
        dims=dims,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        num_microbatches=dims.pp,
        replicas=replicas,
    )


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
    product is the side's ranks)."""

    tp: int | None = None  # null: the side's ranks / (dp x pp)
    pp: int = 1
    dp: int = 1  # replicas of the side, each its own engine group

    def dims(self, ranks: range, where: str) -> ParallelDims:
        for axis in ("tp", "pp", "dp"):
            if getattr(self, axis) is not None and getattr(self, axis) < 1:
                raise ValueError(f"{where}.{axis} must be >= 1, got {getattr(self, axis)}")
        n = len(ranks)
        tp = self.tp if self.tp is not None else max(n // (self.dp * self.pp), 1)
        if n != self.dp * tp * self.pp:
            raise ValueError(f"{where}: dp ({self.dp}) x tp ({tp}) x pp ({self.pp}) must equal its {n} ranks")
        return ParallelDims(dp=self.dp, pp=self.pp, tp=tp, world_size=n, first_rank=ranks[0])


@register_strategy("dejavu")
@dataclass
class DejaVuStrategy(Strategy):
    """Prompt processing on the first ``prompt_ranks`` ranks, token generation on the rest."""

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

    def check_args(self, args: EngineArgs) -> None:
        super().check_args(args)
        if args.kv_block_size is not None or args.compile:
            raise ValueError(
                f"parallel=dejavu runs contiguous, eager KV caches; got engine.kv_block_size={args.kv_block_size} "
                f"and compile={args.compile} (set them to null and false)"
            )

    def build(self, path: str | os.PathLike, args: EngineArgs) -> Engine:
        self.check_args(args)
        prompt_dims, token_dims = self.sides(dist.get_world_size())
        kw = dict(dtype=args.dtype, allow_unused=args.allow_unused)
        prompt, token = build_model(path, prompt_dims, **kw), build_model(path, token_dims, **kw)
        if args.replicas == "lockstep":  # both sides in one loop (fault tolerance's ring follows it)
            if prompt_dims.dp > 1 or token_dims.dp > 1:
                raise ValueError(
                    f"lockstep DejaVu runs one replica per side, got parallel.prompt.dp={prompt_dims.dp}, "
                    f"parallel.token.dp={token_dims.dp}"
                )
            build = dejavu_engine
        else:
            build = dejavu_groups_engine
        return build(
            prompt,
            token,
            prompt_dims,
            token_dims,
            max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
            max_prefill_tokens=args.max_prefill_tokens,
        )

    def summary(self, engine: Engine) -> dict:
        s, (prefill_s, decode_s, streamed) = _job_stats(engine)
        new_tokens = s.decode_tokens / max(s.prefill_tokens and s.prefill_steps, 1)
        plan = plan_disaggregation(
            dist.get_world_size(), max(prefill_s, 1e-9), max(decode_s, 1e-9), max(new_tokens, 1.0), self.overhead
        )
        return {
            "streamed_bytes": int(streamed),
            "stream_wait_seconds": s.stream_wait_seconds,
            "dejavu_plan": plan.as_dict(),
        }

    def report(self, s: dict) -> list[str]:
        plan = s["dejavu_plan"]
        verdict = "would pay" if plan["plan_pays"] else "would not pay"
        return [
            f"dejavu: streamed {s['streamed_bytes'] / (1 << 20):.1f} MiB of prompt KV; on this run's step times the "
            f"appendix-D planner splits {plan['D']} ranks as {plan['D_p']} prompt + {plan['D_t']} token, which "
            f"{verdict} against the same ranks without disaggregation (I_dis {plan['I_dis']:.3g} vs I_c "
            f"{plan['I_c']:.3g}; the ideal real split {'would' if plan['pays'] else 'would not'})"
        ]
