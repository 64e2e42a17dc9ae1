"""DejaVu's sides as engine policies: :class:`PromptSide` (prefill, stream each layer's KV, hand
every prefilled prompt to a token group), :class:`TokenSide` (continuous batching of the
hand-offs' requests, their KV from the group's connector, :class:`StreamedKV`) and, for lockstep
runs, :class:`LockstepSides` (the two in one loop, hand-offs through the same connector). Every KV
movement goes through the stream plan (:mod:`reshard.kv.stream`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
from torch import nn

from reshard.kv.stream_plan import Span
from reshard.parallel.engine import (
    ContinuousBatching,
    EngineConfig,
    EngineStats,
    Policy,
    SlotPool,
    Step,
    StepOutput,
)
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.request import Request, Sequence
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
        self.swap = None  # (no KV here to swap)
        self.engine_group = None  # a rank outside a lockstep side's layout is in no group of it

    def idle(self) -> None:
        """Outside the layout: none of its layers' collectives include this rank."""


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


class LockstepSides(Policy):
    """Both sides in one loop, every step over the whole job: a prompt step (the prompt side's
    ranks prefill, streaming each layer's KV out) alternates with token steps while both have
    work. A prefilled prompt's hand-off goes straight to the token side's connector, as a token
    group's does: its requests resume (in the token side's queue, which this policy keeps beside
    the job's queue of prompts) awaiting KV until it landed on every rank (the ranks
    outside the token layout count theirs landed at once), so a hand-off is one path whether the
    sides are groups or not. The prompt side admits no more prompts than the token side has
    slots left (as when each request held a token slot from its admission)."""

    stats_cls = DejaVuStats

    def __init__(self, prompt: PromptSide, token: TokenSide) -> None:
        self.prompt, self.token = prompt, token

    @property
    def initial_layout(self) -> str:
        return "prompt"

    @property
    def kv_layout(self) -> str:
        return "token"  # where a request's KV lives once it runs on

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self.prompt.setup(ctx)
        self.token.setup(ctx)

    def start(self, queue) -> None:
        self.prompt.start(queue)
        self.token.start(deque())
        self.resumed: deque = deque()  # the token side's queue: the hand-offs' requests, resumed
        self._prefilled = False  # the last step was a prompt step

    def next_step(self, queue) -> Step:
        """A prompt step while the token side has slots its waiting requests leave free (and the
        connector staging slots), alternating with token steps; else a token step."""
        token = self.token
        room = min(len(token.streamed.free), len(token.slots) - len(self.resumed))
        if queue and room > 0 and not (self._prefilled and (token.running or self.resumed)):
            self._prefilled = True
            return self.prompt.next_step(queue, limit=room)
        self._prefilled = False
        return token.next_step(self.resumed)

    def after_step(self, step: Step, output: StepOutput) -> None:
        """A prompt step's hand-off to the token side's connector (its fetches posted now); one
        whose sequences all finished at their first token is received at once (none waits for it)."""
        if step.layout != "prompt":
            return
        for handoff in self.prompt.after_step(step, output):
            received = self.token.streamed.receive(handoff)
            self.resumed.extend(dataclasses.replace(request, kv_source=key) for request, key in received)
            if not handoff.open:
                self.token.streamed.land(f"{handoff.source}:{handoff.tag}")
        self.token.count()

    def retire(self, seq) -> None:
        if self.token.running.get(seq.request.id) is seq:
            self.token.retire(seq)

    def reset_prefix_cache(self, version: int) -> None:
        self.prompt.reset_prefix_cache(version)
        self.token.reset_prefix_cache(version)

    def finish(self) -> None:
        self.token.finish()

    def close(self) -> None:
        self.prompt.close()
        self.token.close()


