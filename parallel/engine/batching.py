"""The default policy: continuous batching over one layout's KV slots (:class:`ContinuousBatching`),
under a token budget per step, with chunked prefill, preemption on a paged cache and the prefix
cache; the strategies' policies (Shift, Seesaw, SiDP, DejaVu's token side, an in-flight pipeline's
first stage) extend it. The contract it follows is :mod:`reshard.parallel.engine.policy`'s."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence as Seq

from reshard.parallel.engine.admission import resumes
from reshard.parallel.engine.config import EngineConfig
from reshard.parallel.engine.policy import Policy
from reshard.parallel.engine.prefix import WAIT
from reshard.parallel.engine.request import Request, Sequence
from reshard.parallel.engine.runner import ModelRunner
from reshard.parallel.engine.slots import SlotPool, check_fits
from reshard.parallel.engine.step import Step, StepOutput

ADMISSION = ("fifo", "longest_first")


class ContinuousBatching(Policy):
    """Admit queued requests into free KV slots; each step gives requests token counts under the
    step's token budget, ``max_prefill_tokens`` per replica (vLLM's ``max_num_batched_tokens``):
    every running sequence whose prompt is computed gets its decode token first (always, even
    past the budget), then prompts get tokens in admission order while the budget lasts (a
    whole prompt larger than the budget still runs, alone in its step). A finished sequence's
    slot is refilled by the next admission. With data-parallel replicas, slots (and so sequences)
    alternate over the replicas.

    ``layout``: the runner whose cache holds the slots; :meth:`layout_for` may pick another
    runner sharing that cache per step (Shift). ``admission``: ``"fifo"`` (request order) or
    ``"longest_first"`` (largest ``max_new_tokens`` first: for offline batches, fewer decode steps
    at a small batch at the end; results per request are the same in any order).

    ``prefill_chunk`` (chunked prefill, vLLM's ``long_prefill_token_threshold``): a prompt gets
    at most this many tokens per step, beside the decode tokens and other prompts' tokens, so a
    long prompt does not stall the others' next tokens. ``mixed``: steps on the token budget,
    prompts beside decode tokens (every strategy's, by default); off (``engine.chunked_prefill
    = false``, vLLM's ``enable_chunked_prefill=False``): newly admitted whole prompts make a step
    of their own, alternating with steps of decode tokens.

    ``preempt`` (paged caches): a sequence takes KV blocks as its tokens need them; when a step's
    tokens need more blocks than are free, the newest running request of that replica is
    preempted: its KV given back, queued first again as a request resumed after the tokens it has
    (:meth:`Request.resume`: recomputed, its seeded draws replayed, so its tokens equal an
    unpreempted run's). Off: each request takes every block it can need at admission and waits
    for them.
    """

    def __init__(
        self,
        layout: str,
        *,
        max_prefill_tokens: int = 4096,
        admission: str = "fifo",
        prefill_chunk: int | None = None,
        mixed: bool = False,
        preempt: bool = False,
        prefix_caching: bool = False,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None: whole prompts), got {prefill_chunk}")
        self.layout = layout
        self.max_prefill_tokens = max_prefill_tokens
        self.admission = admission
        self.prefill_chunk = prefill_chunk
        self.mixed = mixed or prefill_chunk is not None
        self.preempt = preempt
        self.prefix_caching = prefix_caching  # (with preempt, paged: engine/prefix.py)
        self.slots: SlotPool | None = None
        self.running: dict[int, Sequence] = {}  # request id -> its sequence, in admission order
        self.held: dict[int, Sequence] = {}  # a preempted request's last sequence (its logprobs and times)
        self.unstarted: dict[int, Sequence] = {}  # admitted onto cached blocks, no step run yet

    @property
    def initial_layout(self) -> str | None:
        return self.layout

    @property
    def kv_layout(self) -> str:
        return self.layout

    def start(self, queue: deque) -> None:
        if self.admission == "longest_first":  # stable: ties keep request order; resumed ones stay ahead
            ordered = sorted(queue, key=lambda r: (not resumes(r), -r.sampling.max_new_tokens))
            queue.clear()
            queue.extend(ordered)
        if self.slots is None or not self.slots.idle():  # (an idle pool goes on: its cached prefixes too)
            self.slots = self._pool()
        self.running = {}
        self.held = {}
        self.unstarted = {}
        self._prefilled = False  # the last step fed whole prompts (whole-prompt steps alternate)

    def _pool(self) -> SlotPool:
        info = self.runner_info[self.layout]
        spec = info.kv.spec if info.kv is not None else None  # None: a rank outside the layout (its books only)
        return SlotPool(
            info.max_batch_size,
            info.replica.size,
            num_blocks=spec and spec.num_blocks,
            block_size=spec and spec.block_size,
            stats=self.stats,
            grows=self.preempt,
            prefix=self.prefix_caching,
        )

    def reset_prefix_cache(self, version: int) -> None:
        if self.slots is not None:
            self.slots.reset_prefix(version)

    def validate(self, requests: Seq[Request]) -> None:
        check_fits(requests, self.runner_info[self.layout].kv)

    def next_step(self, queue: deque) -> Step:
        step = self._next_step(queue)
        return self._reserved(step, queue) if self.slots.grows else step

    def _next_step(self, queue: deque) -> Step:
        if self.mixed:
            return self._budget_step(queue)
        if queue and self._fits(queue[0]) and not (self._prefilled and self.running):
            seqs = self._admit(queue)  # those with their KV but the last position's decode with the rest
            if not seqs and not self.running:  # the head awaits its KV and nothing runs: wait, ask again
                self.connector.wait_for(queue[0])
                seqs = self._admit(queue)
            if any(s.prompt_len - s.num_computed_tokens > 1 for s in seqs):
                self._prefilled = True
                return self._step(seqs, [s.prompt_len - s.num_computed_tokens for s in seqs])
        # none running: a wait step (the head still awaits its KV; the step's agreement may land it)
        assert self.running or (queue and self._fits(queue[0])), "the head does not fit an empty cache (policy bug)"
        seqs, self._prefilled = list(self.running.values()), False
        return self._step(seqs, [1] * len(seqs))

    def _step(self, seqs: list[Sequence], num_tokens: list[int]) -> Step:
        return Step(seqs, num_tokens, self.layout_for(seqs, num_tokens))

    def layout_for(self, seqs: list[Sequence], num_tokens: list[int]) -> str:
        """The runner of a step of ``seqs`` computing ``num_tokens`` each (subclasses choose per step)."""
        return self.layout

    def _take(self, queue: deque, within: range | None = None) -> Sequence | None:
        """The queue's head into a free slot (of ``within``, if given), running, with the KV the
        engine's connector supplies loaded (its ``num_computed_tokens``); None, the head left
        queued, while that KV is awaited (every rank alike: the connector agrees)."""
        seq = self.new_sequence(queue[0])
        shared = self.slots.take(seq, within)
        matched = None if shared == WAIT else self.connector.matched_tokens(seq)
        if matched is None:  # (its KV awaited, or cached blocks it would share still being computed)
            self.slots.give(seq)
            return None
        queue.popleft()
        if matched:
            self.connector.load(seq, matched)
            seq.num_computed_tokens = matched
        elif shared:  # its prompt's first tokens are in cached blocks: their table rows before its first step
            seq.num_computed_tokens = shared
            self._assign(seq)
            self.unstarted[seq.request.id] = seq
        self.running[seq.request.id] = seq
        carried = self.connector.carried(seq.request.id)
        if carried is not None:  # resumed from a hand-off: its marks and log-probabilities so far go on
            seq.times, seq.logprobs = list(carried[0]), list(carried[1])
        earlier = self.held.pop(seq.request.id, None)
        if earlier is not None:  # a preempted request runs again: what it had goes on
            seq.logprobs, seq.times, seq.cached_tokens = earlier.logprobs, earlier.times, earlier.cached_tokens
        elif self.slots.prefix is not None:  # (vLLM's num_cached_tokens: its first admission's prefix hits;
            seq.cached_tokens = shared  # not a connector's KV, which may be its own prompt's, computed elsewhere)
        return seq

    def _reserve(self, step: Step, queue: deque) -> Step | None:
        """Blocks for every token ``step`` writes; where its replica has too few free, the newest
        running request there is preempted (this step's own included, which then leave it).
        None where that request may not give its blocks back yet (:meth:`_preemptible`)."""
        kept = []
        for seq, n in zip(step.seqs, step.num_tokens):
            while self.is_running(seq) and not self._grow(seq, seq.num_computed_tokens + n):
                newest = self._newest(seq.replica)
                if not self._preemptible(newest):
                    return None
                self._preempt(newest, queue)
            if self.is_running(seq):
                kept.append((seq, n))
        return step if len(kept) == len(step.seqs) else _less(step, kept)

    def _reserved(self, step: Step, queue: deque) -> Step:
        """``step`` with its blocks (:meth:`_reserve`), of which every running request may be preempted."""
        reserved = self._reserve(step, queue)
        assert reserved is not None and (reserved.seqs or not step.seqs), (
            "a step's oldest request fits its replica's cache alone (check_fits)"
        )
        return reserved

    def _preemptible(self, seq: Sequence) -> bool:
        """Whether running ``seq`` may give its blocks back now: always (no step computes it
        between steps; a pipeline whose steps overlap says otherwise)."""
        return True

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """``seq``'s blocks cover ``tokens`` positions; this rank's cache table follows."""
        held = len(seq.blocks)
        if not self.slots.grow(seq, tokens):
            return False
        if len(seq.blocks) > held:
            self._assign(seq)
        return True

    def _assign(self, seq: Sequence) -> None:
        """This rank's cache table row of ``seq``'s slot: its blocks (where this rank holds its replica)."""
        info = self.runner_info[self.layout]
        if info.kv is not None and seq.replica == info.replica.rank:
            info.kv.assign(seq.slot, seq.blocks)

    def after_step(self, step: Step, output: StepOutput) -> None:
        """The step's computed blocks may be shared now (prefix caching)."""
        for seq, n in zip(step.seqs, step.num_tokens):
            self.slots.computed(seq, seq.num_computed_tokens - n)
            self.unstarted.pop(seq.request.id, None)

    def _newest(self, replica: int) -> Sequence:
        return next(s for s in reversed(self.running.values()) if s.replica == replica)

    def _preempt(self, seq: Sequence, queue: deque) -> None:
        """``seq`` gives its slot and blocks back and is queued first, to be computed again."""
        self.retire(seq)
        request = seq.request.resume(seq.output) if seq.output else seq.request
        queue.appendleft(dataclasses.replace(request, preempted=True))
        self.held[request.id] = seq
        self.stats.preemptions += 1

    def _admit(self, queue: deque, within: range | None = None) -> list[Sequence]:
        """Queued requests into free slots (of ``within`` only, if given) up to the prefill budget."""
        budget = self.max_prefill_tokens * self.runner_info[self.layout].replica.size
        admitted: list[Sequence] = []
        while queue and self._fits(queue[0], within) and (not admitted or len(queue[0].prompt_ids) <= budget):
            seq = self._take(queue, within)
            if seq is None:
                break
            budget -= seq.prompt_len - seq.num_computed_tokens
            admitted.append(seq)
        return admitted

    def _admit_fitting(self, queue: deque, within: range | None = None) -> None:
        """Queued requests into free slots (of ``within`` only, if given), in order, while they
        fit. One whose cached prefix is still being computed stays queued in its place and those
        behind it may go (``n`` samples of several prompts: every prompt's first sample in one
        step, the others at the next)."""
        waiting = []
        while queue and self._fits(queue[0], within):
            if self._take(queue, within) is None:
                if not self.slots.shares_pending(queue[0]):
                    break  # (its KV awaited from a connector: the head waits)
                waiting.append(queue.popleft())
        queue.extendleft(reversed(waiting))

    def _budget_step(self, queue: deque, within: range | None = None) -> Step:
        """Admit what fits; every running sequence past its prompt gets one token, then prompts
        get at most ``prefill_chunk`` tokens each, in admission order, while the budget lasts.
        ``within``: only the sequences of those slots (an in-flight pipeline's micro-batch)."""
        self._admit_fitting(queue, within)
        if not self.running and queue:  # the head awaits its KV and nothing runs: wait, ask again
            self.connector.wait_for(queue[0])
            self._admit_fitting(queue, within)
        running = [s for s in self.running.values() if within is None or s.slot in within]
        decoding = sum(s.num_computed_tokens >= s.prompt_len for s in running)
        budget = self.max_prefill_tokens * self.runner_info[self.layout].replica.size - decoding
        seqs, num_tokens = [], []
        for seq in running:
            left = seq.prompt_len - seq.num_computed_tokens  # prompt tokens not computed yet
            n = 1 if left <= 0 else max(min(left, self.prefill_chunk or budget, budget), 0)  # 0: no budget left
            if n:
                seqs.append(seq)
                num_tokens.append(n)
                budget -= n if left > 0 else 0
        return self._step(seqs, num_tokens)

    def _fits(self, request: Request, within: range | None = None) -> bool:
        return self.slots.can_take(request, within)

    def room(self) -> tuple[int, int] | None:
        return self.slots.room(self.runner_info[self.layout].kv.spec.max_seq_len)

    def retire(self, seq: Sequence) -> None:
        self.running.pop(seq.request.id)
        self.unstarted.pop(seq.request.id, None)
        self.slots.give(seq)

    def is_running(self, seq: Sequence) -> bool:
        return self.running.get(seq.request.id) is seq

    def withdraw(self, request_ids: set[int]) -> list[Request]:
        """None waits here; a preempted request aborted while queued leaves what it had."""
        for rid in request_ids:
            self.held.pop(rid, None)
        return []

    # ---- async scheduling: the next step scheduled while this one computes ---------------------
    @property
    def schedules_ahead(self) -> bool:  # type: ignore[override]
        """The token-budget path of this class itself (a subclass that adds to its steps does not)."""
        return self.mixed and type(self).next_step is ContinuousBatching.next_step

    def ahead(self, queue: deque) -> Step:
        """The next step, scheduled once this step's positions count as computed and before its
        tokens are known: admissions and the token budget (blocks are reserved at :meth:`confirm`)."""
        return self._next_step(queue)

    def confirm(self, step: Step, queue: deque) -> Step:
        """The step scheduled ahead, once the last step's tokens are recorded and its finished
        sequences retired: less the sequences that ended since (finished, aborted), with blocks
        for every token it writes (preempting as :meth:`next_step` does)."""
        kept = [(s, n) for s, n in zip(step.seqs, step.num_tokens) if self.is_running(s)]
        if len(kept) < len(step.seqs):
            step = _less(step, kept)
        return self._reserved(step, queue) if self.slots.grows else step

    def requeue_unstarted(self, queue: deque) -> None:
        """The weights changed: requests admitted onto cached blocks that no step has run yet
        (an admission without budget left, or by a step scheduled ahead) go back to the head of
        the queue, in order, and match again under the new weights' cache."""
        for seq in reversed([s for s in self.unstarted.values() if self.is_running(s)]):
            self.slots.unask(seq)
            self.retire(seq)
            if seq.request.preempted:  # what it had before its preemption goes on when it runs
                self.held[seq.request.id] = seq
            queue.appendleft(seq.request)
        self.unstarted = {}


def batching_options(config: EngineConfig, runners: Seq[ModelRunner]) -> dict:
    """:class:`ContinuousBatching`'s options from an engine ``config``, for a policy whose steps
    run on ``runners``: the token budget and admission order; chunked prefill where every runner
    can mix prompt and decode tokens in a step; preemption; the prefix cache (a cached prefix is a
    prompt's first chunk, so it needs mixed steps)."""
    mixed = config.chunked_prefill and all(r.mixes for r in runners)
    return dict(
        max_prefill_tokens=config.max_prefill_tokens,
        admission=config.admission,
        prefill_chunk=config.prefill_chunk,
        mixed=mixed,
        preempt=True,
        prefix_caching=config.prefix_caching and mixed,
    )


def _less(step: Step, kept: list[tuple[Sequence, int]]) -> Step:
    """``step`` with only the ``(sequence, tokens)`` pairs ``kept``: its layout, moves and
    agreement as chosen (a policy's ``layout_for`` is asked once per step)."""
    return dataclasses.replace(step, seqs=[s for s, _ in kept], num_tokens=[n for _, n in kept])
