"""DejaVu's KV streaming library, in three levels each usable on its own.

1. ``stream_out / stream_in`` decisions (:func:`reshard.kv.stream_plan.plan_stream`): from the source and destination KV
   layouts of every rank (layers x KV heads each holds: TP degree, pipeline depth, replicas),
   which ``(layer range x head range)`` goes from which source rank to which destination rank.
   A destination box is split over the source boxes it meets (merging at the destination) and a
   source box over the destinations that need it (splitting at the source); a region several
   ranks hold is sent by the least loaded one. Pure: the movement core's sender assignment.
2. ``scatter / gather`` (:mod:`reshard.kv.scatter`): the non-contiguous region of a peer
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

import functools
from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist

from reshard.kv.cache import KVCache
from reshard.kv.jobs import Job, JobQueue
from reshard.kv.scatter import Packing
from reshard.kv.stream_plan import Span, StreamPlan
from reshard.kv.transport import LocalTransport, P2PTransport, Transport
from reshard.plan import Piece


# ---- level 3 on top: a streamer for one pair of layouts ----------------------------------------
class KVStreamer:
    """Streams KV from the source layout to the destination layout of ``plan``.

    ``transport(peer)`` opens the transport to or from ``peer`` (this rank itself included;
    default: P2P on the background process group, a local copy for this rank); one per peer,
    kept open. ``stream_out``
    and ``stream_in`` must be called with the same spans (by key), layers and ``tag`` on both
    sides, in the same order.
    """

    def __init__(
        self,
        plan: StreamPlan,
        *,
        transport: Callable[[int], Transport] | None = None,
        timeout: float = 60.0,
        background: bool = False,
    ) -> None:
        self.plan = plan
        self.rank = dist.get_rank()
        self.timeout = timeout
        # background: pack and unpack on a thread of the streamer's too (token streaming, where the
        # caller leaves the streamed entries alone until it waits; a prompt's slot may be refilled)
        self._worker = JobQueue("stream") if background else None
        self.out_pieces, self.in_pieces = plan.sends(self.rank), plan.receives(self.rank)
        default = lambda peer: LocalTransport() if peer == self.rank else P2PTransport(peer)  # noqa: E731
        open_ = transport or default
        peers = set(self.out_pieces) | set(self.in_pieces) | {self.rank}
        self.transports = {peer: open_(peer) for peer in sorted(peers)}

    @torch.inference_mode(False)  # background threads write the buffers: no inference tensors
    def stream_out(
        self, cache: KVCache, spans: Sequence[Span], *, layers: Sequence[int] | None = None, tag: object = 0
    ) -> list[Job]:
        """Flush this rank's share of ``spans`` (``layers``: only those) to every destination."""
        jobs = []
        for peer, pieces in _covering(self.out_pieces, layers).items():
            packing, key = Packing.of(cache, pieces, spans, layers), self._key(tag, self.rank, peer, layers)
            if self._worker is None:
                jobs.append(self.transports[peer].flush(packing.pack(cache.k[0].device), key))
            else:
                flush = functools.partial(self._pack_flush, peer, packing, cache.k[0].device, key)
                jobs.append(self._worker.submit("flush", key, packing.nbytes, flush))
        return jobs

    def _pack_flush(self, peer: int, packing: Packing, device, key) -> None:
        self.transports[peer].flush(packing.pack(device), key).wait(self.timeout)

    @torch.inference_mode(False)
    def stream_in(
        self, cache: KVCache, spans: Sequence[Span], *, layers: Sequence[int] | None = None, tag: object = 0
    ) -> StreamIn:
        """Fetch this rank's share of ``spans`` from every source; ``wait()`` unpacks it (in the
        background mode, the streamer's thread unpacks it as it arrives)."""
        fetches = []
        for peer, pieces in _covering(self.in_pieces, layers).items():
            packing = Packing.of(cache, pieces, spans, layers)
            buf = torch.empty(packing.nbytes, dtype=torch.uint8, device=cache.k[0].device)
            job = self.transports[peer].fetch(self._key(tag, peer, self.rank, layers), buf)
            fetches.append((job, packing, buf))
        incoming = StreamIn(fetches, self.timeout)
        if self._worker is not None and fetches:
            incoming.unpacked = self._worker.submit(
                "fetch", ("kv", str(tag), "unpack"), incoming.nbytes, incoming.unpack
            )
        return incoming

    @staticmethod
    def _key(tag, src: int, dst: int, layers) -> tuple:
        return ("kv", str(tag), src, dst, "all" if layers is None else ",".join(map(str, layers)))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close(self.timeout)
        for t in self.transports.values():
            t.close()


