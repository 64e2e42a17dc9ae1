"""Weights for a respawned engine group from a live replica instead of the checkpoint.

Under ``fault.migrate`` the ``tp`` strategy's engine groups are replicas of one layout, so rank
``i`` of a live group holds exactly the local shards rank ``i`` of a respawned group needs. Every
live child runs a :class:`WeightDonor`: a thread that waits for requests under its endpoint
(``weights/want/<endpoint>/<position>``) and answers each over a two-rank link of its own
(:class:`reshard.parallel.fault.mirror.Link`), one message per parameter: its name, local shape,
dtype and whether it is the last, then its bytes. The respawned child builds its model without
reading the checkpoint (``EngineConfig.load_weights=False``), asks a live group's rank of its own position
(:func:`take_weights`) and copies each message into its local shard after checking name, shape
and dtype. A donor that dies or finishes before the last message, or a transfer that stalls,
leaves the taker to read the checkpoint, as a respawn without a live replica does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from reshard.background import Background
from reshard.parallel.engine.channel import Channel
from reshard.parallel.fault.link import Link, Links

WATCH_S = 0.1  # how often a donor looks for requests (and a taker at its transfer)
STALL_S = 60.0  # a taker that received nothing for this long reads the checkpoint instead
CLOSE_S = 1.0  # longest close() waits for transfers under way


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters' local shards in name order (what a replica's rank of one position holds)."""
    return sorted((name, _local(p.data)) for name, p in model.named_parameters())


class WeightDonor:
    """Answers requests for this rank's local weights (``model``'s parameters) addressed to
    ``endpoint`` at ``position`` in its group, on a thread of its own, until :meth:`close` (or
    the end of a ``with`` block). ``connect()``: a new client of the job's store (one per thread).
    It owns its thread, its links to takers and their threads."""

    def __init__(self, model: nn.Module, connect: Callable[[], dist.Store], endpoint: str, position: int) -> None:
        self.model, self.connect, self.key = model, connect, f"weights/want/{endpoint}/{position}"
        self.name = f"weights/{endpoint}/{position}"
        self.links = Links(lambda: Channel("weights", store=connect()).store, "reshard-weight-donor")
        self.links.watch(self._serve)

    def _serve(self) -> None:
        """Each request gets a link, a thread and a store client of its own: a transfer to a
        taker that died blocks only its own thread. Finished transfers' links are closed."""
        channel = Channel("weights", store=self.connect())
        seen = 0
        while not self.links.stopping.wait(WATCH_S):
            for taker in channel.read_list(self.key, seen):
                seen += 1
                self.links.open(f"{self.name}/{taker}", 0, self._send)

    def _send(self, link: Link) -> None:
        try:
            params = _params(self.model)
            for i, (name, local) in enumerate(params):
                meta = (name, tuple(local.shape), str(local.dtype), i == len(params) - 1)  # (.., the last one)
                link.send(meta, local.detach().contiguous().view(torch.uint8))
        finally:
            link.close()

    def close(self, timeout: float = CLOSE_S) -> None:
        """Stop answering (not collective): the thread and the transfers' threads are joined, up
        to ``timeout`` s in all (a transfer under way finishes first only within it; one blocked
        on a taker that died is left, a daemon, holding its link's group)."""
        self.links.close(timeout)

    def __enter__(self) -> WeightDonor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def take_weights(
    model: nn.Module,
    connect: Callable[[], dist.Store],
    donor: str,
    endpoint: str,
    position: int,
    gone: Callable[[], bool],
) -> bool:
    """Fill ``model``'s local shards from rank ``position`` of the live group ``donor`` (an
    endpoint) for this group's ``endpoint``; whether they all arrived before ``gone()`` (the donor
    died or finished) and without a stall of ``STALL_S`` (else the caller loads the checkpoint
    instead, and the transfer is abandoned on its blocked thread). ``AssertionError`` if the
    donor's tensors are not this model's."""
    channel = Channel("weights", store=connect())
    channel.append(f"weights/want/{donor}/{position}", endpoint)
    link = Link(Channel("weights", store=connect()).store, f"weights/{donor}/{position}/{endpoint}", 1)
    mine = dict(_params(model))
    done, failed = threading.Event(), []

    def receive() -> None:  # the link connects here, on its own thread (a dead donor blocks only it)
        try:
            last = False
            while not last:
                (name, shape, dtype, last), data = link.recv()
                local = mine.pop(name)
                assert (shape, dtype) == (tuple(local.shape), str(local.dtype)), (name, shape, dtype, local.shape)
                local.copy_(data.view(local.dtype).view(shape))
            assert not mine, f"the donor {donor} sent no {sorted(mine)[:4]}"
        except AssertionError as e:  # another layout's tensors: a bug, raised in the caller's thread
            failed.append(e)
        except Exception:  # the link broke (the donor died mid-way): the caller reads the checkpoint
            broken.set()
        finally:
            link.close()
        done.set()

    broken = threading.Event()
    taker = Background(receive, "reshard-weight-taker", f"taking weights from {donor}")
    last, since = len(mine), time.monotonic()
    while not done.wait(WATCH_S):
        if len(mine) != last:  # a tensor arrived
            last, since = len(mine), time.monotonic()
        if gone() or time.monotonic() - since > STALL_S:  # the thread, blocked, is left with its link
            link.close()
            return False
    taker.result()
    if failed:
        raise failed[0]
    return not broken.is_set()


__all__ = ["WeightDonor", "take_weights"]
