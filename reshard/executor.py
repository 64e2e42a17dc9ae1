"""Executing transfer plans: coalesced per-peer buffers, batched P2P, bounded buckets.

Every rank computes the same plans and the same round assignment (both are deterministic), so sends
and receives match without any handshake. In each round a rank packs everything it sends to one
peer into one contiguous byte buffer (tensors of mixed dtypes included), posts all sends and
receives of the round as one batch of P2P ops, then unpacks. Only ranks that hold or need data take
part. A round's buffers on any rank (sent + received bytes) stay within ``bucket_bytes``; a piece
larger than that is cut into chunks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial

from reshard.layout import Box, box_numel
from reshard.mesh import device_type
from reshard.plan import Piece, Plan

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass
class CommStats:
    """What one rank did in one movement call."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    messages: int = 0  # coalesced P2P messages this rank sent
    rounds: int = 0
    peak_extra_bytes: int = 0  # largest round's send + receive buffers on this rank
    planned_bytes: int = 0  # all ranks, from the plans
    lower_bound_bytes: int = 0  # all ranks
    seconds: float = 0.0


@dataclass(frozen=True)
class _Item:
    """One chunk of one piece of one plan, in the global canonical order."""

    order: int
    plan: int
    piece: Piece
    box: Box
    nbytes: int


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Cut ``box`` into boxes of at most ``max_numel`` elements, outer dims first."""
    if box_numel(box) <= max_numel or not box:
        return [box]
    (lo, hi), inner = box[0], box_numel(box[1:])
    if inner <= max_numel:
        step = max_numel // inner
        return [((s, min(s + step, hi)),) + box[1:] for s in range(lo, hi, step)]
    return [((i, i + 1),) + sub for i in range(lo, hi) for sub in split_box(box[1:], max_numel)]


def _items(plans: Sequence[Plan], bucket_bytes: int | None) -> list[_Item]:
    out = []
    for i, plan in enumerate(plans):
        limit = None if bucket_bytes is None else bucket_bytes // plan.itemsize
        if limit is not None and limit < 1:
            raise ValueError(
                f"bucket_bytes ({bucket_bytes}) is smaller than the minimum chunk: one "
                f"element of {plan.dst.dtype} ({plan.itemsize} bytes)"
            )
        for piece in plan.pieces:
            chunks = [piece.box] if piece.local or limit is None else split_box(piece.box, limit)
            out += [_Item(len(out) + j, i, piece, c, box_numel(c) * plan.itemsize) for j, c in enumerate(chunks)]
    return out


def assign_rounds(items: list[_Item], plans: Sequence[Plan], bucket_bytes: int | None) -> list[list[_Item]]:
    """First-fit rounds: per round, each rank's sent + received bytes <= ``bucket_bytes``.

    Items of a Partial plan never go to an earlier round than the previous item for the same
    destination, so every replica reduces contributions in the same order (bitwise-equal results).
    """
    rounds: list[list[_Item]] = []
    usage: list[dict[int, int]] = []
    floor: dict[tuple[int, int], int] = defaultdict(int)
    for item in items:
        p = item.piece
        cost = 0 if p.local else item.nbytes
        start = floor[(item.plan, p.dst)] if plans[item.plan].reduce_op else 0
        k = start
        while (
            k < len(rounds)
            and bucket_bytes is not None
            and cost
            and (usage[k].get(p.src, 0) + cost > bucket_bytes or usage[k].get(p.dst, 0) + cost > bucket_bytes)
        ):
            k += 1
        if k == len(rounds):
            rounds.append([])
            usage.append(defaultdict(int))
        rounds[k].append(item)
        usage[k][p.src] += cost
        usage[k][p.dst] += cost
        floor[(item.plan, p.dst)] = k
    return rounds


def _local_slices(box: Box, holder_box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, holder_box))


def _check_world(plans: Sequence[Plan]) -> None:
    world = dist.get_world_size()
    for plan in plans:
        for layout in (plan.src, plan.dst):
            bad = [r for r in layout.all_ranks if not 0 <= r < world]
            if bad:
                raise ValueError(
                    f"mesh names ranks {bad} outside the world of {world} ranks (mesh {list(layout.ranks)})"
                )


@dataclass(frozen=True)
class Schedule:
    """The rounds of a set of plans under a bucket budget: a pure function of both, so a caller
    that runs the same plans again (a weight sync every RL iteration) computes it once."""

    plans: tuple[Plan, ...]
    bucket_bytes: int | None
    rounds: tuple[tuple[_Item, ...], ...]

    @staticmethod
    def of(plans: Sequence[Plan], bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> Schedule:
        rounds = assign_rounds(_items(plans, bucket_bytes), plans, bucket_bytes)
        return Schedule(tuple(plans), bucket_bytes, tuple(tuple(r) for r in rounds))


def execute(
    plans: Sequence[Plan] | Schedule,
    src_locals: Sequence[torch.Tensor | None],
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    out: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor | None], CommStats]:
    """Run ``plans`` together; returns this rank's destination shards (``None`` off the mesh).

    ``out``: this rank's destination shards to write in place (``None`` off the mesh), e.g. a
    model's parameters; otherwise new tensors are allocated on ``device`` (default: the process
    group's, :func:`reshard.mesh.device_type`), or views of the source returned where a rank
    already holds its whole destination box.
    """
    t0 = time.perf_counter()
    device = device if device is not None else device_type()
    schedule = plans if isinstance(plans, Schedule) else Schedule.of(plans, bucket_bytes)
    plans = schedule.plans
    _check_world(plans)
    rank = dist.get_rank()
    if out is not None:
        views, outs = set(), _check_out(plans, out, rank)
    else:
        views = {i for i, plan in enumerate(plans) if _held_whole(plan, rank)}
        outs = [
            _src_slice(plan, src_locals[i], rank) if i in views else _alloc(plan, rank, device)
            for i, plan in enumerate(plans)
        ]
    stats = CommStats(
        planned_bytes=sum(p.bytes_moved for p in plans), lower_bound_bytes=sum(p.lower_bound_bytes for p in plans)
    )
    for round_items in schedule.rounds:
        mine = [it for it in round_items if rank in (it.piece.src, it.piece.dst)]
        if mine:
            _run_round(mine, plans, src_locals, outs, rank, stats, group, views)
        stats.rounds += 1
    for plan, o in zip(plans, outs):
        if o is not None and plan.reduce_op == "avg":
            o.div_(plan.num_contributions)
        for n in _partition_divisors(plan) if o is not None else ():
            o.div_(n)
    stats.seconds = time.perf_counter() - t0
    return outs, stats


def _check_out(plans: Sequence[Plan], out: Sequence[torch.Tensor | None], rank: int) -> list:
    """Destination shards given by the caller: one per plan, of this rank's local shape."""
    assert len(out) == len(plans), f"{len(out)} destination tensors for {len(plans)} plans"
    for plan, o in zip(plans, out):
        shape = plan.dst.local_shape(rank)
        assert (o is None) == (shape is None) and (o is None or tuple(o.shape) == shape), (
            f"destination shard {None if o is None else tuple(o.shape)} != planned {shape}"
        )
        if o is not None and plan.reduce_op:
            o.fill_(identity(plan.reduce_op, o.dtype))
    return list(out)


