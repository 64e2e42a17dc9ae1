"""The engine core: one request loop, one model runner, one event interface, policies, a strategy registry."""

from reshard.parallel.engine.admission import Endpoint
from reshard.parallel.engine.agree import agree_tokens, sample_step
from reshard.parallel.engine.batching import ContinuousBatching
from reshard.parallel.engine.config import EngineConfig
from reshard.parallel.engine.core import CoreOutput, EngineCore, RequestStatus
from reshard.parallel.engine.events import EngineEvents, LayerHooks
from reshard.parallel.engine.loop import Engine
from reshard.parallel.engine.policy import Move, Policy, PolicyContext, RunnerInfo, Step, StepOutput
from reshard.parallel.engine.registry import (
    Strategy,
    WorkloadShape,
    make_strategy,
    register_strategy,
    registered,
    strategy_class,
)
from reshard.parallel.engine.request import Completion, EngineStats, Request, Sequence
from reshard.parallel.engine.runner import ModelRunner, Replica
from reshard.parallel.engine.slots import SlotPool
from reshard.parallel.engine.splits import StageLink, TokenSplit, split_ranges

__all__ = [
    "Completion",
    "ContinuousBatching",
    "CoreOutput",
    "Endpoint",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineEvents",
    "EngineStats",
    "LayerHooks",
    "ModelRunner",
    "Move",
    "Policy",
    "PolicyContext",
    "Replica",
    "Request",
    "RequestStatus",
    "RunnerInfo",
    "Sequence",
    "SlotPool",
    "StageLink",
    "Step",
    "StepOutput",
    "Strategy",
    "TokenSplit",
    "WorkloadShape",
    "agree_tokens",
    "make_strategy",
    "register_strategy",
    "registered",
    "sample_step",
    "split_ranges",
    "strategy_class",
]
