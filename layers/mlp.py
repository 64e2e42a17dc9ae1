"""SwiGLU feed-forward block (drop-in for HF ``LlamaMLP`` / ``Qwen2MLP`` / ``MistralMLP``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from reshard.layers._base import Redistributable, Targets, activation, prefixed
from reshard.layers.linear import ParallelLinear


class SwiGLUMLP(Redistributable, nn.Module):
    """``down(act(gate(x)) * up(x))``.

    ``placements=(Shard(0),)`` is the TP layout: gate/up colwise, down rowwise (one all-reduce).
    ``(Replicate(),)`` keeps every weight whole; on an n-D mesh give one of the two per axis.
    Input and output are replicated over the sharded axes.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        mesh: DeviceMesh,
        hidden_act: str = "silu",
        bias: bool = False,
        placements: Sequence[Placement] = (Shard(0),),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        up, down = _ffn_placements(tuple(placements))
        kw = dict(mesh=mesh, dtype=dtype, device=device)
        self.gate_proj = ParallelLinear(hidden_size, intermediate_size, bias, placements=up, **kw)
        self.up_proj = ParallelLinear(hidden_size, intermediate_size, bias, placements=up, **kw)
        self.down_proj = ParallelLinear(intermediate_size, hidden_size, bias, placements=down, **kw)
        self.act_fn = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj, self.up_proj, self.down_proj, self.act_fn)

    def add_source(self, name: str, mesh: DeviceMesh, placements: Sequence[Placement], *, copy: bool) -> int:
        """The FFN's weights also in the layout of ``placements`` on ``mesh``, used while source
        ``name`` is selected (:mod:`layers.weights`); returns the extra bytes on this rank."""
        up, down = _ffn_placements(tuple(placements))
        return (
            self.gate_proj.add_source(name, mesh, up, copy=copy)
            + self.up_proj.add_source(name, mesh, up, copy=copy)
            + self.down_proj.add_source(name, mesh, down, copy=copy)
        )

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """``(Shard(0),)``: TP (gate/up colwise, down rowwise); ``(Replicate(),)``: whole weights."""
        up, down = _ffn_placements(placements)
        return {
            **prefixed("gate_proj", self.gate_proj.redistribute_targets(mesh, up)),
            **prefixed("up_proj", self.up_proj.redistribute_targets(mesh, up)),
            **prefixed("down_proj", self.down_proj.redistribute_targets(mesh, down)),
        }


Projection = Callable[[torch.Tensor], torch.Tensor]


def swiglu(x: torch.Tensor, gate: Projection, up: Projection, down: Projection, act: Projection) -> torch.Tensor:
    """The SwiGLU FFN ``down(act(gate(x)) * up(x))`` over any three projections: the layers of
    :class:`SwiGLUMLP`, or whole weights held elsewhere (:func:`swiglu_weights`)."""
    return down(act(gate(x)) * up(x))


def swiglu_weights(x: torch.Tensor, weights: Sequence[torch.Tensor], act: Projection) -> torch.Tensor:
    """:func:`swiglu` with bias-free whole weights ``(gate (I, D), up (I, D), down (D, I))`` held
    as plain tensors (an owner pool's, a cache slot's). ``x``: ``(..., D)`` -> ``(..., D)``."""
    gate, up, down = (functools.partial(F.linear, weight=w) for w in weights)
    return swiglu(x, gate, up, down, act)


def _ffn_placements(placements: tuple[Placement, ...]) -> tuple[tuple, tuple]:
    """Per mesh axis: ``Shard(0)`` = TP (gate/up Shard(0), down Shard(1)); ``Replicate()`` = whole."""
    bad = [p for p in placements if p != Shard(0) and not isinstance(p, Replicate)]
    if bad:
        raise ValueError(f"SwiGLUMLP takes Shard(0) or Replicate() per mesh axis, got {placements}")
    down = tuple(Shard(1) if isinstance(p, Shard) else p for p in placements)
    return placements, down
