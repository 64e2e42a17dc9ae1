"""A model's weights moved to host memory and back in place (``LLM.release(weights=True)``).

The device storages of every parameter and buffer are copied to host and resized to nothing, as
FSDP2 frees unsharded parameters; :meth:`HostWeights.restore` re-allocates each storage and copies
the bytes back. The tensors and storages stay the same objects, so views into one storage (fused
projections), tied weights and DTensor parameters (their local shards) hold unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class HostWeights:
    """``models``' parameter and buffer storages, held on host while their device memory is freed."""

    def __init__(self, models: list[nn.Module]) -> None:
        storages = {}  # data_ptr -> storage: a storage shared by several tensors is saved once
        for model in models:
            for t in itertools.chain(model.parameters(), model.buffers()):
                local = t._local_tensor if isinstance(t, DTensor) else t
                storage = local.untyped_storage()
                if storage.nbytes() > 0:
                    storages.setdefault(storage.data_ptr(), storage)
        self.saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        for storage in storages.values():
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                host = host.pin_memory()
            host.copy_(storage)
            storage.resize_(0)
            self.saved.append((storage, host))

    @property
    def nbytes(self) -> int:
        """Device bytes freed (and held on host until :meth:`restore`)."""
        return sum(host.nbytes() for _, host in self.saved)

    def restore(self) -> None:
        """Re-allocate every storage and copy its bytes back (no-op when restored)."""
        for storage, host in self.saved:
            storage.resize_(host.nbytes())
            storage.copy_(host)
        self.saved = []


def allocated_caches(caches: list) -> list:
    """The distinct allocated KV caches among ``caches`` (None: a layout this rank is outside)."""
    return [kv for kv in {id(kv): kv for kv in caches if kv is not None}.values() if kv.allocated]


def release_runners(runners: list, caches: list, weights: bool, held: list, eager: bool) -> tuple[int, list]:
    """Free ``runners``' KV caches and ``caches`` (a connector's) and, with ``weights``, move their
    models' weights to host (:func:`release`); ``eager``: the runners decode eagerly from now on
    (a compile left to the default: the memory moves at every release, so graphs would re-record).
    Returns the device bytes freed and ``held`` with what was freed."""
    if eager:
        for runner in runners:
            runner.run_eagerly()
    models = [r.model for r in runners] if weights else []
    return release(allocated_caches([*(r.kv for r in runners), *caches]), models, held)


def release(caches: list, models: list[nn.Module], held: list) -> tuple[int, list]:
    """Free ``caches`` (KV caches: ``release()`` / ``restore()``) and move ``models``' weights to
    host (none: weights stay); returns the device bytes freed and ``held`` with what was freed."""
    freed, held = sum(kv.release() for kv in caches), held + caches
    if models and not any(isinstance(h, HostWeights) for h in held):
        held.append(HostWeights(models))
        freed += held[-1].nbytes
    return freed, held


def restore(held: list, tags: Collection[str]) -> list:
    """Restore what of ``held`` ``tags`` names (``"weights"``, ``"kv_cache"``); returns the rest."""
    back = [h for h in held if ("weights" if isinstance(h, HostWeights) else "kv_cache") in tags]
    for h in back:
        h.restore()
    return [h for h in held if not any(h is b for b in back)]