def _held_whole(plan: Plan, rank: int) -> bool:
    """This rank already holds its whole destination box (one local piece, nothing to reduce
    or divide)."""
    mine = [p for p in plan.pieces if p.dst == rank]
    whole = len(mine) == 1 and mine[0].local and mine[0].box == plan.dst.box(rank)
    return whole and not plan.reduce_op and plan.src.dtype == plan.dst.dtype and not _partition_divisors(plan)


def _partition_divisors(plan: Plan) -> list[int]:
    """A (non-Partial) source moved to Partial(sum) axes: each holder gets the full value, divided
    by each such axis's size in mesh order (DTensor's ``Partial._partition_value``, axis by axis).
    None for a Partial source: its destination is either reduced or keeps its partial axes."""
    if plan.src.is_partial:
        return []
    axes = [a for a, p in enumerate(plan.dst.placements) if isinstance(p, Partial) and p.reduce_op == "sum"]
    return [plan.dst.grid.shape[a] for a in axes]


def _src_slice(plan: Plan, src_local: torch.Tensor, rank: int) -> torch.Tensor:
    """The destination shard as a view of the source shard (no copy, as DTensor does)."""
    return src_local[_local_slices(plan.dst.box(rank), plan.src.box(rank))]


def _alloc(plan: Plan, rank: int, device) -> torch.Tensor | None:
    shape = plan.dst.local_shape(rank)
    if shape is None:
        return None
    if plan.reduce_op:
        return torch.full(shape, identity(plan.reduce_op, plan.dst.dtype), dtype=plan.dst.dtype, device=device)
    return torch.empty(shape, dtype=plan.dst.dtype, device=device)


def identity(op: str, dtype: torch.dtype) -> float | int:
    """The value a reduction ``op`` starts from (what reducing it with ``x`` leaves ``x``)."""
    if op in ("sum", "avg"):
        return 0
    if dtype.is_floating_point:
        return -float("inf") if op == "max" else float("inf")
    return torch.iinfo(dtype).min if op == "max" else torch.iinfo(dtype).max


def reduce_into(target: torch.Tensor, data: torch.Tensor, op: str | None) -> None:
    """``target`` op= ``data`` in place (``None``: a copy)."""
    if op is None:
        target.copy_(data)
    elif op in ("sum", "avg"):
        target.add_(data)
    else:
        (torch.maximum if op == "max" else torch.minimum)(target, data, out=target)


