"""Seesaw: prefill in one layout (pipeline / data parallel), decode in another (tensor parallel).

Two module trees of the same model live side by side, one per phase, built for that phase's
:class:`ParallelDims`; only the active one holds weights. A transition moves every weight from one
tree to the other through the movement core (``weights="move"``: one coalesced plan, minimal
bytes) or re-reads each rank's new shards from a shared-memory CPU copy (``weights="reload"``, the
paper's way). KV cache never moves rank to rank: prefill swaps it out into the CPU tier
(:class:`reshard.kv.CPUKVTier`) under the prefill layout, decode swaps in each rank's own
head range under the decode layout, so the swap re-shards it.

The engine is the one loop (:mod:`parallel.engine`) with a runner per phase and
:class:`SeesawPolicy`, which wraps the schedulers of :mod:`parallel.schedulers`.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from reshard.api import assign_tensor
from reshard.dtensor import wrap_local
from reshard.executor import DEFAULT_BUCKET_BYTES, execute
from reshard.kv import CPUKVTier, KVSwapper, TierSpec
from reshard.plan import plan_transfer
from reshard.weight_store import SharedWeightStore

from .dims import ParallelDims, device_type
from .engine import (Engine, EngineArgs, EngineStats, ModelRunner, Policy, Sequence, SlotPool, Step, Strategy,
                     register_strategy)
from .layouts import global_layout
from .parallelize import parallelize
from .pipeline import parallelize_pipeline
from .schedulers import SchedState, make_scheduler

PHASES = ("prefill", "decode")
WEIGHT_MODES = ("move", "reload")


@dataclass(frozen=True)
class TransitionStats:
    """One weight transition, as seen by this rank (bytes are over all ranks)."""

    to: str  # the phase switched to
    bytes: int  # moved between ranks (move) or read from the CPU copy (reload)
    lower_bound_bytes: int  # what any rank-to-rank move must transfer
    seconds: float
    peak_weight_bytes: int  # this rank's weights of both layouts + transfer buffers, at the peak


def shared_path(prefix: str) -> str:
    """A fresh file path in shared memory (``/dev/shm`` when present), the same on every rank."""
    name = [os.path.join(_shm_root(), f"{prefix}-{os.getpid()}-{time.time_ns()}.bin")]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_shared(prefix: str, factory):
    """``factory(path)`` on every rank over one fresh shared-memory file that never has a name.

    Rank 0 creates the file unnamed (``O_TMPFILE``) and maps it first (sizing it); the other
    ranks map the same file through ``/proc/<pid>/fd/<fd>``. No rank can die while a name exists,
    so a crash leaves nothing in ``/dev/shm``; the memory goes back to the system when the last
    mapping goes. Where ``O_TMPFILE`` is missing, a named file is unlinked once all have mapped it
    (collective).
    """
    if not hasattr(os, "O_TMPFILE"):
        return _map_named(prefix, factory)
    fd, ref, obj = None, [None], None
    if dist.get_rank() == 0:
        fd = os.open(_shm_root(), os.O_TMPFILE | os.O_RDWR, 0o600)
        ref = [f"/proc/{os.getpid()}/fd/{fd}"]
        obj = factory(ref[0])
    try:
        dist.broadcast_object_list(ref, src=0)
        obj = obj if obj is not None else factory(ref[0])
        dist.barrier()  # every rank has mapped it before rank 0 closes the descriptor
    finally:
        if fd is not None:
            os.close(fd)
    return obj


def _map_named(prefix: str, factory):
    path = shared_path(prefix)
    obj = factory(path)
    dist.barrier()  # every rank has mapped it
    if dist.get_rank() == 0:
        os.unlink(path)
    return obj


def build_model(path: str | os.PathLike, dims: ParallelDims, *, dtype: torch.dtype | None = None,
                load_weights: bool = True, allow_unused: bool = False) -> nn.Module:
    """The model in ``dims``' layout: pipeline stages when ``dims.pp > 1``, else TP x DP."""
    if dims.sp != 1:
        raise ValueError(f"Seesaw layouts take dp, pp and tp; got sp={dims.sp}")
    if dims.pp > 1:
        return parallelize_pipeline(path, dims, dtype=dtype, load_weights=load_weights,
                                    allow_unused=allow_unused)
    return parallelize(path, dims, dtype=dtype, load_weights=load_weights, allow_unused=allow_unused)


