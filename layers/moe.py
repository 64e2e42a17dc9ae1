"""Mixture-of-experts feed-forward block (drop-in for HF ``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``): a top-k router, experts whose weights are
DTensors with the experts on an ``ep`` mesh axis, and an optional gated shared expert.

Placements on the block's 2-D ``(ep, etp)`` mesh (a view of the attention's tp group):

- router ``gate.weight (E, D)``: ``Replicate()`` on both axes;
- ``experts.gate_proj`` / ``experts.up_proj (E, I, D)``: ``(Shard(0), Shard(1))``, experts over
  ``ep``, each expert's intermediate rows over ``etp`` (its own tensor parallelism);
- ``experts.down_proj (E, D, I)``: ``(Shard(0), Shard(2))``.

Input and output are replicated over the mesh (the tp group's tokens are the same on every rank).
Each rank routes every token, runs the tokens routed to its experts through one grouped GEMM
(:func:`grouped_swiglu`: one batched matmul over the local experts' sorted tokens, not a loop over
experts) and adds them weighted into its partial output; one all-reduce over the mesh sums the
experts' and the slices' contributions, as a dense TP FFN's does. No capacity factor: every token
reaches every expert it chose, so the result is HF's, up to summation order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from reshard import empty_dtensor
from reshard.layers._base import activation
from reshard.layers._comm import all_gather_chunks, all_reduce, all_to_all_split
from reshard.layers.grouped_gemm import check_backend, grouped_swiglu
from reshard.layers.mlp import SwiGLUMLP
from reshard.layers.weights import active_source
from reshard.layout import chunk_range

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up (E, I, D); down (E, D, I)


class TopKGate(nn.Module):
    """``weight (E, D)`` replicated. ``scoring="softmax"``: softmax over the experts (fp32), the
    ``top_k`` largest, those renormalized to sum to one where ``renormalize`` (HF's
    ``norm_topk_prob``; Mixtral always); ``cast_back``: the weights in the input's dtype (Qwen's
    routers), else fp32 (Mixtral's). ``scoring="sigmoid"`` (Llama 4): the ``top_k`` largest logits,
    each weighted by its sigmoid (fp32, cast back)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        mesh: DeviceMesh,
        renormalize: bool,
        cast_back: bool = True,
        scoring: str = "softmax",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        assert scoring in ("softmax", "sigmoid"), scoring
        self.top_k, self.renormalize, self.cast_back, self.scoring = top_k, renormalize, cast_back, scoring
        whole = (Replicate(),) * mesh.ndim
        self.weight = nn.Parameter(empty_dtensor((num_experts, hidden_size), mesh, whole, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (T, D)`` -> ``(weights (T, k), experts (T, k))``."""
        logits = F.linear(x, self.weight.to_local())  # (T, E)
        if self.scoring == "sigmoid":
            top, experts = torch.topk(logits, self.top_k, dim=-1)  # (T, k)
            return torch.sigmoid(top.float()).to(logits.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if self.cast_back else top), experts


class GroupedExperts(nn.Module):
    """The experts' SwiGLU weights as DTensors (see the module docstring); ``forward(x, weights,
    experts)`` returns this rank's partial sum of ``sum_k weights[:, k] * expert_k(x)`` (its
    experts, its slice of each): the caller all-reduces it over the mesh. ``scale_input`` (Llama
    4): ``sum_k expert_k(weights[:, k] * x)``, the routing weight scales the expert's input.
    ``backend``: the grouped GEMM's (:func:`reshard.layers.grouped_gemm.grouped_swiglu`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        mesh: DeviceMesh,
        hidden_act: str = "silu",
        scale_input: bool = False,
        backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        assert mesh.ndim == 2, f"experts live on an (ep, etp) mesh, got {mesh.ndim} axes"
        if num_experts % mesh.size(0) != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the ranks the experts are spread over "
                f"({mesh.size(0)}: parallel.ep; sp * tp under Shift; dp under SiDP)"
            )
        kw = dict(dtype=dtype, device=device)
        shape_in = (num_experts, intermediate_size, hidden_size)
        shape_out = (num_experts, hidden_size, intermediate_size)
        self.gate_proj = nn.Parameter(empty_dtensor(shape_in, mesh, (Shard(0), Shard(1)), **kw))
        self.up_proj = nn.Parameter(empty_dtensor(shape_in, mesh, (Shard(0), Shard(1)), **kw))
        self.down_proj = nn.Parameter(empty_dtensor(shape_out, mesh, (Shard(0), Shard(2)), **kw))
        self.num_experts, self.act_fn, self.scale_input = num_experts, activation(hidden_act), scale_input
        self.backend = check_backend(backend)

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts (``Shard(0)`` over ``ep``: contiguous, even)."""
        per = self.num_experts // self.gate_proj.device_mesh.size(0)
        first = self.gate_proj.device_mesh.get_local_rank(0) * per
        return range(first, first + per)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, whole: Weights | None = None
    ) -> torch.Tensor:
        """``x (T, D)``, ``weights`` / ``experts (T, k)`` -> this rank's partial ``(T, D)``;
        ``whole``: every expert's weights here (SiDP's WaS), the whole ``(T, D)``."""
        local = range(self.num_experts) if whole is not None else self.local_experts
        token, slot = torch.nonzero((experts >= local.start) & (experts < local.stop), as_tuple=True)  # (N,)
        w = weights[token, slot, None]  # (N, 1)
        y = self.compute(self._input(x[token], w), experts[token, slot] - local.start, whole)  # (N, D)
        return torch.zeros_like(x).index_add_(0, token, self._output(y, w).to(x.dtype))

    def _input(self, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (rows * w).to(rows.dtype) if self.scale_input else rows

    def _output(self, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rows if self.scale_input else rows * w  # (fp32 routing weights promote, as HF's)

    def dispatched(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention's MoE: ``x (T, D)`` is this rank's own tokens (``T`` may be 0:
        an idle replica still takes part). Each token travels once to each rank holding one of its
        experts, with its choices there (expert ids, ``-1`` for the others, and weights), in one
        all-to-all with exact splits (the counts exchanged first); that rank sums the token's
        weighted outputs of its experts and sends the one row back by the reverse all-to-all
        (the lower bound: one hidden row each way per (token, rank) pair). Returns ``(T, D)``."""
        mesh = self.gate_proj.device_mesh
        assert mesh.size(1) == 1, f"dispatched experts are whole on their rank, not split over {mesh.size(1)}"
        ep, per = mesh.size(0), self.num_experts // mesh.size(0)
        dest = experts // per  # (T, k) the rank holding each choice
        hit = torch.zeros(x.shape[0], ep, dtype=torch.bool, device=x.device).scatter_(1, dest, True)  # (T, ep)
        rank, token = torch.nonzero(hit.t(), as_tuple=True)  # (P,) pairs, by destination rank
        there = dest[token] == rank[:, None]  # (P, k) the token's choices on that rank
        ids = torch.where(there, experts[token], -1)  # (P, k)
        w = torch.where(there, weights[token], torch.zeros_like(weights[token]))
        sends = torch.bincount(rank, minlength=ep)
        splits = sends.tolist()
        recvs = all_to_all_split(sends, [1] * ep, [1] * ep, mesh, 0).tolist()  # pairs from each rank
        rows = all_to_all_split(x[token], recvs, splits, mesh, 0)  # (R, D)
        got = self(rows, all_to_all_split(w, recvs, splits, mesh, 0), all_to_all_split(ids, recvs, splits, mesh, 0))
        back = all_to_all_split(got, splits, recvs, mesh, 0)  # (P, D), send order
        return torch.zeros_like(x).index_add_(0, token, back)

    def compute(self, rows: torch.Tensor, local: torch.Tensor, whole: Weights | None = None) -> torch.Tensor:
        """Each row of ``rows (N, D)`` through this rank's expert ``local (N,)`` (its slice of
        it; of ``whole``'s experts where given), in one grouped GEMM over the rows sorted by
        expert; returns ``(N, D)`` in ``rows``' order."""
        out = torch.empty_like(rows)
        if rows.shape[0]:
            gate, up, down = whole or (self.gate_proj.to_local(), self.up_proj.to_local(), self.down_proj.to_local())
            order = torch.argsort(local, stable=True)
            counts = torch.bincount(local, minlength=gate.shape[0])  # (E_local,)
            out[order] = grouped_swiglu(
                rows[order], local[order], counts, gate, up, down, self.act_fn, backend=self.backend
            )
        return out


