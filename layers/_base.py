"""What every drop-in layer shares: ``redistribute()`` through the movement core, HF's activations."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from reshard import CommStats, redistribute_module
from reshard.executor import DEFAULT_BUCKET_BYTES

Targets = dict[str, tuple[DeviceMesh, tuple[Placement, ...]]]


def activation(name: str) -> torch.nn.Module:
    """HF's activation ``name`` (a config's ``hidden_act``), as its models build it. transformers
    is imported here, when a layer is built, not with this package: a process that only reads
    configs (the ``reshard`` command's checks before any rank starts) is spared its second of CPU."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def prefixed(prefix: str, targets: Targets) -> Targets:
    return {f"{prefix}.{k}": v for k, v in targets.items()}


def local_tensor(t: DTensor) -> torch.Tensor:
    """This rank's shard of ``t``, as ``t.to_local()`` gives it, for a forward to compute with.

    Without autograd the DTensor's own local tensor (TorchDynamo traces it too): ``to_local``
    hands a Parameter's out as a fresh view marked a Parameter, an op and attribute writes per
    weight per step (a decode step reads ~20). With autograd, ``to_local`` itself.
    """
    if torch.is_grad_enabled():
        return t.to_local()
    return t._local_tensor


class Redistributable:
    """Mixin: a layer names a target layout per parameter; the movement core moves them at once."""

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        raise NotImplementedError

    def redistribute(
        self, mesh: DeviceMesh, placements: Sequence[Placement], *, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    ) -> CommStats:
        """Move every parameter to the layer's layout for ``placements`` on ``mesh`` (in place).

        One coalesced transfer through :func:`reshard.redistribute_module`; returns its accounting.
        The forward follows the new placements.
        """
        targets = self.redistribute_targets(mesh, tuple(placements))
        stats = redistribute_module(self, targets, bucket_bytes=bucket_bytes)
        self._after_redistribute(mesh, tuple(placements))
        return stats

    def _after_redistribute(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
        pass
