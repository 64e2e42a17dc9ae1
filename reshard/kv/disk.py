"""The disk tier of the KV store: a request's KV in safetensors files, written under one layout
and read under any other.

Each writer stores the layers and KV heads its cache holds (one file per request and region,
``K``/``V`` per layer as ``(heads, tokens, head_dim)``), written to a temporary name and renamed
into place, so a reader never sees half a file. A reader assembles its own layers and heads from
whichever files overlap them, reading only the slices it needs (``safe_open``), so KV moves
between TP degrees and pipeline depths through the disk as it does through the CPU tier.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.kv.cache import KVCache

_NAME = re.compile(r"req(?P<req>-?\d+)-L(?P<l0>\d+)-(?P<l1>\d+)-H(?P<h0>\d+)-(?P<h1>\d+)\.safetensors$")


class DiskKVTier:
    """Requests' KV as safetensors files in ``directory`` (shared by the ranks that use it)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"disk KV tier directory {str(self.directory)!r} does not exist")
        self.bytes_written = self.bytes_read = 0

    def swap_out(self, cache: KVCache, slot: int, request_id: int, num_tokens: int) -> int:
        """Write ``num_tokens`` of ``slot`` (this cache's layers and heads); returns bytes written."""
        s = cache.spec
        tensors = {}
        for layer in range(s.first_layer, s.first_layer + s.num_layers):
            k, v = cache.read_slot(layer, slot, num_tokens)
            tensors[f"{layer}.k"], tensors[f"{layer}.v"] = k.cpu().contiguous(), v.cpu().contiguous()
        path = self.directory / (
            f"req{request_id}-L{s.first_layer}-{s.first_layer + s.num_layers}"
            f"-H{s.head_start}-{s.head_start + s.num_heads}.safetensors"
        )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"tokens": str(num_tokens)})
        os.replace(tmp, path)  # replicas of a region write the same bytes: the last rename wins
        written = sum(t.numel() * t.element_size() for t in tensors.values())
        self.bytes_written += written
        return written

    def swap_in(self, cache: KVCache, slot: int, request_id: int) -> int:
        """Read this cache's layers and heads of the request into ``slot``; returns its tokens."""
        s = cache.spec
        files = self._files(request_id)
        tokens = None
        for layer in range(s.first_layer, s.first_layer + s.num_layers):
            parts = self._overlapping(files, layer, s.head_start, s.head_start + s.num_heads, request_id, cache)
            k = torch.cat([p[0] for p in parts])  # (heads, tokens, hd), heads in order
            v = torch.cat([p[1] for p in parts])
            cache.write_slot(layer, slot, k, v)
            tokens = k.shape[1]
            self.bytes_read += 2 * k.numel() * k.element_size()
        return tokens

    def _files(self, request_id: int) -> list[tuple[tuple[int, int, int, int], Path]]:
        out = []
        for path in sorted(self.directory.glob(f"req{request_id}-*.safetensors")):
            m = _NAME.match(path.name)
            if m and int(m["req"]) == request_id:
                out.append(((int(m["l0"]), int(m["l1"]), int(m["h0"]), int(m["h1"])), path))
        return out

    def _overlapping(self, files, layer: int, h0: int, h1: int, request_id: int, cache: KVCache):
        """``(k, v)`` slices covering heads ``[h0, h1)`` of ``layer`` in head order."""
        parts, at = [], h0
        for (l0, l1, f0, f1), path in sorted(files, key=lambda f: f[0][2]):
            if not (l0 <= layer < l1 and f0 <= at < f1):
                continue
            stop = min(f1, h1)
            with safe_open(str(path), framework="pt") as f:
                parts.append(tuple(f.get_slice(f"{layer}.{kv}")[at - f0 : stop - f0] for kv in ("k", "v")))
            at = stop
            if at == h1:
                return parts
        raise ValueError(
            f"request {request_id}: the disk tier at {self.directory} holds no KV for layer {layer} "
            f"heads [{at}, {h1}) (cache layout {cache.layout}; files {[p.name for _, p in files]})"
        )

    def free(self, request_id: int) -> None:
        """Delete the request's files (call once every reader is done)."""
        for _, path in self._files(request_id):
            path.unlink(missing_ok=True)