# ---- the sides as engine groups (they run at the same time) ------------------------------------
class PromptSide(Policy):
    """A prompt group: prefill admitted prompts (streaming each layer's KV out as it is written)
    and hand every prefilled prompt, with its first token, to a token group.

    A prompt is computed once for the requests that share it (``n`` samples):

    - In the step that computes it, the queue's next requests with the same prompt are its
      *siblings*: no slot, no stream of their own. They leave with no token: the token group
      loads them from its streamed KV but for the last position, which their first step there
      feeds (it samples their first token).
    - Once computed, its KV stays in its slot (*retained*, least recently used first) until a new
      prompt needs the slot, the weights change or the call ends. A later request with that
      prompt feeds only the last prompt token, in that slot, and streams the whole prompt again.
    """

    stats_cls = DejaVuStats

    def __init__(self, streamers: dict, group: int, token_groups: list[int], max_prefill_tokens: int) -> None:
        self.streamers = streamers  # token group -> streamer from this group's ranks to that group's
        self.group = group
        self.token_groups = token_groups
        self.max_prefill_tokens = max_prefill_tokens
        self.outgoing: list = []
        self.steps = 0
        self.retained: OrderedDict[tuple[int, ...], Sequence] = OrderedDict()  # prompt -> the sequence that computed it

    @property
    def initial_layout(self) -> str:
        return "prompt"

    def start(self, queue) -> None:
        self.slots = SlotPool(self.runner_info["prompt"].max_batch_size, 1)
        self.retained.clear()  # (a new pool: every slot free)

    def next_step(self, queue, limit: int | None = None) -> Step:
        """Prefill queued prompts up to the token budget, or, where the queue's head has a
        retained prompt, stream retained prompts again (at most ``limit`` requests in all,
        siblings counted)."""
        self._siblings: dict[int, list[Request]] = {}  # a prompt's request in the step -> its siblings
        again = bool(queue) and tuple(queue[0].prompt_ids) in self.retained
        admitted = self._again(queue, limit) if again else self._compute(queue, limit)
        self._prefilling, self._passes, self._streams_at_end = admitted, {}, again
        return Step(admitted, [s.prompt_len - s.num_computed_tokens for s in admitted], "prompt")

    def _compute(self, queue, limit: int | None) -> list[Sequence]:
        """The queue's head requests whose prompt is not retained, within the token budget,
        each with its siblings."""
        budget, admitted, prompts = self.max_prefill_tokens, [], {}
        while (
            queue
            and self._taking(admitted) != limit
            and (len(self.slots) or self._evict())
            and tuple(queue[0].prompt_ids) not in self.retained
            and (not admitted or len(queue[0].prompt_ids) <= budget)
        ):
            admitted.append(self._admit(queue.popleft(), prompts))
            self.slots.take(admitted[-1])
            budget -= admitted[-1].prompt_len
            self._take_siblings(queue, prompts, limit, admitted)
        return admitted

    def _again(self, queue, limit: int | None) -> list[Sequence]:
        """The queue's head requests whose prompt is retained, each with its siblings: each feeds
        its prompt's last token in that prompt's slot (its first token is sampled here), which it
        then holds; its whole prompt streams again at the step's end (:meth:`after_step`)."""
        admitted, prompts = [], {}
        while queue and self._taking(admitted) != limit and tuple(queue[0].prompt_ids) in self.retained:
            seq = self._admit(queue.popleft(), prompts)
            seq.replica, seq.slot = 0, self.retained.pop(tuple(seq.request.prompt_ids)).slot
            seq.num_computed_tokens = seq.prompt_len - 1
            admitted.append(seq)
            self._take_siblings(queue, prompts, limit, admitted)
        return admitted

    def _admit(self, request: Request, prompts: dict) -> Sequence:
        """``request``'s sequence; later requests of its prompt in the step are its siblings."""
        prompts.setdefault(tuple(request.prompt_ids), request.id)
        self._count(request, computed=tuple(request.prompt_ids) not in self.retained)
        return self.new_sequence(request)

    def _evict(self) -> bool:
        """Free the slot of the least recently used retained prompt; whether there was one."""
        if not self.retained:
            return False
        self.slots.give(self.retained.popitem(last=False)[1])
        return True

    def _taking(self, admitted: list) -> int:
        """Requests this step hands off: its prompts' and their siblings."""
        return len(admitted) + sum(map(len, self._siblings.values()))

    def _take_siblings(self, queue, prompts: dict, limit: int | None, admitted: list) -> None:
        """The queue's head requests whose prompt (of two tokens or more) the step streams:
        they take no slot and no stream of their own."""  # (prompts: the step's -> its request)
        while (
            queue
            and self._taking(admitted) != limit
            and len(queue[0].prompt_ids) > 1
            and (leader := prompts.get(tuple(queue[0].prompt_ids))) is not None
        ):
            self._siblings.setdefault(leader, []).append(queue.popleft())
            self._count(self._siblings[leader][-1], computed=False)

    def _count(self, request: Request, computed: bool) -> None:
        """The prefix-cache figures: a prompt streamed without computing it is a hit of all but
        its last token's."""
        self.stats.prefix_cache_queries += len(request.prompt_ids)
        self.stats.prefix_cache_hits += 0 if computed else len(request.prompt_ids) - 1

    @property
    def target(self) -> int:
        """The token group of this step's prompts (round robin over the steps)."""
        return self.token_groups[self.steps % len(self.token_groups)]

    def stream_layer(self, layer: int, h: torch.Tensor, ctx) -> None:
        """``layer_after``: once every micro-batch of a step of whole prompts passed ``layer``, its
        KV leaves for the token group."""
        if self._streams_at_end:
            return
        self._passes[layer] = self._passes.get(layer, 0) + 1
        if self._passes[layer] < len(split_ranges(len(self._prefilling), self.runner_info["prompt"].num_microbatches)):
            return
        self._stream(self._prefilling, [layer])

    def _stream(self, seqs: list[Sequence], layers: list[int]) -> None:
        """``seqs``' prompt KV, layer by layer, to this step's token group."""
        spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in seqs]
        kv = self.runner_info["prompt"].kv
        streamer = self.streamers[self.target]
        for layer in layers:
            self.outgoing += streamer.stream_out(kv, spans, layers=[layer], tag=self.steps)

    def after_step(self, step: Step, output: StepOutput) -> list[Handoff]:
        """The step's hand-off: its requests (in the stream's order), then their siblings; its
        prompts retained. A step of retained prompts streams them now, every layer."""
        if self._streams_at_end and self.runner_info["prompt"].kv is not None:
            self._stream(step.seqs, self._layers())
        for seq in step.seqs:
            self._retain(seq)
        self.outgoing = [job for job in self.outgoing if not job.done()]
        index = {s.request.id: i for i, s in enumerate(step.seqs)}
        shared = [(index[rid], r) for rid, rs in self._siblings.items() for r in rs]
        blank = ((),) * len(shared)  # (no token yet)
        handoff = Handoff(
            self.group,
            self.target,
            self.steps,
            tuple(s.request for s in step.seqs) + tuple(r for _, r in shared),
            tuple(tuple(s.output) for s in step.seqs) + blank,
            tuple(s.finish_reason is not None for s in step.seqs) + (False,) * len(shared),
            tuple(tuple(s.times) for s in step.seqs) + blank,
            tuple(tuple(s.logprobs) for s in step.seqs) + blank,
            leaders=(*range(len(step.seqs)), *(i for i, _ in shared)) if shared else (),
        )
        self.steps += 1
        return [handoff]

    def _layers(self) -> list[int]:
        """The decoder layers this rank holds KV of (its pipeline stage's), in order."""
        spec = self.runner_info["prompt"].kv.spec
        return list(range(spec.first_layer, spec.first_layer + spec.num_layers))

    def _retain(self, seq: Sequence) -> None:
        """``seq``'s prompt KV stays in its slot for later requests (one of two tokens or more,
        that no other slot retains), else the slot is free again."""
        prompt = tuple(seq.request.prompt_ids)
        if len(prompt) < 2 or prompt in self.retained:
            self.slots.give(seq)
            return
        self.retained[prompt] = seq

    def reset_prefix_cache(self, version: int) -> None:
        """The weights changed: no retained prompt is streamed again."""
        while self.retained:
            self.slots.give(self.retained.popitem()[1])

    def room(self) -> tuple[int, int]:
        """Free slots, retained ones counted (a new prompt takes one)."""
        free = len(self.slots) + len(self.retained)
        return free, free * self.runner_info["prompt"].kv.spec.max_seq_len

    def close(self) -> None:
        for job in self.outgoing:
            job.wait(next(iter(self.streamers.values())).timeout)
        for streamer in self.streamers.values():
            streamer.close()


