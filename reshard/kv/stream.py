"""DejaVu's KV streaming library, in three levels each usable on its own.

1. ``stream_out / stream_in`` decisions (:func:`plan_stream`): from the source and destination KV
   layouts of every rank (layers x KV heads each holds: TP degree, pipeline depth, replicas),
   which ``(layer range x head range)`` goes from which source rank to which destination rank.
   A destination box is split over the source boxes it meets (merging at the destination) and a
   source box over the destinations that need it (splitting at the source); a region several
   ranks hold is sent by the least loaded one. Pure: the movement core's sender assignment.
2. ``scatter / gather`` (:func:`scatter`, :func:`gather`): the non-contiguous region of a peer
   (a head range x a token range, across blocks and layers, for several sequences) packed into
   one contiguous buffer per peer and unpacked at the other end (the paper's buffered copies),
   with one indexed copy per layer and K/V for all the sequences at once (measured: per-chunk
   packing of many small chunks, e.g. one decode step's entries, costs far more than the bytes).
3. ``flush / fetch`` (:mod:`reshard.kv.transport`): one buffer per peer over the transport the
   two media call for, as background jobs with ids, completion checks and timeouts.

:class:`KVStreamer` ties them together for one pair of layouts: ``stream_out`` on the source
ranks returns the flush jobs; ``stream_in`` on the destination ranks returns a handle whose
``wait`` fetches and unpacks. Sequences are named by their request id on both sides; each side
passes its own slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from ..plan import Piece, assign_senders
from .cache import KVCache, KVLayout
from .pack import pack_kv
from .transport import Job, LocalTransport, P2PTransport, Transport

Box = tuple[tuple[int, int], tuple[int, int]]  # (layers [l0, l1), KV heads [h0, h1))


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, stop)`` of request ``key``, held in ``slot`` of this side's cache."""

    key: int
    slot: int
    start: int
    stop: int


# ---- level 1: which chunks go where ------------------------------------------------------------
def kv_box(layout: KVLayout) -> Box:
    return ((layout.first_layer, layout.first_layer + layout.num_layers),
            (layout.head_start, layout.head_start + layout.num_heads))


