"""Parallel linear layers: a drop-in ``nn.Linear`` whose weight is a DTensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from reshard import Layout, empty_dtensor, redistribute, wrap_local
from reshard.layers._base import Redistributable, Targets, local_tensor
from reshard.layers._comm import all_gather_last, reduce_output, replicated_input
from reshard.layers.weights import LinearWeights, StaticWeights, WeightSource, active_source


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

    Training: a colwise layer sums its input's gradient over the sharded mesh axes
    (``input_grad="sharded"``), or over every axis (``"all"``) when replicas of its output are
    consumed differently, e.g. a K/V projection replicated over ranks with different query heads.

    ``sources`` holds alternative weights by source name (:mod:`layers.weights`); while a runner
    selects one of them with ``use_weights(name)``, the forward computes with it instead.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh: DeviceMesh,
        placements: Sequence[Placement] = (Replicate(),),
        gather_output: bool = False,
        input_grad: str = "sharded",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(f"mesh has {mesh.ndim} axes but {len(placements)} placements were given")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.input_grad = _check_input_grad(input_grad)
        self.weight = nn.Parameter(
            empty_dtensor((out_features, in_features), mesh, placements, dtype=dtype, device=device)
        )
        self.sources: dict[str, WeightSource] = {}
        self._plan_of = None  # (placements, mesh, plan) of the weight last computed with (see _plan)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                empty_dtensor((out_features,), mesh, _bias_placements(placements), dtype=dtype, device=device)
            )

    @property
    def mesh(self) -> DeviceMesh:
        return self.weight.device_mesh

    @property
    def style(self) -> str:
        """``colwise`` | ``rowwise`` | ``replicated``, read off the weight's placements."""
        return _style(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One 2-D GEMM either way: ATen flattens a contiguous (1, N, D) input itself (no reshape and
        # view per call), any other is flattened here (its batched matmul is far slower on CPU).
        shape = None if x.is_contiguous() else x.shape
        if shape is not None:
            x = x.reshape(-1, shape[-1])
        weight, bias, grad_axes = self.active_weights()
        w, b = local_tensor(weight), local_tensor(bias) if bias is not None else None
        style, axes, reduced = self._plan(weight)
        if style == "rowwise":
            y = F.linear(x, w)
            for axis in reduced:  # (a size-1 axis sums nothing)
                y = reduce_output(y, weight.device_mesh, axis)
            y = y if b is None else y + b
        else:
            if torch.is_grad_enabled():  # (the marks only route the backward's gradients)
                for axis in axes if grad_axes == "sharded" else range(weight.device_mesh.ndim):
                    x = replicated_input(x, weight.device_mesh, axis)
            y = F.linear(x, w, b)
            if reduced and self.gather_output:  # (a size-1 axis gathers nothing)
                y = all_gather_last(y, weight.device_mesh, self.out_features, _shard_axis(weight))
        return y if shape is None else y.view(*shape[:-1], y.shape[-1])

    def _plan(self, weight: DTensor) -> tuple[str, list[int], list[int]]:
        """``weight``'s style, its sharded mesh axes and those of them of more than one rank (a
        rowwise output is summed over them, a gathered colwise one gathered), kept while its
        placements and mesh stay the same objects (held: never freed and their ids taken over)."""
        placements, mesh, held = weight.placements, weight.device_mesh, self._plan_of
        if held is not None and held[0] is placements and held[1] is mesh:
            return held[2]
        axes = _shard_axes(weight)
        plan = (_style(weight), axes, [a for a in axes if mesh.size(a) > 1])
        if not torch.compiler.is_compiling():  # (a compiled graph guards on what it read instead)
            self._plan_of = (placements, mesh, plan)
        return plan

    # ---- alternative weights (Shift parallelism's full-TP layout, ...) ------------------------
    def add_source(
        self, name: str, mesh: DeviceMesh, placements: Sequence[Placement], *, copy: bool, input_grad: str = "sharded"
    ) -> int:
        """Hold the weight also in ``placements`` on ``mesh``, used while source ``name`` is selected.

        ``copy=True`` stores separate shards (moved through the movement core); ``copy=False``
        takes views of this rank's base shard, which must contain the new box. Returns the extra
        bytes this rank now holds. ``input_grad``: see the constructor.
        """
        weights = [self.weight] + ([self.bias] if self.bias is not None else [])
        pls = [tuple(placements), _bias_placements(placements)]
        alt = [_alternate(t.data, mesh, pl, copy) for t, pl in zip(weights, pls)]
        extra = sum(a.to_local().numel() * a.to_local().element_size() for a in alt) if copy else 0
        chosen = LinearWeights(alt[0], alt[1] if len(alt) > 1 else None, _check_input_grad(input_grad))
        self.sources[name] = StaticWeights(chosen, extra)
        return extra

    def active_weights(self) -> tuple[DTensor, DTensor | None, str]:
        """(weight, bias, input_grad) of the selected source (this layer's parameters by default)."""
        source = self.sources.get(active_source()) if self.sources else None
        if source is None:
            return self.weight, self.bias, self.input_grad
        w = source.get()
        return w.weight, w.bias, w.input_grad

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """The weight takes ``placements``; the bias follows the weight's output dim."""
        targets = {"weight": (mesh, placements)}
        if self.bias is not None:
            targets["bias"] = (mesh, _bias_placements(placements))
        return targets

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, style={self.style}, "
            f"placements={tuple(self.weight.placements)}"
        )


def _style(weight: DTensor) -> str:
    dims = {p.dim for p in weight.placements if isinstance(p, Shard)}
    return "colwise" if dims == {0} else "rowwise" if dims == {1} else "replicated"


def _alternate(t: DTensor, mesh: DeviceMesh, placements, copy: bool) -> DTensor:
    """``t`` in another layout: moved by the movement core, or a view of this rank's shard."""
    moved = redistribute(t, mesh, placements) if copy else None  # collective: every rank calls it
    if mesh.get_coordinate() is None:  # a rank outside the layout (e.g. a trainer beside rollout ranks)
        return wrap_local(t.to_local().new_empty(0), mesh, placements, t.shape)
    if copy:
        return moved
    rank = dist.get_rank()
    base, box = Layout.of_dtensor(t).box(rank), Layout.of(mesh, placements, t.shape, t.dtype).box(rank)
    if any(lo < b0 or hi > b1 for (lo, hi), (b0, b1) in zip(box, base)):
        raise ValueError(f"slice layout needs box {box} inside this rank's base box {base}; use copy=True")
    view = t.to_local()[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(box, base))]
    return wrap_local(view, mesh, placements, t.shape)


def _check_input_grad(value: str) -> str:
    if value not in ("sharded", "all"):
        raise ValueError(f"input_grad must be 'sharded' or 'all', got {value!r}")
    return value


def _shard_axes(t: DTensor) -> list[int]:
    return [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]


def _shard_axis(t: DTensor) -> int:
    axes = _shard_axes(t)
    if len(axes) != 1:
        raise ValueError(f"gathering the output needs one sharded mesh axis, got {t.placements}")
    return axes[0]