class TokenSide(ContinuousBatching):
    """A token group: each hand-off's requests that run on are added to the group resumed after
    their first token, their hand-off as KV source (``EngineCore.add_request``; the group's
    connector, :class:`StreamedKV`, which this policy owns, receives the hand-off); they await KV
    until their prompt's KV landed on every rank of the group, then take token slots as they free
    up and decode."""

    stats_cls = DejaVuStats

    def __init__(self, streamed: StreamedKV) -> None:
        super().__init__("token")
        self.streamed = streamed

    def setup(self, ctx) -> None:
        super().setup(ctx)
        ctx.connector.add(self.streamed)

    def next_step(self, queue) -> Step:
        step = super().next_step(queue)
        self.count()
        return step

    def finish(self) -> None:
        self.count()  # (KV landed after the last step: hand-offs whose sequences all finished)

    def count(self) -> None:
        """The connector's counters into the group's stats."""
        s, kv = self.stats, self.streamed
        s.streamed_bytes, s.stream_wait_seconds, s.handoffs_loaded = kv.bytes, kv.wait_seconds, kv.loads

    def _take(self, queue, within=None):
        """The waiting head into a slot with its KV; it continues its prompt group's marks and log-probabilities."""
        seq = super()._take(queue, within)
        carried = None if seq is None else self.streamed.carried(seq.request.id)
        if carried is not None:
            seq.times, seq.logprobs = list(carried[0]), list(carried[1])
        return seq

    def close(self) -> None:
        self.streamed.close()