def _run_round(
    items: list[_Item], plans, src_locals, outs, rank: int, stats: CommStats, group, views: set[int]
) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for it in items:
        if not it.piece.local:
            (sends[it.piece.dst] if it.piece.src == rank else recvs[it.piece.src]).append(it)
    send_bufs = {peer: _send_buffer(its, plans, src_locals, rank) for peer, its in sends.items()}
    direct = {peer: _direct_target(its, plans, outs, rank, views) for peer, its in recvs.items()}
    direct = {peer: t for peer, t in direct.items() if t is not None}
    recv_bufs = {
        peer: direct.get(peer)
        if peer in direct
        else torch.empty(sum(i.nbytes for i in its), dtype=torch.uint8, device=outs[its[0].plan].device)
        for peer, its in recvs.items()
    }
    ops = [dist.P2POp(dist.isend, buf, peer, group) for peer, buf in send_bufs.items()]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in recv_bufs.items()]
    works = dist.batch_isend_irecv(ops) if ops else []
    for w in works:
        w.wait()
    done = {recvs[peer][0].order for peer in direct}
    _unpack([it for it in items if it.order not in done], plans, src_locals, outs, recv_bufs, rank, stats, views)
    stats.bytes_sent += sum(b.numel() for b in send_bufs.values())
    stats.bytes_received += sum(b.numel() for b in recv_bufs.values())
    stats.messages += len(send_bufs)
    staged = [b for p, b in send_bufs.items() if not _is_view(b, sends[p], plans, src_locals, rank)]
    staged += [b for p, b in recv_bufs.items() if p not in direct]
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, sum(b.numel() for b in staged))


def _send_buffer(items: list[_Item], plans, src_locals, rank: int) -> torch.Tensor:
    """A peer's bytes: the source slice itself when it is one contiguous chunk (no copy), else
    every chunk packed into one buffer."""
    if len(items) == 1 and _same_dtype(items[0], plans):
        view = _src_view(items[0], plans, src_locals, rank)
        if view.is_contiguous():
            return view.reshape(-1).view(torch.uint8)
    return _pack(items, plans, src_locals, rank)


def _same_dtype(it: _Item, plans) -> bool:
    return plans[it.plan].src.dtype == plans[it.plan].dst.dtype


def _is_view(buf: torch.Tensor, items: list[_Item], plans, src_locals, rank: int) -> bool:
    return (
        len(items) == 1
        and _same_dtype(items[0], plans)
        and buf.data_ptr() == _src_view(items[0], plans, src_locals, rank).data_ptr()
    )


def _direct_target(items: list[_Item], plans, outs, rank: int, views: set[int]) -> torch.Tensor | None:
    """Where one chunk from a peer can be received in place: its contiguous destination slice
    (``None`` when it must be staged: several chunks, a reduction, or a strided slice)."""
    if len(items) != 1:
        return None
    it, plan = items[0], plans[items[0].plan]
    if plan.reduce_op or it.plan in views or outs[it.plan] is None:
        return None
    target = outs[it.plan][_local_slices(it.box, plan.dst.box(rank))]
    return target.reshape(-1).view(torch.uint8) if target.is_contiguous() else None


def _src_view(it: _Item, plans, src_locals, rank: int) -> torch.Tensor:
    plan = plans[it.plan]
    return src_locals[it.plan][_local_slices(it.box, plan.src.box(rank))]


def _offsets(items: list[_Item], plans) -> dict[int, int]:
    """Byte offset of each chunk in one peer's buffer: largest dtypes first, so every chunk is
    aligned for its dtype (mixed dtypes share a buffer); canonical order within a dtype size."""
    offsets, at = {}, 0
    for it in sorted(items, key=lambda i: (-plans[i.plan].itemsize, i.order)):
        offsets[it.order] = at
        at += it.nbytes
    return offsets


def _typed(buf: torch.Tensor, offset: int, it: _Item, plans) -> torch.Tensor:
    """The chunk's bytes in ``buf`` as a tensor of its dtype and box shape (a view)."""
    shape = tuple(hi - lo for lo, hi in it.box)
    return buf[offset : offset + it.nbytes].view(plans[it.plan].dst.dtype).view(shape)


def _pack(items: list[_Item], plans, src_locals, rank: int) -> torch.Tensor:
    """One contiguous byte buffer of every chunk for one peer; chunks are copied straight in
    (converted to the destination dtype where a plan casts)."""
    offsets = _offsets(items, plans)
    buf = torch.empty(sum(it.nbytes for it in items), dtype=torch.uint8, device=src_locals[items[0].plan].device)
    for it in items:
        _typed(buf, offsets[it.order], it, plans).copy_(_src_view(it, plans, src_locals, rank))
    return buf


def _unpack(
    items: list[_Item], plans, src_locals, outs, recv_bufs, rank: int, stats: CommStats, views: set[int]
) -> None:
    """Write received chunks and local copies into destination shards, in canonical order."""
    by_peer = defaultdict(list)
    for it in items:
        if it.piece.dst == rank and not it.piece.local:
            by_peer[it.piece.src].append(it)
    offsets = {peer: _offsets(its, plans) for peer, its in by_peer.items()}
    for it in items:  # canonical order: every replica reduces Partial contributions alike
        p, plan = it.piece, plans[it.plan]
        if p.dst != rank or it.plan in views:
            continue
        if p.local:
            data = _src_view(it, plans, src_locals, rank)
            stats.bytes_copied_locally += it.nbytes
        else:
            data = _typed(recv_bufs[p.src], offsets[p.src][it.order], it, plans)
        target = outs[it.plan][_local_slices(it.box, plan.dst.box(rank))]
        reduce_into(target, data, plan.reduce_op)
