"""Weight sync: tensors of one model written in place into another's, in any two layouts.

The RL rollout case: a policy trained in its training layout (FSDP2's ``Shard(0)``) and a rollout
copy in an inference layout (TP, Shift), on the same ranks or on other ranks. One
:class:`WeightSync` is built once (a collective: every rank of the world, whether it holds the
source, the destination, both or neither). It exchanges the two sides' layouts, matches tensors by
name and checks global shapes and dtypes (floating dtypes convert on the way), plans every
transfer with the movement core and keeps the plans and their bucketed rounds. Each
:meth:`WeightSync.sync` then moves exactly the bytes the destination ranks lack (the lower bound),
senders spread over source replicas, in rounds whose buffers stay within ``bucket_bytes``, and
writes the destination's storages in place, so compiled graphs and CUDA graphs that captured them
stay valid.

``method`` selects the common baselines instead, in the same code for comparison:
``"full_tensor"`` (every parameter gathered whole by ``DTensor.full_tensor()`` on the source
ranks, broadcast to destination ranks outside the source mesh, then sliced) and ``"broadcast"``
(every parameter gathered whole on the source ranks, as ZeRO-3's ``GatheredParameters`` does,
then broadcast from the first source rank to every destination rank, as OpenRLHF does).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from reshard.background import Background
from reshard.baselines import Baseline
from reshard.delta import INT_OF_SIZE, DeltaCache, check_chunks, execute_delta
from reshard.executor import DEFAULT_BUCKET_BYTES, CommStats, Schedule, execute
from reshard.layout import Box, Layout, nested_tuple
from reshard.mesh import all_gather_checked, cached_group, collective_exit_wait, device_type, group_ranks
from reshard.plan import Plan, plan_transfer

SYNC_METHODS = ("planned", "full_tensor", "broadcast")


@dataclass
class WeightVersion:
    """Which training step a model's weights come from; ``pending`` while a sync writes them."""

    step: int | None = None
    pending: int | None = None
    writes: int = 0  # writes begun so far (a cache of KV computed under these weights is stale after one)

    def check_ready(self) -> None:
        """``RuntimeError`` while a sync is being applied (or one failed half-way)."""
        if self.pending is not None:
            over = "the loaded weights" if self.step is None else f"step {self.step}"
            raise RuntimeError(
                f"the weights are half-synced: step {self.pending} is being written over {over}; "
                "wait for the sync (or re-run a failed one) before generating"
            )


@dataclass(frozen=True)
class SyncEntry:
    """One destination tensor: its key, the source tensor it copies, and both global layouts."""

    key: str
    source: str
    src: Layout
    dst: Layout


