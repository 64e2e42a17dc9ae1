"""Pack a (heads x tokens) region of a paged KV cache into one contiguous buffer, and back.

Paged layout, per layer and for K and V alike: ``(num_blocks, num_heads, block_size, head_dim)``,
heads outermost within a block. Token ``t`` of a sequence with block table ``blocks`` (1-D ids)
lives in block ``blocks[t // block_size]`` at offset ``t % block_size``. A packed region is
``(h1 - h0, t1 - t0, head_dim)``, contiguous: what a transfer (``flush``/``fetch`` in DejaVu's
terms) sends as one message.

Two backends compute the same bytes: ``"torch"`` (index arithmetic, one gather or scatter) and
``"triton"`` (one program per (block, head) copying that block's contiguous run of the head).
Triton is optional and imported on first use. ``backend="auto"`` picks Triton when it imports and
the cache is on CUDA, or when ``TRITON_INTERPRET=1`` and ``RESHARD_KV_PACK=triton`` (the
interpreter, for tests on CPU); ``RESHARD_KV_PACK=torch`` forces torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton")
_MAX_CHUNK = 4096  # elements one Triton program moves per step

tl: Any = None  # triton.language once _triton_kernel() has imported it (the kernel's global)


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
    that shape and the cache's dtype and device; it is filled and returned.
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
    """Inverse of :func:`pack_kv`: write ``src`` ``(h1-h0, t1-t0, head_dim)`` into ``cache`` in place."""
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


def _copy_run(
    cache_ptr,
    blocks_ptr,
    buf_ptr,
    h0,
    t0,
    t1,
    stride_block,
    stride_head,
    stride_buf_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """Program ``(j, h)``: the tokens of block ``t0 // BLOCK_SIZE + j`` in ``[t0, t1)``, head ``h0 + h``.

    Within one block and head those tokens are ``(end - start) * HEAD_DIM`` contiguous elements of
    the cache, and contiguous in the packed buffer ``(nh, nt, HEAD_DIM)`` too.
    """
    j = tl.program_id(0)
    h = tl.program_id(1)
    bi = t0 // BLOCK_SIZE + j  # logical block
    start = tl.maximum(t0, bi * BLOCK_SIZE)
    end = tl.minimum(t1, (bi + 1) * BLOCK_SIZE)
    phys = tl.load(blocks_ptr + bi).to(tl.int64)
    src = cache_ptr + phys * stride_block + (h0 + h).to(tl.int64) * stride_head + (start - bi * BLOCK_SIZE) * HEAD_DIM
    dst = buf_ptr + h.to(tl.int64) * stride_buf_head + (start - t0).to(tl.int64) * HEAD_DIM
    n = (end - start) * HEAD_DIM
    for k in range(0, n, CHUNK):
        idx = k + tl.arange(0, CHUNK)
        mask = idx < n
        if UNPACK:
            tl.store(src + idx, tl.load(dst + idx, mask=mask), mask=mask)
        else:
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


@functools.cache
def _triton_kernel() -> Callable | None:
    """The jitted :func:`_copy_run`, or ``None`` when triton does not import."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError:
        return None
    tl = language
    return triton.jit(_copy_run, do_not_specialize=["h0", "t0", "t1"])


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
        forced = os.environ.get("RESHARD_KV_PACK", "auto")
        if forced not in BACKENDS:
            raise ValueError(f"RESHARD_KV_PACK must be one of {BACKENDS}, got {forced!r}")
        usable = _triton_ok(cache) and (cache.is_cuda or _interpreting()) and _triton_kernel() is not None
        if forced == "torch" or not usable or (not cache.is_cuda and forced != "triton"):
            return "torch"
        return "triton"
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
