"""SiDP's expert pool: the experts of every mixture-of-experts layer owned by the ranks of a
data-parallel group, an owner per expert group, as :mod:`layers.owner_pool` owns dense FFNs.

Each rank is a replica with its own tokens; layer ``k``'s experts are ``Shard(0)`` over the group
(rank ``g`` owns experts ``[g E/G, (g+1) E/G)``: the ``(ep, etp) = (G, 1)`` mesh of data-parallel
attention). The weight source of the forward selects the mode, as for the dense pool:

- **WaS** (:data:`WAS`): the layer's experts are gathered whole from their owners into a slot and
  every token runs here (no activation moves). The gather of the next MoE layer is started when a
  layer's forward starts (on a process group of its own), so it runs under this layer's compute
  and the next attention: a prefetch one layer deep, two slots.
- **CaS** (:data:`CAS`): each token travels once to each owner of one of its experts by one
  all-to-all with exact splits; the owner runs every rank's rows for its experts in one grouped
  GEMM and sends back one summed row per token (:meth:`GroupedExperts.dispatched`). A rank with no
  rows sends nothing.

Every rank runs every MoE layer of every step in order (a rank without sequences through
:meth:`PooledMoE.idle`), so the gathers and all-to-alls pair up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from reshard.layers.moe import SparseMoE
from reshard.layers.owner_pool import CAS, WAS
from reshard.layers.weights import active_source
from reshard.mesh import cached_group


@dataclass
class ExpertCounters:
    """What the expert pool did on this rank."""

    gathers: int = 0  # MoE layers whose experts were gathered here (WaS)
    gather_bytes: int = 0  # expert bytes received from the other owners
    prefetched: int = 0  # gathers started before their layer's forward (one layer ahead)


class ExpertPool:
    """The MoE ``blocks`` (one per MoE layer, their experts ``Shard(0)`` over ``ranks``)."""

    def __init__(self, blocks: list[SparseMoE], ranks: list[int]) -> None:
        for block in blocks:
            mesh = block.experts.gate_proj.device_mesh
            assert block.dispatch and mesh.mesh.flatten().tolist() == list(ranks), "experts Shard(0) over the ranks"
        self.blocks, self.ranks = blocks, list(ranks)
        self.group = cached_group(self.ranks, purpose="sidp-experts")
        self.pending: dict[int, list[torch.Tensor]] = {}  # layer -> its gather in flight
        self.counters = ExpertCounters()

    def owned_bytes(self) -> int:
        """Expert bytes this rank owns."""
        return sum(_nbytes(p.to_local()) for b in self.blocks for p in b.experts.parameters())

    def whole_bytes(self) -> int:
        """Expert bytes of every layer, whole (what a replicated replica holds)."""
        return sum(p.numel() * p.element_size() for b in self.blocks for p in b.experts.parameters())

    def slot_bytes(self) -> int:
        """The most gathered expert bytes alive at once: two layers' (one computing, one in flight)."""
        whole = sorted(sum(p.numel() * p.element_size() for p in b.experts.parameters()) for b in self.blocks)
        return sum(whole[-2:])

    def gathered(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE layer ``k``'s experts whole, ``gate`` / ``up (E, I, D)``, ``down (E, D, I)``: waits
        for its gather (started here if it was not) and starts layer ``k + 1``'s. Layer 0 starts a
        step: a gather left in flight by a step that failed part-way is waited for and dropped."""
        if k == 0:
            for stale in self.pending.values():
                for t in stale:
                    funcol.wait_tensor(t)
            self.pending.clear()
        if k not in self.pending:
            self.pending[k] = self._start(k)
        elif k:
            self.counters.prefetched += 1
        if k + 1 < len(self.blocks) and k + 1 not in self.pending:
            self.pending[k + 1] = self._start(k + 1)
        whole = tuple(funcol.wait_tensor(t) for t in self.pending.pop(k))
        self.counters.gathers += 1
        self.counters.gather_bytes += sum(_nbytes(t) for t in whole) * (len(self.ranks) - 1) // len(self.ranks)
        return whole

    def _start(self, k: int) -> list[torch.Tensor]:
        """Layer ``k``'s all-gathers over the group (asynchronous until waited)."""
        e = self.blocks[k].experts
        return [funcol.all_gather_single(p.to_local(), 0, self.group) for p in (e.gate_proj, e.up_proj, e.down_proj)]


class PooledMoE(nn.Module):
    """Drop-in for a decoder layer's MoE block in SiDP: ``block``'s router and shared expert here,
    its experts from ``pool`` (gathered: WaS; dispatched to their owners: CaS)."""

    def __init__(self, block: SparseMoE, pool: ExpertPool, layer: int) -> None:
        super().__init__()
        self.block, self.pool, self.layer = block, pool, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        if active_source() == CAS:
            return self.block(x)
        assert active_source() == WAS, f"SiDP's experts run in WaS or CaS, not {active_source()!r}"
        return self.block(x, whole=self.pool.gathered(self.layer))

    def idle(self) -> None:
        """A step without rows here: the layer's gather (WaS) or all-to-alls (CaS), nothing to compute."""
        if active_source() == CAS:
            self.block.idle()
        else:
            self.pool.gathered(self.layer)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
