"""``parallelize``: swap an HF model's modules for drop-in parallel layers and load each rank's slices."""

from __future__ import annotations

import copy
import fnmatch
import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from reshard import Layout
from reshard.layout import box_slices
from reshard.parallel.model.checkpoint import CheckpointReader, resolve_checkpoint
from reshard.parallel.model.dims import ParallelDims, device_type
from reshard.parallel.model.info import LoadStats, ParallelInfo
from reshard.parallel.model.plans import BuildContext, MeshOf, ParallelStyle, tp_plan
from reshard.parallel.model.sources import (
    Source,
    check_expert_count,
    checkpoint_source,
    config_experts,
    experts_transposed,
)
from reshard.parallel.model.weight_sync import split_fused, train_tensors

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "llama4_text")


def check_architecture(config) -> None:
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        name = (config.architectures or [config.model_type])[0]
        raise ValueError(
            f"unsupported architecture {name!r} (model_type {config.model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def check_ep(config, dims: ParallelDims) -> None:
    """``ValueError`` when ``dims.ep`` splits the experts of a model that has none (a dense model
    would otherwise ignore it)."""
    if dims.ep > 1 and not config_experts(config):
        name = (config.architectures or [config.model_type])[0]
        raise ValueError(
            f"ep ({dims.ep}) splits a mixture-of-experts model's experts over ranks, but {name} "
            f"(model_type {config.model_type!r}) has no experts: leave ep at 1"
        )


def parallelize(
    model_or_path: nn.Module | str | os.PathLike,
    dims: ParallelDims | None = None,
    *,
    plan: Mapping[str, ParallelStyle] | None = None,
    dtype: torch.dtype | None = None,
    mesh_of: MeshOf | None = None,
    load_weights: bool = True,
    allow_unused: bool = False,
    inplace: bool = False,
) -> nn.Module:
    """An HF causal LM whose modules (named in ``plan``) are our parallel layers, with its
    :class:`ParallelInfo` as ``model.parallel_info`` (``dims``, ``load_stats``, weight version).

    From a path or hub id, the model skeleton is built on the meta device and every rank reads only
    its own slices from the safetensors files (``parallel_info.load_stats`` counts the bytes). From a model
    object, each rank slices its parameters from the model it already holds, into a model of its
    own: the caller's module (its parameters, ties, mode, config) is not touched, unless
    ``inplace`` swaps its modules for ours where it stands (its optimizer then holds parameters
    the model no longer uses). ``mesh_of(name)`` is
    the mesh each module lives on (default: this rank's tp mesh; a pipeline stage's tp mesh, where a
    rank reads only its stage's slices; Shift's ``(sp, tp)`` base mesh). ``load_weights=False``
    (from a path) leaves the parameters uninitialized. Every checkpoint tensor's shape and dtype is
    checked against the parameter it fills before any mesh is made (the first collective: a bad
    checkpoint fails on every rank alike, none left waiting); checkpoint tensors the model does not
    use are an error unless ``allow_unused``.
    """
    dims = dims if dims is not None else ParallelDims.from_world(tp=_world_size())
    plan = plan if plan is not None else tp_plan()
    if isinstance(model_or_path, nn.Module):
        return _parallelize_module(model_or_path, dims, plan, mesh_of, inplace)
    return _parallelize_path(model_or_path, dims, plan, dtype, mesh_of, load_weights, allow_unused)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _parallelize_path(path, dims, plan, dtype, mesh_of=None, load_weights=True, allow_unused=False) -> nn.Module:
    from transformers import AutoConfig

    directory = resolve_checkpoint(path)
    config = AutoConfig.from_pretrained(directory)
    check_architecture(config)
    check_ep(config, dims)
    reader = CheckpointReader(directory) if load_weights else None  # (a config alone builds unloaded)
    dtype = dtype or _config_dtype(config)
    model = _meta_model(config, dtype)
    if reader is not None:  # every tensor checked against the model before the first collective
        check_expert_count(directory, config, reader)
        sources = check_checkpoint(train_tensors(model), config, reader, allow_unused=allow_unused)
    _swap_modules(model, plan, BuildContext(config, dims, dtype, device_type(), mesh_of=mesh_of))
    if reader is not None:
        _read(model, reader, sources)
    _rebuild_rotary(model, device_type())
    model.generation_config = generation_config(directory, model.generation_config)
    stats = LoadStats(reader.bytes_read, reader.total_bytes(), str(directory)) if reader else LoadStats(0, 0)
    model.parallel_info = ParallelInfo(dims, stats)
    return model.eval()


def _skeleton(config, dims, plan, dtype: torch.dtype, mesh_of) -> nn.Module:
    """The HF model of ``config`` built on the meta device with the ``plan``'s modules swapped for
    our layers (their parameters allocated, unread)."""
    model = _meta_model(config, dtype)
    _swap_modules(model, plan, BuildContext(config, dims, dtype, device_type(), mesh_of=mesh_of))
    return model


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The HF model of ``config`` on the meta device (no collective: no mesh yet)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def _parallelize_module(module: nn.Module, dims, plan, mesh_of=None, inplace=False) -> nn.Module:
    """Our model of ``module``'s weights; ``inplace``: ``module`` itself, its modules swapped."""
    check_architecture(module.config)
    check_ep(module.config, dims)
    transposed = experts_transposed(module.config)
    full = {k: v.detach() for name, t in module.state_dict().items() for k, v in split_fused(name, t, transposed)}
    dtype = next(iter(full.values())).dtype
    if inplace:
        _swap_modules(module, plan, BuildContext(module.config, dims, dtype, device_type(), mesh_of=mesh_of))
        model = module
    else:  # (HF's from_config writes into the config it is given: a copy)
        model = _skeleton(copy.deepcopy(module.config), dims, plan, dtype, mesh_of)
        _rebuild_rotary(model, device_type())
    copy_full_state(model, full)
    if not inplace and hasattr(module, "generation_config"):  # (its EOS ids: generation_config.json's)
        model.generation_config = copy.deepcopy(module.generation_config)
    model.parallel_info = ParallelInfo(dims)
    return model.eval()


def copy_full_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Fill ``module``'s DTensor parameters from full tensors every rank holds (local slicing)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in module.named_parameters():
        box = Layout.of_dtensor(param).box(rank)
        if box is not None:  # off the parameter's mesh (another pipeline stage): nothing to copy
            param.data.to_local().copy_(state[name][box_slices(box)])


def generation_config(directory, default):
    """The checkpoint's ``generation_config.json`` as HF's ``from_pretrained`` reads it (its EOS
    ids end requests), else ``default`` (the one HF makes from the model's config)."""
    from transformers import GenerationConfig

    if not (Path(directory) / "generation_config.json").is_file():
        return default
    return GenerationConfig.from_pretrained(directory)


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def _swap_modules(model: nn.Module, plan: Mapping[str, ParallelStyle], ctx: BuildContext) -> None:
    """Replace each module whose name matches a plan key (``*`` = one name component)."""
    for name, module in list(model.named_modules()):
        style = _match(plan, name)
        if style is None:
            continue
        ctx.layer_idx, ctx.name = _layer_index(name), name
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, style.build(module, ctx))


