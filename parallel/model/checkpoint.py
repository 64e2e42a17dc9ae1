"""Reading HF safetensors checkpoints one box at a time (a rank never reads the full model)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open

from reshard.layout import Box, box_slices

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)


@contextlib.contextmanager
def hf_bars_off() -> Iterator[None]:
    """transformers' progress bars off inside (its "Writing model shards" and "Loading weights",
    one per rank, around the library's own saves and loads of tiny checkpoints: the job's output
    is its own lines), as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def resolve_checkpoint(path_or_id: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id resolved through huggingface_hub.

    Offline (``HF_HUB_OFFLINE=1`` or no network) a hub id resolves from the local cache.
    """
    if not isinstance(path_or_id, (str, os.PathLike)):
        raise ValueError(f"a model is a checkpoint directory or a hub id (org/name), got {path_or_id!r:.60}")
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ValueError(f"checkpoint path {str(path)!r} is a file; expected a directory")
    return _from_hub(str(path_or_id))


def config_value(directory: str | os.PathLike, key: str) -> object:
    """A top-level ``key`` of the checkpoint's ``config.json``, read without transformers:
    ``AutoConfig`` imports every model family's configuration module first (seconds of CPU in a
    process that needs one number). Where the file lacks the key, ``AutoConfig``'s attribute
    (its defaults and aliases) is the answer."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads((Path(directory) / "config.json").read_text())[key]
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(directory), key)


def checkpoint_eos_ids(directory: str | os.PathLike) -> frozenset[int]:
    """The EOS ids ``config.json`` and ``generation_config.json`` name (as the engine's
    ``model_eos_ids`` reads them off the model), read without transformers."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        with contextlib.suppress(OSError, ValueError):
            eos = json.loads((Path(directory) / name).read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


# HF GenerationConfig's defaults of the sampling values a server takes from generation_config.json
GENERATION_DEFAULTS = MappingProxyType(
    {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
)


def generation_defaults(directory: str | os.PathLike) -> dict[str, float]:
    """The sampling values ``generation_config.json`` sets away from HF's defaults (vLLM's server
    defaults: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``max_new_tokens``), read without transformers; {} without the file."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        given = json.loads((Path(directory) / "generation_config.json").read_text())
        keys = (*GENERATION_DEFAULTS, "max_new_tokens")
        return {k: given[k] for k in keys if _set_value(k, given.get(k)) and given[k] != GENERATION_DEFAULTS.get(k)}
    return {}


def _set_value(key: str, value) -> bool:
    """Whether ``value`` is one a request could give for ``key`` (ints for counts, else numbers)."""
    if key in ("top_k", "max_new_tokens"):
        return type(value) is int
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is neither a local directory nor a valid hub id") from e
    except Exception as online_error:  # no network: fall back to the local cache
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        except Exception:
            raise ValueError(
                f"checkpoint {repo_id!r} is not a local directory and could not be fetched from the "
                f"hub or found in the local cache ({type(online_error).__name__})"
            ) from online_error


class CheckpointReader:
    """Index over a checkpoint's safetensors files; :meth:`read` reads one box and counts bytes."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.weight_map = _weight_map(self.directory)
        for filename in sorted(set(self.weight_map.values())):
            _check_file(self.directory / filename)
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __iter__(self):
        """The checkpoint's tensor names."""
        return iter(self.weight_map)

    def file_of(self, name: str) -> Path:
        return self.directory / self.weight_map[name]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        """Shape and dtype of tensor ``name`` from its file's header (no data read)."""
        entry = _header(self.file_of(name))[1].get(name)
        if entry is None:
            raise ValueError(
                f"tensor {name!r} is listed for {self.file_of(name)} but that file does not "
                f"contain it (index {self.directory / INDEX_FILE})"
            )
        return tuple(entry["shape"]), DTYPES.get(entry["dtype"], entry["dtype"])

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, target: str) -> None:
        """``ValueError`` naming both unless tensor ``name`` can fill ``target`` of ``shape`` (a
        floating tensor may be cast to another floating dtype, as HF does)."""
        have, kind = self.spec(name)
        castable = isinstance(kind, torch.dtype) and kind.is_floating_point == dtype.is_floating_point
        if have != tuple(shape) or not castable:
            raise ValueError(
                f"checkpoint tensor {name!r} in {self.file_of(name)} is {list(have)} {kind} but "
                f"parameter {target!r} is {list(shape)} {dtype} (does config.json match "
                f"the weights?)"
            )

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The ``box`` of tensor ``name`` (only those bytes are read from disk)."""
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
        path = self.directory / self.weight_map[name]
        with safe_open(str(path), framework="pt") as f:
            piece = f.get_slice(name)[box_slices(box)] if box else f.get_tensor(name)
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def total_bytes(self) -> int:
        files = set(self.weight_map.values())
        return sum(_data_bytes(self.directory / f) for f in files)


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SINGLE_FILE
    if not single.exists():
        raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}; only safetensors checkpoints load")
    with safe_open(str(_check_file(single)), framework="pt") as f:
        return {k: SINGLE_FILE for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"safetensors file {path} is truncated (no header)")
        (n,) = struct.unpack("<Q", raw)
        body = fh.read(n)
    if len(body) < n:
        raise ValueError(f"safetensors file {path} is truncated (header cut short)")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return n, header


def _check_file(path: Path) -> Path:
    """Raise ``ValueError`` naming ``path`` if it is missing or shorter than its header says."""
    if not path.exists():
        raise ValueError(f"checkpoint file {path} is missing (listed in the index)")
    n, header = _header(path)
    need = 8 + n + _data_bytes(path, header)
    if path.stat().st_size < need:
        raise ValueError(f"safetensors file {path} is truncated: {path.stat().st_size} bytes, header needs {need}")
    return path


def _data_bytes(path: Path, header: dict | None = None) -> int:
    header = header if header is not None else _header(path)[1]
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return max(ends, default=0)
