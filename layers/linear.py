"""Parallel linear layers: a drop-in ``nn.Linear`` whose weight is a DTensor."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from reshard import empty_dtensor

from ._base import Redistributable, Targets
from ._comm import all_gather_last, all_reduce


def _bias_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """A bias follows the weight's output dim (Shard(0)); a rowwise weight's bias is replicated."""
    return tuple(p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements)


class ParallelLinear(Redistributable, nn.Module):
    """``y = x W^T + b`` with ``W`` a DTensor ``(out_features, in_features)`` on ``mesh``.

    The weight's placements decide the forward's communication:

    - ``Shard(0)`` (colwise): input replicated; returns Shard(-1) on the mesh (this rank's output
      features), or the full output with ``gather_output=True``.
    - ``Shard(1)`` (rowwise): input Shard(-1); returns the output all-reduced over the sharded axes.
    - ``Replicate()``: input and output replicated; no communication.

    State-dict keys (``weight``, ``bias``) and shapes are those of ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 mesh: DeviceMesh, placements: Sequence[Placement] = (Replicate(),),
                 gather_output: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(f"mesh has {mesh.ndim} axes but {len(placements)} placements were given")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.weight = nn.Parameter(empty_dtensor((out_features, in_features), mesh, placements,
                                                 dtype=dtype, device=device))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(empty_dtensor((out_features,), mesh, _bias_placements(placements),
                                                   dtype=dtype, device=device))

    @property
    def mesh(self) -> DeviceMesh:
        return self.weight.device_mesh

    @property
    def style(self) -> str:
        """``colwise`` | ``rowwise`` | ``replicated``, read off the weight's placements."""
        dims = {p.dim for p in self.weight.placements if isinstance(p, Shard)}
        return "colwise" if dims == {0} else "rowwise" if dims == {1} else "replicated"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # 2-D GEMM: CPU kernels are far slower on (1, N, D) inputs
        w = self.weight.to_local()
        b = self.bias.to_local() if self.bias is not None else None
        style = self.style
        if style == "rowwise":
            y = F.linear(x, w)
            for axis in _shard_axes(self.weight):
                y = all_reduce(y, self.mesh, axis)
            y = y if b is None else y + b
        else:
            y = F.linear(x, w, b)
            if style == "colwise" and self.gather_output:
                y = all_gather_last(y, self.mesh, self.out_features, _shard_axis(self.weight))
        return y.view(*lead, y.shape[-1])

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """The weight takes ``placements``; the bias follows the weight's output dim."""
        targets = {"weight": (mesh, placements)}
        if self.bias is not None:
            targets["bias"] = (mesh, _bias_placements(placements))
        return targets

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, style={self.style}, "
                f"placements={tuple(self.weight.placements)}")


def _shard_axes(t: DTensor) -> list[int]:
    return [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]


def _shard_axis(t: DTensor) -> int:
    axes = _shard_axes(t)
    if len(axes) != 1:
        raise ValueError(f"gathering the output needs one sharded mesh axis, got {t.placements}")
    return axes[0]
