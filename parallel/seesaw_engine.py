"""The Seesaw engine: prefill in layout c_p, decode in layout c_d, KV through a shared CPU tier.

Every rank runs the same scheduler on the same state, so phases, batches and tier allocations
agree without messages. Prefill batches are split over c_p's dp replicas; each replica samples its
requests' first tokens, which are then summed over the dp axis so every rank knows them. A
request's KV goes out to the tier right after its prefill, on a background thread that overlaps
the next prefill step; decode on-boards it into a free slot on a background "prefetcher" thread
that overlaps the current decode step, and the request joins the batch at the next step.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from reshard.kv_tier import CPUKVTier, TierSpec

from .dims import ParallelDims, device_type
from .engine import Completion, Request, _Sequence
from .sampling import skip_draws
from .schedulers import SchedState, make_scheduler
from .seesaw import LayoutSwitch, TransitionStats, make_engine, map_shared


@dataclass
class SeesawStats:
    transitions: int = 0
    reshard_bytes: int = 0
    reshard_lower_bound_bytes: int = 0
    reshard_seconds: float = 0.0
    swap_seconds: float = 0.0  # main-thread time spent swapping or waiting for a swap
    swap_out_bytes: int = 0  # this rank
    swap_in_tokens: int = 0  # this rank
    kv_bytes_released: int = 0  # this rank: KV cache memory a phase gave up at its transitions
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_batch_sum: int = 0
    history: list[TransitionStats] = field(default_factory=list)

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_sum / max(self.decode_steps, 1)

    def add(self, t: TransitionStats) -> None:
        self.transitions += 1
        self.reshard_bytes += t.bytes
        self.reshard_lower_bound_bytes += t.lower_bound_bytes
        self.reshard_seconds += t.seconds
        self.history.append(t)


@dataclass(frozen=True)
class _DP:
    """This rank's data-parallel replica in one phase's layout."""

    size: int
    rank: int
    group: object  # the dp-axis process group (None when size == 1)

    @staticmethod
    def of(dims: ParallelDims) -> "_DP":
        group = dims.mesh("dp").get_group() if dims.dp > 1 else None
        return _DP(dims.dp, dims.world_mesh().get_coordinate()[0], group)

    def owns(self, slot: int, slots_per_replica: int) -> bool:
        """Whether global decode ``slot`` belongs to this rank's replica."""
        return slot // slots_per_replica == self.rank


@dataclass
class _State:
    queue: deque  # requests not yet prefilled
    buffered: deque = field(default_factory=deque)  # prefilled sequences whose KV is in the tier
    running: dict = field(default_factory=dict)  # global decode slot -> sequence
    loading: list = field(default_factory=list)  # (future | None, sequence, global slot) swap-ins
    free: list = field(default_factory=list)  # free global decode slots (replica * slots + slot)
    done: dict = field(default_factory=dict)


