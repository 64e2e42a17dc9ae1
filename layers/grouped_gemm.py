"""The experts' grouped GEMM: each row of an expert-sorted ``x`` through its own expert's SwiGLU.

Two backends compute the same function, chosen by ``backend``:

- ``"torch"``: the rows laid out per expert in a zero-padded ``(E, C, D)`` block (``C`` the largest
  count) through three batched matmuls, one per projection. Padding costs ``E * C`` rows of work
  where the counts are skewed.
- ``"triton"``: one program per (tile of at most ``BLOCK_M`` rows of one expert, block of output
  columns) of :func:`reshard.layers.grouped_gemm_kernel.grouped_mm`, for each projection: no
  padding, no row of another expert read. Triton is optional and imported on first use.

``"auto"`` (the default) picks Triton for CUDA tensors when it imports, else torch (as
:mod:`reshard.kv.pack` does). ``backend="triton"`` on CPU tensors runs Triton's interpreter, which
Triton's own ``TRITON_INTERPRET=1`` turns on (tests). The Triton backend has been checked against
torch under the interpreter only: it has not been compiled or timed on a GPU yet.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

BACKENDS = ("auto", "torch", "triton")
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # (looked up, not imported)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def check_backend(backend: str) -> str:
    """``backend`` when it is one of :data:`BACKENDS`, else ``ValueError`` naming it."""
    if backend not in BACKENDS:
        raise ValueError(f"grouped GEMM backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def grouped_swiglu(
    x: torch.Tensor,
    expert: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """SwiGLU of each row of ``x (N, D)`` through its expert (``expert (N,)`` sorted ascending,
    ``counts (E,)`` rows per expert) with stacked weights ``gate`` / ``up (E, I, D)``, ``down (E,
    D, I)``; returns ``(N, D)`` in ``x``'s order."""
    if _pick(backend, x) == "triton":
        tiles = _tiles(counts.tolist(), x.device)  # (one host read of the counts for the three GEMMs)
        h = act(_triton_mm(x, tiles, gate)) * _triton_mm(x, tiles, up)  # (N, I)
        return _triton_mm(h, tiles, down)
    capacity = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    pos = torch.arange(x.shape[0], device=x.device) - starts[expert]  # (N,) row within its expert
    block = x.new_zeros(counts.shape[0], capacity, x.shape[1])  # (E, C, D)
    block[expert, pos] = x
    h = act(torch.bmm(block, gate.transpose(1, 2))) * torch.bmm(block, up.transpose(1, 2))  # (E, C, I)
    return torch.bmm(h, down.transpose(1, 2))[expert, pos]  # (N, D)


def _pick(backend: str, x: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for ``backend``; ``ValueError`` when ``"triton"`` cannot run."""
    check_backend(backend)
    if backend == "auto":
        return "triton" if x.is_cuda and _kernel() is not None else "torch"
    if backend == "triton" and _kernel() is None:
        raise ValueError("backend='triton' but triton does not import (pip install 'reshard[triton]')")
    if backend == "triton" and not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1, got {x.device} tensors")
    return backend


def _kernel() -> Callable | None:
    """The jitted :func:`reshard.layers.grouped_gemm_kernel.grouped_mm`, or ``None`` when triton
    does not import (imported on first use; the import system keeps it)."""
    if not TRITON_INSTALLED:
        return None
    try:
        return importlib.import_module("reshard.layers.grouped_gemm_kernel").grouped_mm
    except ImportError:
        return None


def _triton_mm(x: torch.Tensor, tiles: tuple[torch.Tensor, ...], w: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[e(r)]^T`` for expert-sorted rows ``x (M, K)`` and ``w (E, N, K)``, over
    the row ``tiles`` of :func:`_tiles`."""
    x, w = x.contiguous(), w.contiguous()
    expert, start, end = tiles
    out = x.new_empty(x.shape[0], w.shape[1])  # (M, N)
    if expert.numel():
        grid = (expert.numel(), triton_cdiv(w.shape[1], BLOCK_N))
        _kernel()[grid](
            x, w, out, expert, start, end, w.shape[1], w.shape[2], x.stride(0), w.stride(0), w.stride(1),
            out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    return out


def _tiles(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile of at most :data:`BLOCK_M` rows of one expert: its expert, first and end row."""
    expert, start, end, at = [], [], [], 0
    for e, n in enumerate(counts):
        for lo in range(at, at + n, BLOCK_M):
            expert.append(e)
            start.append(lo)
            end.append(min(lo + BLOCK_M, at + n))
        at += n
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (expert, start, end))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
