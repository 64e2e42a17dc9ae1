"""The Triton kernel of :mod:`reshard.layers.grouped_gemm` (its ``"triton"`` backend). Importing
this module imports Triton: :mod:`reshard.layers.grouped_gemm` imports it only when that backend
is asked for."""

import triton
import triton.language as tl


@triton.jit
def grouped_mm(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program ``(t, j)``: rows ``[start, end)`` of tile ``t`` (at most ``BLOCK_M`` rows, all of one
    expert ``e``, in the expert-sorted input) times ``W[e]^T``, output columns ``[j * BLOCK_N, ...)``.

    ``x (M, K)``, ``w (E, N, K)`` and ``out (M, N)`` have unit stride along their last dimension;
    the accumulator is fp32, and no row of another expert (or padding) is read.
    """
    t = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    rows = start + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < end, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