class LayoutSwitch:
    """One model in a prefill layout and a decode layout; :meth:`switch` moves the weights.

    The prefill tree is loaded from ``path`` and active first; the decode tree starts empty.
    """

    def __init__(self, path: str | os.PathLike, prefill: ParallelDims, decode: ParallelDims, *,
                 weights: str = "move", dtype: torch.dtype | None = None,
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, allow_unused: bool = False) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        if prefill.world_size != decode.world_size:
            raise ValueError(f"prefill layout has {prefill.world_size} ranks but decode layout has "
                             f"{decode.world_size}; both must span the same ranks")
        self.dims = {"prefill": prefill, "decode": decode}
        self.models = {"prefill": build_model(path, prefill, dtype=dtype, allow_unused=allow_unused),
                       "decode": build_model(path, decode, dtype=dtype, load_weights=False)}
        release_weights(self.models["decode"])
        self.active, self.weights, self.bucket_bytes = "prefill", weights, bucket_bytes
        self.history: list[TransitionStats] = []
        self.store = self._make_store() if weights == "reload" else None

    def _make_store(self) -> SharedWeightStore:
        """Every rank writes the prefill shards it is first to hold; after the barrier the store is full."""
        store = map_shared("reshard-weights", lambda p: SharedWeightStore.for_module(self.models["prefill"], p))
        rank = dist.get_rank()
        for name, p in self.models["prefill"].named_parameters():
            store.write(name, p, rank)
        dist.barrier()
        return store

    def switch(self, phase: str) -> TransitionStats:
        """Make ``phase``'s tree hold the weights and release the other one's (collective)."""
        if phase not in PHASES or phase == self.active:
            raise ValueError(f"cannot switch from {self.active!r} to {phase!r}")
        src, dst = self.models[self.active], self.models[phase]
        t0 = time.perf_counter()
        plans = self._plans(self.active, phase)
        moved, buffers = self._move(src, dst, plans) if self.store is None else (self._reload(phase), 0)
        peak = weight_bytes(src, dst) + buffers
        release_weights(src)
        stats = TransitionStats(phase, moved, sum(p.lower_bound_bytes for p in plans),
                                time.perf_counter() - t0, peak)
        self.active = phase
        self.history.append(stats)
        return stats

    def _plans(self, src_phase: str, dst_phase: str) -> list:
        src, dst = self.models[src_phase], self.models[dst_phase]
        dst_params = dict(dst.named_parameters())
        return [plan_transfer(global_layout(p, self.dims[src_phase]),
                              global_layout(dst_params[n], self.dims[dst_phase]))
                for n, p in src.named_parameters()]

    def _move(self, src: nn.Module, dst: nn.Module, plans: list) -> tuple[int, int]:
        """Rank-to-rank through the movement core; returns (bytes sent by all ranks, this rank's
        largest send + receive buffers)."""
        rank = dist.get_rank()
        params = list(src.named_parameters())
        locals_ = [p.to_local() if plan.src.box(rank) is not None else None
                   for (_, p), plan in zip(params, plans)]
        outs, stats = execute(plans, locals_, bucket_bytes=self.bucket_bytes, device=_device_of(dst))
        for (name, _), out in zip(params, outs):
            _install(dst, name, None if out is None else _compact(out))
        return _sum_over_ranks(stats.bytes_sent), stats.peak_extra_bytes

    def _reload(self, phase: str) -> int:
        """Each rank copies its boxes of ``phase``'s layout out of the shared CPU copy."""
        rank, before, dst = dist.get_rank(), self.store.bytes_read, self.models[phase]
        for name, p in dst.named_parameters():
            box = global_layout(p, self.dims[phase]).box(rank)
            _install(dst, name, None if box is None else self.store.read(name, box, _device_of(dst)))
        return _sum_over_ranks(self.store.bytes_read - before)

    def close(self) -> None:
        """Drop the CPU weight copy's mapping (not collective: its file is already unlinked)."""
        if self.store is not None:
            self.store.close()
            self.store = None


def release_weights(model: nn.Module) -> None:
    """Drop every parameter's local storage, keeping its mesh, placements and global shape."""
    for name, p in list(model.named_parameters()):
        assign_tensor(model, name, _empty_like_layout(p))


def weight_bytes(*models: nn.Module) -> int:
    """Bytes of the distinct storages behind this rank's parameter shards of ``models``."""
    seen = {}
    for model in models:
        for p in model.parameters():
            storage = p.to_local().untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _empty_like_layout(p) -> torch.Tensor:
    local = p.to_local()
    empty = torch.empty((0,) * p.dim(), dtype=p.dtype, device=local.device)
    return wrap_local(empty, p.device_mesh, p.placements, p.shape)


