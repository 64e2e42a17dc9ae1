"""SiDP's owner-based FFN weight pool: each decoder layer's FFN lives on exactly one rank of a
data-parallel group; the others either fetch it into a few cache slots ahead of use (WaS) or ship
their activations to the owner (CaS).

- **WaS** (weight-as-a-service): a housekeeper thread per rank fetches the next non-owned layers'
  FFN weights into ``slots`` pre-allocated cache slots over a background process group, as
  planned transfers of the movement core (the owner's housekeeper sends; its compute thread does
  nothing per fetch). Fetches run in rounds, every rank at most one layer per round; the compute
  thread waits on the layer's slot event before its FFN and releases the slot after it. With
  **peak shifting** each rank walks a cycle of G layers from its own offset, so in any round the
  ranks read from different owners (counted: ``max_concurrent_readers``).
- **CaS** (compute-as-a-service): for a non-owned layer a rank sends its FFN input to the owner,
  which concatenates every rank's rows into one GEMM, splits the output and sends each rank its
  part. A rank with no tokens in the step (a dummy step) sends nothing and the owner skips it.

The pool is collective per step: every rank of the group calls :meth:`FFNPool.begin_step` with
the same arguments (each rank's token count and the mode) and runs its layers in order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from reshard import Layout
from reshard.executor import execute
from reshard.layers.weights import active_source
from reshard.plan import plan_transfer

WAS, CAS = "sidp:was", "sidp:cas"  # the weight-source names the runners select


@dataclass
class PoolCounters:
    """What the pool did on this rank (identical schedule on every rank)."""

    fetches: int = 0  # layers fetched into slots by this rank
    fetch_bytes: int = 0  # bytes this rank received into slots
    max_concurrent_readers: int = 0  # most ranks reading one owner in one round (the schedule)
    cas_layers: int = 0  # non-owned FFNs computed by their owners for this rank
    cas_bytes: int = 0  # activation bytes this rank sent and received
    owner_gemms: int = 0  # fused GEMMs this rank ran as an owner for other ranks
    dummy_skips: int = 0  # (layer, rank) CaS exchanges skipped because the rank had no tokens
    wait_seconds: float = 0.0  # compute thread waiting for slots
    active_steps: dict = field(default_factory=lambda: {"sidp:was": 0, "sidp:cas": 0})  # steps with rows here
    dummy_steps: int = 0  # steps with no rows on this rank
    readers: dict = field(default_factory=dict)  # owner -> most readers in one round


class FFNPool:
    """The FFN weights of ``mlps`` (one per decoder layer, whole on every rank when given)
    pooled over the ``ranks`` of a data-parallel group: layer ``j`` is owned by ``ranks[j % G]``
    (round-robin; every layer has the same size). Non-owners free their copy.

    Args:
        slots: cache slots for fetched layers (WaS); ``prefetch_depth``: how many layers ahead a
            rank may fetch (at most ``slots``); ``peak_shifting``: each rank starts its cycle at
            its own offset (needs ``slots >= G - 1``).
    """

    def __init__(
        self,
        mlps: list[nn.Module],
        ranks: list[int],
        *,
        slots: int = 2,
        prefetch_depth: int = 2,
        peak_shifting: bool = True,
        timeout: float = 60.0,
    ) -> None:
        self.ranks, self.rank, self.G = list(ranks), dist.get_rank(), len(ranks)
        if not 1 <= prefetch_depth <= slots:
            raise ValueError(f"need 1 <= prefetch_depth ({prefetch_depth}) <= slots ({slots})")
        if peak_shifting and slots < self.G - 1:
            raise ValueError(
                f"peak shifting walks a cycle of {self.G} layers: it needs slots >= {self.G - 1}, got {slots}"
            )
        self.slots, self.depth, self.shift, self.timeout = slots, prefetch_depth, peak_shifting, timeout
        self.act = mlps[0].act_fn
        self.owner = [self.ranks[j % self.G] for j in range(len(mlps))]
        self.shapes = [tuple(w.shape) for w in _weights(mlps[0])]
        first = _weights(mlps[0])[0]  # every layer's weights share its dtype and device
        dtype, device = first.dtype, first.device
        # one flat buffer per owned layer and per slot (gate | up | down): a fetch is one message
        self.flat = {j: _take(m) if self.owner[j] == self.rank else _free(m) for j, m in enumerate(mlps)}
        self.weights = {j: _split(f, self.shapes) for j, f in self.flat.items() if f is not None}
        self.slot_flat = [
            torch.empty(sum(_numel(sh) for sh in self.shapes), dtype=dtype, device=device) for _ in range(slots)
        ]
        self.slot_tensors = [_split(f, self.shapes) for f in self.slot_flat]
        self.counters = PoolCounters()
        self._group = _background_group(self.ranks)
        self._events: dict[int, tuple[threading.Event, int]] = {}
        self._free_slots: list[int] = list(range(slots))
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.tokens: list[int] = [0] * self.G

    # ---- accounting -----------------------------------------------------------------------------
    def ffn_bytes(self) -> int:
        """FFN weight bytes this rank holds for the layers it owns (slots not counted)."""
        return sum(_nbytes(f) for f in self.flat.values() if f is not None)

    def slot_bytes(self) -> int:
        return sum(_nbytes(f) for f in self.slot_flat)

    # ---- one step ---------------------------------------------------------------------------------
    def begin_step(self, tokens: list[int], mode: str) -> None:
        """A step starts: ``tokens[g]`` rows on each group rank (0: a dummy step), ``mode`` WaS or CaS.
        In WaS the housekeeper starts fetching this rank's non-owned layers."""
        assert len(tokens) == self.G and mode in (WAS, CAS), (tokens, mode)
        self.end_step()
        self.tokens = list(tokens)
        if tokens[self.ranks.index(self.rank)]:
            self.counters.active_steps[mode] += 1
        else:
            self.counters.dummy_steps += 1
        if mode == WAS:
            rounds = self.schedule([t > 0 for t in tokens])
            self._count_readers(rounds)
            self._events = {j: (threading.Event(), -1) for j, o in enumerate(self.owner) if o != self.rank}
            self._thread = threading.Thread(
                target=self._housekeep, args=(rounds,), name="sidp-housekeeper", daemon=True
            )
            self._thread.start()

    def end_step(self) -> None:
        """Wait for the housekeeper (its errors reach the caller here)."""
        if self._thread is not None:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"SiDP housekeeper of rank {self.rank} did not finish its fetches in {self.timeout} s"
                )
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def schedule(self, active: list[bool]) -> list[list[tuple[int, int]]]:
        """Fetch rounds of a step: round ``t`` lists ``(reader rank, layer)``, one layer per active
        reader. Without peak shifting every reader walks its non-owned layers in order; with it,
        each cycle of G layers starting at the reader's own offset in the group."""
        orders = {r: self._order(r) for r, on in zip(self.ranks, active) if on}
        n = max((len(o) for o in orders.values()), default=0)
        return [[(r, o[t]) for r, o in orders.items() if t < len(o)] for t in range(n)]

    def _order(self, reader: int) -> list[int]:
        g = self.ranks.index(reader)
        layers = [j for j in range(len(self.owner)) if self.owner[j] != reader]
        if not self.shift:
            return layers
        out = []
        for c in range(0, len(self.owner), self.G):  # within each cycle, from the reader's offset
            cycle = [c + (g + 1 + t) % self.G for t in range(self.G) if c + (g + 1 + t) % self.G < len(self.owner)]
            out += [j for j in cycle if self.owner[j] != reader]
        return out

    def _count_readers(self, rounds) -> None:
        for rnd in rounds:
            per: dict[int, int] = {}
            for _, j in rnd:
                per[self.owner[j]] = per.get(self.owner[j], 0) + 1
            for o, n in per.items():
                self.counters.readers[o] = max(self.counters.readers.get(o, 0), n)
                self.counters.max_concurrent_readers = max(self.counters.max_concurrent_readers, n)

    # ---- WaS: the housekeeper -------------------------------------------------------------------
    def _housekeep(self, rounds) -> None:
        try:
            with torch.inference_mode():
                for rnd in rounds:
                    self._fetch_round(rnd)
        except BaseException as e:  # re-raised on the compute thread
            self._error = e
            for event, _ in self._events.values():
                event.set()

    def _fetch_round(self, rnd: list[tuple[int, int]]) -> None:
        mine = next((j for r, j in rnd if r == self.rank), None)
        slot = self._take_slot() if mine is not None else None
        plans, srcs, outs = [], [], []
        like = self.slot_flat[0]
        for reader, j in rnd:  # the layer's flat FFN: whole on its owner -> whole in the reader's slot
            shape = tuple(like.shape)
            plans.append(
                plan_transfer(
                    Layout((self.owner[j],), (Replicate(),), shape, like.dtype),
                    Layout((reader,), (Replicate(),), shape, like.dtype),
                )
            )
            srcs.append(self.flat[j] if self.owner[j] == self.rank else None)
            outs.append(self.slot_flat[slot] if reader == self.rank else None)
        _, stats = execute(plans, srcs, out=outs, group=self._group)
        if mine is not None:
            self.counters.fetches += 1
            self.counters.fetch_bytes += stats.bytes_received
            event, _ = self._events[mine]
            self._events[mine] = (event, slot)
            event.set()

    def fetch_round_once(self) -> None:
        """One fetch round of a step in which every rank reads (profiling); the slot is freed."""
        self._events = {j: (threading.Event(), -1) for j in range(len(self.owner))}
        with torch.inference_mode():
            self._fetch_round(self.schedule([True] * self.G)[0])
        self._events, self._free_slots = {}, list(range(self.slots))

    def _take_slot(self) -> int:
        with self._cv:
            while not self._free_slots:
                self._cv.wait(self.timeout)
            return self._free_slots.pop()

    def _release(self, slot: int) -> None:
        with self._cv:
            self._free_slots.append(slot)
            self._cv.notify()

    # ---- the FFN ----------------------------------------------------------------------------------
    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``j``'s FFN of ``x`` ``(..., D)`` in the step's mode (the active weight source)."""
        if self.owner[j] == self.rank and active_source() != CAS:
            return self._ffn(self.weights[j], x)
        if active_source() == CAS:
            return self._cas(j, x)
        return self._was(j, x)

    def _ffn(self, w, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = w
        return F.linear(self.act(F.linear(x, gate)) * F.linear(x, up), down)

    def _was(self, j: int, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        event, _ = self._events[j]
        if not event.wait(self.timeout):
            raise TimeoutError(
                f"rank {self.rank}: FFN weights of layer {j} did not arrive from rank "
                f"{self.owner[j]} within {self.timeout} s"
            )
        if self._error is not None:
            raise self._error
        slot = self._events[j][1]
        self.counters.wait_seconds += time.perf_counter() - t0
        y = self._ffn(self.slot_tensors[slot], x)
        self._release(slot)
        return y

    def _cas(self, j: int, x: torch.Tensor) -> torch.Tensor:
        owner, d = self.owner[j], x.shape[-1]
        rows = x.reshape(-1, d)
        if owner != self.rank:
            return self._cas_client(owner, rows).view_as(x)
        return self._cas_owner(j, rows).view_as(x)

    def _cas_client(self, owner: int, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        ops = [dist.P2POp(dist.isend, rows.contiguous(), owner), dist.P2POp(dist.irecv, out, owner)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.counters.cas_layers += 1
        self.counters.cas_bytes += 2 * _nbytes(rows)
        return out

    def _cas_owner(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (dummy ranks skipped) through one GEMM; each rank gets its part back."""
        d, peers = rows.shape[-1], [r for r in self.ranks if r != self.rank]
        counts = {r: self.tokens[self.ranks.index(r)] for r in peers}
        self.counters.dummy_skips += sum(1 for r in peers if counts[r] == 0)
        inbound = {r: torch.empty(counts[r], d, dtype=rows.dtype, device=rows.device) for r in peers if counts[r]}
        _wait([dist.P2POp(dist.irecv, buf, r) for r, buf in inbound.items()])
        if not inbound and rows.shape[0] == 0:
            return rows
        fused = self._ffn(self.weights[j], torch.cat([rows] + list(inbound.values())))  # one GEMM for all
        self.counters.owner_gemms += bool(inbound)
        parts = torch.split(fused, [rows.shape[0]] + [b.shape[0] for b in inbound.values()])
        _wait([dist.P2POp(dist.isend, part.contiguous(), r) for r, part in zip(inbound, parts[1:])])
        return parts[0]

    def serve_idle(self) -> None:
        """A dummy step on this rank (no tokens of its own) in CaS mode: still serve the layers it
        owns to the ranks that have tokens, in layer order."""
        slot = self.slot_tensors[0][0]
        empty = torch.empty(0, self.weights_dim(), dtype=slot.dtype, device=slot.device)
        for j, owner in enumerate(self.owner):
            if owner == self.rank:
                self._cas_owner(j, empty)

    def weights_dim(self) -> int:
        return self.slot_tensors[0][0].shape[1]


class PooledMLP(nn.Module):
    """Drop-in for a decoder layer's MLP: its FFN from ``pool`` (owned, fetched or shipped)."""

    def __init__(self, pool: FFNPool, layer: int) -> None:
        super().__init__()
        self.pool, self.layer = pool, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool.forward(self.layer, x)


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


_GROUPS: dict = {}


def _background_group(ranks: list[int]) -> dist.ProcessGroup:
    """The housekeepers' process group (created once per default group; collective)."""
    key = (id(dist.group.WORLD), tuple(ranks))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(range(dist.get_world_size())))
    return _GROUPS[key]