class WeightSync:
    """Copies ``src`` tensors into ``dst`` tensors in place, planned once.

    Args:
        src: ``{name: tensor}`` this rank holds of the source model (``None``: none). DTensors
            carry their layout; a plain tensor is a whole copy on this rank.
        dst: ``{key: tensor}`` this rank holds of the destination (``None``: none). A key copies
            the source tensor of the same name; ``"name@alt"`` copies ``name`` too (an extra copy
            of a weight in another layout, e.g. Shift's full-TP shards).
        version: the destination model's :class:`WeightVersion` (ranks holding ``dst``).
        bucket_bytes: the staging budget: a round's send + receive buffers on any rank.
        method: ``"planned"`` (ours) or a baseline, ``"full_tensor"`` | ``"broadcast"``.
        allow_unused: source tensors no destination copies are an error unless set.
        delta: send only the elements that changed since the last sync (in the destination's
            dtype: most bf16 rollout weights do not change in one RL step), per chunk whichever
            of changed elements or the whole chunk is smaller; the first sync is dense. Each
            sender keeps what it last sent (its sent bytes, in the destination dtype); the
            destination must still hold what the last sync wrote. See :mod:`reshard.delta`.

    Collective: every rank of the world constructs it and calls :meth:`sync` / :meth:`start`.
    A name or shape mismatch, or dtypes that do not convert (a floating dtype converts to another
    while it is packed: fp32 training weights into a bf16 rollout moves bf16 bytes), or a Partial
    destination (a sync writes whole values), is a ``ValueError`` on every rank, before anything moves;
    so are arguments the ranks give differently (``method``, ``bucket_bytes``, ...) or that one rank
    alone gets wrong, and a step that is not the same int on every rank.
    One sync at a time: a :meth:`sync` or :meth:`start` called while a background sync is in
    flight waits for it first (so the version label always names the bytes last written);
    :meth:`close` (or leaving a ``with`` block) waits for it too.
    """

    def __init__(
        self,
        src: Mapping[str, torch.Tensor] | None,
        dst: Mapping[str, torch.Tensor] | None,
        *,
        version: WeightVersion | None = None,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        method: str = "planned",
        allow_unused: bool = False,
        delta: bool = False,
    ) -> None:
        self.src, self.dst = dict(src or {}), dict(dst or {})
        self.version = version
        self.method = method
        self.bucket_bytes = bucket_bytes
        arguments = {"method": method, "bucket_bytes": bucket_bytes, "allow_unused": allow_unused, "delta": delta}
        srcs, dsts = _exchange(self.src, self.dst, arguments)
        self.entries = match_layouts(srcs, dsts, allow_unused)
        partial = next((e.key for e in self.entries if e.dst.is_partial), None)
        if partial is not None:
            raise ValueError(f"a weight sync writes whole values; destination {partial!r} is Partial")
        self.plans: tuple[Plan, ...] = tuple(plan_transfer(e.src, e.dst, cast=True) for e in self.entries)
        self._baseline = Baseline(self.entries, method) if method != "planned" else None
        self.schedule = Schedule.of(self.plans, bucket_bytes) if self._baseline is None else None
        self._delta = DeltaCache() if delta else None
        if delta and any(p.reduce_op for p in self.plans):
            partial = next(e.source for e, p in zip(self.entries, self.plans) if p.reduce_op)
            raise ValueError(f"a delta sync copies; {partial!r} is Partial (a reduction): use delta=False")
        if delta:
            check_chunks(self.schedule)
        self._background = cached_group(purpose="weight-sync")
        self._running: SyncHandle | None = None  # the background sync in flight, if any
        self._lock = threading.Lock()  # held while a sync writes (callers on several threads)

    @functools.cached_property
    def lower_bound_bytes(self) -> int:
        """Bytes the destination ranks need and do not hold, over every plan (fixed once planned:
        read at every sync's statistics)."""
        return sum(p.lower_bound_bytes for p in self.plans)

    def sync(self, step: int, *, verify: bool = False) -> CommStats:
        """Write the source's current values into the destination (in place); mark them ``step``
        (``verify``: then :meth:`verify` what was written)."""
        self._wait_running()
        self._check_step(step, None)
        self._mark(pending=step)
        with self._lock:
            stats = self._apply(None)
        self._mark(step=step)
        if verify:
            self.verify()
        return stats

    def verify(self) -> None:
        """Check every destination shard against the source: each rank checksums what it holds
        of the destination, and the source side the same boxes (piece by piece, additive); one
        all-reduce of the sums, then ``RuntimeError`` on every rank naming each tensor and rank
        that differs. Collective; the source must not have changed since the sync.
        ``Partial`` sources are not checked (their destination is a reduction of them)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        sums = torch.zeros(len(self.entries), world, dtype=torch.int64, device=device_type())  # wrapping sums
        for i, (e, plan) in enumerate(zip(self.entries, self.plans)):
            local, box = _local(self.src.get(e.source), e.src), e.src.box(rank)
            for piece in plan.pieces if plan.reduce_op is None else ():
                if piece.src == rank:
                    sums[i, piece.dst] += _checksum(local, box, piece.box, e.dst.dtype)
        dist.all_reduce(sums)
        differs = torch.zeros_like(sums)  # (entries, world): 1 where a rank's shard differs
        for i, (e, plan) in enumerate(zip(self.entries, self.plans)):
            if plan.reduce_op is None and (box := e.dst.box(rank)) is not None:
                mine = _checksum(_local(self.dst.get(e.key), e.dst), box, box).to(sums.device)
                differs[i, rank] = int(not torch.equal(sums[i, rank] & _checksum_mask(e.dst.dtype), mine))
        dist.all_reduce(differs)
        wrong = [(self.entries[i].key, r) for i, r in differs.nonzero().tolist()]
        if wrong:
            if self._delta is not None:  # the receivers do not hold what was sent: next sync dense
                self._delta.invalidate()
            listed = ", ".join(f"{key!r} on rank {r}" for key, r in wrong[:8])
            raise RuntimeError(
                f"weight sync verification failed: {len(wrong)} destination shard(s) differ from the source: {listed}"
            )

    def start(self, step: int) -> SyncHandle:
        """:meth:`sync` on a background thread over its own process group. The source tensors
        must not change until :meth:`SyncHandle.wait` returns (a forward and backward may run,
        an optimizer step may not); the destination refuses to generate until then, on every
        rank alike (however far each rank's thread got). If the script ends first (an error on
        the caller's thread), the process waits for the sync before it exits (its peers' exits
        do the same), so it ends with that error, never an abort inside the backend."""
        if self._baseline is not None:
            raise ValueError(f"the {self.method!r} baseline runs synchronously only; use sync()")
        self._wait_running()
        self._check_step(step, self._background)
        self._mark(pending=step)  # refuse to generate from the moment the sync is started
        self._running = SyncHandle(self, step)
        return self._running

    def close(self) -> None:
        """Wait for the background sync in flight, if any (raising its error): before the
        process groups it uses are destroyed."""
        self._wait_running()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            self.close()
        except Exception:
            if kind is None:  # an error already leaving the block stays the one reported
                raise

    def _wait_running(self) -> None:
        """Wait for the background sync in flight (every rank alike: each waits for its own)."""
        running, self._running = self._running, None
        if running is not None:
            running.wait()

    def _apply_locked(self, group) -> CommStats:
        with self._lock:
            return self._apply(group)

    # ---- internals --------------------------------------------------------------------------
    def _mark(self, *, pending: int | None = None, step: int | None = None) -> None:
        """On the caller's thread (the same moment on every rank): the destination's version is
        ``pending`` (being written) or, once written, ``step``."""
        if self.version is None:
            return
        if pending is not None:
            self.version.pending = pending
            self.version.writes += 1
        else:
            self.version.step, self.version.pending = step, None

    def _apply(self, group) -> CommStats:
        """Write the destination (on the caller's thread or a background sync's)."""
        srcs = [_local(self.src.get(e.source), e.src) for e in self.entries]
        outs = [_local(self.dst.get(e.key), e.dst) for e in self.entries]
        if self._baseline is not None:
            stats = self._baseline.run(self.src, outs)
            stats.lower_bound_bytes = self.lower_bound_bytes
        elif self._delta is not None:
            stats = execute_delta(self.schedule, srcs, outs, self._delta, group)
        else:
            _, stats = execute(self.schedule, srcs, out=outs, group=group)
        return stats

    def _check_step(self, step: int, group) -> None:
        """Every rank must sync the same step, an int: one small all-gather of every rank's step
        and its own check, then the same ``ValueError`` on every rank naming the values and ranks
        (a step only some ranks get wrong, say an optimizer's tensor step on the trainers, never
        leaves the others waiting in the sync's collectives). The same all-gather spreads a delta
        cache's invalidation: if any rank dropped its cache, every rank drops its own (the next
        sync is dense everywhere)."""
        error = None if type(step) is int else f"step must be an int, got {_one_line(step)}"
        invalid = self._delta is not None and self._delta.invalid
        everyone = dict(zip(group_ranks(group), all_gather_checked((step, invalid), error, group)))
        if self._delta is not None and any(inv for _, inv in everyone.values()):
            self._delta.clear()
        (first, (value, _)), *_ = everyone.items()
        other = next((r for r, (v, _) in everyone.items() if v != value), None)
        if other is not None:
            raise ValueError(
                f"ranks sync different steps: rank {first} step {value} vs rank {other} step {everyone[other][0]}"
            )


def _one_line(value: object) -> str:
    """``value``'s type and repr on one line, cut to 60 characters (a tensor's repr spans lines)."""
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class SyncHandle:
    """A sync running in the background; :meth:`wait` returns its stats or raises its error, and
    marks the destination synced (on the caller's thread, the same moment on every rank)."""

    def __init__(self, sync: WeightSync, step: int) -> None:
        self.step, self._sync = step, sync
        self._job = Background(
            lambda: sync._apply_locked(sync._background),
            "reshard-sync",
            f"weight sync of step {step}",
            exit_wait=collective_exit_wait(),
        )

    def done(self) -> bool:
        return self._job.done()

    def wait(self, timeout: float | None = None) -> CommStats:
        stats = self._job.result(timeout)
        self._sync._mark(step=self.step)
        return stats


# ---- layouts: exchanged once, matched by name, checked by shape and dtype -----------------------
def _layouts(tensors: Mapping[str, torch.Tensor]) -> dict[str, Layout]:
    """Each tensor's layout; a plain tensor is a whole copy on this rank."""
    rank = dist.get_rank()
    return {
        name: Layout.of_dtensor(t)
        if isinstance(t, DTensor)
        else Layout((rank,), (Replicate(),), tuple(t.shape), t.dtype)
        for name, t in tensors.items()
    }


def _exchange(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], arguments: dict
) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """Every rank's layouts, merged: the same on every rank afterwards (a mismatch raises on
    every rank next). The same all-gather agrees on what one rank can check alone (its
    ``arguments`` and tensors) and that every rank gave the same ``arguments``: one
    ``ValueError`` on every rank otherwise, never a rank left waiting in a collective."""
    error = _argument_error(arguments) or _tensor_error("src", src) or _tensor_error("dst", dst)
    layouts = (_layouts(src), _layouts(dst)) if error is None else None
    shown = {k: repr(v) for k, v in arguments.items()}
    everyone = dict(zip(group_ranks(), all_gather_checked((shown, layouts), error)))
    (first, (given, _)), *_ = everyone.items()
    for rank, (theirs, _) in everyone.items():
        key = next((k for k in given if theirs[k] != given[k]), None)
        if key is not None:
            raise ValueError(
                f"ranks built the WeightSync with different arguments: {key}={given[key]} on rank {first} "
                f"vs {key}={theirs[key]} on rank {rank}"
            )
    reports = [(r, layouts) for r, (_, layouts) in everyone.items()]
    return merge_layouts([(r, s) for r, (s, _) in reports]), merge_layouts([(r, d) for r, (_, d) in reports])


