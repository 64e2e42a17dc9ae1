"""Pack a (heads x tokens) region of a paged KV cache into one contiguous buffer, and back.

Paged layout, per layer and for K and V alike: ``(num_blocks, num_heads, block_size, head_dim)``,
heads outermost within a block. Token ``t`` of a sequence with block table ``blocks`` (1-D ids)
lives in block ``blocks[t // block_size]`` at offset ``t % block_size``. A packed region is
``(h1 - h0, t1 - t0, head_dim)``, contiguous: what a transfer (``flush``/``fetch`` in DejaVu's
terms) sends as one message.

Two backends compute the same bytes, chosen by the ``backend`` argument: ``"torch"`` (index
arithmetic, one gather or scatter) and ``"triton"`` (one program per (block, head) copying that
block's contiguous run of the head; :mod:`reshard.kv.pack_kernel`). Triton is optional and
imported on first use. ``backend="auto"`` (the default) picks Triton when it is installed, the
cache is on CUDA and each (block, head) of it is contiguous, else torch. ``backend="triton"`` on a
CPU cache runs Triton's interpreter, which Triton's own ``TRITON_INTERPRET=1`` turns on (tests).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton")
_MAX_CHUNK = 4096  # elements one Triton program moves per step
# whether triton is installed (looked up, not imported): a failed import costs ~2 ms, too much per call
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def pack_kv(
    cache: Tensor,
    blocks: Tensor,
    heads: tuple[int, int],
    tokens: tuple[int, int],
    out: Tensor | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Heads ``[h0, h1)`` x tokens ``[t0, t1)`` of ``cache`` as a contiguous ``(h1-h0, t1-t0, head_dim)``.

    ``cache``: ``(num_blocks, num_heads, block_size, head_dim)``; ``blocks``: the sequence's block
    table, 1-D int64/int32 covering token ``t1 - 1``. ``out``, when given, must be contiguous with
    that shape and the cache's dtype and device; it is filled and returned. ``backend``:
    ``"auto"``, ``"torch"`` or ``"triton"`` (see the module docstring).
    """
    shape = _check_region(cache, blocks, heads, tokens)
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    else:
        _check_buffer(out, shape, cache, "out", contiguous=True)
    if out.numel() == 0:
        return out
    if _pick_backend(backend, cache) == "triton":
        _launch(cache, blocks, heads, tokens, out, unpack=False)
    else:
        _pack_torch(cache, blocks, heads, tokens, out)
    return out


def unpack_kv(
    src: Tensor,
    cache: Tensor,
    blocks: Tensor,
    heads: tuple[int, int],
    tokens: tuple[int, int],
    *,
    backend: str = "auto",
) -> None:
    """Inverse of :func:`pack_kv`: write ``src`` ``(h1-h0, t1-t0, head_dim)`` into ``cache`` in place
    (``backend`` as there)."""
    shape = _check_region(cache, blocks, heads, tokens)
    _check_buffer(src, shape, cache, "src", contiguous=False)
    if src.numel() == 0:
        return
    if _pick_backend(backend, cache) == "triton":
        _launch(cache, blocks, heads, tokens, src.contiguous(), unpack=True)
    else:
        cache.index_put_(_region_index(cache, blocks, heads, tokens), src)


# ---- torch backend -------------------------------------------------------------------------------


