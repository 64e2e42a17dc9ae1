"""Vocab-parallel token embedding (drop-in ``nn.Embedding``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from reshard import Layout, empty_dtensor
from reshard.layers._base import Redistributable, Targets
from reshard.layers._comm import all_reduce


class VocabParallelEmbedding(Redistributable, nn.Module):
    """Embedding table ``(num_embeddings, embedding_dim)`` as a DTensor on ``mesh``.

    With ``Shard(0)`` each rank holds a vocab range (DTensor chunk rule), looks up the ids in its
    range, zeros the others and all-reduces over the sharded axes; with ``Replicate()`` it is a plain
    lookup.
    Input ids are replicated; returns replicated ``(*ids.shape, embedding_dim)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        mesh: DeviceMesh,
        placements: Sequence[Placement] = (Shard(0),),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(
            empty_dtensor((num_embeddings, embedding_dim), mesh, tuple(placements), dtype=dtype, device=device)
        )

    def _vocab_range(self) -> tuple[int, int]:
        """This rank's rows, cached per layout: the weight's mesh, placements and shape (never its
        ``id``, which a weight moved in later can take over from a freed one)."""
        w = self.weight
        key = (w.device_mesh, tuple(w.placements), tuple(w.shape))
        if getattr(self, "_range_key", None) != key:
            self._range = Layout.of_dtensor(w).box(dist.get_rank())[0]
            self._range_key = key
        return self._range

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight.to_local()
        axes = [i for i, p in enumerate(self.weight.placements) if isinstance(p, Shard)]
        if not axes:
            return F.embedding(input_ids, w)
        lo, hi = self._vocab_range()
        inside = (input_ids >= lo) & (input_ids < hi)
        local_ids = torch.where(inside, input_ids - lo, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, w) * inside.unsqueeze(-1).to(w.dtype)
        for axis in axes:
            out = all_reduce(out, self.weight.device_mesh, axis)
        return out

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """The table takes ``placements`` (``Shard(0)`` or ``Replicate()``)."""
        return {"weight": (mesh, placements)}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, placements={tuple(self.weight.placements)}"