def _argument_error(arguments: dict) -> str | None:
    """What is wrong with a :class:`WeightSync`'s ``arguments`` (one line), or ``None``."""
    method, delta = arguments["method"], arguments["delta"]
    if method not in SYNC_METHODS:
        return f"weight sync method must be one of {SYNC_METHODS}, got {method!r}"
    if delta and method != "planned":
        return f"a delta sync runs the planned method only, got method={method!r}"
    return None


def _tensor_error(side: str, tensors: dict) -> str | None:
    """The first entry of ``tensors`` that is no tensor (one line), or ``None``."""
    bad = next((name for name, t in tensors.items() if not isinstance(t, torch.Tensor)), None)
    if bad is None:
        return None
    return f"WeightSync {side}[{bad!r}] must be a tensor, got {_one_line(tensors[bad])}"


def merge_layouts(reports: list[tuple[int, dict[str, Layout]]]) -> dict[str, Layout]:
    """One world-wide layout per name from every rank's report.

    Ranks on one mesh report the same layout; different meshes holding the same layout (data-
    parallel replicas, plain tensors on several ranks) become replicas along a new leading axis.
    """
    by_name: dict[str, list[Layout]] = {}
    for _, layouts in sorted(reports, key=lambda r: r[0]):
        for name, layout in layouts.items():
            seen = by_name.setdefault(name, [])
            if layout not in seen:
                seen.append(layout)
    return {name: _stack_replicas(name, layouts) for name, layouts in by_name.items()}


