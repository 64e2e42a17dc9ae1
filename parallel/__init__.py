"""Meshes, parallelization plans, checkpoint loading and the generation engine."""
from .checkpoint import CheckpointReader, resolve_checkpoint
from .dims import ParallelDims, device_type
from .engine import Completion, Engine, EngineStats, Request
from .parallelize import SUPPORTED_ARCHITECTURES, LoadStats, parallelize
from .plans import tp_plan
from .sampling import SamplingParams

__all__ = ["CheckpointReader", "Completion", "Engine", "EngineStats", "LoadStats", "ParallelDims",
           "Request", "SUPPORTED_ARCHITECTURES", "SamplingParams", "device_type", "parallelize",
           "resolve_checkpoint", "tp_plan"]
