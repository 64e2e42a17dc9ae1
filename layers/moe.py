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

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from transformers.activations import ACT2FN

from reshard import empty_dtensor
from reshard.layers._comm import all_reduce, all_to_all_split
from reshard.layers.mlp import SwiGLUMLP


class TopKGate(nn.Module):
    """``weight (E, D)`` replicated: softmax over the experts (fp32), the ``top_k`` largest, those
    renormalized to sum to one where ``renormalize`` (HF's ``norm_topk_prob``; Mixtral always).
    ``cast_back``: the weights in the input's dtype (Qwen's routers), else fp32 (Mixtral's)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        mesh: DeviceMesh,
        renormalize: bool,
        cast_back: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k, self.renormalize, self.cast_back = top_k, renormalize, cast_back
        whole = (Replicate(),) * mesh.ndim
        self.weight = nn.Parameter(empty_dtensor((num_experts, hidden_size), mesh, whole, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (T, D)`` -> ``(weights (T, k), experts (T, k))``."""
        logits = F.linear(x, self.weight.to_local())  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if self.cast_back else top), experts


class GroupedExperts(nn.Module):
    """The experts' SwiGLU weights as DTensors (see the module docstring); ``forward(x, weights,
    experts)`` returns this rank's partial sum of ``sum_k weights[:, k] * expert_k(x)`` (its
    experts, its slice of each): the caller all-reduces it over the mesh."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        mesh: DeviceMesh,
        hidden_act: str = "silu",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        assert mesh.ndim == 2, f"experts live on an (ep, etp) mesh, got {mesh.ndim} axes"
        if num_experts % mesh.size(0) != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by parallel.ep ({mesh.size(0)})")
        kw = dict(dtype=dtype, device=device)
        shape_in = (num_experts, intermediate_size, hidden_size)
        shape_out = (num_experts, hidden_size, intermediate_size)
        self.gate_proj = nn.Parameter(empty_dtensor(shape_in, mesh, (Shard(0), Shard(1)), **kw))
        self.up_proj = nn.Parameter(empty_dtensor(shape_in, mesh, (Shard(0), Shard(1)), **kw))
        self.down_proj = nn.Parameter(empty_dtensor(shape_out, mesh, (Shard(0), Shard(2)), **kw))
        self.num_experts, self.act_fn = num_experts, ACT2FN[hidden_act]

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts (``Shard(0)`` over ``ep``: contiguous, even)."""
        per = self.num_experts // self.gate_proj.device_mesh.size(0)
        first = self.gate_proj.device_mesh.get_local_rank(0) * per
        return range(first, first + per)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x (T, D)``, ``weights`` / ``experts (T, k)`` -> this rank's partial ``(T, D)``."""
        local = self.local_experts
        token, slot = torch.nonzero((experts >= local.start) & (experts < local.stop), as_tuple=True)  # (N,)
        y = self.compute(x[token], experts[token, slot] - local.start)  # (N, D)
        y = y * weights[token, slot, None]  # (fp32 routing weights promote, as HF's)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def dispatched(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention's MoE: ``x (T, D)`` is this rank's own tokens (``T`` may be 0:
        an idle replica still takes part). Each (token, choice) pair travels to the rank holding
        its expert in one all-to-all with exact splits (the counts exchanged first), is computed
        there, and comes back by the reverse all-to-all; returns the whole ``(T, D)``."""
        mesh = self.gate_proj.device_mesh
        ep, per = mesh.size(0), self.num_experts // mesh.size(0)
        token, slot = torch.nonzero(torch.ones_like(experts, dtype=torch.bool), as_tuple=True)  # (T*k,) pairs
        expert = experts[token, slot]
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank holding it
        token, slot, expert = token[order], slot[order], expert[order]
        send = torch.bincount(expert // per, minlength=ep)  # (ep,) pairs to each rank
        sends = send.tolist()
        recvs = all_to_all_split(send, [1] * ep, [1] * ep, mesh, 0).tolist()  # pairs from each rank
        rows = all_to_all_split(x[token], recvs, sends, mesh, 0)  # (R, D)
        local = all_to_all_split(expert, recvs, sends, mesh, 0) - self.local_experts.start  # (R,)
        back = all_to_all_split(self.compute(rows, local), sends, recvs, mesh, 0)  # (T*k, D), send order
        return torch.zeros_like(x).index_add_(0, token, (back * weights[token, slot, None]).to(x.dtype))

    def compute(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each row of ``rows (N, D)`` through this rank's expert ``local (N,)`` (its slice of
        it), in one grouped GEMM over the rows sorted by expert; returns ``(N, D)`` in ``rows``' order."""
        out = torch.empty_like(rows)
        if rows.shape[0]:
            order = torch.argsort(local, stable=True)
            counts = torch.bincount(local, minlength=len(self.local_experts))  # (E_local,)
            out[order] = grouped_swiglu(
                rows[order], local[order], counts, self.gate_proj.to_local(), self.up_proj.to_local(),
                self.down_proj.to_local(), self.act_fn,
            )  # fmt: skip
        return out


def grouped_swiglu(
    x: torch.Tensor,
    expert: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    act,
) -> torch.Tensor:
    """SwiGLU of each row of ``x (N, D)`` through its expert (``expert (N,)`` sorted ascending,
    ``counts (E,)`` rows per expert) with stacked weights ``gate`` / ``up (E, I, D)``, ``down (E,
    D, I)``: the rows are laid out per expert in a ``(E, C, D)`` block (``C`` the largest count,
    short experts zero-padded) and go through three batched matmuls, one per projection."""
    capacity = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    pos = torch.arange(x.shape[0], device=x.device) - starts[expert]  # (N,) row within its expert
    block = x.new_zeros(counts.shape[0], capacity, x.shape[1])  # (E, C, D)
    block[expert, pos] = x
    h = act(torch.bmm(block, gate.transpose(1, 2))) * torch.bmm(block, up.transpose(1, 2))  # (E, C, I)
    return torch.bmm(h, down.transpose(1, 2))[expert, pos]  # (N, D)


class SparseMoE(nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert gated by ``sigmoid(shared_expert_gate(x))``.
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
    ) -> None:
        super().__init__()
        self.gate, self.experts, self.mesh, self.dispatch = gate, experts, mesh, dispatch
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])  # (B*S, D)
        weights, experts = self.gate(flat)
        if self.dispatch:  # each rank its own tokens (data-parallel attention): all-to-all
            out = self.experts.dispatched(flat, weights, experts)
        else:  # the tp group's tokens on every rank: partial sums, one all-reduce
            out = all_reduce(self.experts(flat, weights, experts), self.mesh, 0)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(*lead, out.shape[-1])

    def idle(self) -> None:
        """A step with no tokens on this replica: the dispatch's collectives, with nothing to send."""
        if self.dispatch:
            self(self.gate.weight.to_local().new_zeros(0, self.gate.weight.shape[1]))
