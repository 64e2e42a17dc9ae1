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
from reshard.layers._base import Redistributable, Targets, local_tensor
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
        self._lookup_of = None  # (mesh, placements, shape, lookup) of the table last looked up in
        self.weight = nn.Parameter(
            empty_dtensor((num_embeddings, embedding_dim), mesh, tuple(placements), dtype=dtype, device=device)
        )

    def _lookup(self) -> tuple[int, int, list[int]]:
        """This rank's rows ``[lo, hi)`` and the mesh axes a lookup is summed over (sharded, more
        than one rank), cached per layout: the weight's mesh, placements and shape, held (never
        its ``id``, which a weight moved in later can take over from a freed one)."""
        w, held = self.weight, self._lookup_of
        mesh, placements, shape = w.device_mesh, w.placements, w.shape
        if held is not None and held[0] is mesh and held[1] is placements and held[2] == shape:
            return held[3]
        axes = [i for i, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(i) > 1]
        lo, hi = Layout.of_dtensor(w).box(dist.get_rank())[0] if axes else (0, self.num_embeddings)
        if not torch.compiler.is_compiling():  # (a compiled graph guards on what it read instead)
            self._lookup_of = (mesh, placements, shape, (lo, hi, axes))
        return lo, hi, axes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = local_tensor(self.weight)
        lo, hi, axes = self._lookup()
        if not axes:  # this rank holds the whole table
            return F.embedding(input_ids, w)
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
