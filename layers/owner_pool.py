"""Owner-pooled FFN (SiDP's layer): each decoder layer's FFN lives whole on exactly one rank of a
data-parallel group; the other ranks compute it from a cache slot (WaS) or by shipping their
activations to the owner (CaS).

- **WaS** (weight-as-a-service): a non-owner's forward waits until the layer's weights are in one
  of ``slots`` pre-allocated cache slots, runs the FFN from the slot and frees the slot. Who fills
  the slots, in which order and when, is a fetch scheduler's business (SiDP's lives with its
  strategy): it announces the layers of a step (:meth:`OwnerPool.begin_step`), takes a free slot
  (:meth:`OwnerPool.take_slot`), moves the bytes into it and hands it over (:meth:`OwnerPool.filled`).
- **CaS** (compute-as-a-service): for a non-owned layer a rank sends its FFN input to the owner,
  which concatenates every rank's rows into one GEMM, splits the output and sends each rank its
  part. A rank with no rows in the step (a dummy step) sends nothing and the owner skips it.

The FFN is the SwiGLU of :mod:`layers.mlp` over whole weights. The weight source of the forward
(:data:`WAS` or :data:`CAS`) selects the mode; every rank of the group starts each step with the
same rows per rank and runs its layers in order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reshard.layers.mlp import swiglu_weights
from reshard.layers.weights import active_source

WAS, CAS = "sidp:was", "sidp:cas"  # the weight-source names the runners select


@dataclass
class PoolCounters:
    """What the pooled FFNs did on this rank."""

    cas_layers: int = 0  # non-owned FFNs computed by their owners for this rank
    cas_bytes: int = 0  # activation bytes this rank sent and received
    owner_gemms: int = 0  # fused GEMMs this rank ran as an owner for other ranks
    dummy_skips: int = 0  # (layer, rank) CaS exchanges skipped because the rank had no rows
    wait_seconds: float = 0.0  # compute thread waiting for slots


class OwnerPool:
    """The FFN weights of ``mlps`` (one per decoder layer, whole on every rank when given)
    pooled over the ``ranks`` of a data-parallel group: layer ``j`` is owned by ``ranks[j % G]``
    (round-robin; every layer has the same size). Non-owners free their copy; every rank keeps
    ``slots`` cache slots, each one layer's weights (gate | up | down, one flat buffer).
    ``timeout``: seconds a forward waits for a slot's weights.
    """

    def __init__(self, mlps: list[nn.Module], ranks: list[int], *, slots: int = 2, timeout: float = 60.0) -> None:
        self.ranks = list(ranks)
        self.rank = dist.get_rank()
        self.G = len(ranks)
        self.slots, self.timeout = slots, timeout
        self.act = mlps[0].act_fn
        self.owner = [self.ranks[j % self.G] for j in range(len(mlps))]
        self.shapes = [tuple(w.shape) for w in _weights(mlps[0])]
        self.dtype, device = _weights(mlps[0])[0].dtype, _weights(mlps[0])[0].device
        # one flat buffer per owned layer and per slot (gate | up | down): a fetch is one message
        self.flat = {j: _take(m) if self.owner[j] == self.rank else _free(m) for j, m in enumerate(mlps)}
        self.weights = {j: _split(f, self.shapes) for j, f in self.flat.items() if f is not None}
        numel = sum(_numel(sh) for sh in self.shapes)
        self.slot_flat = [torch.empty(numel, dtype=self.dtype, device=device) for _ in range(slots)]
        self.slot_tensors = [_split(f, self.shapes) for f in self.slot_flat]
        self.counters = PoolCounters()
        self.rows: list[int] = [0] * self.G  # the step's FFN input rows per group rank (CaS owners)
        self._ready: dict[int, tuple[threading.Event, int]] = {}  # layer -> (filled, slot)
        self._free_slots: list[int] = list(range(slots))
        self._cv = threading.Condition()
        self._error: BaseException | None = None

    # ---- accounting -----------------------------------------------------------------------------
    def ffn_bytes(self) -> int:
        """FFN weight bytes this rank holds for the layers it owns (slots not counted)."""
        return sum(_nbytes(f) for f in self.flat.values() if f is not None)

    def slot_bytes(self) -> int:
        return sum(_nbytes(f) for f in self.slot_flat)

    def weights_dim(self) -> int:
        """The FFN's input and output size ``D``."""
        return self.shapes[0][1]

    # ---- one step: the slots' hand-over between a fetch scheduler and the forward ---------------
    def begin_step(self, rows: list[int], fetched: list[int]) -> None:
        """A step starts: ``rows[g]`` FFN input rows on each group rank (0: a dummy step), and the
        layers ``fetched`` will arrive in slots (WaS; empty in CaS). Every slot is free."""
        assert len(rows) == self.G, (rows, self.G)
        self.rows = list(rows)
        self._ready = {j: (threading.Event(), -1) for j in fetched}
        self._free_slots, self._error = list(range(self.slots)), None

    def take_slot(self) -> int:
        """A free slot for the next fetch (blocks until the forward frees one)."""
        with self._cv:
            while not self._free_slots:
                if not self._cv.wait(self.timeout):
                    raise TimeoutError(f"rank {self.rank}: no FFN cache slot was freed within {self.timeout} s")
            return self._free_slots.pop()

    def filled(self, layer: int, slot: int) -> None:
        """Layer ``layer``'s weights are in ``slot``: its forward may run."""
        event, _ = self._ready[layer]
        self._ready[layer] = (event, slot)
        event.set()

    def fail(self, error: BaseException) -> None:
        """The fetches failed: every forward waiting for a slot raises ``error``."""
        self._error = error
        for event, _ in self._ready.values():
            event.set()

    def _release(self, slot: int) -> None:
        with self._cv:
            self._free_slots.append(slot)
            self._cv.notify()

    # ---- the FFN ----------------------------------------------------------------------------------
    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``j``'s FFN of ``x`` ``(..., D)`` in the step's mode (the active weight source)."""
        if self.owner[j] == self.rank and active_source() != CAS:
            return self.owned_ffn(j, x)
        if active_source() == CAS:
            return self._cas(j, x)
        return self._was(j, x)

    def owned_ffn(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``j``'s FFN (owned here) of ``x`` ``(..., D)``."""
        return swiglu_weights(x, self.weights[j], self.act)

    def _was(self, j: int, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        event, _ = self._ready[j]
        if not event.wait(self.timeout):
            raise TimeoutError(
                f"rank {self.rank}: FFN weights of layer {j} did not arrive from rank "
                f"{self.owner[j]} within {self.timeout} s"
            )
        if self._error is not None:
            raise self._error
        slot = self._ready[j][1]
        self.counters.wait_seconds += time.perf_counter() - t0
        y = swiglu_weights(x, self.slot_tensors[slot], self.act)
        self._release(slot)
        return y

    def _cas(self, j: int, x: torch.Tensor) -> torch.Tensor:
        owner, d = self.owner[j], x.shape[-1]
        rows = x.reshape(-1, d)  # (N, D)
        if owner != self.rank:
            return self._cas_client(owner, rows).view_as(x)
        return self._cas_owner(j, rows).view_as(x)

    def _cas_client(self, owner: int, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        _wait([dist.P2POp(dist.isend, rows.contiguous(), owner), dist.P2POp(dist.irecv, out, owner)])
        self.counters.cas_layers += 1
        self.counters.cas_bytes += 2 * _nbytes(rows)
        return out

    def _cas_owner(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (dummy ranks skipped) through one GEMM; each rank gets its part back."""
        d, peers = rows.shape[-1], [r for r in self.ranks if r != self.rank]
        counts = {r: self.rows[self.ranks.index(r)] for r in peers}
        self.counters.dummy_skips += sum(1 for r in peers if counts[r] == 0)
        inbound = {r: torch.empty(counts[r], d, dtype=rows.dtype, device=rows.device) for r in peers if counts[r]}
        _wait([dist.P2POp(dist.irecv, buf, r) for r, buf in inbound.items()])
        if not inbound and rows.shape[0] == 0:
            return rows
        fused = self.owned_ffn(j, torch.cat([rows, *inbound.values()]))  # one GEMM for all: (sum N, D)
        self.counters.owner_gemms += bool(inbound)
        parts = torch.split(fused, [rows.shape[0]] + [b.shape[0] for b in inbound.values()])
        _wait([dist.P2POp(dist.isend, part.contiguous(), r) for r, part in zip(inbound, parts[1:])])
        return parts[0]

    def serve_idle(self, j: int) -> None:
        """A dummy step on this rank (no rows of its own) in CaS mode: still serve layer ``j``
        (owned here) to the ranks that have rows."""
        assert self.owner[j] == self.rank, (j, self.owner[j], self.rank)
        self._cas_owner(j, torch.empty(0, self.weights_dim(), dtype=self.dtype, device=self.slot_flat[0].device))


class PooledMLP(nn.Module):
    """Drop-in for a decoder layer's MLP: its FFN from ``pool`` (owned, fetched or shipped)."""

    def __init__(self, pool: OwnerPool, layer: int) -> None:
        super().__init__()
        self.pool, self.layer = pool, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool.forward(self.layer, x)

    def idle(self) -> None:
        """A step without rows here (a dummy step): in CaS, an owner still serves its layer to
        the ranks that have rows (the runner calls this for each layer, in order)."""
        if active_source() == CAS and self.pool.owner[self.layer] == self.pool.rank:
            self.pool.serve_idle(self.layer)


def _weights(mlp: nn.Module) -> list[torch.Tensor]:
    """``[gate, up, down]`` whole weights (``(I, D)``, ``(I, D)``, ``(D, I)``) of a SwiGLU MLP."""
    ws = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return [w.to_local() if hasattr(w, "to_local") else w.data for w in ws]


def _take(mlp: nn.Module) -> torch.Tensor:
    """An owned FFN as one flat buffer (gate | up | down); the module's own copies are freed."""
    if any(getattr(p, "bias", None) is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        raise ValueError("SiDP's FFN pool takes bias-free SwiGLU MLPs (Llama, Qwen, Mistral)")
    flat = torch.cat([w.detach().reshape(-1) for w in _weights(mlp)])
    _free(mlp)
    return flat


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``flat`` with ``shapes``, in order."""
    out, at = [], 0
    for shape in shapes:
        out.append(flat[at : at + _numel(shape)].view(shape))
        at += _numel(shape)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _free(mlp: nn.Module) -> None:
    """Drop this rank's copy of a non-owned FFN (its storage goes back to the allocator)."""
    for w in _weights(mlp):
        w.untyped_storage().resize_(0)
    return None


def _wait(ops: list) -> None:
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