def _install(model: nn.Module, name: str, local: torch.Tensor | None) -> None:
    """Give ``name`` the local shard ``local`` (``None``: this rank holds none) in its layout."""
    p = model.get_parameter(name)
    if local is None:
        local = torch.empty((0,) * p.dim(), dtype=p.dtype, device=p.to_local().device)
    assign_tensor(model, name, wrap_local(local, p.device_mesh, p.placements, p.shape))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A view into a larger (source) storage is copied out, so releasing the source frees memory."""
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone(memory_format=torch.contiguous_format)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).to_local().device


def _sum_over_ranks(n: int) -> int:
    t = torch.tensor([n], dtype=torch.long, device=device_type())
    dist.all_reduce(t)
    return int(t.item())


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
    host_layouts = frozenset({"prefill"})  # prefill KV reaches the decode cache only through the tier

    def __init__(self, switch: LayoutSwitch, tier: CPUKVTier, *, scheduler: str = "transition_minimizing",
                 max_prefill_tokens: int = 4096) -> None:
        self.switch, self.tier, self.scheduler = switch, tier, make_scheduler(scheduler)
        self.max_prefill_tokens = max_prefill_tokens
        self.swapper = KVSwapper(tier)
        self.decode_slot_of: dict[int, int] = {}  # request id -> decode slot it was swapped into
        self._swap_outs: deque = deque()  # (future, prefill slots it frees)

    def bind(self, engine) -> None:
        super().bind(engine)
        self.prefill, self.decode = engine.runners["prefill"], engine.runners["decode"]
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
                raise ValueError(f"request {r.id}: prompt of {len(r.prompt_ids)} tokens does not fit "
                                 f"the CPU KV tier (cpu_kv_budget={budget} tokens)")
            tokens = len(r.prompt_ids) + r.sampling.max_new_tokens
            if spec.paged and spec.blocks_for(tokens) > spec.num_blocks:
                raise ValueError(f"request {r.id}: {tokens} KV tokens do not fit the paged decode cache "
                                 f"({spec.capacity_tokens} tokens)")

    def start(self, queue: deque) -> None:
        self.buffered: deque = deque()  # prefilled sequences whose KV is in the tier
        self.loading: list = []  # (future | None, sequence) swap-ins
        self.running: dict[int, Sequence] = {}  # request id -> decoding sequence
        spec = self.decode.kv.spec
        self.decode_slots = SlotPool(self.decode.max_batch_size, self.decode.replica.size, num_blocks=spec.num_blocks,
                                     block_size=spec.block_size, stats=self.engine.stats)

    def next_step(self, queue: deque) -> Step:
        phase = self.scheduler.next_phase(self.switch.active, self._snapshot(queue))
        self.engine.enter(phase)  # transition first: the step's KV moves into that layout's cache
        return self._prefill_step(queue) if phase == "prefill" else self._decode_step()

    def _snapshot(self, queue: deque) -> SchedState:
        fits = bool(queue) and self.tier.can_fit(len(queue[0].prompt_ids))
        free = len(self.decode_slots) if not self.buffered or self.decode_slots.can_take(self.buffered[0].request) else 0
        return SchedState(queued=len(queue), next_fits_tier=fits, buffered=len(self.buffered),
                          running=len(self.running), free_slots=free)

    def on_switch(self, old: str | None, new: str) -> None:
        """Move the weights; the phase left behind gives up its KV cache memory where it can."""
        if new == self.switch.active:
            return
        stats = self.engine.stats
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
        return Step("prefill", batch, "prefill")

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
            batch.append(self.engine.new_sequence(request))
        return batch

    def _take_prefill_slots(self, seqs: list[Sequence]) -> None:
        while len(self._prefill_free) < len(seqs):
            self._wait_swap_outs(everything=False)
        for seq in seqs:
            seq.slot = self._prefill_free.pop()

    def after_step(self, step: Step) -> None:
        if step.phase == "decode":
            self._join_loads()
            return
        mine = [s for s in step.seqs if s.replica == self.prefill.replica.rank]
        self.buffered.extend(s for s in step.seqs if s.finish_reason is None)
        jobs = [(s.slot, s.request.id, s.prompt_len) for s in mine if s.finish_reason is None]
        if step.replayed:  # nothing was computed; the persisted tier holds these prompts already
            jobs = []
        self._swap_outs.append((self.swapper.swap_out(self.prefill.kv, jobs), [s.slot for s in mine]))

    def _wait_swap_outs(self, *, everything: bool) -> None:
        t0 = time.perf_counter()
        while self._swap_outs:
            future, slots = self._swap_outs.popleft()
            self.engine.stats.swap_out_bytes += future.result()
            self._prefill_free.extend(slots)
            if not everything:
                break
        self.engine.stats.swap_seconds += time.perf_counter() - t0

    # ---- decode -------------------------------------------------------------------------------
    def _decode_step(self) -> Step:
        """On-board tier requests into free slots (background); decode the running ones."""
        self._onboard()
        if not self.running:
            self._join_loads()
        return Step("decode", list(self.running.values()), "decode")

    def _onboard(self) -> None:
        """Give buffered requests free decode slots; their replica's ranks swap them in."""
        while self.buffered and self.decode_slots.can_take(self.buffered[0].request):
            seq = self.buffered.popleft()
            self.decode_slots.take(seq)
            future = None
            if seq.replica == self.decode.replica.rank:
                self.decode_slot_of[seq.request.id] = seq.slot
                if seq.blocks:  # a paged decode cache: the slot's blocks before the swap-in writes them
                    self.decode.kv.assign(seq.slot, seq.blocks)
                if not self.engine.replaying:  # replayed: recovery restores the decode cache
                    future = self.swapper.swap_in(self.decode.kv, seq.slot, seq.request.id)
            self.loading.append((future, seq))

    def _join_loads(self) -> None:
        t0 = time.perf_counter()
        for future, seq in self.loading:
            self.engine.stats.swap_in_tokens += future.result() if future is not None else 0
            self.tier.free(seq.request.id)
            self.running[seq.request.id] = seq
        self.loading.clear()
        self.engine.stats.swap_seconds += time.perf_counter() - t0

    def retire(self, seq: Sequence) -> None:
        if self.running.pop(seq.request.id, None) is None:  # finished at its prefill
            self.tier.free(seq.request.id)
        else:
            self.decode_slots.give(seq)

    def persist(self, directory: Path) -> None:
        """The CPU tier moves into ``directory``'s file (every rank of the node maps it): a
        restarted job finds the prompts it held."""
        self.tier.remap(directory / "cpu-kv-tier")

    def close(self) -> None:
        """Join the swap thread and drop the shared-memory mappings (not collective: the files
        were unlinked once mapped, so this is safe on an error path too)."""
        self.swapper.close()
        self.tier.close()
        self.switch.close()


