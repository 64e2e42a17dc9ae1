"""pack_kv / unpack_kv: torch path against a per-token reference, Triton (interpreter) against torch."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from reshard.kv import pack
from reshard.kv.pack import pack_kv, unpack_kv

# (num_blocks, num_heads, block_size, head_dim, heads, tokens)
CASES = [
    (6, 2, 4, 8, (0, 2), (0, 24)),  # every token of every block
    (9, 4, 4, 8, (1, 3), (3, 17)),  # starts and ends mid-block, head sub-range
    (9, 4, 4, 8, (2, 3), (5, 7)),  # inside one block
    (9, 3, 8, 16, (0, 3), (8, 16)),  # exactly one whole block, not the first
    (12, 5, 1, 4, (4, 5), (2, 11)),  # block_size 1
    (5, 2, 16, 2, (0, 1), (15, 33)),  # one token of the first block, one of the last
]


def reference_pack(cache: torch.Tensor, blocks: torch.Tensor, heads, tokens) -> torch.Tensor:
    """(nh, nt, head_dim), one token at a time."""
    bs = cache.shape[2]
    return torch.stack(
        [torch.stack([cache[blocks[t // bs], h, t % bs] for t in range(*tokens)]) for h in range(*heads)]
    )


def make(num_blocks, num_heads, block_size, head_dim, tokens, dtype, seed=0):
    """A random cache and a random block table (a shuffled subset of the blocks) covering ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, num_heads, block_size, head_dim, generator=g).to(dtype)
    needed = -(-tokens[1] // block_size)
    blocks = torch.randperm(num_blocks, generator=g)[:needed]
    return cache, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nb,nh,bs,hd,heads,tokens", CASES)
def test_pack_matches_reference(nb, nh, bs, hd, heads, tokens, dtype):
    cache, blocks = make(nb, nh, bs, hd, tokens, dtype)
    out = pack_kv(cache, blocks, heads, tokens, backend="torch")
    assert out.is_contiguous() and out.shape == (heads[1] - heads[0], tokens[1] - tokens[0], hd)
    assert torch.equal(out, reference_pack(cache, blocks, heads, tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nb,nh,bs,hd,heads,tokens", CASES)
def test_round_trip_bitwise(nb, nh, bs, hd, heads, tokens, dtype):
    cache, blocks = make(nb, nh, bs, hd, tokens, dtype, seed=1)
    packed = pack_kv(cache, blocks, heads, tokens, backend="torch")
    fresh = torch.zeros_like(cache)
    unpack_kv(packed, fresh, blocks, heads, tokens, backend="torch")
    assert torch.equal(pack_kv(fresh, blocks, heads, tokens, backend="torch"), packed)
    # exactly the region was written: compare to a per-token scatter into zeros
    expected = torch.zeros_like(cache)
    for i, h in enumerate(range(*heads)):
        for j, t in enumerate(range(*tokens)):
            expected[blocks[t // bs], h, t % bs] = packed[i, j]
    assert torch.equal(
        fresh.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


def test_out_buffer_is_filled_and_returned():
    cache, blocks = make(9, 4, 4, 8, (3, 17), torch.float32)
    out = torch.full((2, 14, 8), float("nan"))
    assert pack_kv(cache, blocks, (1, 3), (3, 17), out) is out
    assert torch.equal(out, reference_pack(cache, blocks, (1, 3), (3, 17)))


def test_non_contiguous_cache_and_src():
    full, blocks = make(9, 6, 4, 8, (3, 17), torch.float32)
    cache = full[:, 1:5]  # (9, 4, 4, 8), a head slice of a larger cache
    out = pack_kv(cache, blocks, (1, 3), (3, 17))
    assert torch.equal(out, reference_pack(cache, blocks, (1, 3), (3, 17)))
    src = torch.randn(14, 2, 8).transpose(0, 1)  # (2, 14, 8), not contiguous
    unpack_kv(src, cache, blocks, (1, 3), (3, 17))
    assert torch.equal(pack_kv(full[:, 1:5], blocks, (1, 3), (3, 17)), src)


def test_int32_block_table_and_empty_regions():
    cache, blocks = make(9, 4, 4, 8, (3, 17), torch.float32)
    ref = reference_pack(cache, blocks, (0, 4), (3, 17))
    assert torch.equal(pack_kv(cache, blocks.int(), (0, 4), (3, 17)), ref)
    assert pack_kv(cache, blocks, (2, 2), (3, 17)).shape == (0, 14, 8)
    assert pack_kv(cache, blocks, (0, 4), (5, 5)).shape == (4, 0, 8)
    before = cache.clone()
    unpack_kv(torch.empty(4, 0, 8), cache, blocks, (0, 4), (5, 5))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(heads=(1, 5)), r"heads \(1, 5\) must satisfy 0 <= h0 <= h1 <= num_heads \(4\)"),
        (dict(heads=(3, 2)), r"heads \(3, 2\)"),
        (dict(tokens=(5, 3)), r"tokens \(5, 3\) must satisfy 0 <= t0 <= t1"),
        (dict(tokens=(3, 21)), r"tokens \(3, 21\) span 6 blocks of 4 but the block table has 5"),
        (dict(blocks=torch.tensor([0, 1, 9, 2, 3])), r"block ids \[0, 1, 9, 2, 3\] .* must lie in \[0, 9\)"),
        (
            dict(blocks=torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])),
            r"1-D int64/int32 block table, got shape \(5,\) dtype torch.float32",
        ),
        (
            dict(cache=torch.zeros(9, 4, 32)),
            r"cache must be \(num_blocks, num_heads, block_size, head_dim\), got shape \(9, 4, 32\)",
        ),
        (dict(out=torch.zeros(2, 14, 7)), r"out must be \(2, 14, 8\) torch.float32 on cpu, got \(2, 14, 7\)"),
        (dict(out=torch.zeros(2, 14, 8, dtype=torch.bfloat16)), r"got \(2, 14, 8\) torch.bfloat16"),
        (dict(out=torch.zeros(14, 2, 8).transpose(0, 1)), r"out must be contiguous"),
        (dict(backend="cuda"), r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    ],
)
def test_bad_input(kwargs, match):
    cache, blocks = make(9, 4, 4, 8, (3, 17), torch.float32)
    args = dict(cache=cache, blocks=blocks, heads=(1, 3), tokens=(3, 17)) | kwargs
    with pytest.raises(ValueError, match=match):
        pack_kv(**args)


def test_unpack_bad_src():
    cache, blocks = make(9, 4, 4, 8, (3, 17), torch.float32)
    with pytest.raises(ValueError, match=r"src must be \(2, 14, 8\) torch.float32 on cpu, got .* torch.float64"):
        unpack_kv(torch.zeros(2, 14, 8, dtype=torch.float64), cache, blocks, (1, 3), (3, 17))


def test_dispatch(monkeypatch):
    cpu = torch.zeros(2, 2, 4, 8)
    monkeypatch.setattr(pack, "_triton_kernel", lambda: object())  # "triton imports", without importing it
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pack._pick_backend("auto", cpu) == "torch"
    with pytest.raises(ValueError, match=r"needs a CUDA cache or TRITON_INTERPRET=1, got a cpu cache"):
        pack._pick_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pack._pick_backend("auto", cpu) == "torch"  # the interpreter runs only when asked for by name
    assert pack._pick_backend("triton", cpu) == "triton"
    assert pack._pick_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match=r"each \(block, head\) of the cache contiguous"):
        pack._pick_backend("triton", cpu.transpose(2, 3))
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'fast'"):
        pack._pick_backend("fast", cpu)


def test_works_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.setitem(sys.modules, "reshard.kv.pack_kernel", None)  # even if an earlier test imported it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cache, blocks = make(9, 4, 4, 8, (3, 17), torch.float32)
    out = pack_kv(cache, blocks, (1, 3), (3, 17))  # auto: torch
    assert torch.equal(out, reference_pack(cache, blocks, (1, 3), (3, 17)))
    with pytest.raises(ValueError, match=r"backend='triton' but triton does not import"):
        pack_kv(cache, blocks, (1, 3), (3, 17), backend="triton")


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from reshard.kv import pack
    from reshard.kv.pack import pack_kv, unpack_kv
    from tests.test_kv_pack import CASES, make

    for dtype in (torch.float32, torch.bfloat16):
        for nb, nh, bs, hd, heads, tokens in CASES:
            cache, blocks = make(nb, nh, bs, hd, tokens, dtype)
            assert pack._pick_backend("auto", cache) == "torch"  # a CPU cache: the interpreter only by name
            ref = pack_kv(cache, blocks, heads, tokens, backend="torch")
            out = torch.empty_like(ref)
            assert pack_kv(cache, blocks, heads, tokens, out, backend="triton") is out
            assert torch.equal(out, ref), (dtype, nb, nh, bs, hd, heads, tokens)
            a, b = torch.zeros_like(cache), torch.zeros_like(cache)
            unpack_kv(ref, a, blocks, heads, tokens, backend="triton")
            unpack_kv(ref, b, blocks, heads, tokens, backend="torch")
            assert torch.equal(a, b), (dtype, nb, nh, bs, hd, heads, tokens)
    # a chunk loop: block_size * head_dim = 8192 > 4096 elements per step
    cache, blocks = make(3, 1, 64, 128, (10, 140), torch.float32)
    ref = pack_kv(cache, blocks, (0, 1), (10, 140), backend="torch")
    assert torch.equal(pack_kv(cache, blocks, (0, 1), (10, 140), backend="triton"), ref)
    print("TRITON-OK")
""")


def test_triton_interpreter_matches_torch():
    pytest.importorskip("triton")
    # the interpreter must be on before triton is imported: run in a fresh process
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "TRITON-OK" in proc.stdout, proc.stdout + proc.stderr
