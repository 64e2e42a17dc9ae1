"""The engine core: one request loop, one model runner with hooks, policies, a strategy registry."""
from .agree import agree_tokens, sample_step
from .loop import Engine
from .policy import ContinuousBatching, Policy, SlotPool, Step
from .registry import EngineArgs, Strategy, make_strategy, register_strategy, registered, strategy_class
from .request import Completion, EngineStats, Request, Sequence
from .runner import ModelRunner, Replica, RunnerHooks, StageLink, TokenSplit, split_ranges

__all__ = ["Completion", "ContinuousBatching", "Engine", "EngineArgs", "EngineStats", "ModelRunner", "Policy",
           "Replica", "Request", "RunnerHooks", "Sequence", "SlotPool", "StageLink", "Step", "Strategy",
           "TokenSplit", "agree_tokens", "make_strategy", "register_strategy", "registered", "sample_step",
           "split_ranges", "strategy_class"]