def seesaw_engine(switch: LayoutSwitch, *, cpu_kv_budget: int, scheduler: str = "transition_minimizing",
                  max_batch_size: int = 8, max_seq_len: int | None = None, max_prefill_tokens: int = 4096,
                  num_microbatches: int = 2, compile: bool = False, kv_block_size: int | None = None,
                  kv_tokens: int | None = None) -> Engine:
    """The Seesaw engine over ``switch``'s two trees (collective: maps the shared CPU tier).

    ``max_batch_size``: KV slots of each dp replica in both layouts; ``cpu_kv_budget``: the
    tier's capacity in tokens (every prompt must fit); ``compile``: the decode step;
    ``kv_block_size`` / ``kv_tokens``: a paged decode cache (requests are swapped in from the
    tier once their replica has blocks for them).
    """
    if cpu_kv_budget < 1:
        raise ValueError(f"cpu_kv_budget must be >= 1 token, got {cpu_kv_budget}")
    kw = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    paged = {"kv_block_size": kv_block_size, "kv_tokens": kv_tokens}
    runners = {phase: ModelRunner(switch.models[phase], dims=switch.dims[phase], **kw,
                                  num_microbatches=num_microbatches if switch.dims[phase].pp > 1 else 1,
                                  compile=compile and phase == "decode", **(paged if phase == "decode" else {}))
               for phase in PHASES}
    cfg, kv = switch.models["decode"].config, runners["decode"].kv.spec
    spec = TierSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, kv.head_dim, cpu_kv_budget, kv.dtype)
    tier = map_shared("reshard-kv", lambda path: CPUKVTier(spec, path))
    policy = SeesawPolicy(switch, tier, scheduler=scheduler, max_prefill_tokens=max_prefill_tokens)
    return Engine(runners=runners, policy=policy)