def _stack_replicas(name: str, layouts: list[Layout]) -> Layout:
    if len(layouts) == 1:
        return layouts[0]
    first = layouts[0]
    for other in layouts[1:]:
        if (other.shape, other.dtype) != (first.shape, first.dtype):
            raise ValueError(
                f"{name!r} is {list(first.shape)} {first.dtype} on ranks {first.all_ranks} but "
                f"{list(other.shape)} {other.dtype} on ranks {other.all_ranks}"
            )
        if (other.placements, other.grid.shape) != (first.placements, first.grid.shape):
            raise ValueError(
                f"{name!r} has placements {first.placements} on ranks {first.all_ranks} but "
                f"{other.placements} on ranks {other.all_ranks}; replicas must share a layout"
            )
    grid = torch.stack([layout.grid for layout in layouts])
    if len(set(grid.flatten().tolist())) != grid.numel():
        raise ValueError(f"{name!r} is held in overlapping layouts {[lay.all_ranks for lay in layouts]}")
    return Layout(nested_tuple(grid.tolist()), (Replicate(),) + first.placements, first.shape, first.dtype)


def match_layouts(src: dict[str, Layout], dst: dict[str, Layout], allow_unused: bool = False) -> list[SyncEntry]:
    """One :class:`SyncEntry` per destination key, in sorted key order (the same on every rank)."""
    entries = []
    missing = []
    used = set()
    for key in sorted(dst):
        name = key.split("@", 1)[0]
        if name not in src:
            missing.append(key)
            continue
        s, d = src[name], dst[key]
        castable = s.dtype.is_floating_point and d.dtype.is_floating_point and not s.is_partial
        if s.shape != d.shape or (s.dtype != d.dtype and not castable):
            raise ValueError(
                f"parameter {key!r}: the source holds {list(s.shape)} {s.dtype} but the "
                f"destination {list(d.shape)} {d.dtype}"
            )
        used.add(name)
        entries.append(SyncEntry(key, name, s, d))
    if missing:
        raise ValueError(
            f"{len(missing)} destination tensors have no source tensor of the same name: "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
        )
    unused = sorted(set(src) - used)
    if unused and not allow_unused:
        raise ValueError(
            f"{len(unused)} source tensors are not copied to the destination: {unused[:6]}"
            f"{' ...' if len(unused) > 6 else ''} (pass allow_unused=True to sync anyway)"
        )
    return entries


