"""Seesaw's policy: which phase runs next (its schedulers), the CPU KV tier, and the layout switch.

KV cache never moves rank to rank: prefill swaps it out into the CPU tier
(:class:`reshard.kv.CPUKVTier`) under the prefill layout; a prefilled request then resumes after
its first token with ``kv_source`` naming the tier, and the decode side (continuous batching in
the decode layout) admits it as any request whose KV lives elsewhere: the engine's connector, here
:class:`TierKV` (``tier_kv.py``), loads each rank's own head range of it from the tier into its
decode slot, so the load re-shards it; a prompt loaded stays in the tier for later requests that
share it (the tier as a prefix cache). A request that comes back with KV from another connector
(a respawn's mirror, ``fault.migrate=kv``) is admitted the same way. A transition is a step whose
layout is the other phase's: the weights move in :meth:`SeesawPolicy.on_switch`; the KV caches
change over by the step's cache moves, which the engine makes (:class:`ReleaseKV`,
:class:`RestoreKV`). The first decode step after prefill steps only changes the caches over: each
rank has written its swap-outs to the tier before it agrees on that step, so the decode steps
after it load from a tier that holds every rank's (no barrier of the policy's own).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field, replace

from reshard.kv import CPUKVTier, KVSwapper, TierSpec
from reshard.parallel.engine import (
    ContinuousBatching,
    Engine,
    EngineConfig,
    EngineStats,
    ModelRunner,
    PolicyContext,
    Sequence,
    Step,
    StepOutput,
)
from reshard.parallel.engine.admission import resumes, take_resuming
from reshard.parallel.engine.channel import Handoff
from reshard.parallel.engine.request import Request
from reshard.parallel.engine.step import CacheMove, ReleaseKV, RestoreKV
from reshard.parallel.strategies.seesaw.schedulers import SchedState, make_scheduler
from reshard.parallel.strategies.seesaw.switch import PHASES, LayoutSwitch, TransitionStats
from reshard.parallel.strategies.seesaw.tier_kv import TIER, TierKV
from reshard.shm import map_shared


# ---- the engine: a policy on the one loop ---------------------------------------------------------
@dataclass
class SeesawStats(EngineStats):
    transitions: int = 0
    reshard_bytes: int = 0
    reshard_lower_bound_bytes: int = 0
    reshard_seconds: float = 0.0
    swap_seconds: float = 0.0  # main-thread time spent swapping or waiting for a swap (this rank)
    swap_out_bytes: int = 0  # this rank
    swap_in_tokens: int = 0  # this rank
    history: list[TransitionStats] = field(default_factory=list)

    def add(self, t: TransitionStats) -> None:
        self.transitions += 1
        self.reshard_bytes += t.bytes
        self.reshard_lower_bound_bytes += t.lower_bound_bytes
        self.reshard_seconds += t.seconds
        self.history.append(t)


class SeesawPolicy(ContinuousBatching):
    """Prefill in layout ``"prefill"``, decode in ``"decode"``, KV through a shared CPU tier.

    Every rank runs the same scheduler on the same state, so phases, batches and tier allocations
    agree without messages. A prefill batch alternates over the prefill layout's dp replicas; a
    request's KV goes out to the tier right after its prefill, on a background thread that
    overlaps the next prefill step, and the request is handed to the decode side (resumed after
    its first token, its marks carried: the engine adds it, in its queue): continuous batching
    over the decode layout's slots (:class:`ContinuousBatching`), whose admission loads it
    through the engine's connector (:class:`TierKV`). At each transition the weights move
    (:class:`LayoutSwitch`) and the phase left behind gives its KV cache up where it can (cache
    moves the engine makes).
    """

    stats_cls = SeesawStats
    hands_off_to_itself = True  # a prefill step's requests that run on go to the decode side through the tier

    def __init__(
        self,
        switch: LayoutSwitch,
        tier: CPUKVTier,
        *,
        scheduler: str = "transition_minimizing",
        max_prefill_tokens: int = 4096,
        share_prompts: bool = True,
        chunked: bool = True,
    ) -> None:
        # the decode side's steps: the token budget (whole-prompt steps where chunked prefill is off)
        super().__init__("decode", max_prefill_tokens=max_prefill_tokens, mixed=chunked)
        self.share_prompts = share_prompts  # n samples of a prompt prefilled once (prefix_caching)
        self.switch = switch
        self.tier = tier
        self.scheduler = make_scheduler(scheduler)
        self.swapper = KVSwapper(tier)
        self._swap_outs: deque = deque()  # (future, prefill slots it frees)

    def setup(self, ctx: PolicyContext) -> None:
        super().setup(ctx)
        self.prefill, self.decode = ctx.runner_info["prefill"], ctx.runner_info["decode"]
        self._kv_phase = "prefill"  # the phase whose KV cache is allocated (the decode one: by its first step)
        self._changed_over = False  # the last step changed the caches over to decode: admit from the tier now
        self._prefill_free = list(range(self.prefill.max_batch_size - 1, -1, -1))
        self.tiered = TierKV(self.tier, self.decode, self.stats, retain=self.share_prompts)
        ctx.connector.add(self.tiered)

    @property
    def initial_layout(self) -> str:
        return self.switch.active

    def validate(self, requests) -> None:
        """Every prompt prefilled here must fit the CPU KV tier (one with a KV source goes to the
        decode side), every whole request a paged decode cache."""
        budget, spec = self.tier.spec.capacity_tokens, self.decode.kv.spec
        for r in requests:
            if len(r.prompt_ids) > budget and not r.kv_source:
                raise ValueError(
                    f"request {r.id}: prompt of {len(r.prompt_ids)} tokens does not fit "
                    f"the CPU KV tier (cpu_kv_budget={budget} tokens)"
                )
            tokens = len(r.prompt_ids) + r.sampling.max_new_tokens
            if spec.paged and spec.blocks_for(tokens) > spec.num_blocks:
                raise ValueError(
                    f"request {r.id}: {tokens} KV tokens do not fit the paged decode cache "
                    f"({spec.capacity_tokens} tokens)"
                )

    def start(self, queue: deque) -> None:
        super().start(queue)
        self.siblings: dict[int, list[Request]] = {}  # a request in a prefill step -> those its prompt serves

    def next_step(self, queue: deque) -> Step:
        """The scheduler's phase; its layout is that phase's (a transition when it is not the
        active one: the engine makes it before the step). The engine's queue holds the decode
        side's requests first (:func:`take_resuming`: KV in the tier or elsewhere, such as a
        respawn's mirror, or preempted there), then the fresh prompts, which are prefilled in the
        prefill layout; each step takes the first apart and puts back what it left."""
        buffered = take_resuming(queue)
        step = self._next_of(queue, buffered)
        queue.extendleft(reversed(buffered))
        return step

    def _next_of(self, fresh: deque, buffered: deque) -> Step:
        """The next step over the fresh prompts and the requests waiting for the decode side."""
        self._take_reused(fresh, buffered)
        changed_over, self._changed_over = self._changed_over, False
        if changed_over and (buffered or self.running):  # (the phase chosen for the step before)
            return self._decode_step(buffered)
        phase = self.scheduler.next_phase(self.switch.active, self._snapshot(fresh, buffered))
        return self._prefill_step(fresh, buffered) if phase == "prefill" else self._decode_step(buffered)

    def _take_reused(self, fresh: deque, buffered: deque) -> None:
        """The fresh head requests whose prompt starts as a retained one does (the tier's prefix
        cache, :meth:`TierKV.reuse`) skip the prefill layout: they wait for the decode side,
        which loads the shared positions from the tier and computes the rest."""
        while fresh and (shared := self.tiered.reuse(fresh[0])):
            request = fresh.popleft()
            self.stats.prefix_cache_queries += len(request.prompt_ids)
            self.stats.prefix_cache_hits += shared
            buffered.append(dataclasses.replace(request, kv_source=TIER))

    def _snapshot(self, fresh: deque, buffered: deque) -> SchedState:
        fits = bool(fresh) and self.tiered.could_fit(len(fresh[0].prompt_ids))
        free = len(self.slots) if not buffered or self.slots.can_take(buffered[0]) else 0
        return SchedState(
            queued=len(fresh),
            next_fits_tier=fits,
            buffered=len(buffered),
            running=len(self.running),
            free_slots=free,
        )

    def on_switch(self, old: str | None, new: str) -> None:
        """Move the weights (the KV caches change over by the step's cache moves, made first)."""
        if new != self.switch.active:
            self.stats.add(self.switch.switch(new))

    def _cache_moves(self, phase: str) -> tuple[CacheMove, ...]:
        """The moves that give ``phase`` its KV cache (the engine makes them before the step):
        the phase left behind gives its up where it can (the decode cache, while nothing
        decodes)."""
        if phase == self._kv_phase:
            return ()
        self._kv_phase = phase
        if phase == "decode":
            return ReleaseKV("prefill"), RestoreKV("decode")
        return (ReleaseKV("decode"),) * (not self.running) + (RestoreKV("prefill"),)

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_step(self, fresh: deque, buffered: deque) -> Step:
        moves = self._cache_moves("prefill")
        batch, dp = self._admit_prefill(fresh, buffered), self.prefill.replica
        for i, seq in enumerate(batch):
            seq.replica = i % dp.size
        self._take_prefill_slots([s for s in batch if s.replica == dp.rank])
        return Step(batch, [s.prompt_len for s in batch], "prefill", moves=moves)

    def _admit_prefill(self, queue: deque, buffered: deque) -> list[Sequence]:
        """The next prefill batch from the fresh ``queue`` (same on every rank); reserves each
        prompt's tier tokens."""
        dp = self.prefill.replica.size
        slots, budget = self.prefill.max_batch_size * dp, self.max_prefill_tokens * dp
        target = self.scheduler.buffer_target(self._snapshot(queue, buffered)) - len(buffered)
        batch: list[Sequence] = []
        prompts: dict[tuple[int, ...], int] = {}  # the batch's prompts -> the request that computes each
        while queue and len(batch) < min(slots, target):
            self._take_reused(queue, buffered)
            n = len(queue[0].prompt_ids) if queue else 0
            if not queue or (batch and n > budget) or not self.tiered.make_room(n):
                break
            request = queue.popleft()
            assert not resumes(request), f"request {request.id} resumes: it is the decode side's"
            self.tier.allocate(request.id, n)
            budget -= n
            self.stats.prefix_cache_queries += n if self.share_prompts else 0
            batch.append(self.new_sequence(request))
            prompts.setdefault(tuple(request.prompt_ids), request.id)
            self._take_siblings(queue, prompts)
        return batch

    def _take_siblings(self, queue: deque, prompts: dict[tuple[int, ...], int]) -> None:
        """The queue's head requests whose prompt (of two tokens or more) one of the batch's
        computes: they take no prefill slot and load that request's prompt KV from the tier for
        their first decode step (``n`` samples of a prompt prefilled once)."""
        while (
            self.share_prompts
            and queue
            and len(queue[0].prompt_ids) > 1
            and (leader := prompts.get(tuple(queue[0].prompt_ids))) is not None
        ):
            self.siblings.setdefault(leader, []).append(queue.popleft())
            n = len(self.siblings[leader][-1].prompt_ids)  # (a hit of all but its last token)
            self.stats.prefix_cache_queries += n
            self.stats.prefix_cache_hits += n - 1

    def _take_prefill_slots(self, seqs: list[Sequence]) -> None:
        while len(self._prefill_free) < len(seqs):
            self._wait_swap_outs(everything=False)
        for seq in seqs:
            seq.slot = self._prefill_free.pop()

    def after_step(self, step: Step, output: StepOutput) -> list[Handoff]:
        """A prefill step's KV goes out to the tier (in the background); its requests that run on,
        and the siblings its prompts serve, are handed to the decode side: the engine adds them
        with the tier as KV source (:meth:`TierKV.receive`: resumed after their first token)."""
        if step.layout == "decode":
            return []
        mine = [s for s in step.seqs if s.replica == self.prefill.replica.rank]
        rows: list[tuple] = []  # (request, its tokens, finished, its marks, its log-probabilities)
        for s in step.seqs:
            rows.append((s.request, tuple(s.output), s.finish_reason is not None, tuple(s.times), tuple(s.logprobs)))
            siblings = self.siblings.pop(s.request.id, [])
            if siblings:
                self.tiered.share(s.request.id, [r.id for r in siblings], leader_loads=s.finish_reason is None)
                rows += [(r, (), False, (), ()) for r in siblings]
        self._swap_out(step, mine)
        requests, tokens, finished, times, logprobs = zip(*rows) if rows else ((),) * 5
        handoff = Handoff(0, 0, self.stats.prefill_steps, requests, tokens, finished, times, logprobs)
        return [handoff]  # (from this group to itself: TierKV takes it)

    def _swap_out(self, step: Step, mine: list[Sequence]) -> None:
        """The tier's books of the step's prompts (every rank's: the tier is one), and this rank's
        replica's KV out to it in the background."""
        for s in step.seqs:  # (every rank's books: the tier is one)
            if s.finish_reason is None or s.request.id in self.tiered.holders:
                self.tiered.computed(s.request.id, s.request)
        kept = [s for s in mine if s.finish_reason is None or s.request.id in self.tiered.holders]
        jobs = [(s.slot, s.request.id, s.prompt_len) for s in kept]
        self._swap_outs.append((self.swapper.swap_out(self.prefill.kv, jobs), [s.slot for s in mine]))

    def _wait_swap_outs(self, *, everything: bool) -> None:
        t0 = time.perf_counter()
        while self._swap_outs:
            future, slots = self._swap_outs.popleft()
            self.stats.swap_out_bytes += future.result()
            self._prefill_free.extend(slots)
            if not everything:
                break
        self.stats.swap_seconds += time.perf_counter() - t0

    # ---- decode -------------------------------------------------------------------------------
    def _decode_step(self, buffered: deque) -> Step:
        """Continuous batching over the decode slots: waiting requests are admitted with their KV
        from the engine's connector (the tier's, or a respawn's mirror), then decoded. The first
        decode step after prefill steps is a wait step that changes the caches over: its
        agreement, which every rank reaches with its swap-outs written, is what lets the next
        step load from the tier (the barrier this takes the place of)."""
        if self._kv_phase == "decode":
            return super().next_step(buffered)
        self._wait_swap_outs(everything=True)
        self._changed_over = True
        return Step([], [], "decode", moves=self._cache_moves("decode"))

    def requeue_unstarted(self, queue: deque) -> None:
        """The weights changed: a sibling not loaded yet would take its prompt's KV of the old
        weights from the tier; it goes back to the head of the queue (prefilled anew), as the
        decode side's unstarted requests do."""
        super().requeue_unstarted(queue)
        stale = [r for r in queue if r.kv_source == TIER and r.id in self.tiered.entry_of]
        if stale:
            self._wait_swap_outs(everything=True)  # (a hold it drops may free or keep an entry: written first)
        for request in stale:
            queue.remove(request)
            # its prefix-cache query and hit are counted again when it is admitted anew
            self.stats.prefix_cache_queries -= len(request.prompt_ids)
            self.stats.prefix_cache_hits -= self.tiered.matched.get(request.id, len(request.prompt_ids) - 1)
            self.tiered.drop(request.id)
        first_fresh = next((i for i, r in enumerate(queue) if not resumes(r)), len(queue))
        for request in reversed(stale):  # (the head of the fresh prompts, in order)
            queue.insert(first_fresh, dataclasses.replace(request, kv_source=""))

    def reset_prefix_cache(self, version: int) -> None:
        """The weights were written: the decode cache's blocks and the tier's retained prompts
        match no request any more."""
        super().reset_prefix_cache(version)
        self.tiered.reset()

    def withdraw(self, request_ids: set[int]) -> list[Request]:
        """Requests aborted while they wait for a decode slot with a hold on the tier's KV
        (resumed after their prefill, siblings, reused prompts): the engine's queue withdraws
        them and the tier's connector drops the hold (:meth:`TierKV.forget`); their swap-outs
        are written first (a hold dropped may free or keep an entry). None waits here."""
        super().withdraw(request_ids)
        if any(rid in self.tiered.marks or rid in self.tiered.entry_of for rid in request_ids):
            self._wait_swap_outs(everything=True)
        return []

    def retire(self, seq: Sequence) -> None:
        if self.running.get(seq.request.id) is seq:
            super().retire(seq)
        elif seq.request.id not in self.tiered.holders:  # finished at its prefill (its siblings free its KV)
            self.tier.free(seq.request.id)

    def close(self) -> None:
        """Join the swap thread and drop the shared-memory mappings (not collective: the files
        were unlinked once mapped, so this is safe on an error path too)."""
        self.swapper.close()
        self.tier.close()
        self.switch.close()


def seesaw_engine(
    switch: LayoutSwitch,
    config: EngineConfig | None = None,
    *,
    cpu_kv_budget: int,
    scheduler: str = "transition_minimizing",
    num_microbatches: int = 2,
) -> Engine:
    """The Seesaw engine over ``switch``'s two trees (collective: maps the shared CPU tier).

    ``config``: ``max_batch_size`` KV slots of each dp replica in both layouts; ``compile`` the
    decode step; ``kv_block_size`` / ``kv_tokens`` a paged decode cache (requests are swapped
    in from the tier once their replica has blocks for them); ``max_prefill_tokens`` the
    scheduler's. ``cpu_kv_budget``: the tier's capacity in tokens (every prompt must fit);
    ``num_microbatches``: per step in a layout with pipeline stages.
    """
    config = config if config is not None else EngineConfig()
    if cpu_kv_budget < 1:
        raise ValueError(f"cpu_kv_budget must be >= 1 token, got {cpu_kv_budget}")
    check_microbatches(config, num_microbatches)
    runners = {
        phase: ModelRunner(
            switch.models[phase],
            _runner_config(config, phase, switch.dims[phase].pp, num_microbatches),
            dims=switch.dims[phase],
        )
        for phase in PHASES
    }
    cfg, kv = switch.models["decode"].config, runners["decode"].kv.spec
    spec = TierSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, kv.head_dim, cpu_kv_budget, kv.dtype)
    tier = map_shared("reshard-kv", lambda path: CPUKVTier(spec, path))
    policy = SeesawPolicy(
        switch,
        tier,
        scheduler=scheduler,
        max_prefill_tokens=config.max_prefill_tokens,
        share_prompts=config.prefix_caching,
        chunked=config.chunked_prefill,
    )
    runners["decode"].kv.release()  # (allocated by the first decode step's cache moves)
    # prefill KV reaches the decode cache only through the tier
    return Engine(runners=runners, policy=policy, config=config, host_tiers={"prefill": tier})


def check_microbatches(config: EngineConfig, num_microbatches: int) -> None:
    """``ValueError`` naming both keys when ``config`` sets micro-batches: Seesaw's come from its
    own key (a pipeline layout's micro-batches are part of the layout)."""
    if config.num_microbatches is not None:
        raise ValueError(
            f"parallel=seesaw runs parallel.num_microbatches ({num_microbatches}) micro-batches per step; "
            f"got engine.num_microbatches={config.num_microbatches} (set it to null)"
        )


def _runner_config(config: EngineConfig, phase: str, pp: int, num_microbatches: int) -> EngineConfig:
    """A layout's runner config: replicas share every step (the policy splits it), micro-batches
    only with pipeline stages; ``compile`` and a paged cache are the decode layout's (prefill KV
    goes to the tier)."""
    config = replace(config, replicas="lockstep", num_microbatches=num_microbatches if pp > 1 else 1)
    if phase == "decode":  # (compiled only when asked: each transition moves its KV and weights)
        return replace(config, compile=config.compile or False)
    return replace(config, compile=False, kv_block_size=None, kv_tokens=None)
