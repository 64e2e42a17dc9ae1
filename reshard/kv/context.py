"""The per-step view of the KV cache that attention layers consume.

An engine step flattens the new tokens of ``B`` sequences into ``N`` tokens (sequence-major).
:class:`AttentionContext` says where each token's K/V goes in the cache and which cached keys each
query may see. Prefill builds one from the step's lengths; decode reuses :class:`DecodeInputs`,
persistent per-slot buffers updated in place, and runs every slot of the cache so that the cache
is read as a view (no gathered copy) and the step's shapes never change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reshard.kv.cache import KVCache


@dataclass(frozen=True)
class Chunked:
    """An attention pattern: a query sees the causal keys of its own ``size``-token chunk of the
    sequence (Llama 4's ``chunked_attention`` layers), as a mask key beside a sliding window's int."""

    size: int


@dataclass
class AttentionContext:
    """Metadata of one engine step: ``B`` sequences, ``N`` new tokens in total, flattened.

    ``gather``/``valid`` map the flat tokens to a padded ``(B, Tq)`` grid for the attention
    kernel (``single_token``: one token per sequence, the grid is the flat order itself). Masks
    are built once per step, per sliding window.
    """

    kv: KVCache
    slots: torch.Tensor | slice  # (B,) cache slot of each sequence; a slice when consecutive
    token_slots: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,) each token's position in its sequence
    rows: torch.Tensor  # (N,) where each token's K/V is written: storage row (slot or block) ...
    cols: torch.Tensor  # (N,) ... and column (position or offset in the block), from KVCache.locate
    query_positions: torch.Tensor  # (B, Tq), padded
    gather: torch.Tensor | None  # (B, Tq) index into the N flat tokens; None if single_token
    valid: torch.Tensor | None  # (B, Tq) bool; None if single_token
    kv_len: int
    single_token: bool = False
    parts: list = field(default_factory=list)  # [(a context, (n,) its tokens' flat indices)]: attended apart
    _masks: dict = field(default_factory=dict)
    _index: list = field(default_factory=list)  # [the paged cache's read index], once computed

    @staticmethod
    def build(
        kv: KVCache, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], *, kv_len: int | None = None
    ) -> AttentionContext:
        """Sequence ``i`` writes ``lengths[i]`` tokens at positions ``starts[i]...`` of slot
        ``slots[i]``. A step that mixes one-token sequences (decodes) with longer ones (prompt
        chunks) attends the two apart: the decodes are not padded to the longest chunk's queries."""
        ctx = AttentionContext._build(kv, slots, starts, lengths, kv_len=kv_len)
        ones = [i for i, n in enumerate(lengths) if n == 1]
        if kv_len is None and 0 < len(ones) < len(lengths):
            first = list(itertools.accumulate(lengths, initial=0))
            for group in (ones, [i for i, n in enumerate(lengths) if n != 1]):
                part = AttentionContext._build(kv, *([seq[i] for i in group] for seq in (slots, starts, lengths)))
                index = [t for i in group for t in range(first[i], first[i] + lengths[i])]
                ctx.parts.append((part, torch.tensor(index, device=ctx.positions.device)))
        return ctx

    @staticmethod
    def _build(
        kv: KVCache, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], *, kv_len: int | None = None
    ) -> AttentionContext:
        device = kv.k[0].device
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        offs = torch.arange(int(lengths_t.max()))
        valid = offs[None, :] < lengths_t[:, None]  # (B, Tq)
        first = torch.cumsum(lengths_t, 0) - lengths_t
        gather = torch.where(valid, first[:, None] + offs[None, :], torch.zeros_like(valid, dtype=torch.long))
        qpos = starts_t[:, None] + offs[None, :]  # (B, Tq)
        slots_t = torch.tensor(slots, dtype=torch.long)
        token_slots, positions = torch.repeat_interleave(slots_t, lengths_t).to(device), qpos[valid].to(device)
        rows, cols = kv.locate(token_slots, positions)
        return AttentionContext(
            kv=kv,
            slots=_as_slice(slots) or slots_t.to(device),
            token_slots=token_slots,
            positions=positions,
            rows=rows,
            cols=cols,
            query_positions=qpos.to(device),
            gather=gather.to(device),
            valid=valid.to(device),
            kv_len=max(int((starts_t + lengths_t).max()), kv_len or 0),
        )

    def mask(self, window: int | Chunked | None) -> torch.Tensor:
        """Bool ``(B, 1, Tq, kv_len)``: key allowed for query (causal, within ``window``: the last
        ``window`` positions, or the query's own chunk)."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | Chunked | None) -> torch.Tensor:
        kpos = torch.arange(self.kv_len, device=self.query_positions.device)
        qpos = self.query_positions[:, :, None]
        allowed = kpos[None, None, :] <= qpos
        if isinstance(window, Chunked):
            allowed &= (qpos // window.size) == (kpos // window.size)[None, None, :]
        elif window is not None:
            allowed &= (qpos - kpos[None, None, :]) < window
        if self.valid is not None:
            allowed[~self.valid] = False
            allowed[..., 0] |= ~self.valid  # padded query rows see one key: no NaN
        return allowed.unsqueeze(1)

    def read_index(self) -> torch.Tensor | None:
        """The cache's gather index for this step's reads (:meth:`KVCache.read_index`), computed
        once for every layer (None: a contiguous cache reads views)."""
        if not self._index:
            self._index.append(self.kv.read_index(self.slots, self.kv_len))
        return self._index[0]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float,
        window: int | Chunked | None,
    ) -> torch.Tensor:
        """Write this step's K/V, attend over the cache. ``q``/``k``/``v``: ``(1, N, H, hd)``.

        Returns ``(1, N, Hq, hd)``.
        """
        self.kv.write(layer, self.rows, self.cols, k[0], v[0])
        if not self.parts:
            return self._attend_cached(layer, q, scaling=scaling, window=window)
        out = torch.empty_like(q)  # (1, N, Hq, hd)
        for part, index in self.parts:
            out[0, index] = part._attend_cached(layer, q[:, index], scaling=scaling, window=window)[0]
        return out

    def _attend_cached(
        self, layer: int, q: torch.Tensor, *, scaling: float, window: int | Chunked | None
    ) -> torch.Tensor:
        """``q`` ``(1, N, Hq, hd)`` over the cache as it holds this step's K/V; ``(1, N, Hq, hd)``."""
        keys, values = self.kv.read(layer, self.slots, self.kv_len, self.read_index())  # (B, Hkv, L, hd)
        if self.single_token:
            qp = q[0].unsqueeze(2)  # (B, Hq, 1, hd)
        else:
            qp = q[0][self.gather].transpose(1, 2)  # (B, Hq, Tq, hd)
        out = F.scaled_dot_product_attention(
            qp, keys, values, attn_mask=self.mask(window), scale=scaling, enable_gqa=True
        )
        if self.single_token:
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1, q.shape[-1])
        return out.transpose(1, 2)[self.valid].unsqueeze(0)  # (1, N, Hq, hd)


