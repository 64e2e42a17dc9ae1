"""Weight sources: where a layer's weights come from for the forward that is running.

A layer holds its own parameters (the HF state-dict keys) and, optionally, alternatives keyed by a
source name: Shift parallelism's full-TP copy or slice of a weight, later a cache slot that a
remote weight is fetched into. The runner selects one source name for a whole forward
(:func:`use_weights`); a layer without that source uses its own parameters. Layers keep no mode
of their own, so no engine can leave a shared model in another engine's mode.

The selection belongs to the thread running the forward (a ``threading.local``), not to the
process: a forward on another thread (a background fetch, a second engine) sees its own selection,
``None`` unless it selects one. Not a ``contextvars.ContextVar``: TorchDynamo cannot trace
``ContextVar.get`` (a graph break in every linear layer of a compiled step, torch 2.13), while it
reads a ``threading.local`` attribute and guards on its value, so a compiled step recompiles per
source instead of running with the wrong weights.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from torch.distributed.tensor import DTensor

_SELECTED = threading.local()  # .source: the name selected on this thread (unset or None: own parameters)


@dataclass(frozen=True)
class LinearWeights:
    """The weight and bias a linear layer computes with, and how its input gradient is reduced."""

    weight: DTensor
    bias: DTensor | None
    input_grad: str  # "sharded" | "all" (see ParallelLinear)


class WeightSource(Protocol):
    """Supplies a layer's weights when its name is selected; may wait for them (a prefetch)."""

    def get(self) -> LinearWeights: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class StaticWeights:
    """Weights held in memory for the layer's whole life (a copy, or views of its own shards)."""

    weights: LinearWeights
    nbytes: int = 0  # extra bytes this rank holds for them (0 for views)

    def get(self) -> LinearWeights:
        return self.weights


def active_source() -> str | None:
    """The source name selected for the forward running on this thread (``None``: own parameters)."""
    return getattr(_SELECTED, "source", None)  # getattr with a default: TorchDynamo guards on it


@contextmanager
def use_weights(source: str | None) -> Iterator[None]:
    """Run the enclosed forwards of this thread with every layer's ``source`` weights (``None``:
    own parameters); the previous selection comes back on exit, nested selections included."""
    previous = active_source()
    _SELECTED.source = source
    try:
        yield
    finally:
        _SELECTED.source = previous


def weight_copies(model) -> dict[str, DTensor]:
    """Every separate copy a layer holds of its weights, keyed ``"<parameter name>@<source>"``
    (views of the layer's own shards are left out: writing the parameter updates them)."""
    out: dict[str, DTensor] = {}
    for prefix, module in model.named_modules():
        for source, held in getattr(module, "sources", {}).items():
            if not isinstance(held, StaticWeights) or held.nbytes == 0:
                continue
            out[f"{prefix}.weight@{source}"] = held.weights.weight
            if held.weights.bias is not None:
                out[f"{prefix}.bias@{source}"] = held.weights.bias
    return out
