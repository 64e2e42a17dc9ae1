"""Which checkpoint tensors fill a parameter of our layers, and how a box of it is read.

A parameter is filled by the tensor of its own name (HF's state-dict key), by the tied embedding
(``lm_head.weight``), by Mixtral's on-disk name (``block_sparse_moe`` for our ``mlp``), or, for a
stacked experts parameter ``...mlp.experts.gate_proj (E, I, D)``, by the hub's per-expert tensors
(Qwen's ``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``)
or transformers' fused ``mlp.experts.gate_up_proj (E, 2I, D)`` (gate rows first, then up); Llama
4's fused experts are stored input-major, ``gate_up_proj (E, D, 2I)`` and ``down_proj (E, I, D)``
(``transposed``: dims 1 and 2 swapped against ours).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from reshard.layout import Box
from reshard.parallel.model.checkpoint import CheckpointReader

# a stacked experts parameter <- its per-expert tensors: Qwen's names, then Mixtral's
EXPERT_TENSORS = MappingProxyType(
    {"gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3"), "down_proj": ("down_proj", "w2")}
)

# config.json's names for the routed experts of a MoE layer (Qwen's hub configs, Mixtral / Llama 4 and
# transformers 5's saves, DeepSeek): transformers maps them onto one attribute, the last one read wins
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_experts(config) -> int:
    """The routed experts per MoE layer of the model ``config`` builds (0: a dense model)."""
    return max((v for k in EXPERT_COUNT_KEYS if isinstance(v := getattr(config, k, None), int)), default=0)


def check_expert_count(directory: Path, config, reader: CheckpointReader) -> None:
    """``ValueError`` naming the declared count, the built one and the files' when ``config.json``
    declares an expert count (under any of its names) that the model ``config`` builds does not
    have: transformers silently keeps the last of two keys that disagree."""
    raw = json.loads((directory / "config.json").read_text())
    raw = raw.get("text_config", raw)
    built = config_experts(config)
    for key in EXPERT_COUNT_KEYS:
        declared = raw.get(key)
        if isinstance(declared, int) and declared != getattr(config, key, declared):
            raise ValueError(
                f"config.json in {directory} declares {key} = {declared} experts, but the model transformers "
                f"builds from it has {built} ({_other_keys(raw, key)}) and the safetensors hold "
                f"{files_experts(reader)} per MoE layer: make config.json's expert counts agree"
            )


def _other_keys(raw: dict, key: str) -> str:
    return ", ".join(f"{k} = {raw[k]}" for k in EXPERT_COUNT_KEYS if k != key and k in raw) or "its default"


def files_experts(reader: CheckpointReader) -> int | str:
    """How many experts a MoE layer of ``reader``'s checkpoint holds: the per-expert tensors'
    highest index + 1, else the fused ``gate_up_proj``'s dim 0 (``"none"`` in a dense checkpoint)."""
    indices = {int(m.group(1)) for k in reader if (m := re.search(r"\.experts\.(\d+)\.", k))}
    if indices:
        return max(indices) + 1
    fused = next((k for k in reader if k.endswith(".experts.gate_up_proj")), None)
    return reader.spec(fused)[0][0] if fused else "none"


def experts_transposed(config) -> bool:
    """Whether ``config``'s model stores its fused experts input-major (Llama 4)."""
    return config.model_type == "llama4_text"


@dataclass(frozen=True)
class Source:
    """``keys``: one tensor, or one per expert stacked on dim 0 (``stacked``); ``fused``: the
    parameter is rows ``[offset, offset + I)`` of dim 1 of a fused ``(E, 2I, D)`` tensor;
    ``transposed``: the tensor holds the parameter's dims 1 and 2 swapped."""

    keys: tuple[str, ...]
    stacked: bool = False
    fused: bool = False
    offset: int = 0
    transposed: bool = False

    def check(self, reader: CheckpointReader, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
        """``ValueError`` naming the tensor and ``name`` unless every key fits a parameter of ``shape``."""
        for key in self.keys:
            want = shape[1:] if self.stacked else (shape[0], 2 * shape[1], *shape[2:]) if self.fused else shape
            reader.check(key, _swap12(want) if self.transposed else want, dtype, name)

    def read(self, reader: CheckpointReader, box: Box) -> torch.Tensor:
        """The parameter's ``box`` (each expert's box where stacked; shifted rows where fused)."""
        if self.stacked:
            (first, stop), rest = box[0], box[1:]
            return torch.stack([reader.read(self.keys[e], rest) for e in range(first, stop)])
        if self.fused:
            (lo, hi) = box[1]
            box = (box[0], (lo + self.offset, hi + self.offset), *box[2:])
        if self.transposed:
            return reader.read(self.keys[0], _swap12(box)).transpose(1, 2)
        return reader.read(self.keys[0], box)


def _swap12(dims: tuple) -> tuple:
    return (dims[0], dims[2], dims[1], *dims[3:])


def checkpoint_source(
    name: str, shape: tuple[int, ...], reader: CheckpointReader, tied: bool, transposed: bool = False
) -> Source:
    """Where parameter ``name`` (of ``shape``) comes from in ``reader``'s checkpoint (module
    docstring); ``transposed``: the model's fused experts are stored input-major (Llama 4)."""
    block, _, leaf = name.rpartition(".experts.")
    if block and leaf in EXPERT_TENSORS:
        return _experts(name, block, leaf, shape, reader, transposed)
    mixtral = name.replace(".mlp.", ".block_sparse_moe.")
    if name not in reader and mixtral in reader:
        return Source((mixtral,))
    if name not in reader and tied and name == "lm_head.weight":
        return Source(("model.embed_tokens.weight",))
    if name not in reader:
        raise ValueError(f"parameter {name!r} is not in the checkpoint at {reader.directory}")
    return Source((name,))


def _experts(
    name: str, block: str, leaf: str, shape: tuple[int, ...], reader: CheckpointReader, transposed: bool
) -> Source:
    """A stacked experts parameter's source: transformers' fused tensors, else the hub's per-expert
    ones; ``ValueError`` naming the first expert tensor the checkpoint lacks."""
    fused = f"{block}.experts.gate_up_proj"
    if leaf != "down_proj" and fused in reader:
        return Source((fused,), fused=True, offset=0 if leaf == "gate_proj" else shape[1], transposed=transposed)
    if leaf == "down_proj" and name in reader:  # (E, D, I): the fused layout's own name and shape
        return Source((name,), transposed=transposed)
    layouts = [(block, EXPERT_TENSORS[leaf][0]), (block.replace(".mlp", ".block_sparse_moe"), EXPERT_TENSORS[leaf][1])]
    for prefix, hub in layouts:
        keys = tuple(f"{prefix}.experts.{e}.{hub}.weight" for e in range(shape[0]))
        if any(k in reader for k in keys):
            missing = [k for k in keys if k not in reader]
            if missing:
                raise ValueError(
                    f"checkpoint at {reader.directory} lacks expert tensor {missing[0]!r} (for {name!r})"
                    + _fewer_experts(len(keys), len(keys) - len(missing), keys[-len(missing) :] == tuple(missing))
                )
            return Source(keys, stacked=True)
    raise ValueError(f"parameter {name!r}: no per-expert or fused expert tensors of {block} in {reader.directory}")


def _fewer_experts(declared: int, held: int, tail: bool) -> str:
    """The missing-expert message's end when the checkpoint holds only the first experts."""
    return f": config.json declares {declared} experts, the checkpoint holds {held} (0..{held - 1})" if tail else ""
