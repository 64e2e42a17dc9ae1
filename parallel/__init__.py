"""Meshes, parallelization plans, checkpoint loading, the engine core and the strategies."""
from .checkpoint import CheckpointReader, resolve_checkpoint
from .dims import ParallelDims, device_type
from .engine import Completion, Engine, EngineStats, ModelRunner, Request, register_strategy
from .parallelize import SUPPORTED_ARCHITECTURES, LoadStats, parallelize
from .plans import tp_plan
from .sampling import SamplingParams

__all__ = ["CheckpointReader", "Completion", "Engine", "EngineStats", "LoadStats", "ModelRunner", "ParallelDims",
           "Request", "SUPPORTED_ARCHITECTURES", "SamplingParams", "device_type", "parallelize",
           "register_strategy", "resolve_checkpoint", "tp_plan"]
