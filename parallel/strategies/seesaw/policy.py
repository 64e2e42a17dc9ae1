"""Seesaw's policy: which phase runs next (its schedulers), the CPU KV tier swaps, and the layout switch.

KV cache never moves rank to rank: prefill swaps it out into the CPU tier
(:class:`reshard.kv.CPUKVTier`) under the prefill layout, decode swaps in each rank's own
head range under the decode layout, so the swap re-shards it. A transition is a step whose layout
is the other phase's (the engine calls :meth:`SeesawPolicy.on_switch`); the swap-ins a decode
step needs are its :class:`SwapIn` moves, made by the engine after the transition.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from reshard.kv import CPUKVTier, KVSwapper, TierSpec
from reshard.parallel.engine import (
    Engine,
    EngineConfig,
    EngineStats,
    ModelRunner,
    Move,
    Policy,
    PolicyContext,
    Sequence,
    SlotPool,
    Step,
    StepOutput,
)
from reshard.parallel.strategies.seesaw.schedulers import SchedState, make_scheduler
from reshard.parallel.strategies.seesaw.switch import PHASES, LayoutSwitch, TransitionStats
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
    kv_bytes_released: int = 0  # this rank: KV cache memory a phase gave up at its transitions
    history: list[TransitionStats] = field(default_factory=list)

    def add(self, t: TransitionStats) -> None:
        self.transitions += 1
        self.reshard_bytes += t.bytes
        self.reshard_lower_bound_bytes += t.lower_bound_bytes
        self.reshard_seconds += t.seconds
        self.history.append(t)


@dataclass(frozen=True)
class SwapIn(Move):
    """Request ``request_id``'s prompt KV from the CPU tier into slot ``slot`` (and, paged,
    ``blocks``) of the decode cache, on the ranks of decode replica ``replica`` (background)."""

    request_id: int
    replica: int
    slot: int
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class JoinSwapIns(Move):
    """Wait for the swap-ins in flight: their sequences run in this step (nothing else decodes)."""


class SeesawPolicy(Policy):
    """Prefill in layout ``"prefill"``, decode in ``"decode"``, KV through a shared CPU tier.

    Every rank runs the same scheduler on the same state, so phases, batches and tier allocations
    agree without messages. A prefill batch alternates over the prefill layout's dp replicas; a
    request's KV goes out to the tier right after its prefill, on a background thread that
    overlaps the next prefill step; decode on-boards it into a free slot (of the decode layout's
    replicas) on that thread while the current decode step runs, and the request joins the batch
    at the next step. At each transition the weights move (:class:`LayoutSwitch`) and the phase
    left behind releases its KV cache where it can.
    """

    stats_cls = SeesawStats

    def __init__(
        self,
        switch: LayoutSwitch,
        tier: CPUKVTier,
        *,
        scheduler: str = "transition_minimizing",
        max_prefill_tokens: int = 4096,
    ) -> None:
        self.switch = switch
        self.tier = tier
        self.scheduler = make_scheduler(scheduler)
        self.max_prefill_tokens = max_prefill_tokens
        self.swapper = KVSwapper(tier)
        self.decode_slot_of: dict[int, int] = {}  # request id -> decode slot it was swapped into
        self._swap_outs: deque = deque()  # (future, prefill slots it frees)
        self._swap_ins: dict[int, object] = {}  # request id -> future of its swap-in (this rank's)

    def setup(self, ctx: PolicyContext) -> None:
        super().setup(ctx)
        self.prefill, self.decode = ctx.runner_info["prefill"], ctx.runner_info["decode"]
        self.decode.kv.release()  # allocated at the first transition to decode
        self._prefill_free = list(range(self.prefill.max_batch_size - 1, -1, -1))

    @property
    def initial_layout(self) -> str:
        return self.switch.active

    def validate(self, requests) -> None:
        """Every prompt must fit the CPU KV tier, every whole request a paged decode cache."""
        budget, spec = self.tier.spec.capacity_tokens, self.decode.kv.spec
        for r in requests:
            if len(r.prompt_ids) > budget:
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
        self.buffered: deque = deque()  # prefilled sequences whose KV is in the tier
        self.loading: list[Sequence] = []  # sequences being swapped in
        self.running: dict[int, Sequence] = {}  # request id -> decoding sequence
        spec = self.decode.kv.spec
        self.decode_slots = SlotPool(
            self.decode.max_batch_size,
            self.decode.replica.size,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            stats=self.stats,
        )

    def next_step(self, queue: deque) -> Step:
        """The scheduler's phase; its layout is that phase's (a transition when it is not the
        active one: the engine makes it before the step's moves)."""
        phase = self.scheduler.next_phase(self.switch.active, self._snapshot(queue))
        return self._prefill_step(queue) if phase == "prefill" else self._decode_step()

    def _snapshot(self, queue: deque) -> SchedState:
        fits = bool(queue) and self.tier.can_fit(len(queue[0].prompt_ids))
        free = (
            len(self.decode_slots) if not self.buffered or self.decode_slots.can_take(self.buffered[0].request) else 0
        )
        return SchedState(
            queued=len(queue),
            next_fits_tier=fits,
            buffered=len(self.buffered),
            running=len(self.running),
            free_slots=free,
        )

    def on_switch(self, old: str | None, new: str) -> None:
        """Move the weights; the phase left behind gives up its KV cache memory where it can."""
        if new == self.switch.active:
            return
        stats = self.stats
        if new == "decode":  # the tier must hold every rank's KV before anyone reads it
            self._wait_swap_outs(everything=True)
            dist.barrier()
            stats.kv_bytes_released += self.prefill.kv.release()
            self.decode.kv.restore()
        else:
            if not self.running:  # nothing decoding keeps KV in the decode cache
                stats.kv_bytes_released += self.decode.kv.release()
            self.prefill.kv.restore()
        stats.add(self.switch.switch(new))

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_step(self, queue: deque) -> Step:
        batch, dp = self._admit(queue), self.prefill.replica
        for i, seq in enumerate(batch):
            seq.replica = i % dp.size
        self._take_prefill_slots([s for s in batch if s.replica == dp.rank])
        return Step(batch, [s.prompt_len for s in batch], "prefill")

    def _admit(self, queue: deque) -> list[Sequence]:
        """The next prefill batch (same on every rank); reserves each prompt's tier tokens."""
        dp = self.prefill.replica.size
        slots, budget = self.prefill.max_batch_size * dp, self.max_prefill_tokens * dp
        target = self.scheduler.buffer_target(self._snapshot(queue)) - len(self.buffered)
        batch: list[Sequence] = []
        while queue and len(batch) < min(slots, target):
            n = len(queue[0].prompt_ids)
            if (batch and n > budget) or not self.tier.can_fit(n):
                break
            request = queue.popleft()
            self.tier.allocate(request.id, n)
            budget -= n
            batch.append(self.new_sequence(request))
        return batch

    def _take_prefill_slots(self, seqs: list[Sequence]) -> None:
        while len(self._prefill_free) < len(seqs):
            self._wait_swap_outs(everything=False)
        for seq in seqs:
            seq.slot = self._prefill_free.pop()

    def after_step(self, step: Step, output: StepOutput) -> None:
        if step.layout == "decode":
            self._join_loads()
            return
        mine = [s for s in step.seqs if s.replica == self.prefill.replica.rank]
        self.buffered.extend(s for s in step.seqs if s.finish_reason is None)
        jobs = [(s.slot, s.request.id, s.prompt_len) for s in mine if s.finish_reason is None]
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
    def _decode_step(self) -> Step:
        """On-board tier requests into free slots (swapped in while this step runs); decode the
        running ones, or, when none runs, wait for the swap-ins and decode those."""
        moves: list[Move] = self._onboard()
        if self.running:
            return Step(list(self.running.values()), [1] * len(self.running), "decode", moves=tuple(moves))
        return Step(list(self.loading), [1] * len(self.loading), "decode", moves=(*moves, JoinSwapIns()))

    def _onboard(self) -> list[SwapIn]:
        """Give buffered requests free decode slots; their replica's ranks swap them in."""
        moves = []
        while self.buffered and self.decode_slots.can_take(self.buffered[0].request):
            seq = self.buffered.popleft()
            self.decode_slots.take(seq)
            if seq.replica == self.decode.replica.rank:
                self.decode_slot_of[seq.request.id] = seq.slot
            moves.append(SwapIn(seq.request.id, seq.replica, seq.slot, tuple(seq.blocks)))
            self.loading.append(seq)
        return moves

    def make(self, move: Move) -> None:
        """A swap-in starts on the swap thread (the decode cache is allocated: the engine made
        the transition first); a join waits for every swap-in in flight."""
        if isinstance(move, JoinSwapIns):
            self._join_loads()
            return
        assert isinstance(move, SwapIn), move
        if move.replica != self.decode.replica.rank:
            return
        if move.blocks:  # a paged decode cache: the slot's blocks before the swap-in writes them
            self.decode.kv.assign(move.slot, list(move.blocks))
        self._swap_ins[move.request_id] = self.swapper.swap_in(self.decode.kv, move.slot, move.request_id)

    def _join_loads(self) -> None:
        t0 = time.perf_counter()
        for seq in self.loading:
            future = self._swap_ins.pop(seq.request.id, None)  # none: another replica's
            self.stats.swap_in_tokens += future.result() if future is not None else 0
            self.tier.free(seq.request.id)
            self.running[seq.request.id] = seq
        self.loading.clear()
        self.stats.swap_seconds += time.perf_counter() - t0

    def retire(self, seq: Sequence) -> None:
        if self.running.pop(seq.request.id, None) is None:  # finished at its prefill
            self.tier.free(seq.request.id)
        else:
            self.decode_slots.give(seq)

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
    policy = SeesawPolicy(switch, tier, scheduler=scheduler, max_prefill_tokens=config.max_prefill_tokens)
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
    if phase == "decode":
        return config
    return replace(config, compile=False, kv_block_size=None, kv_tokens=None)
