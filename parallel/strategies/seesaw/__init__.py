"""Seesaw: prefill in one layout (pipeline / data parallel), decode in another (tensor parallel).

- ``switch.py``: :class:`LayoutSwitch`, the model's two module trees and the weight moves at
  transitions;
- ``schedulers.py``: when to switch (transition-minimizing, prefill- or decode-prioritizing);
- ``policy.py``: :class:`SeesawPolicy` over the one engine loop, the CPU KV tier swaps;
- ``tier_kv.py``: :class:`TierKV`, the tier as the decode side's KV connector and prefix cache;
- ``strategy.py``: the ``seesaw`` strategy config and its engine.
"""

from reshard.parallel.strategies.seesaw.policy import SeesawPolicy, SeesawStats, seesaw_engine
from reshard.parallel.strategies.seesaw.strategy import LayoutConfig, SeesawStrategy
from reshard.parallel.strategies.seesaw.switch import LayoutSwitch, TransitionStats, release_weights, weight_bytes

__all__ = [
    "LayoutConfig",
    "LayoutSwitch",
    "SeesawPolicy",
    "SeesawStats",
    "SeesawStrategy",
    "TransitionStats",
    "release_weights",
    "seesaw_engine",
    "weight_bytes",
]
