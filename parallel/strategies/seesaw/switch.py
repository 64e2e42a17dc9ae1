"""Seesaw's layout switch: one model in a prefill layout and a decode layout, weights moved at transitions.

Two module trees of the same model live side by side, one per phase, built for that phase's
:class:`ParallelDims`; only the active one holds weights. A transition moves every weight from one
tree to the other through the movement core (``weights="move"``: one coalesced plan, minimal
bytes) or re-reads each rank's new shards from a shared-memory CPU copy (``weights="reload"``, the
paper's way).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reshard.api import assign_tensor
from reshard.dtensor import wrap_local
from reshard.executor import DEFAULT_BUCKET_BYTES, execute
from reshard.parallel.model.dims import ParallelDims, device_type
from reshard.parallel.model.layouts import global_layout
from reshard.parallel.model.pipeline import build_model
from reshard.plan import plan_transfer
from reshard.shm import map_shared
from reshard.weight_store import SharedWeightStore

PHASES = ("prefill", "decode")
WEIGHT_MODES = ("move", "reload")


@dataclass(frozen=True)
class TransitionStats:
    """One weight transition, as seen by this rank (bytes are over all ranks)."""

    to: str  # the phase switched to
    bytes: int  # moved between ranks (move) or read from the CPU copy (reload)
    lower_bound_bytes: int  # what any rank-to-rank move must transfer
    seconds: float
    peak_weight_bytes: int  # this rank's weights of both layouts + transfer buffers, at the peak


class LayoutSwitch:
    """One model in a prefill layout and a decode layout; :meth:`switch` moves the weights.

    The prefill tree is loaded from ``path`` and active first; the decode tree starts empty.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        prefill: ParallelDims,
        decode: ParallelDims,
        *,
        weights: str = "move",
        dtype: torch.dtype | None = None,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        allow_unused: bool = False,
    ) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        if prefill.world_size != decode.world_size:
            raise ValueError(
                f"prefill layout has {prefill.world_size} ranks but decode layout has "
                f"{decode.world_size}; both must span the same ranks"
            )
        self.dims = {"prefill": prefill, "decode": decode}
        self.models = {
            "prefill": build_model(path, prefill, dtype=dtype, allow_unused=allow_unused),
            "decode": build_model(path, decode, dtype=dtype, load_weights=False),
        }
        release_weights(self.models["decode"])
        self.active = "prefill"
        self.weights = weights
        self.bucket_bytes = bucket_bytes
        self.history: list[TransitionStats] = []
        self.store = self._make_store() if weights == "reload" else None

    def _make_store(self) -> SharedWeightStore:
        """Every rank writes the prefill shards it is first to hold; after the barrier the store is full."""
        store = map_shared("reshard-weights", lambda p: SharedWeightStore.for_module(self.models["prefill"], p))
        rank = dist.get_rank()
        for name, p in self.models["prefill"].named_parameters():
            store.write(name, p, rank)
        dist.barrier()
        return store

    def switch(self, phase: str) -> TransitionStats:
        """Make ``phase``'s tree hold the weights and release the other one's (collective)."""
        if phase not in PHASES or phase == self.active:
            raise ValueError(f"cannot switch from {self.active!r} to {phase!r}")
        src, dst = self.models[self.active], self.models[phase]
        t0 = time.perf_counter()
        plans = self._plans(self.active, phase)
        moved, buffers = self._move(src, dst, plans) if self.store is None else (self._reload(phase), 0)
        peak = weight_bytes(src, dst) + buffers
        release_weights(src)
        stats = TransitionStats(phase, moved, sum(p.lower_bound_bytes for p in plans), time.perf_counter() - t0, peak)
        self.active = phase
        self.history.append(stats)
        return stats

    def _plans(self, src_phase: str, dst_phase: str) -> list:
        src, dst = self.models[src_phase], self.models[dst_phase]
        dst_params = dict(dst.named_parameters())
        return [
            plan_transfer(global_layout(p, self.dims[src_phase]), global_layout(dst_params[n], self.dims[dst_phase]))
            for n, p in src.named_parameters()
        ]

    def _move(self, src: nn.Module, dst: nn.Module, plans: list) -> tuple[int, int]:
        """Rank-to-rank through the movement core; returns (bytes sent by all ranks, this rank's
        largest send + receive buffers)."""
        rank = dist.get_rank()
        params = list(src.named_parameters())
        locals_ = [p.to_local() if plan.src.box(rank) is not None else None for (_, p), plan in zip(params, plans)]
        outs, stats = execute(plans, locals_, bucket_bytes=self.bucket_bytes, device=_device_of(dst))
        for (name, _), out in zip(params, outs):
            _install(dst, name, None if out is None else _compact(out))
        return _sum_over_ranks(stats.bytes_sent), stats.peak_extra_bytes

    def _reload(self, phase: str) -> int:
        """Each rank copies its boxes of ``phase``'s layout out of the shared CPU copy."""
        rank = dist.get_rank()
        before = self.store.bytes_read
        dst = self.models[phase]
        for name, p in dst.named_parameters():
            box = global_layout(p, self.dims[phase]).box(rank)
            _install(dst, name, None if box is None else self.store.read(name, box, _device_of(dst)))
        return _sum_over_ranks(self.store.bytes_read - before)

    def close(self) -> None:
        """Drop the CPU weight copy's mapping (not collective: its file is already unlinked)."""
        if self.store is not None:
            self.store.close()
            self.store = None


def release_weights(model: nn.Module) -> None:
    """Drop every parameter's local storage, keeping its mesh, placements and global shape."""
    for name, p in list(model.named_parameters()):
        assign_tensor(model, name, _empty_like_layout(p))


def weight_bytes(*models: nn.Module) -> int:
    """Bytes of the distinct storages behind this rank's parameter shards of ``models``."""
    seen = {}
    for model in models:
        for p in model.parameters():
            storage = p.to_local().untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _empty_like_layout(p) -> torch.Tensor:
    local = p.to_local()
    empty = torch.empty((0,) * p.dim(), dtype=p.dtype, device=local.device)
    return wrap_local(empty, p.device_mesh, p.placements, p.shape)


def _install(model: nn.Module, name: str, local: torch.Tensor | None) -> None:
    """Give ``name`` the local shard ``local`` (``None``: this rank holds none) in its layout."""
    p = model.get_parameter(name)
    if local is None:
        local = torch.empty((0,) * p.dim(), dtype=p.dtype, device=p.to_local().device)
    assign_tensor(model, name, wrap_local(local, p.device_mesh, p.placements, p.shape))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A view into a larger (source) storage is copied out, so releasing the source frees memory."""
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone(memory_format=torch.contiguous_format)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).to_local().device


def _sum_over_ranks(n: int) -> int:
    t = torch.tensor([n], dtype=torch.long, device=device_type())
    dist.all_reduce(t)
    return int(t.item())
