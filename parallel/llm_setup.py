"""How ``reshard.LLM`` is set up: its process group, its strategy and engine config from its keyword
arguments (vLLM's names translated by :func:`~reshard.parallel.vllm_api.llm_options`), its
tokenizer, and the device-memory share it may take."""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from reshard.parallel.engine import EngineConfig
from reshard.parallel.engine.registry import make_strategy, strategy_class

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def join_group() -> bool:
    """Join torchrun's process group, or make a one-rank one in a plain process; whether this
    call made it (its maker ends it)."""
    if dist.is_initialized():
        return False
    from reshard.recipes.launch import collective_timeout

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, accelerate: env:// rendezvous
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=collective_timeout())
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _split_options(strategy: str, options: dict) -> tuple[dict, dict]:
    """``options`` as (engine keys, strategy keys); ``ValueError`` naming an unknown key (and the
    nearest known one)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"dtype"}
    strategy_fields = {f.name for f in dataclasses.fields(strategy_class(strategy))}
    unknown = sorted(set(options) - engine_fields - strategy_fields)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(engine_fields | strategy_fields), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"LLM got {unknown[0]!r}{hint}: neither an engine key nor a key of strategy {strategy!r} "
            f"({sorted(strategy_fields)})"
        )
    engine = {k: v for k, v in options.items() if k in engine_fields}
    return engine, {k: v for k, v in options.items() if k not in engine_fields}


def load_tokenizer(given, path: Path | None):
    """The tokenizer: ``given`` (a tokenizer, or a path to load one from), else the checkpoint's at
    ``path``, or None where it ships none."""
    if given is not None and not isinstance(given, (str, os.PathLike)):
        return given
    path = Path(given) if given is not None else path
    if path is None or not any((path / f).exists() for f in TOKENIZER_FILES):
        if given is not None:
            raise ValueError(f"LLM: tokenizer={str(given)!r} holds no tokenizer (none of {TOKENIZER_FILES})")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def configure(strategy: str, options: dict) -> tuple[object, EngineConfig]:
    """The strategy and the engine's config from ``LLM``'s keyword arguments (ours: vLLM's are
    translated by :func:`llm_options`); ``ValueError`` naming a bad key before anything loads.
    Unless the cache's keys are given (``kv_block_size=None``: contiguous slots), the KV cache is
    the strategy's default (``Strategy.default_kv_block_size``: paged where it caches prefixes)."""
    if options.get("tp") is None and strategy == "tp":
        options["tp"] = 1  # the tp strategy: every process a data-parallel replica
    cache_given = {"kv_block_size", "kv_tokens"} & options.keys() or options.get("kv_swap")
    options = {k: v for k, v in options.items() if v is not None or k not in ("tp", "pp")}
    dtype = options.pop("dtype", None)
    engine_keys, strategy_keys = _split_options(strategy, options)
    parallel = make_strategy({"strategy": strategy, **strategy_keys})
    parallel.layouts(dist.get_world_size())
    if not cache_given:  # (its tokens: the contiguous slots' memory)
        engine_keys["kv_block_size"] = parallel.default_kv_block_size()
    return parallel, EngineConfig(dtype=dtype, **engine_keys)


def check_share(share: float | None) -> None:
    if share is not None and not (isinstance(share, (int, float)) and 0 < share <= 1):
        raise ValueError(f"LLM: gpu_memory_utilization must be in (0, 1], got {share!r}")


def check_memory(share: float | None) -> None:
    """On CUDA, ``ValueError`` where the weights and KV cache take more than ``share`` of the device."""
    if share is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    used = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if used > share * total:
        raise ValueError(
            f"LLM: the weights and KV cache take {used / 2**30:.2f} GiB, {used / total:.2f} of the device; "
            f"gpu_memory_utilization={share} allows {share * total / 2**30:.2f} GiB "
            "(lower max_num_seqs or max_model_len)"
        )


def check_same_arguments(arguments: dict) -> None:
    """``ValueError`` on every rank unless every rank built its ``LLM`` with the same ``arguments``
    (the strategy, its degrees, engine keys, ...): ranks that disagree would wait in different
    collectives until the timeout. One small all-gather, the first collective of the ``LLM``."""
    if dist.get_world_size() == 1:
        return
    from reshard.mesh import all_gather_objects

    everyone = all_gather_objects({k: _comparable(v) for k, v in arguments.items()})
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        differ = sorted(k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k))
        if differ:
            key = differ[0]
            raise ValueError(
                f"LLM: the ranks were given different arguments: {key}={first.get(key)} on rank 0, "
                f"{key}={theirs.get(key)} on rank {rank}; every rank builds the same LLM"
            )


def _comparable(value) -> str:
    """A value as ranks can compare it: a module by its class and config, anything else by repr."""
    if isinstance(value, torch.nn.Module):
        config = getattr(value, "config", None)
        return f"{type(value).__name__}({config.to_json_string(use_diff=True) if config is not None else ''})"
    return repr(value)