def _match(plan: Mapping[str, ParallelStyle], name: str) -> ParallelStyle | None:
    for pattern, style in plan.items():
        if name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else 0


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, allow_unused: bool = False) -> None:
    """Read this rank's boxes of every parameter of ``model`` (built with ``load_weights=False``)
    from the checkpoint at ``path``; rank-local, no collective."""
    reader = CheckpointReader(resolve_checkpoint(path))
    params = dict(model.named_parameters())
    _read(model, reader, check_checkpoint(params, model.config, reader, allow_unused=allow_unused))


def check_checkpoint(
    params: Mapping[str, torch.Tensor], config, reader: CheckpointReader, *, allow_unused: bool
) -> dict[str, Source]:
    """Where each of ``params`` (our layers' names, global shapes: a model of them, or an HF
    model's :func:`train_tensors`) comes from in ``reader``'s checkpoint, after checking every
    tensor's shape and dtype and that the checkpoint holds nothing unused (``ValueError`` naming
    the first tensor that does not fit). Rank-local, no collective."""
    tied, transposed = bool(getattr(config, "tie_word_embeddings", False)), experts_transposed(config)
    sources = {name: checkpoint_source(name, tuple(p.shape), reader, tied, transposed) for name, p in params.items()}
    for name, p in params.items():
        sources[name].check(reader, tuple(p.shape), p.dtype, name)
    _check_unused(reader, {k for source in sources.values() for k in source.keys}, allow_unused)
    return sources


def _read(model: nn.Module, reader: CheckpointReader, sources: Mapping[str, Source]) -> None:
    """Copy each rank's box of every parameter from its checked ``sources`` into its local shard."""
    params = dict(model.named_parameters())
    assert params.keys() == sources.keys(), sorted(params.keys() ^ sources.keys())
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in params.items():
        box = Layout.of_dtensor(param).box(rank)
        if box is not None:  # off the parameter's mesh (another pipeline stage): nothing to read
            param.data.to_local().copy_(sources[name].read(reader, box))


def _check_unused(reader: CheckpointReader, used: set[str], allow_unused: bool) -> None:
    """HF reports checkpoint tensors the model does not use; a mismatched config.json (fewer
    layers) must not load silently."""
    unused = sorted(k for k in reader if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused and not allow_unused:
        raise ValueError(
            f"{len(unused)} tensors in the checkpoint at {reader.directory} are not used by "
            f"the model built from its config.json: {unused[:6]}{' ...' if len(unused) > 6 else ''}"
            f" (pass allow_unused=True to load anyway)"
        )


def _rebuild_rotary(model: nn.Module, device) -> None:
    """The rotary module's buffers were made on the meta device; build it again for real."""
    old = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(old)(config=model.config)
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not leftovers, f"tensors left on the meta device: {leftovers}"
