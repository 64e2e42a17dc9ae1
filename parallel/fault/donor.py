"""Weights for a respawned engine group from a live replica instead of the checkpoint.

Under ``fault.migrate`` the ``tp`` strategy's engine groups are replicas of one layout, so rank
``i`` of a live group holds exactly the local shards rank ``i`` of a respawned group needs. Every
live child runs a :class:`WeightDonor`: a thread that waits for requests under its endpoint
(``weights/want/<endpoint>/<position>``) and answers each over a two-rank link of its own
(:class:`reshard.parallel.fault.mirror.Link`), one message per parameter: its name and local
shape and dtype, then its bytes. The respawned child builds its model without reading the
checkpoint (``EngineArgs.load_weights=False``), asks a live group's rank of its own position
(:func:`take_weights`) and copies each message into its local shard after checking name, shape
and dtype. A donor that dies or finishes before the last message leaves the taker to read the
checkpoint, as a respawn without a live replica does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from reshard.parallel.engine.router import Channel
from reshard.parallel.fault.mirror import Link

WATCH_S = 0.1  # how often a donor looks for requests
DONE = "done"  # the last message's name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters' local shards in name order (what a replica's rank of one position holds)."""
    return sorted((name, _local(p.data)) for name, p in model.named_parameters())


class WeightDonor:
    """Answers requests for this rank's local weights (``model``'s parameters) addressed to
    ``endpoint`` at ``position`` in its group, on a thread of its own, until :meth:`close`.
    ``connect()``: a new client of the job's store (one per thread)."""

    def __init__(self, model: nn.Module, connect: Callable[[], dist.Store], endpoint: str, position: int) -> None:
        self.model, self.connect, self.key = model, connect, f"weights/want/{endpoint}/{position}"
        self.name = f"weights/{endpoint}/{position}"
        self.sent: list[str] = []  # the endpoints served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reshard-weight-donor", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        channel = Channel("weights", store=self.connect())
        seen = 0
        while not self._stop.wait(WATCH_S):
            for taker in channel.read_list(self.key, seen):
                seen += 1
                self._send(Link(channel.store, f"{self.name}/{taker}", 0))
                self.sent.append(taker)

    def _send(self, link: Link) -> None:
        for name, local in _params(self.model):
            link.send((name, tuple(local.shape), str(local.dtype)), local.detach().contiguous().view(torch.uint8))
        link.send((DONE, (), ""), torch.empty(0, dtype=torch.uint8))

    def close(self) -> None:
        """Stop answering (a transfer under way finishes first only if the process lives on)."""
        self._stop.set()


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
    died or finished: the caller loads the checkpoint instead, and the transfer is abandoned on
    its blocked thread). ``AssertionError`` if the donor's tensors are not this model's."""
    channel = Channel("weights", store=connect())
    channel.append(f"weights/want/{donor}/{position}", endpoint)
    link = Link(Channel("weights", store=connect()).store, f"weights/{donor}/{position}/{endpoint}", 1)
    mine = dict(_params(model))
    done, failed = threading.Event(), []

    def receive() -> None:
        try:
            while True:
                (name, shape, dtype), data = link.recv()
                if name == DONE:
                    break
                local = mine.pop(name)
                assert (shape, dtype) == (tuple(local.shape), str(local.dtype)), (name, shape, dtype, local.shape)
                local.copy_(data.view(local.dtype).view(shape))
            assert not mine, f"the donor {donor} sent no {sorted(mine)[:4]}"
        except BaseException as e:
            failed.append(e)
        done.set()

    threading.Thread(target=receive, name="reshard-weight-taker", daemon=True).start()
    while not done.wait(WATCH_S):
        if gone():
            return False
    if failed:
        raise failed[0]
    return True


__all__ = ["WeightDonor", "take_weights"]