class SeesawEngine:
    """Generation with prefill and decode in different layouts (see the module docstring).

    Args:
        switch: the model in both layouts (:class:`parallel.seesaw.LayoutSwitch`).
        cpu_kv_budget: capacity of the CPU KV tier in tokens; every prompt must fit.
        scheduler: ``transition_minimizing`` | ``prefill_prioritizing`` | ``decode_prioritizing``.
        max_batch_size: decode slots and prefill slots of each dp replica (dp splits each prefill
            batch and, in the decode layout, the running requests).
    """

    def __init__(self, switch: LayoutSwitch, *, cpu_kv_budget: int,
                 scheduler: str = "transition_minimizing", max_batch_size: int = 8,
                 max_seq_len: int | None = None, max_prefill_tokens: int = 4096,
                 num_microbatches: int = 2) -> None:
        if cpu_kv_budget < 1:
            raise ValueError(f"cpu_kv_budget must be >= 1 token, got {cpu_kv_budget}")
        dims_p, dims_d = switch.dims["prefill"], switch.dims["decode"]
        self.switch, self.scheduler = switch, make_scheduler(scheduler)
        kw = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        pp_kw = lambda d: dict(num_microbatches=num_microbatches) if d.pp > 1 else {}  # noqa: E731
        self.prefill_engine = make_engine(switch.models["prefill"], dims_p, **kw, **pp_kw(dims_p),
                                          max_prefill_tokens=max_prefill_tokens)
        self.decode_engine = make_engine(switch.models["decode"], dims_d, **kw, **pp_kw(dims_d))
        self.decode_engine.kv.release()  # allocated at the first transition to decode
        self.dp = {"prefill": _DP.of(dims_p), "decode": _DP.of(dims_d)}
        spec = self._tier_spec(cpu_kv_budget)
        self.tier = map_shared("reshard-kv", lambda path: CPUKVTier(spec, path))
        self.stats = SeesawStats()
        self._swapper = ThreadPoolExecutor(1, thread_name_prefix="seesaw-swap")
        self._swap_outs: deque[tuple[Future, list[int]]] = deque()
        self._prefill_free = list(range(max_batch_size - 1, -1, -1))
        self.decode_slot_of: dict[int, int] = {}  # request id -> decode slot it was swapped into

    def _tier_spec(self, capacity: int) -> TierSpec:
        cfg, kv = self.decode_engine.model.config, self.decode_engine.kv.spec
        return TierSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, kv.head_dim, capacity, kv.dtype)

    # ---- public API ---------------------------------------------------------------------------
    @property
    def model(self):
        """The model tree of the active phase (both trees share the HF config)."""
        return self.switch.models[self.switch.active]

    def validate(self, requests: Sequence[Request]) -> None:
        """Engine checks in both layouts, plus: every prompt must fit the CPU KV tier."""
        self.prefill_engine.validate(requests)
        self.decode_engine.validate(requests)
        budget = self.tier.spec.capacity_tokens
        for r in requests:
            if len(r.prompt_ids) > budget:
                raise ValueError(f"request {r.id}: prompt of {len(r.prompt_ids)} tokens does not fit "
                                 f"the CPU KV tier (cpu_kv_budget={budget} tokens)")

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], *, progress: bool = False) -> list[Completion]:
        """Run all ``requests`` to completion; returns completions in request order."""
        self.validate(requests)
        st = _State(queue=deque(requests), free=self._decode_slots())
        with tqdm(total=len(requests), disable=not progress, desc="seesaw", unit="req") as bar:
            while st.queue or st.buffered or st.running:
                phase = self.scheduler.next_phase(self.switch.active, self._snapshot(st))
                if phase != self.switch.active:
                    self._transition(phase, st)
                before = len(st.done)
                self._prefill_step(st) if phase == "prefill" else self._decode_step(st)
                bar.update(len(st.done) - before)
        return [st.done[r.id] for r in requests]

    def _decode_slots(self) -> list[int]:
        """Global decode slots ``group * max_batch_size + slot``, popped alternating over groups."""
        n, groups = self.decode_engine.max_batch_size, self.dp["decode"].size
        return [g * n + i for i in reversed(range(n)) for g in reversed(range(groups))]

    def close(self) -> None:
        """Join the swap thread and drop the shared-memory mappings (not collective: the files
        were unlinked once mapped, so this is safe on an error path too)."""
        self._swapper.shutdown(wait=True)
        self.tier.close()
        self.switch.close()

    def __enter__(self) -> "SeesawEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- scheduling ---------------------------------------------------------------------------
    def _snapshot(self, st: _State) -> SchedState:
        fits = bool(st.queue) and self.tier.can_fit(len(st.queue[0].prompt_ids))
        return SchedState(queued=len(st.queue), next_fits_tier=fits, buffered=len(st.buffered),
                          running=len(st.running), free_slots=len(st.free))

    def _transition(self, phase: str, st: _State) -> None:
        """Move the weights; the phase left behind gives up its KV cache memory where it can."""
        if phase == "decode":  # the tier must hold every rank's KV before anyone reads it
            self._wait_swap_outs(everything=True)
            dist.barrier()
            self.stats.kv_bytes_released += self.prefill_engine.kv.release()
            self.decode_engine.kv.restore()
        else:
            if not st.running:  # nothing decoding keeps KV in the decode cache
                self.stats.kv_bytes_released += self.decode_engine.kv.release()
            self.prefill_engine.kv.restore()
        self.stats.add(self.switch.switch(phase))

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_step(self, st: _State) -> None:
        """One prefill step of a batch split over the dp replicas; KV out to the tier behind it."""
        batch, dp = self._admit(st), self.dp["prefill"]
        mine = [s for i, s in enumerate(batch) if i % dp.size == dp.rank]
        self._take_prefill_slots(mine)
        t0 = time.perf_counter()
        if mine:
            self.prefill_engine.prefill(mine)
        self._share_tokens(dp, batch, mine, [len(s.request.prompt_ids) for s in batch])
        self.stats.prefill_seconds += time.perf_counter() - t0
        for seq in batch:
            if seq.finish_reason is not None:
                self.tier.free(seq.request.id)
                st.done[seq.request.id] = seq.completion()
            else:
                st.buffered.append(seq)
        self._swap_out([s for s in mine if s.finish_reason is None], [s.slot for s in mine])

    def _admit(self, st: _State) -> list[_Sequence]:
        """The next prefill batch (same on every rank); reserves each prompt's tier tokens."""
        slots = self.prefill_engine.max_batch_size * self.dp["prefill"].size
        budget = self.prefill_engine.max_prefill_tokens * self.dp["prefill"].size
        target = self.scheduler.buffer_target(self._snapshot(st)) - len(st.buffered)
        batch: list[_Sequence] = []
        while st.queue and len(batch) < min(slots, target):
            n = len(st.queue[0].prompt_ids)
            if (batch and n > budget) or not self.tier.can_fit(n):
                break
            request = st.queue.popleft()
            self.tier.allocate(request.id, n)
            budget -= n
            batch.append(self.decode_engine.new_sequence(request, slot=-1))
        return batch

    def _take_prefill_slots(self, seqs: list[_Sequence]) -> None:
        while len(self._prefill_free) < len(seqs):
            self._wait_swap_outs(everything=False)
        for seq in seqs:
            seq.slot = self._prefill_free.pop()

    def _share_tokens(self, dp: "_DP", batch: list[_Sequence], mine: list[_Sequence],
                      lengths: list[int]) -> None:
        """Each dp replica sampled the next token of its share of ``batch`` (``lengths`` new
        tokens each); every rank learns all of them and advances its generators alike."""
        if dp.size == 1:
            return
        ours = {id(s) for s in mine}
        tokens = torch.tensor([s.last_token if id(s) in ours else 0 for s in batch], device=device_type())
        dist.all_reduce(tokens, group=dp.group)
        others = [(s, t, n) for s, t, n in zip(batch, tokens.tolist(), lengths) if id(s) not in ours]
        skip_draws([s.request.sampling for s, _, _ in others], [s.generator for s, _, _ in others],
                   self.decode_engine.vocab_size)
        for seq, token, n in others:
            seq.cached += n
            seq.append(token)

    def _swap_out(self, seqs: list[_Sequence], slots: list[int]) -> None:
        """Write ``seqs``' prefill KV into the tier on the swap thread; ``slots`` free after it."""
        jobs = [(s.slot, s.request.id, len(s.request.prompt_ids)) for s in seqs]
        future = self._swapper.submit(self._write_tier, jobs)
        self._swap_outs.append((future, slots))

    def _write_tier(self, jobs: list[tuple[int, int, int]]) -> int:
        return sum(self.tier.swap_out(self.prefill_engine.kv, slot, rid, n) for slot, rid, n in jobs)

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
    def _decode_step(self, st: _State) -> None:
        """On-board tier requests into free slots (background), decode the running ones."""
        self._onboard(st)
        if not st.running:
            self._join_loads(st)
        active, dp = list(st.running.values()), self.dp["decode"]
        mine = [s for slot, s in st.running.items() if dp.owns(slot, self.decode_engine.max_batch_size)]
        t0 = time.perf_counter()
        if mine:
            self.decode_engine.decode(mine)
        self._share_tokens(dp, active, mine, [1] * len(active))
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self.stats.decode_batch_sum += len(active)
        self._join_loads(st)
        for slot in [k for k, s in st.running.items() if s.finish_reason is not None]:
            seq = st.running.pop(slot)
            st.done[seq.request.id] = seq.completion()
            st.free.append(slot)

    def _onboard(self, st: _State) -> None:
        """Give buffered requests free decode slots; their replica's ranks swap them in."""
        n = self.decode_engine.max_batch_size
        while st.free and st.buffered:
            seq, slot = st.buffered.popleft(), st.free.pop()
            seq.slot = slot % n  # the slot in the owning replica's cache
            future = None
            if self.dp["decode"].owns(slot, n):
                self.decode_slot_of[seq.request.id] = seq.slot
                future = self._swapper.submit(self.tier.swap_in, self.decode_engine.kv, seq.slot, seq.request.id)
            st.loading.append((future, seq, slot))

    def _join_loads(self, st: _State) -> None:
        t0 = time.perf_counter()
        for future, seq, slot in st.loading:
            self.stats.swap_in_tokens += future.result() if future is not None else 0
            self.tier.free(seq.request.id)
            st.running[slot] = seq
        st.loading.clear()
        self.stats.swap_seconds += time.perf_counter() - t0


__all__ = ["SeesawEngine", "SeesawStats"]
