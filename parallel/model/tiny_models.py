"""Seeded tiny HF checkpoints built from config (for tests and the main job's built-in default).

These are randomly initialized models, saved with ``save_pretrained`` as safetensors and loaded
back through the real loading path; they are not trained models.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

FAMILY_DEFAULTS = MappingProxyType(
    {
        "llama": dict(num_key_value_heads=2),
        "qwen2": dict(num_key_value_heads=2),
        "qwen3": dict(num_key_value_heads=2, head_dim=32),
        "mistral": dict(num_key_value_heads=1, sliding_window=24),
    }
)
_COMMON = MappingProxyType(
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
)
BUILTIN = MappingProxyType(
    dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.05,
    )
)
BUILTIN_NAME = "tiny-llama-seed0-v1"


def tiny_config(family: str, **overrides):
    """An HF config of ``family`` (llama | qwen2 | qwen3 | mistral) with tiny dimensions."""
    from transformers import AutoConfig

    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"unknown tiny model family {family!r}; choose from {sorted(FAMILY_DEFAULTS)}")
    kwargs = {**_COMMON, **FAMILY_DEFAULTS[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def make_tiny_checkpoint(
    family: str, path: str | os.PathLike, *, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Build a seeded tiny model and ``save_pretrained`` it (safetensors) into ``path``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return Path(path)


def default_cache_dir() -> Path:
    root = os.environ.get("RESHARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "reshard"
    )
    return Path(root)


def builtin_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The built-in tiny Llama checkpoint, created on first use and reused afterwards."""
    return cached_checkpoint(BUILTIN_NAME, BUILTIN, cache_dir)


def cached_checkpoint(name: str, overrides: Mapping, cache_dir: str | os.PathLike | None = None) -> Path:
    """A seeded Llama (``overrides`` of the tiny config) under ``cache_dir/name``, built once.

    Written to a temporary directory and renamed into place, so an interrupted run leaves no
    half-written checkpoint behind.
    """
    target = Path(cache_dir or default_cache_dir()) / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        make_tiny_checkpoint("llama", tmp, seed=0, **overrides)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
