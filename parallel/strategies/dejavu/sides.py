"""DejaVu's sides as engine policies: :class:`PromptSide` (prefill, stream each layer's KV, hand
every prefilled prompt to a token group), :class:`TokenSide` (continuous batching of the
hand-offs' requests, their KV from the group's connector, :class:`StreamedKV`) and, for lockstep
runs, :class:`DejaVuPolicy` (both sides in one loop). Every KV movement goes through the stream
plan (:mod:`reshard.kv.stream`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reshard.kv.stream import KVStreamer
from reshard.kv.stream_plan import Span
from reshard.parallel.engine import (
    ContinuousBatching,
    EngineConfig,
    EngineStats,
    Move,
    Policy,
    SlotPool,
    Step,
    StepOutput,
)
from reshard.parallel.engine.router import Handoff
from reshard.parallel.engine.runner import Replica
from reshard.parallel.engine.splits import split_ranges
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.strategies.dejavu.connector import StreamedKV


class AbsentRunner:
    """A layout this rank is not part of: it runs none of the layout's sequences and only joins
    the token agreement (over the whole job)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, config: EngineConfig) -> None:
        self.model, self.dims = model, dims
        self.max_batch_size = config.max_batch_size
        self.max_seq_len = config.seq_len(model.config)
        self.num_microbatches = config.num_microbatches or dims.pp
        self.replica = Replica(dims.dp, -1)
        self.is_source = False
        self.kv = None
        self.engine_group = None  # a rank outside a lockstep side's layout is in no group of it


@dataclass
class DejaVuStats(EngineStats):
    streamed_bytes: int = 0  # prompt KV received by the token ranks (all ranks, summed at the end)
    stream_wait_seconds: float = 0.0  # token ranks waiting for prompt KV before decoding
    handoffs_loaded: int = 0  # requests a token group's KV connector supplied with their prompt KV

    def summary(self) -> dict:
        return {
            "streamed_bytes": self.streamed_bytes,
            "stream_wait_seconds": self.stream_wait_seconds,
            "handoffs_loaded": self.handoffs_loaded,
        }


@dataclass(frozen=True)
class ReceiveStreams(Move):
    """Before decoding: every streamed prompt is unpacked into the token cache, every flush is done."""


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
        self._prefilled, self._prefilling = False, []  # whether the last step fed prompts; the ones fed

    def next_step(self, queue) -> Step:
        if queue and len(self.token_slots) and (not self.running or not self._prefilled):
            seqs, self._prefilled = self._admit(queue), True
            return Step(seqs, [s.prompt_len for s in seqs], "prompt")
        self._prefilled = False
        seqs = list(self.running.values())
        return Step(seqs, [1] * len(seqs), "token", moves=(ReceiveStreams(),))

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
        if step.layout != "prompt":
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
        return Step(admitted, [s.prompt_len for s in admitted], "prompt")

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


class TokenSide(ContinuousBatching):
    """A token group: each hand-off's requests that run on, resumed after their first token, wait
    (awaiting KV) until their prompt's KV landed on every rank of the group through the group's
    connector (:class:`StreamedKV`, which this policy owns), then take token slots as they free
    up and decode; with nothing to decode, the oldest hand-off's KV is waited for."""

    stats_cls = DejaVuStats

    def __init__(self, streamed: StreamedKV) -> None:
        super().__init__("token")
        self.streamed = streamed

    def setup(self, ctx) -> None:
        super().setup(ctx)
        ctx.connector.add(self.streamed)

    def start(self, queue) -> None:
        super().start(queue)
        self.waiting: deque = deque()  # resumed requests, in hand-off order

    def next_step(self, queue) -> Step:
        while queue and (requests := self.streamed.expect(queue[0])) is not None:
            queue.popleft()
            self.waiting.extend(requests)
        if not self.waiting and not self.running:  # a hand-off whose sequences all finished at their first token
            self.streamed.wait_for()
            step = self._step([], [])
        else:
            step = super().next_step(self.waiting)
        s, kv = self.stats, self.streamed
        s.streamed_bytes, s.stream_wait_seconds, s.handoffs_loaded = kv.bytes, kv.wait_seconds, kv.loads
        return step

    def _take(self, queue, within=None):
        """The waiting head into a slot with its KV; it continues its prompt group's marks and log-probabilities."""
        seq = super()._take(queue, within)
        if seq is not None:
            times, logprobs = self.streamed.carried(seq.request.id)
            seq.times, seq.logprobs = list(times), list(logprobs)
        return seq

    def load(self, queue):
        return super().load(self.waiting)

    def close(self) -> None:
        self.streamed.close()
