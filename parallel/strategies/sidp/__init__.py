"""SiDP: data parallel replicas whose FFN weights live in an owner pool (the layer:
:mod:`reshard.layers.owner_pool`).

- ``fetch.py``: :class:`FetchScheduler`, which non-owned FFN layers each rank fetches into its
  cache slots and when (the housekeeper thread, prefetch rounds, peak shifting);
- ``pools.py``: the model's pools (dense FFNs in an owner pool, or a MoE model's experts in an
  expert pool, :mod:`reshard.layers.expert_pool`) and the profiled threshold ``b*``;
- ``strategy.py``: the orchestrator (:func:`choose_mode`, WaS or CaS with hysteresis),
  :class:`SiDPPolicy` over the one engine loop, the ``sidp`` strategy config and its engine.
"""

from reshard.parallel.strategies.sidp.fetch import FetchCounters, FetchScheduler
from reshard.parallel.strategies.sidp.pools import Pools, pool_model, profile_threshold
from reshard.parallel.strategies.sidp.strategy import (
    MODES,
    SiDPPolicy,
    SiDPStats,
    SiDPStrategy,
    choose_mode,
    kv_bytes_per_token,
    sidp_engine,
)

__all__ = [
    "MODES",
    "FetchCounters",
    "FetchScheduler",
    "Pools",
    "SiDPPolicy",
    "SiDPStats",
    "SiDPStrategy",
    "choose_mode",
    "kv_bytes_per_token",
    "pool_model",
    "profile_threshold",
    "sidp_engine",
]
