"""The Triton kernel of :mod:`reshard.kv.pack` (its ``"triton"`` backend). Importing this module
imports Triton: :mod:`reshard.kv.pack` imports it only when that backend is asked for."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["h0", "t0", "t1"])
def copy_run(
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
