"""The engine core: one request loop, one model runner with hooks, policies, a strategy registry."""

from reshard.parallel.engine.agree import agree_tokens, sample_step
from reshard.parallel.engine.loop import Engine
from reshard.parallel.engine.policy import ContinuousBatching, Policy, SlotPool, Step
from reshard.parallel.engine.registry import (
    EngineArgs,
    Strategy,
    make_strategy,
    register_strategy,
    registered,
    strategy_class,
)
from reshard.parallel.engine.request import Completion, EngineStats, Request, Sequence
from reshard.parallel.engine.runner import ModelRunner, Replica, RunnerHooks, StageLink, TokenSplit, split_ranges

__all__ = [
    "Completion",
    "ContinuousBatching",
    "Engine",
    "EngineArgs",
    "EngineStats",
    "ModelRunner",
    "Policy",
    "Replica",
    "Request",
    "RunnerHooks",
    "Sequence",
    "SlotPool",
    "StageLink",
    "Step",
    "Strategy",
    "TokenSplit",
    "agree_tokens",
    "make_strategy",
    "register_strategy",
    "registered",
    "sample_step",
    "split_ranges",
    "strategy_class",
]