# ---- the strategy -------------------------------------------------------------------------------
@dataclass
class LayoutConfig:
    """One Seesaw phase's layout; at most one degree may be null (= the rest of the world)."""

    dp: int | None = 1
    pp: int | None = 1
    tp: int | None = 1

    def resolve(self, world: int, where: str) -> ParallelDims:
        """Dims with the null degree filled in; ``ValueError`` unless they multiply to ``world``."""
        degrees = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        for axis, value in degrees.items():
            if value is not None and value < 1:
                raise ValueError(f"{where}.{axis} must be >= 1, got {value}")
        unknown = [a for a, v in degrees.items() if v is None]
        if len(unknown) > 1:
            raise ValueError(f"{where}: at most one of dp, pp, tp may be null, got {unknown}")
        known = math.prod(v for v in degrees.values() if v is not None)
        if unknown:
            if world % known:
                raise ValueError(f"{where}: {degrees} cannot cover the world size ({world})")
            degrees[unknown[0]] = world // known
        if math.prod(degrees.values()) != world:
            raise ValueError(f"{where}: dp({degrees['dp']}) * pp({degrees['pp']}) * tp({degrees['tp']}) "
                             f"!= world size ({world})")
        return ParallelDims(**degrees, world_size=world)


def _layout(value, where: str) -> LayoutConfig:
    if isinstance(value, LayoutConfig):
        return value
    unknown = sorted(set(value) - {"dp", "pp", "tp"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: dp, pp, tp")
    return LayoutConfig(**value)


@register_strategy("seesaw")
@dataclass
class SeesawStrategy(Strategy):
    """Prefill in one layout (pipeline / data parallel), decode in another (tensor parallel)."""

    prefill: LayoutConfig = field(default_factory=lambda: LayoutConfig(pp=None))
    decode: LayoutConfig = field(default_factory=lambda: LayoutConfig(tp=None))
    cpu_kv_budget: int = 8192  # CPU KV tier capacity in tokens
    weights: str = "move"  # move | reload
    scheduler: str = "transition_minimizing"
    num_microbatches: int = 2  # pipeline micro-batches per step

    def __post_init__(self) -> None:
        from .schedulers import SCHEDULERS

        self.prefill, self.decode = _layout(self.prefill, "parallel.prefill"), _layout(self.decode, "parallel.decode")
        for name in ("cpu_kv_budget", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"parallel.weights must be move or reload, got {self.weights!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"parallel.scheduler {self.scheduler!r} is not one of {sorted(SCHEDULERS)}")

    def layouts(self, world: int) -> tuple[ParallelDims, ParallelDims]:
        return self.prefill.resolve(world, "parallel.prefill"), self.decode.resolve(world, "parallel.decode")

    def dims(self, world_size: int) -> ParallelDims:
        self.layouts(world_size)  # validate both layouts before loading anything
        return ParallelDims(tp=world_size, world_size=world_size)

    def build(self, path, args: EngineArgs) -> Engine:
        prefill, decode = self.layouts(dist.get_world_size())
        switch = LayoutSwitch(path, prefill, decode, weights=self.weights, dtype=args.dtype,
                              allow_unused=args.allow_unused)
        return seesaw_engine(switch, cpu_kv_budget=self.cpu_kv_budget, scheduler=self.scheduler, **args.kv,
                             max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                             max_prefill_tokens=args.max_prefill_tokens,
                             num_microbatches=self.num_microbatches, compile=args.compile)

    def summary(self, engine: Engine) -> dict:
        s, switch = engine.stats, engine.policy.switch
        swap = torch.tensor([s.swap_seconds], dtype=torch.float64)
        dist.all_reduce(swap, op=dist.ReduceOp.MAX)
        return {"transitions": s.transitions, "reshard_bytes": s.reshard_bytes,
                "reshard_lower_bound_bytes": s.reshard_lower_bound_bytes,
                "reshard_seconds": s.reshard_seconds, "swap_seconds": swap.item(),
                "scheduler": self.scheduler, "weights": switch.weights,
                "layouts": {p: {"dp": d.dp, "pp": d.pp, "tp": d.tp} for p, d in switch.dims.items()},
                "peak_weight_bytes": max((h.peak_weight_bytes for h in s.history), default=0)}

    def report(self, s: dict) -> list[str]:
        return [f"seesaw {s['layouts']['prefill']} -> {s['layouts']['decode']}: {s['transitions']} "
                f"transitions, re-shard {s['reshard_seconds']:.3f} s ({s['reshard_bytes']} bytes, lower "
                f"bound {s['reshard_lower_bound_bytes']}), swap {s['swap_seconds']:.3f} s"]
