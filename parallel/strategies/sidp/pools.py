"""SiDP's pools of one model: the dense FFN layers in an owner pool with its fetch scheduler
(:mod:`layers.owner_pool`, :mod:`.fetch`), or, for a mixture-of-experts model, every MoE layer's
experts in an expert pool (:mod:`layers.expert_pool`: an owner per expert group, the experts
gathered ahead of use in WaS, the tokens dispatched to their owners in CaS); and the profiled
threshold ``b*`` of the dense pool.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reshard.layers.expert_pool import ExpertPool, PooledMoE
from reshard.layers.moe import SparseMoE, feed_forward
from reshard.layers.owner_pool import CAS, OwnerPool, PooledMLP
from reshard.layers.weights import use_weights
from reshard.mesh import device_type
from reshard.parallel.strategies.sidp.fetch import FetchScheduler, check_slots


@dataclass
class Pools:
    """A pooled model's pools: ``fetcher`` (its ``pool``: the dense FFNs; None in a MoE model,
    whose dense FFN layers and shared experts stay replicated), ``experts`` (None in a dense
    model, and over one rank), over a group of ``G`` replicas."""

    fetcher: FetchScheduler | None
    experts: ExpertPool | None
    G: int

    @property
    def dense(self) -> OwnerPool | None:
        return self.fetcher.pool if self.fetcher is not None else None

    def held_bytes(self, model: nn.Module) -> tuple[int, int]:
        """``(FFN bytes held, slot bytes)`` on this rank: owned dense layers + their slots, or the
        replicated FFN parts + owned experts + the two layers' gathered experts."""
        if self.dense is not None:
            return self.dense.ffn_bytes(), self.dense.slot_bytes()
        rest = ffn_bytes(model) - (self.experts.whole_bytes() if self.experts else 0)
        if self.experts is None:
            return rest, 0
        return rest + self.experts.owned_bytes(), self.experts.slot_bytes()

    def fetched_bytes(self) -> int:
        """Bytes this rank fetched or gathered (WaS)."""
        dense = self.fetcher.counters.fetch_bytes if self.fetcher is not None else 0
        return dense + (self.experts.counters.gather_bytes if self.experts is not None else 0)


def ffn_bytes(model: nn.Module) -> int:
    """Every decoder layer's FFN (experts included) whole: what a replicated replica holds."""
    return sum(p.numel() * p.element_size() for layer in model.model.layers for p in feed_forward(layer).parameters())


def profile_threshold(
    fetcher: FetchScheduler, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 3
) -> float:
    """b* on this hardware (a small built-in sweep; collective over the group): per layer, WaS
    costs ``max(fetch, ffn(b))`` (the fetch hides behind compute), CaS costs one activation round
    trip plus the owner's fused GEMM over every rank's rows. Returns the smallest swept ``b``
    where CaS is the slower on some rank (the same on every rank), else the largest."""
    pool = fetcher.pool
    hidden = pool.weights_dim()
    owned = next(j for j, o in enumerate(pool.owner) if o == pool.rank)
    fetch = _timed(fetcher.fetch_round_once, repeats)
    for b in sizes:
        x = torch.randn(b, hidden, dtype=pool.dtype, device=pool.slot_flat[0].device)
        ffn = _timed(lambda x=x: pool.owned_ffn(owned, x), repeats)
        pool.begin_step([b] * pool.G, fetched=[])
        with use_weights(CAS):
            cas = _timed(lambda x=x: pool.forward(0, x), repeats)
        slower = torch.tensor([int(cas > max(fetch, ffn))], device=device_type())
        dist.all_reduce(slower, op=dist.ReduceOp.MAX)  # every rank stops at the same size
        if slower.item():
            return float(b)
    return float(sizes[-1])


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, every rank starting together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _fetched_layers(model: nn.Module, group_size: int) -> int:
    """The fewest FFN layers any rank of a ``group_size`` owner pool fetches (those it does not own)."""
    layers = len(model.model.layers)
    return layers - math.ceil(layers / group_size)


def pool_model(model: nn.Module, ranks: list[int], *, slots: int, prefetch_depth: int, peak_shifting: bool) -> Pools:
    """Pool ``model``'s FFNs over the replicas ``ranks`` (collective): a dense model's FFN layers
    (whole on every rank) into an owner pool, each swapped for a :class:`PooledMLP`; a MoE
    model's experts (loaded ``Shard(0)`` over ``ranks``) into an expert pool, each block wrapped
    in a :class:`PooledMoE`."""
    layers = model.model.layers
    if any(isinstance(feed_forward(layer), SparseMoE) for layer in layers):
        return Pools(None, _pool_experts(layers, ranks), len(ranks))
    check_slots(  # before any change
        slots, len(ranks), prefetch_depth=prefetch_depth, peak_shifting=peak_shifting, layers=len(layers)
    )
    pool = OwnerPool([layer.mlp for layer in layers], ranks, slots=slots)
    fetcher = FetchScheduler(pool, prefetch_depth=prefetch_depth, peak_shifting=peak_shifting)
    for j, layer in enumerate(layers):
        layer.mlp = PooledMLP(pool, j)
    return Pools(fetcher, None, len(ranks))


def _pool_experts(layers: nn.ModuleList, ranks: list[int]) -> ExpertPool | None:
    """Every MoE block's experts in one :class:`ExpertPool` (None over one rank: nothing to pool)."""
    moe = [layer for layer in layers if isinstance(feed_forward(layer), SparseMoE)]
    if len(ranks) == 1:
        return None
    pool = ExpertPool([feed_forward(layer) for layer in moe], ranks)
    for k, layer in enumerate(moe):
        name = "feed_forward" if hasattr(layer, "feed_forward") else "mlp"
        setattr(layer, name, PooledMoE(feed_forward(layer), pool, k))
    return pool