_MIX = (0x7F4A7C159E3779B9, 0x6A09E667F3BCC909, 0x3C6EF372FE94F82B)  # odd 63-bit constants


def _checksum(local: torch.Tensor, held: Box, box: Box, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over ``box`` (global coordinates, inside ``held``: the box ``local`` holds) of each
    element's bit pattern (as ``dtype``, default its own) times an odd pseudo-random weight of its
    global position, mod 2^32 (mod 2^64 for 8-byte dtypes, whose low bits may all be zero):
    additive over disjoint boxes, so pieces checksummed where they were sent from add up to the
    destination's (a changed element always changes it). The weight is a product of one per
    coordinate, so the sum contracts one dim at a time: one vectorized multiply and sum per
    element, the rest on ever smaller tensors. A 0-d int64 tensor (see :func:`_checksum_mask`)."""
    view = local[tuple(slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(box, held))]
    view = view.to(dtype) if dtype is not None else view
    wide = torch.int64 if view.element_size() == 8 else torch.int32  # arithmetic wraps in this width
    acc = view.contiguous().view(INT_OF_SIZE[view.element_size()]).to(wide)  # (n_0, ..., n_k)
    for d in reversed(range(acc.dim())):
        acc = (acc * _position_weights(box[d], d, acc.device, wide)).sum(-1, dtype=wide)  # contracts dim d
    return acc.to(torch.int64) & _checksum_mask(view.dtype)


def _checksum_mask(dtype: torch.dtype) -> int:
    """The bits a checksum of ``dtype`` keeps: 32 (its arithmetic is int32), or all 64."""
    return -1 if dtype.itemsize == 8 else 0xFFFFFFFF


def _position_weights(span: tuple[int, int], dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(hi - lo,) odd weights of global indices ``lo..hi`` along ``dim`` (a fixed mix), as ``dtype``."""
    h = (torch.arange(*span, dtype=torch.int64, device=device) + (dim + 1) * 1_000_003) * _MIX[0]
    h = (h ^ (h >> 29)) * _MIX[1]
    h = (h ^ (h >> 32)) * _MIX[2]
    return (h | 1).to(dtype)


def _local(t: torch.Tensor | None, layout: Layout) -> torch.Tensor | None:
    """This rank's shard of ``t`` (``None`` when this rank holds none of it)."""
    if t is None or layout.box(dist.get_rank()) is None:
        return None
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    return t.to_local() if isinstance(t, DTensor) else t
