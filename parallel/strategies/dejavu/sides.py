"""DejaVu's sides as engine policies: the prompt side (:mod:`.prompt`: prefill, stream each layer's
KV, hand every prefilled prompt to a token group), :class:`TokenSide` (continuous batching of the
hand-offs' requests, their KV from the group's connector, :class:`StreamedKV`) and, for lockstep
runs, :class:`LockstepSides` (the two in one loop, hand-offs through the same connector). Every KV
movement goes through the stream plan (:mod:`reshard.kv.stream`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from reshard.parallel.engine import (
    ContinuousBatching,
    EngineConfig,
    EngineStats,
    Policy,
    Request,
    Step,
    StepOutput,
)
from reshard.parallel.engine.admission import take_resuming
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.runner import Replica
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.strategies.dejavu.connector import StreamedKV

if TYPE_CHECKING:
    from reshard.parallel.strategies.dejavu.prompt import PromptSide


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
        self.compiled, self.compile_seconds = False, 0.0  # (no decode step runs here)
        self.device = None  # (no weights of the layout here)

    def run_eagerly(self) -> None:
        """(Nothing compiled here.)"""

    def idle(self) -> None:
        """Outside the layout: none of its layers' collectives include this rank."""


@dataclass
class DejaVuStats(EngineStats):
    per_rank = ("streamed_bytes",)
    streamed_bytes: int = 0  # prompt KV this rank received (a group's figure sums its ranks')
    stream_wait_seconds: float = 0.0  # token ranks waiting for prompt KV before decoding
    handoffs_loaded: int = 0  # requests a token group's KV connector supplied with their prompt KV
    streamed_tokens: int = 0  # prompt positions streamed to the token groups (not their bytes: every rank alike)
    kept_tokens_reused: int = 0  # prompt positions a token group copied from prompts it kept, not streamed
    kept_misses: int = 0  # requests whose kept prefix a token group no longer held (computed there)

    def summary(self) -> dict:
        return {
            "streamed_bytes": self.streamed_bytes,
            "stream_wait_seconds": self.stream_wait_seconds,
            "handoffs_loaded": self.handoffs_loaded,
            "streamed_tokens": self.streamed_tokens,
            "kept_tokens_reused": self.kept_tokens_reused,
            "kept_misses": self.kept_misses,
        }


class LockstepSides(Policy):
    """Both sides in one loop, every step over the whole job: a prompt step (the prompt side's
    ranks prefill, streaming each layer's KV out) alternates with token steps while both have
    work. A prefilled prompt's hand-off is this group's own (:attr:`hands_off_to_itself`): the
    engine receives it into the token side's connector and adds its requests with their KV
    source, as a token group does, so a hand-off is one path whether the sides are groups or not
    and its requests wait in the engine's queue (``WAITING_FOR_KV``) until it landed on every rank
    (the ranks outside the token layout count theirs landed at once). Each step takes the queue's
    requests for the token side (:func:`take_resuming`) apart from the fresh prompts. The prompt
    side admits no more prompts than the token side has slots left (as when each request held a
    token slot from its admission)."""

    stats_cls = DejaVuStats
    hands_off_to_itself = True

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
        self._prefilled = False  # the last step was a prompt step

    def next_step(self, queue) -> Step:
        """A prompt step while the token side has slots its waiting requests leave free (and the
        connector staging slots), alternating with token steps; else a token step. The queue
        holds the token side's requests first (:func:`take_resuming`: resumed from a hand-off, or
        preempted there), then the fresh prompts."""
        token, resumed = self.token, take_resuming(queue)
        token.count()  # (the connector's counters, the last hand-off received since)
        room = min(len(token.streamed.free), len(token.slots) - len(resumed))
        if queue and room > 0 and not (self._prefilled and (token.running or resumed)):
            self._prefilled = True
            step = self.prompt.next_step(queue, limit=room)
            assert not any(s.request.kv_source for s in step.seqs), "a resumed request reached the prompt side"
        else:
            self._prefilled = False
            step = token.next_step(resumed)
        queue.extendleft(reversed(resumed))  # (what the token side left, ahead again)
        return step

    def after_step(self, step: Step, output: StepOutput) -> list[Handoff]:
        """A prompt step's hand-off, for the engine to receive into this group; one whose
        sequences all finished at their first token is received and landed here at once (no
        request waits for it, so nothing else would land it before the group idles)."""
        if step.layout != "prompt":
            return []
        handoffs = self.prompt.after_step(step, output)
        for handoff in [h for h in handoffs if not h.open]:
            self.token.streamed.receive(handoff)
            self.token.streamed.land(f"{handoff.source}:{handoff.tag}")
        return [h for h in handoffs if h.open]

    def retire(self, seq) -> None:
        if self.token.running.get(seq.request.id) is seq:
            self.token.retire(seq)

    def withdraw(self, request_ids: set[int]) -> list[Request]:
        return self.token.withdraw(request_ids)

    def waiting(self) -> Seq[Request]:
        return self.token.waiting()

    def is_running(self, seq) -> bool:
        return self.token.is_running(seq)

    def make(self, move) -> None:
        self.prompt.make(move)  # (the prompt side's prefix copies: only it names moves)

    def reset_prefix_cache(self, version: int) -> None:
        self.prompt.reset_prefix_cache(version)
        self.token.reset_prefix_cache(version)

    def finish(self) -> None:
        self.token.finish()

    def close(self) -> None:
        self.prompt.close()
        self.token.close()


# ---- the sides as engine groups (they run at the same time) ------------------------------------
class TokenSide(ContinuousBatching):
    """A token group: each hand-off's requests that run on are added to the group resumed after
    their first token, their hand-off as KV source (``EngineCore.add_request``; the group's
    connector, :class:`StreamedKV`, which this policy owns, receives the hand-off); they await KV
    until their prompt's KV landed on every rank of the group, then take token slots as they free
    up and decode."""

    stats_cls = DejaVuStats

    def __init__(self, streamed: StreamedKV, *, chunked: bool = True) -> None:
        super().__init__("token", mixed=chunked)  # (the token budget; whole-prompt steps where chunked prefill is off)
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
        s.streamed_tokens, s.kept_tokens_reused, s.kept_misses = kv.positions, kv.reused, kv.misses

    def close(self) -> None:
        self.streamed.close()