@dataclass(frozen=True)
class StreamPlan:
    """Pieces ``(src rank, dst rank, (layers, heads))`` between two layouts (every rank's)."""

    src: tuple[tuple[int, KVLayout], ...]
    dst: tuple[tuple[int, KVLayout], ...]
    pieces: tuple[Piece, ...]

    def sends(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` streams out, by destination rank (itself included: a local copy)."""
        return _by(p for p in self.pieces if p.src == rank)

    def receives(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` streams in, by source rank."""
        return _by((p for p in self.pieces if p.dst == rank), key=lambda p: p.src)


def _by(pieces, key=lambda p: p.dst) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = {}
    for p in pieces:
        out.setdefault(key(p), []).append(p)
    return dict(sorted(out.items()))


def plan_stream(src: Mapping[int, KVLayout], dst: Mapping[int, KVLayout]) -> StreamPlan:
    """Which region of the KV each destination rank gets from which source rank.

    ``src`` / ``dst``: the KV layout each rank holds (ranks that hold none are left out). A
    destination whose layers and heads the sources do not cover, or whose head dim or dtype
    differs, is refused with both layouts named.
    """
    items: dict[Box, list[int]] = {}
    for rank, layout in sorted(src.items()):
        items.setdefault(kv_box(layout), []).append(rank)
    first = next(iter(src.values()), None)
    for rank, layout in sorted(dst.items()):
        _check_reader(rank, layout, first, src, items)
    pieces = assign_senders(list(items.items()), [(r, kv_box(l)) for r, l in sorted(dst.items())])
    return StreamPlan(tuple(sorted(src.items())), tuple(sorted(dst.items())), tuple(pieces))


def _check_reader(rank: int, layout: KVLayout, first: KVLayout | None, src, items) -> None:
    box = kv_box(layout)
    covered = sum(_area(_intersect(b, box)) for b in items)
    if first is None or (layout.head_dim, layout.dtype) != (first.head_dim, first.dtype) or covered != _area(box):
        raise ValueError(f"rank {rank} reads KV layout {layout}, which the source layouts do not hold "
                         f"({ {r: l for r, l in sorted(src.items())} })")


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _area(box: Box | None) -> int:
    return 0 if box is None else (box[0][1] - box[0][0]) * (box[1][1] - box[1][0])


def world_layouts(cache: KVCache | None, group: dist.ProcessGroup | None = None) -> dict[int, KVLayout]:
    """Every rank's KV layout (ranks without a cache left out): one all-gather of descriptors."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), cache.layout if cache is not None else None), group=group)
    return {rank: layout for rank, layout in everyone if layout is not None}


# ---- level 2: scatter / gather ----------------------------------------------------------------
def _regions(cache: KVCache, pieces: Sequence[Piece], layers: Sequence[int] | None):
    """``(storage, (h0, h1))`` of every chunk, in the canonical order both sides use: piece,
    layer, K then V; heads local to ``cache``. A chunk holds every span's tokens."""
    s = cache.spec
    for piece in pieces:
        (l0, l1), (h0, h1) = piece.box
        for layer in range(l0, l1):
            if layers is not None and layer not in layers:
                continue
            for storage in cache.layer(layer):
                yield storage, (h0 - s.head_start, h1 - s.head_start)


def _locations(cache: KVCache, spans: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage ``(rows, cols)`` of every token of ``spans``, span after span (paged or not)."""
    device = cache.k[0].device
    slots = torch.cat([torch.full((sp.stop - sp.start,), sp.slot, dtype=torch.long) for sp in spans])
    positions = torch.cat([torch.arange(sp.start, sp.stop) for sp in spans])
    return cache.locate(slots.to(device), positions.to(device))


def chunk_bytes(cache: KVCache, pieces, spans, layers=None) -> list[int]:
    tokens = sum(sp.stop - sp.start for sp in spans)
    item = torch.empty((), dtype=cache.spec.dtype).element_size()
    return [(h1 - h0) * tokens * cache.spec.head_dim * item for _, (h0, h1) in _regions(cache, pieces, layers)]


def scatter(cache: KVCache, pieces: Sequence[Piece], spans: Sequence[Span],
            layers: Sequence[int] | None = None) -> torch.Tensor:
    """One contiguous byte buffer of every chunk for one peer (``layers``: only those). Each chunk
    is one indexed copy of all spans' tokens ``(N, heads, head_dim)``, however scattered their
    blocks: one copy per layer and K/V, not one per sequence."""
    sizes = chunk_bytes(cache, pieces, spans, layers)
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=cache.k[0].device)
    if not spans:
        return buf
    rows, cols = _locations(cache, spans)
    at = 0
    for (storage, (h0, h1)), n in zip(_regions(cache, pieces, layers), sizes):
        buf[at:at + n].view(cache.spec.dtype).view(len(rows), h1 - h0, -1).copy_(storage[rows, h0:h1, cols])
        at += n
    return buf


def chunks(cache: KVCache, pieces, spans, layers=None) -> list[torch.Tensor]:
    """The same bytes one chunk per (layer, K/V, sequence), each packed by
    :func:`reshard.kv.pack.pack_kv` (the naive per-chunk way, for comparison)."""
    out = []
    for storage, heads in _regions(cache, pieces, layers):
        for span in spans:
            out.append(pack_kv(storage, _blocks(cache, span.slot), heads, (span.start, span.stop)))
    return out


def chunk_sizes(cache: KVCache, pieces, spans, layers=None) -> list[int]:
    """Bytes of each chunk :func:`chunks` makes (what a per-chunk receiver allocates)."""
    item = torch.empty((), dtype=cache.spec.dtype).element_size()
    return [(h1 - h0) * (sp.stop - sp.start) * cache.spec.head_dim * item
            for _, (h0, h1) in _regions(cache, pieces, layers) for sp in spans]


def _blocks(cache: KVCache, slot: int) -> torch.Tensor:
    """The slot's block table; a contiguous cache is one block of ``max_seq_len + 1`` per slot."""
    if cache.spec.paged:
        return cache.table[slot]
    return torch.tensor([slot], device=cache.k[0].device)


def gather(cache: KVCache, pieces: Sequence[Piece], spans: Sequence[Span], buf: torch.Tensor,
           layers: Sequence[int] | None = None) -> None:
    """Unpack a peer's buffer (from :func:`scatter` on the other side) into ``cache``."""
    sizes = chunk_bytes(cache, pieces, spans, layers)
    assert buf.numel() == sum(sizes), f"buffer of {buf.numel()} bytes for chunks of {sum(sizes)}"
    if not spans:
        return
    rows, cols = _locations(cache, spans)
    at = 0
    for (storage, (h0, h1)), n in zip(_regions(cache, pieces, layers), sizes):
        storage[rows, h0:h1, cols] = buf[at:at + n].view(cache.spec.dtype).view(len(rows), h1 - h0, -1)
        at += n


# ---- level 3 on top: a streamer for one pair of layouts ----------------------------------------
class KVStreamer:
    """Streams KV from the source layout to the destination layout of ``plan``.

    ``transport(peer)`` opens the transport to or from ``peer`` (this rank itself included;
    default: P2P on the background process group, a local copy for this rank); one per peer,
    kept open. ``stream_out``
    and ``stream_in`` must be called with the same spans (by key), layers and ``tag`` on both
    sides, in the same order.
    """

    def __init__(self, plan: StreamPlan, *, transport: Callable[[int], Transport] | None = None,
                 timeout: float = 60.0) -> None:
        self.plan, self.rank, self.timeout = plan, dist.get_rank(), timeout
        self.out_pieces, self.in_pieces = plan.sends(self.rank), plan.receives(self.rank)
        default = lambda peer: LocalTransport() if peer == self.rank else P2PTransport(peer)  # noqa: E731
        open_ = transport or default
        peers = set(self.out_pieces) | set(self.in_pieces) | {self.rank}
        self.transports = {peer: open_(peer) for peer in sorted(peers)}

    @torch.inference_mode(False)  # background threads write the buffers: no inference tensors
    def stream_out(self, cache: KVCache, spans: Sequence[Span], *, layers: Sequence[int] | None = None,
                   tag: object = 0) -> list[Job]:
        """Flush this rank's share of ``spans`` (``layers``: only those) to every destination."""
        return [self.transports[peer].flush(scatter(cache, pieces, spans, layers), self._key(tag, self.rank, peer, layers))
                for peer, pieces in _covering(self.out_pieces, layers).items()]

    @torch.inference_mode(False)
    def stream_in(self, cache: KVCache, spans: Sequence[Span], *, layers: Sequence[int] | None = None,
                  tag: object = 0) -> "StreamIn":
        """Fetch this rank's share of ``spans`` from every source; ``wait()`` unpacks it."""
        fetches = []
        for peer, pieces in _covering(self.in_pieces, layers).items():
            buf = torch.empty(sum(chunk_bytes(cache, pieces, spans, layers)), dtype=torch.uint8,
                              device=cache.k[0].device)
            job = self.transports[peer].fetch(self._key(tag, peer, self.rank, layers), buf)
            fetches.append((job, pieces, buf))
        return StreamIn(cache, spans, layers, fetches, self.timeout)

    @staticmethod
    def _key(tag, src: int, dst: int, layers) -> tuple:
        return ("kv", str(tag), src, dst, "all" if layers is None else ",".join(map(str, layers)))

    def close(self) -> None:
        for t in self.transports.values():
            t.close()


def _covering(by_peer: dict[int, list[Piece]], layers: Sequence[int] | None) -> dict[int, list[Piece]]:
    """The peers (and their pieces) holding any of ``layers``: both sides skip the others."""
    if layers is None:
        return by_peer
    out = {peer: [p for p in pieces if any(p.box[0][0] <= i < p.box[0][1] for i in layers)]
           for peer, pieces in by_peer.items()}
    return {peer: pieces for peer, pieces in out.items() if pieces}


class StreamIn:
    """Fetches in flight for one ``stream_in``; :meth:`wait` unpacks them into the cache."""

    def __init__(self, cache, spans, layers, fetches, timeout: float) -> None:
        self.cache, self.spans, self.layers, self.fetches, self.timeout = cache, spans, layers, fetches, timeout

    def done(self) -> bool:
        return all(job.done() for job, _, _ in self.fetches)

    def wait(self, timeout: float | None = None) -> int:
        """Block until every fetch arrived (``TimeoutError`` naming the job), unpack; returns bytes."""
        for job, pieces, buf in self.fetches:
            job.wait(self.timeout if timeout is None else timeout)
            gather(self.cache, pieces, self.spans, buf, self.layers)
        return sum(buf.numel() for _, _, buf in self.fetches)


class TokenStream:
    """Token streaming: the KV entries each engine step writes leave for another store while the
    next step runs (DejaVu section 4.2.1), as a runner's ``step_end`` hook.

    ``streamer`` maps the runner's KV layout to the destination's (a CPU or file mirror on the
    same ranks, or other ranks). ``send_cache`` / ``recv_cache``: this rank's source cache and
    destination cache (``None`` where it holds none). A prefill step streams each prompt, a
    decode step each sequence's one new position. Step ``n``'s jobs are waited for at step
    ``n + 1`` (or :meth:`drain`), so streaming overlaps one step of compute. A paged destination
    takes the source's block ids (a mirror of the same shape).
    """

    def __init__(self, streamer: KVStreamer, send_cache: KVCache | None, recv_cache: KVCache | None, *,
                 timeout: float = 60.0) -> None:
        self.streamer, self.send_cache, self.recv_cache, self.timeout = streamer, send_cache, recv_cache, timeout
        self.steps, self.bytes_out = 0, 0
        self._pending: list = []

    def step_end(self, phase: str, seqs: Sequence, *, whole: Collection[int] = ()) -> None:
        """Stream the step's new entries of ``seqs`` (the sequences this rank's layout ran);
        ``whole``: request ids whose every entry so far is streamed (KV that reached the cache
        outside a step, e.g. a swap-in)."""
        spans = [Span(s.request.id, s.slot, *_new_positions(phase, s, s.request.id in whole)) for s in seqs]
        if self.recv_cache is not None and self.recv_cache.spec.paged:
            for s in seqs:
                if phase == "prefill" or s.request.id in whole:
                    self.recv_cache.assign(s.slot, s.blocks)
        jobs = self.streamer.stream_out(self.send_cache, spans, tag=self.steps) if self.send_cache else []
        incoming = self.streamer.stream_in(self.recv_cache, spans, tag=self.steps) if self.recv_cache else None
        self.drain()
        self.bytes_out += sum(j.nbytes for j in jobs)
        self._pending, self.steps = [jobs, incoming], self.steps + 1

    def drain(self) -> None:
        """Wait for every job in flight (errors and timeouts reach the caller here)."""
        if not self._pending:
            return
        jobs, incoming = self._pending
        for job in jobs:
            job.wait(self.timeout)
        if incoming is not None:
            incoming.wait(self.timeout)
        self._pending = []


def _new_positions(phase: str, seq, whole: bool = False) -> tuple[int, int]:
    """Positions a step wrote for ``seq``: its prompt (prefill) or its last token (decode);
    ``whole``: every position up to the step's."""
    if phase == "prefill":
        return 0, seq.prompt_len
    return (0 if whole else seq.cached), seq.cached + 1