def _region_index(
    cache: Tensor, blocks: Tensor, heads: tuple[int, int], tokens: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """Advanced indices ``(block (1, nt), head (nh, 1), offset (1, nt))`` of the region in ``cache``."""
    block_size, dev = cache.shape[2], cache.device
    t = torch.arange(*tokens, device=dev)  # (nt,)
    phys = blocks.to(dev, torch.long)[t // block_size]  # (nt,) physical block of each token
    h = torch.arange(*heads, device=dev)  # (nh,)
    return phys[None, :], h[:, None], (t % block_size)[None, :]


def _pack_torch(cache: Tensor, blocks: Tensor, heads: tuple[int, int], tokens: tuple[int, int], out: Tensor) -> None:
    phys, h, off = _region_index(cache, blocks, heads, tokens)
    if not cache.is_contiguous():
        out.copy_(cache[phys, h, off])  # (nh, nt, head_dim)
        return
    _, num_heads, block_size, head_dim = cache.shape
    rows = (phys * num_heads + h) * block_size + off  # (nh, nt) rows of cache.view(-1, head_dim)
    torch.index_select(cache.view(-1, head_dim), 0, rows.view(-1), out=out.view(-1, head_dim))


# ---- triton backend ------------------------------------------------------------------------------


def _triton_kernel() -> Callable | None:
    """The jitted :func:`reshard.kv.pack_kernel.copy_run`, or ``None`` when triton does not import
    (imported on first use; the import system keeps it)."""
    if not TRITON_INSTALLED:
        return None
    try:
        return importlib.import_module("reshard.kv.pack_kernel").copy_run
    except ImportError:
        return None


def _launch(
    cache: Tensor, blocks: Tensor, heads: tuple[int, int], tokens: tuple[int, int], buf: Tensor, *, unpack: bool
) -> None:
    """Copy between the region and ``buf`` ``(nh, nt, head_dim)`` (contiguous) on the Triton path."""
    kernel = _triton_kernel()
    assert kernel is not None and _triton_ok(cache)
    (h0, h1), (t0, t1) = heads, tokens
    block_size, head_dim = cache.shape[2], cache.shape[3]
    grid = ((t1 - 1) // block_size - t0 // block_size + 1, h1 - h0)  # (blocks touched, heads)
    chunk = min(_next_pow2(block_size * head_dim), _MAX_CHUNK)
    kernel[grid](
        cache,
        blocks.to(cache.device).contiguous(),
        buf,
        h0,
        t0,
        t1,
        cache.stride(0),
        cache.stride(1),
        buf.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        CHUNK=chunk,
        UNPACK=unpack,
    )


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---- dispatch and checks -------------------------------------------------------------------------


def _pick_backend(backend: str, cache: Tensor) -> str:
    """``"torch"`` or ``"triton"`` for ``backend``; ``ValueError`` when ``"triton"`` cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        usable = cache.is_cuda and _triton_ok(cache) and _triton_kernel() is not None
        return "triton" if usable else "torch"
    if backend == "triton" and _triton_kernel() is None:
        raise ValueError("backend='triton' but triton does not import (pip install 'reshard[triton]')")
    if backend == "triton" and not (cache.is_cuda or _interpreting()):
        raise ValueError(f"backend='triton' needs a CUDA cache or TRITON_INTERPRET=1, got a {cache.device} cache")
    if backend == "triton" and not _triton_ok(cache):
        raise ValueError(
            f"backend='triton' needs each (block, head) of the cache contiguous, got strides "
            f"{tuple(cache.stride())} for shape {tuple(cache.shape)}"
        )
    return backend


def _interpreting() -> bool:
    """Whether Triton's own interpreter switch is on (Triton reads it when it is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_ok(cache: Tensor) -> bool:
    """Whether each ``(block, head)`` of ``cache`` is one contiguous ``block_size * head_dim`` run."""
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]


def _check_region(
    cache: Tensor, blocks: Tensor, heads: tuple[int, int], tokens: tuple[int, int]
) -> tuple[int, int, int]:
    """``(nh, nt, head_dim)`` of the region; ``ValueError`` naming bad shapes, ranges or block ids.

    Block ids are range-checked only for a CPU block table (checking a CUDA one would synchronize).
    """
    if cache.dim() != 4:
        raise ValueError(f"cache must be (num_blocks, num_heads, block_size, head_dim), got shape {tuple(cache.shape)}")
    num_blocks, num_heads, block_size, head_dim = cache.shape
    (h0, h1), (t0, t1) = heads, tokens
    if not 0 <= h0 <= h1 <= num_heads:
        raise ValueError(f"heads {heads} must satisfy 0 <= h0 <= h1 <= num_heads ({num_heads})")
    if not 0 <= t0 <= t1:
        raise ValueError(f"tokens {tokens} must satisfy 0 <= t0 <= t1")
    if blocks.dim() != 1 or blocks.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"blocks must be a 1-D int64/int32 block table, got shape {tuple(blocks.shape)} dtype {blocks.dtype}"
        )
    needed = -(-t1 // block_size) if t1 > t0 else 0
    if blocks.numel() < needed:
        raise ValueError(
            f"tokens {tokens} span {needed} blocks of {block_size} but the block table has {blocks.numel()}"
        )
    used = blocks[t0 // block_size : needed]
    if used.numel() and not used.is_cuda and not 0 <= int(used.min()) <= int(used.max()) < num_blocks:
        raise ValueError(f"block ids {used.tolist()} for tokens {tokens} must lie in [0, {num_blocks})")
    return h1 - h0, t1 - t0, head_dim


def _check_buffer(buf: Tensor, shape: tuple[int, int, int], cache: Tensor, name: str, *, contiguous: bool) -> None:
    if tuple(buf.shape) != shape or buf.dtype != cache.dtype or buf.device != cache.device:
        raise ValueError(
            f"{name} must be {shape} {cache.dtype} on {cache.device}, got "
            f"{tuple(buf.shape)} {buf.dtype} on {buf.device}"
        )
    if contiguous and not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(buf.stride())}")
