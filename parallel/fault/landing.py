"""One source's KV mirror on a receiving rank (:class:`Landing`) and the unpacking of a message
into it (:func:`land`): what a group's :class:`reshard.parallel.fault.mirror.KVMirror` keeps of
each source group it mirrors, and what the supervisors' host
(:class:`reshard.parallel.fault.host.MirrorHost`) keeps of the lockstep group it replays."""

from __future__ import annotations

import dataclasses

import torch

from reshard.kv import KVCache
from reshard.kv.scatter import Packing
from reshard.kv.stream_plan import Span
from reshard.plan import Piece


class Landing:
    """One source endpoint's mirror on this rank: a contiguous cache of ``slots`` slots (and a
    scratch slot for what cannot be placed), each request's slot and landed length. A request
    takes a free slot when its KV first arrives (from position 0); with none free, the request
    written least recently gives up its own (a finished sequence is never written again)."""

    def __init__(self, spec, slots: int, device) -> None:
        spec = dataclasses.replace(spec, num_slots=slots + 1, block_size=None, num_blocks=None)
        self.cache = KVCache(spec, device=device)
        self.scratch = slots
        self.index: dict[int, list[int]] = {}  # request id -> [slot, positions landed]; oldest write first
        self.free = list(range(slots))
        self.closed = False  # its sender is gone: nothing more will land

    def place(self, spans: list[Span]) -> list[Span]:
        """``spans`` (the sender's slots) in this mirror's slots; a span that does not continue
        what landed (a request first seen mid-way) goes to the scratch slot."""
        out = []
        for sp in spans:
            entry = self.index.pop(sp.key, None)
            if sp.start == 0:
                entry = entry or [self._take(), 0]
            elif entry is None or entry[1] != sp.start:  # its whole resend places it
                if entry is not None:
                    self.index[sp.key] = entry
                out.append(Span(sp.key, self.scratch, sp.start, sp.stop))
                continue
            entry[1] = sp.stop
            self.index[sp.key] = entry  # now the most recently written
            out.append(Span(sp.key, entry[0], sp.start, sp.stop))
        return out

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        oldest = next(iter(self.index))
        return self.index.pop(oldest)[0]

    def release(self, key: int) -> None:
        if key in self.index:
            self.free.append(self.index.pop(key)[0])

    def landed(self, key: int) -> tuple[int, int]:
        """``(slot, positions landed)`` of request ``key`` (``(-1, 0)``: none)."""
        slot, landed = self.index.get(key, (-1, 0))
        return slot, landed


def land(landing: Landing, piece: Piece, spans: list[Span], data: torch.Tensor) -> None:
    """Unpack one message (``spans`` of its sender's slots, packed over ``piece``) into ``landing``."""
    packing = Packing.of(landing.cache, [piece], landing.place(spans))
    assert packing.nbytes == data.numel(), (packing.nbytes, data.numel())
    packing.unpack(data.to(landing.cache.device))