def _covering(by_peer: dict[int, list[Piece]], layers: Sequence[int] | None) -> dict[int, list[Piece]]:
    """The peers (and their pieces) holding any of ``layers``: both sides skip the others."""
    if layers is None:
        return by_peer
    out = {
        peer: [p for p in pieces if any(p.box[0][0] <= i < p.box[0][1] for i in layers)]
        for peer, pieces in by_peer.items()
    }
    return {peer: pieces for peer, pieces in out.items() if pieces}


class StreamIn:
    """Fetches in flight for one ``stream_in``; :meth:`wait` unpacks them into the cache (or waits
    for the streamer's thread to have done so: ``unpacked``)."""

    def __init__(self, fetches, timeout: float) -> None:
        self.fetches = fetches
        self.timeout = timeout
        self.unpacked = None

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() for _, _, buf in self.fetches)

    def done(self) -> bool:
        if self.unpacked is not None:
            return self.unpacked.done()
        return all(job.done() for job, _, _ in self.fetches)

    def unpack(self, timeout: float | None = None) -> None:
        for job, packing, buf in self.fetches:
            job.wait(self.timeout if timeout is None else timeout)
            packing.unpack(buf)

    def wait(self, timeout: float | None = None) -> int:
        """Block until every fetch arrived (``TimeoutError`` naming the job), unpack; returns bytes."""
        if self.unpacked is not None:
            self.unpacked.wait(self.timeout if timeout is None else timeout)
        else:
            self.unpack(timeout)
        return self.nbytes


class Batch:
    """The entries one direction of a :class:`TokenStream` gathered since its last message: per
    request its slot and the merged position range of the steps it wrote (a prompt joins whole).

    A sequence that retired is dropped (its slot may already hold another sequence): at a decode
    step, the ones not decoding (a decode step runs every live sequence of a replica); at any step,
    one whose slot a sequence entering the cache takes (a prompt, or a whole sequence swapped in).
    """

    def __init__(self) -> None:
        self.spans: dict[int, Span] = {}  # request id -> slot and merged positions, in arrival order

    def retire(self, phase: str, spans: Sequence[Span]) -> None:
        """Drop the sequences that ``spans`` (a step's) show to be gone."""
        keys, taken = {sp.key for sp in spans}, {sp.slot: sp.key for sp in spans if sp.start == 0}
        self.spans = {
            key: sp
            for key, sp in self.spans.items()
            if (phase != "decode" or key in keys) and taken.get(sp.slot, key) == key
        }

    def merge(self, spans: Sequence[Span]) -> None:
        for sp in spans:
            old = self.spans.get(sp.key)
            assert old is None or old.slot == sp.slot, f"request {sp.key} moved from slot {old.slot} to {sp.slot}"
            self.spans[sp.key] = (
                sp if old is None else Span(sp.key, sp.slot, min(old.start, sp.start), max(old.stop, sp.stop))
            )


class _Direction:
    """One direction of a :class:`TokenStream` (out of ``send_cache`` or into ``recv_cache``):
    its :class:`Batch`, its message count (the tag both ends name a message by) and the message
    in flight. ``landed``: steps whose entries are all through (flushed out, or unpacked here)."""

    def __init__(self, streamer: KVStreamer, cache: KVCache, *, out: bool, timeout: float) -> None:
        self.streamer, self.cache, self.out, self.timeout = streamer, cache, out, timeout
        self.batch = Batch()
        self.messages, self.landed, self.bytes = 0, 0, 0
        self.acked: dict[int, int] = {}  # request id -> last step (0-based) of its entries that is through
        self._flight: list[tuple[object, int, list[int]]] = []  # (jobs or StreamIn, steps covered, request ids)

    def retire(self, phase: str, spans: Sequence[Span], *, before: int) -> bool:
        """Wait for the message in flight, drop the sequences ``spans`` (a step's) show gone; if
        one enters a slot, send what earlier steps gathered (``before``: steps taken), returning
        True: the caller waits for it (after every direction sent, or two ranks wait on each
        other), so a slot's next occupant never lands before its previous occupant's last step."""
        self.wait()
        self.batch.retire(phase, spans)
        if self.batch.spans and any(sp.start == 0 for sp in spans):
            self.send(before)
            return True
        return False

    def add(self, spans: Sequence[Span], *, steps: int, send: bool) -> None:
        """Add a step's ``spans``; ``send``: the batch (entries of ``steps`` steps) leaves."""
        self.batch.merge(spans)
        if send:
            self.send(steps)

    def send(self, steps: int) -> None:
        """The batch (the entries of steps up to ``steps``) leaves in one message; none if empty."""
        spans, self.batch.spans = list(self.batch.spans.values()), {}
        if not spans:  # nothing to send: the steps are through once what is in flight is
            self._flight.append((None, steps, []))
            return
        tag = self.messages
        if self.out:
            handle = self.streamer.stream_out(self.cache, spans, tag=tag)
            self.bytes += sum(j.nbytes for j in handle)
        else:
            handle = self.streamer.stream_in(self.cache, spans, tag=tag)
        self.messages += 1
        self._flight.append((handle, steps, [sp.key for sp in spans]))

    def wait(self) -> None:
        """Wait for the messages in flight (errors and timeouts reach the caller here)."""
        for handle, steps, keys in self._flight:
            for job in [] if handle is None else handle if self.out else [handle]:
                job.wait(self.timeout)
            self.landed = steps
            self.acked.update(dict.fromkeys(keys, steps - 1))
        self._flight = []


