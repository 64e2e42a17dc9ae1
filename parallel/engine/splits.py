"""How a runner's layout splits a step: over pipeline stages (:class:`StageLink`, hidden states
by P2P between neighbouring stages), over the ranks of a Ulysses axis (:class:`TokenSplit`, the
step's tokens) and over micro-batches (:func:`split_ranges`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from reshard.layers._comm import all_gather


class StageLink:
    """Pipeline P2P: stage ``s`` receives ``(1, N, D)`` hidden states from stage ``s - 1`` and sends
    its output to stage ``s + 1`` without waiting (peers: this rank's group, one rank per stage)."""

    def __init__(
        self, stage: int, peers: list[int], hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.stage, self.peers = stage, peers
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.peers) - 1

    def recv(self, num_tokens: int) -> torch.Tensor:
        h = torch.empty(1, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(h, self.peers[self.stage - 1])
        return h

    def send(self, h: torch.Tensor) -> dist.Work:
        return dist.isend(h.contiguous(), self.peers[self.stage + 1])


class TokenSplit:
    """Ulysses sequence parallelism: a step's ``N`` tokens split over ``axis`` of ``mesh``
    (padded to a multiple of its size); hidden states gathered back before the head."""

    def __init__(self, mesh: DeviceMesh, axis: int = 0) -> None:
        self.mesh, self.axis = mesh, axis
        self.size, self.rank = mesh.size(axis), mesh.get_coordinate()[axis]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the ``(N, ...)`` tokens: ``(ceil(N / size), ...)``."""
        n = x.shape[0]
        per = -(-n // self.size)
        x = F.pad(x, (0,) * (2 * (x.dim() - 1)) + (0, per * self.size - n))
        return x[self.rank * per : (self.rank + 1) * per]

    def gather(self, h: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``(1, N / size, D)`` shares -> ``(1, N, D)``: every rank's tokens."""
        return all_gather(h[0], self.mesh, self.axis)[:num_tokens][None]


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items into at most ``parts`` contiguous, near-equal, non-empty ranges."""
    parts = max(min(parts, n), 1)
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
