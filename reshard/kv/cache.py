"""Preallocated KV cache, heads outermost (HND): contiguous slots or a paged block pool.

Contiguous (default): one slot of ``max_seq_len + 1`` positions per running sequence. Paged
(``block_size`` set): a pool of ``num_blocks`` blocks of ``block_size`` positions shared by all
slots, and a block table per slot, so capacity is counted in tokens; a sequence holds only the
blocks it needs, handed out by the policy and returned when it finishes. Both are addressed the
same way: a token's K/V lives at ``(row, :, col)`` of a layer's storage, ``row`` = the slot (or
the block from the slot's table) and ``col`` = the position (or the offset in the block).

Each rank stores the KV heads ``[head_start, head_start + num_heads)`` of the global
``num_kv_heads`` for layers ``[first_layer, first_layer + num_layers)``; with KV-head replication
several ranks hold the same range. The descriptor (:class:`KVLayout`) travels with the cache: a
reader (an attention layer, a tier, a peer) whose layout differs is refused when it attaches.

Every slot has ``max_seq_len + 1`` positions: the last one is a scratch column that decode steps
over all slots write for slots with no running sequence, so such a write never lands on a slot
another thread is filling (a swap-in) and is never read (no query attends past its position).
Paged, the pool's last block is the scratch block: idle slots write there, and table entries a
sequence does not own point there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reshard.mesh import device_type


@dataclass(frozen=True)
class KVLayout:
    """Which part of a model's KV a cache holds: global layers and KV heads, head dim, dtype."""

    first_layer: int
    num_layers: int
    head_start: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def covers(self, reader: KVLayout) -> bool:
        """Whether ``reader``'s layers lie in this layout's, with the same heads, head dim and dtype."""
        return (
            self.first_layer <= reader.first_layer
            and reader.first_layer + reader.num_layers <= self.first_layer + self.num_layers
            and (reader.head_start, reader.num_heads, reader.head_dim, reader.dtype)
            == (self.head_start, self.num_heads, self.head_dim, self.dtype)
        )

    def check(self, reader: KVLayout, who: str) -> None:
        """``ValueError`` naming both layouts unless this layout covers ``reader``'s."""
        if not self.covers(reader):
            raise ValueError(f"{who} expects KV layout {reader} but the cache holds {self}")


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_slots: int
    num_heads: int  # KV heads held on this rank
    max_seq_len: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    head_start: int = 0  # first global KV head held on this rank
    first_layer: int = 0  # global index of layer 0 here (a pipeline stage holds a block of layers)
    block_size: int | None = None  # paged: positions per block (None: contiguous slots)
    num_blocks: int | None = None  # paged: blocks in the pool (the scratch block not counted)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "num_heads", "max_seq_len", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")
        if (self.block_size is None) != (self.num_blocks is None):
            raise ValueError(
                f"a paged cache needs block_size and num_blocks, got block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}"
            )
        if self.paged and (self.block_size < 1 or self.num_blocks < 1):
            raise ValueError(f"KVSpec.block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}")

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def max_blocks(self) -> int:
        """Block-table columns per slot: blocks covering positions ``0..max_seq_len``."""
        return -(-(self.max_seq_len + 1) // self.block_size)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """KV tokens the cache holds for running sequences."""
        return self.num_blocks * self.block_size if self.paged else self.num_slots * self.max_seq_len

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def scratch(self) -> int:
        """The position decode writes for an idle slot (never read)."""
        return self.max_seq_len

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Storage per layer, for K and for V: ``(num_slots, num_heads, max_seq_len + 1, head_dim)``,
        paged ``(num_blocks + 1, num_heads, block_size, head_dim)`` (the last block is scratch)."""
        if self.paged:
            return (self.num_blocks + 1, self.num_heads, self.block_size, self.head_dim)
        return (self.num_slots, self.num_heads, self.max_seq_len + 1, self.head_dim)

    @property
    def bytes(self) -> int:
        n = 2 * self.num_layers * torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.first_layer, self.num_layers, self.head_start, self.num_heads, self.head_dim, self.dtype)


class KVCache:
    """K and V per layer, each ``(num_slots, num_heads, max_seq_len + 1, head_dim)``.

    ``storage``: flat ``uint8`` memory of ``spec.bytes`` bytes to hold K and V instead of zeroed
    memory of the cache's own (e.g. a shared-memory file, :func:`reshard.shm.map_file`; its
    contents are kept): every layer's K, then every layer's V, each ``spec.shape``. The cache is
    on ``storage``'s device; after :meth:`release`, :meth:`restore` allocates memory of its own.
    """

    def __init__(
        self, spec: KVSpec, device: torch.device | str | None = None, *, storage: torch.Tensor | None = None
    ) -> None:
        if storage is not None and (storage.dtype != torch.uint8 or storage.shape != (spec.bytes,)):
            raise ValueError(
                f"KV cache storage must be {spec.bytes} bytes (flat uint8) for {spec}; got "
                f"{storage.dtype} of shape {tuple(storage.shape)}"
            )
        self.spec = spec
        self.device = storage.device if storage is not None else device if device is not None else device_type()
        self.storage = storage
        self.k: list[torch.Tensor] = []
        self.table: torch.Tensor | None = None  # paged: (num_slots, max_blocks) block ids
        self.v: list[torch.Tensor] = []
        self.restore()

    @property
    def layout(self) -> KVLayout:
        return self.spec.layout

    def attach(self, reader: KVLayout, who: str) -> None:
        """A reader announces the layout it will read and write; ``ValueError`` unless covered."""
        self.layout.check(reader, who)

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def release(self) -> int:
        """Free the cache's memory (its contents are lost); returns the bytes freed."""
        freed = self.spec.bytes if self.allocated else 0
        self.k = []
        self.v = []
        self.table = None
        self.storage = None
        return freed

    def restore(self) -> None:
        """(Re)allocate a zeroed cache after :meth:`release` (no-op when allocated); at
        construction, lay K and V over the given storage."""
        if self.allocated:
            return
        s = self.spec
        with torch.inference_mode(False):  # plain tensors even when restored inside generate():
            # background swap threads (outside inference mode) write into them
            if self.storage is None:
                self.k = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
                self.v = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
            else:
                kv = self.storage.view(s.dtype).view(2 * s.num_layers, *s.shape)  # (2L, *shape): K layers, V layers
                self.k, self.v = list(kv[: s.num_layers]), list(kv[s.num_layers :])
            self.table = (
                torch.full((s.num_slots, s.max_blocks), s.scratch_block, dtype=torch.long, device=self.device)
                if s.paged
                else None
            )

    # ---- paged addressing -----------------------------------------------------------------------
    def assign(self, slot: int, blocks: list[int]) -> None:
        """Slot ``slot`` now holds a sequence whose positions live in ``blocks`` (in order)."""
        assert self.spec.paged and len(blocks) <= self.spec.max_blocks, (len(blocks), self.spec.max_blocks)
        row = torch.full((self.spec.max_blocks,), self.spec.scratch_block, dtype=torch.long, device=self.device)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.table[slot].copy_(row)

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, cols)`` of the storage where position ``positions[i]`` of slot ``slots[i]``
        lives. The scratch position (idle decode slots) maps to the scratch block, paged."""
        if not self.spec.paged:
            return slots, positions
        bs, scratch = self.spec.block_size, positions == self.spec.scratch
        rows = self.table[slots, torch.where(scratch, 0, positions) // bs]
        return torch.where(scratch, self.spec.scratch_block, rows), torch.where(scratch, 0, positions % bs)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of global layer ``index``."""
        index -= self.spec.first_layer
        return self.k[index], self.v[index]

    def write(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store per-token ``k``/``v`` ``(N, num_heads, head_dim)`` at ``(rows[i], :, cols[i])``
        (from :meth:`locate`)."""
        kc, vc = self.layer(layer)
        kc[rows, :, cols] = k
        vc[rows, :, cols] = v

    def read(
        self, layer: int, slots: torch.Tensor | slice, length: int, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``(len(slots), num_heads, length, head_dim)``: views for a slice of contiguous
        slots, copies otherwise (paged: the slots' positions gathered through the block table,
        by ``index`` from :meth:`read_index`, which a step computes once for all its layers)."""
        kc, vc = self.layer(layer)
        if not self.spec.paged:
            return kc[slots, :, :length], vc[slots, :, :length]
        index = self.read_index(slots, length) if index is None else index
        shape = (-1, self.spec.num_heads, length, self.spec.head_dim)
        return _take(kc, index).view(shape), _take(vc, index).view(shape)

    def read_index(self, slots: torch.Tensor | slice, length: int) -> torch.Tensor | None:
        """Paged: the flat index ``(B * num_heads * length,)`` into a layer's storage viewed as
        ``(num_blocks * num_heads * block_size, head_dim)`` rows that :meth:`read` gathers, in
        ``(B, H, length)`` order; None for a contiguous cache (it reads views)."""
        if not self.spec.paged:
            return None
        bs, h = self.spec.block_size, self.spec.num_heads
        positions = torch.arange(length, device=self.table.device)
        blocks = self.table[slots][:, positions // bs]  # (B, length)
        heads = torch.arange(h, device=self.table.device)
        rows = (blocks[:, None, :] * h + heads[None, :, None]) * bs + (positions % bs)[None, None, :]  # (B, H, length)
        return rows.view(-1)

    def read_slot(self, layer: int, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``(num_heads, num_tokens, head_dim)`` of one slot's first positions."""
        k, v = self.read(
            layer,
            torch.tensor([slot], device=self.table.device) if self.spec.paged else slice(slot, slot + 1),
            num_tokens,
        )
        return k[0], v[0]

    def write_slot(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``(num_heads, T, head_dim)`` K, V at positions ``0..T-1`` of ``slot``."""
        n = k.shape[1]
        if not self.spec.paged:
            kc, vc = self.layer(layer)
            kc[slot, :, :n].copy_(k, non_blocking=True)
            vc[slot, :, :n].copy_(v, non_blocking=True)
            return
        positions = torch.arange(n, device=self.table.device)
        rows, cols = self.locate(torch.full_like(positions, slot), positions)
        self.write(layer, rows, cols, k.transpose(0, 1).to(self.device), v.transpose(0, 1).to(self.device))


def _take(storage: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a layer's paged ``storage`` ``(num_blocks, H, block_size, hd)`` viewed as
    ``(num_blocks * H * block_size, hd)``: one indexed copy, ``(len(index), hd)``."""
    return storage.view(-1, storage.shape[-1]).index_select(0, index)
