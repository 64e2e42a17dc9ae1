"""Meshes, parallelization plans, checkpoint loading, the engine core and the strategies."""

from reshard.parallel.engine import (
    Completion,
    Engine,
    EngineConfig,
    EngineCore,
    EngineStats,
    ModelRunner,
    Request,
    RequestStatus,
    register_strategy,
)
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.model.checkpoint import CheckpointReader, resolve_checkpoint
from reshard.parallel.model.dims import ParallelDims, device_type
from reshard.parallel.model.info import LoadStats, ParallelInfo, parallel_info
from reshard.parallel.model.parallelize import SUPPORTED_ARCHITECTURES, parallelize
from reshard.parallel.model.plans import tp_plan

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointReader",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "LoadStats",
    "ModelRunner",
    "ParallelDims",
    "ParallelInfo",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "device_type",
    "parallel_info",
    "parallelize",
    "register_strategy",
    "resolve_checkpoint",
    "tp_plan",
]