class SparseMoE(nn.Module):
    """Router, experts and a shared expert (Qwen2-MoE's gated by ``sigmoid(shared_expert_gate(x))``,
    Llama 4's ungated). The router is registered under ``router_name`` (HF's: ``gate``, Llama 4's
    ``router``); ``tuple_output``: returns ``(out, None)`` as Llama 4's block does.
    ``x (B, S, D)`` replicated over ``mesh`` (the 1-D tp group the experts' mesh views) -> ``(B, S,
    D)`` replicated: one all-reduce over ``mesh`` sums the experts' partial outputs. ``dispatch``
    (data-parallel attention): ``x`` is this rank's own tokens, the experts' ``(ep, 1)`` mesh spans
    the replicas, pairs travel by all-to-all (:meth:`GroupedExperts.dispatched`); :meth:`idle` takes part in a
    step this replica has no tokens for."""

    def __init__(
        self,
        gate: TopKGate,
        experts: GroupedExperts,
        mesh: DeviceMesh,
        shared_expert: SwiGLUMLP | None = None,
        shared_expert_gate: nn.Module | None = None,
        *,
        dispatch: bool = False,
        token_replicas: Mapping[str | None, tuple[DeviceMesh, int]] | None = None,
        router_name: str = "gate",
        tuple_output: bool = False,
    ) -> None:
        super().__init__()
        self.router_name, self.tuple_output, self.token_replicas = router_name, tuple_output, token_replicas
        self.add_module(router_name, gate)
        self.experts, self.mesh, self.dispatch = experts, mesh, dispatch
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    @property
    def route(self) -> TopKGate:
        return self._modules[self.router_name]

    def forward(self, x: torch.Tensor, whole: Weights | None = None) -> torch.Tensor | tuple[torch.Tensor, None]:
        """``x (..., D)``; ``whole``: every expert's weights, here (SiDP's WaS): no collective."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])  # (B*S, D)
        if whole is not None:
            out = self.experts(flat, *self.route(flat), whole)
        elif self.dispatch:  # each rank its own tokens (or its share of them): all-to-all
            out = self._dispatched(flat)
        else:  # the tp group's tokens on every rank: partial sums, one all-reduce
            out = all_reduce(self.experts(flat, *self.route(flat)), self.mesh, 0)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        elif self.shared_expert is not None:
            out = self.shared_expert(flat) + out  # (Llama 4's order: shared first, as HF sums)
        out = out.view(*lead, out.shape[-1])
        return (out, None) if self.tuple_output else out

    def _dispatched(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat (T, D)`` through the all-to-all dispatch. Where ranks hold the same tokens (Shift:
        ``token_replicas`` of the selected weight source), each dispatches its chunk of them and
        the chunks are all-gathered back over those ranks."""
        replicas = self.token_replicas.get(active_source()) if self.token_replicas is not None else None
        if replicas is None:
            return self.experts.dispatched(flat, *self.route(flat))
        mesh, axis = replicas
        lo, hi = chunk_range(flat.shape[0], mesh.size(axis), mesh.get_local_rank(axis))
        part = flat[lo:hi]  # (T_chunk, D)
        return all_gather_chunks(self.experts.dispatched(part, *self.route(part)), flat.shape[0], mesh, axis)

    def add_source(self, name: str, mesh: DeviceMesh, placements, *, copy: bool) -> int:
        """The shared expert's weights in another layout (Shift's full TP; the experts keep one
        layout for every source); returns the extra bytes on this rank."""
        return self.shared_expert.add_source(name, mesh, placements, copy=copy) if self.shared_expert else 0

    def idle(self) -> None:
        """A step with no tokens on this replica: the dispatch's collectives, with nothing to send."""
        if self.dispatch:
            self(self.route.weight.to_local().new_zeros(0, self.route.weight.shape[1]))


def feed_forward(layer: nn.Module) -> nn.Module:
    """A decoder layer's FFN block: ``mlp`` (Llama, Qwen, Mixtral), ``feed_forward`` (Llama 4)."""
    return layer.feed_forward if hasattr(layer, "feed_forward") else layer.mlp