class TokenStream:
    """Token streaming: the KV entries each engine step writes leave for another store while the
    next step runs (DejaVu section 4.2.1), as a ``step_end`` listener of the engine's events.

    ``streamer`` maps the runner's KV layout to the destination's (a CPU or file mirror on the
    same ranks, or other ranks). ``send_cache`` / ``recv_cache``: this rank's source cache and
    destination cache (``None`` where it holds none). A prefill step writes each prompt, a
    decode step each sequence's one new position; ``every`` steps' entries (all sequences') leave
    in one message per peer, at every ``every``-th step and at :meth:`drain`. A message is waited
    for at the next step (or :meth:`drain`), so streaming overlaps a step of compute; ``landed``
    counts the steps whose entries are all through. A paged destination takes the source's block
    ids (a mirror of the same shape).
    """

    def __init__(
        self,
        streamer: KVStreamer,
        send_cache: KVCache | None,
        recv_cache: KVCache | None,
        *,
        timeout: float = 60.0,
        every: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError(f"replicate_every must be >= 1 (steps per message), got {every}")
        self.streamer = streamer
        self.send_cache = send_cache
        self.recv_cache = recv_cache
        self.timeout, self.every = timeout, every
        self.steps = 0
        self.directions = [
            _Direction(streamer, cache, out=out, timeout=timeout)
            for cache, out in ((send_cache, True), (recv_cache, False))
            if cache is not None
        ]

    @property
    def bytes_out(self) -> int:
        return sum(d.bytes for d in self.directions if d.out)

    @property
    def landed(self) -> int:
        """Steps whose entries are all through, both ways this rank streams."""
        return min((d.landed for d in self.directions), default=self.steps)

    @property
    def acked(self) -> dict[int, int]:
        """Request id -> last step whose entries are unpacked here (the receiving direction)."""
        return next((d.acked for d in self.directions if not d.out), {})

    def step_end(
        self, phase: str, seqs: Sequence, *, whole: Collection[int] = (), incoming: Sequence | None = None
    ) -> None:
        """Gather the step's new entries of ``seqs`` (the sequences this rank's layout ran) and
        send the batch every ``every``-th step; ``whole``: request ids whose every entry so far is
        streamed (KV that reached the cache outside a step, e.g. a swap-in); ``incoming``: the
        sequences whose entries arrive here, where they are not ``seqs`` (another data-parallel
        replica's)."""
        if phase not in ("prefill", "decode"):
            raise ValueError(
                f"TokenStream streams whole-prompt and decode steps, got a {phase!r} step "
                "(run the engine with chunked_prefill=False)"
            )
        incoming = seqs if incoming is None else incoming
        if self.recv_cache is not None and self.recv_cache.spec.paged:
            for s in incoming:
                if phase == "prefill" or s.request.id in whole:
                    self.recv_cache.assign(s.slot, s.blocks)
        send = (self.steps + 1) % self.every == 0
        spans = {
            d: [
                Span(s.request.id, s.slot, *_new_positions(phase, s, s.request.id in whole))
                for s in (seqs if d.out else incoming)
            ]
            for d in self.directions
        }
        for d in [d for d in self.directions if d.retire(phase, spans[d], before=self.steps)]:
            d.wait()
        for d in self.directions:
            d.add(spans[d], steps=self.steps + 1, send=send)
        self.steps += 1

    def drain(self) -> None:
        """Send what is gathered and wait for every message in flight."""
        for d in self.directions:
            d.send(self.steps)
        for d in self.directions:
            d.wait()


def _new_positions(phase: str, seq, whole: bool = False) -> tuple[int, int]:
    """Positions a step wrote for ``seq``: its prompt (prefill) or its last token (decode);
    ``whole``: every position up to the step's."""
    if phase == "prefill":
        return 0, seq.prompt_len
    return (0 if whole else seq.num_computed_tokens), seq.num_computed_tokens + 1