def _as_slice(slots: Sequence[int]) -> slice | None:
    """Consecutive ascending slots read the cache as a view instead of a gathered copy."""
    first = slots[0]
    return slice(first, first + len(slots)) if list(slots) == list(range(first, first + len(slots))) else None


class DecodeInputs:
    """Persistent per-slot inputs of a decode step over every slot of ``kv`` (updated in place).

    Slot ``i`` reads token ``ids[i]`` at position ``positions[i]``; an idle slot is pointed at the
    cache's scratch column, so its (wasted) write touches nothing any sequence reads. ``ids`` and
    ``positions`` are the rows of one buffer, written whole from a host copy once per step; a
    contiguous cache's storage rows and columns are the slot ids and positions themselves.
    """

    def __init__(self, kv: KVCache, device: torch.device | str) -> None:
        n = kv.spec.num_slots
        self.kv, self.device = kv, device
        self._host = [[0] * n, [kv.spec.scratch] * n]  # ids, positions: what the device buffer holds
        self._buffer = torch.tensor(self._host, dtype=torch.long, device=device)  # (2, n)
        self.ids, self.positions = self._buffer[0], self._buffer[1]
        self.slot_ids = torch.arange(n, device=device)
        self.rows, self.cols = self.slot_ids, self.positions  # (contiguous: where each slot's K/V goes)
        if kv.spec.paged:  # (rows and columns from the block table, per step)
            self.rows, self.cols = self.slot_ids.clone(), self.positions.clone()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def update(self, slots: Sequence[int], ids: Sequence[int], positions: Sequence[int]) -> None:
        """The step's running sequences: ``ids[j]`` at ``positions[j]`` in slot ``slots[j]`` (every
        other slot keeps its id and goes to the scratch position)."""
        host_ids, host_positions = self._host[0], [self.kv.spec.scratch] * len(self._host[1])
        for slot, token, position in zip(slots, ids, positions):
            host_ids[slot], host_positions[slot] = token, position
        self._host[1] = host_positions
        self._buffer.copy_(torch.tensor(self._host, dtype=torch.long, device=self.device))
        if self.kv.spec.paged:
            rows, cols = self.kv.locate(self.slot_ids, self.positions)
            self.rows.copy_(rows)
            self.cols.copy_(cols)

    def context(self, start: int, stop: int, kv_len: int) -> AttentionContext:
        """The view of slots ``[start, stop)`` attending over ``kv_len`` cached positions."""
        if (start, stop) not in self._views:  # views of the buffers: a step's values, read in place
            positions = self.positions[start:stop]
            self._views[start, stop] = (
                self.slot_ids[start:stop],
                positions,
                self.rows[start:stop],
                self.cols[start:stop],
                positions[:, None],
            )
        token_slots, positions, rows, cols, query_positions = self._views[start, stop]
        return AttentionContext(
            kv=self.kv,
            slots=slice(start, stop),
            token_slots=token_slots,
            positions=positions,
            rows=rows,
            cols=cols,
            query_positions=query_positions,
            gather=None,
            valid=None,
            kv_len=kv_len,
            single_token=True,
        )
