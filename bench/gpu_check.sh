#!/usr/bin/env bash
# First CUDA checks of reshard, in one call on a lent GPU machine (bench/RESULTS.md, "First CUDA run").
#
#   bash bench/gpu_check.sh        # from the repo root; the log goes to $OUT/log.txt (./gpu_check.log without $OUT)
#
# Steps, most valuable first, each under its own timeout so one failure does not stop the rest:
# versions, the editable install (offline), the KV pack tests and the Triton pack kernel on a CUDA
# paged cache (bitwise against the torch path), then bench/generate.py on GPU 0: the realistic
# workload in fp32 and bf16 (ours eager fifo / longest_first and compiled, i.e. CUDA graphs, vs HF
# generate), then the uniform one; before them, bench/sampler.py with CUDA logits. BUDGET (default 460 s; give the call a limit of about 500 s)
# bounds the whole script: a step's timeout is cut to what is left of it.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-.}/log.txt
[ -n "${OUT:-}" ] || LOG=./gpu_check.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 RESHARD_CACHE=${RESHARD_CACHE:-/tmp/reshard-cache}
T0=$SECONDS
SUMMARY=""

BUDGET=${BUDGET:-460} # seconds for the whole script: a step gets at most what is left of it

step() { # NAME SECONDS CMD...: run CMD under a timeout, log its exit status and duration
    local name=$1 limit=$2 start=$SECONDS rc left
    shift 2
    left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: skipped, ${left} s of the budget left"
        SUMMARY+="$name: skipped"$'\n'
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== [$((SECONDS - T0)) s] $name (timeout $limit s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "=== [$((SECONDS - T0)) s] $name: rc=$rc ($((SECONDS - start)) s)"
    SUMMARY+="$name: rc=$rc, $((SECONDS - start)) s"$'\n'
}

GEN=(python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/generate.py --device cuda)

step nvidia_smi 20 nvidia-smi
step versions 45 python3 -c 'import torch, transformers, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "triton", triton.__version__)'
step install 90 python3 -m pip install -q --no-deps --no-build-isolation -e .
step kv_pack_tests 60 python3 -m pytest -x -q -p no:cacheprovider tests/test_kv_pack.py
step kv_pack_cuda 60 python3 - <<'EOF'
"""pack_kv / unpack_kv on a CUDA paged cache: backend "auto" must pick Triton; triton == torch, bitwise."""
import torch
from triton.testing import do_bench

from reshard.kv import pack
from reshard.kv.pack import pack_kv, unpack_kv
from tests.test_kv_pack import CASES, make

dev = torch.device("cuda")
cases = CASES + [(64, 8, 16, 128, (2, 6), (5, 700)), (3, 1, 64, 128, (0, 1), (10, 140))]
checked = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for nb, nh, bs, hd, heads, tokens in cases:
        cache, blocks = make(nb, nh, bs, hd, tokens, dtype)
        cache = cache.to(dev)
        for table in (blocks.to(dev), blocks.to(dev, torch.int32), blocks):  # CUDA int64 / int32, CPU int64
            assert pack._pick_backend("auto", cache) == "triton"
            ref = pack_kv(cache, table, heads, tokens, backend="torch")
            out = torch.full_like(ref, float("nan"))
            assert pack_kv(cache, table, heads, tokens, out, backend="triton") is out
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (dtype, nb, nh, bs, hd, heads, tokens)
            assert torch.equal(pack_kv(cache, table, heads, tokens).view(torch.uint8), ref.view(torch.uint8))
            a = torch.randn_like(cache)
            b = a.clone()
            src = torch.randn_like(ref)
            unpack_kv(src, a, table, heads, tokens, backend="triton")
            unpack_kv(src, b, table, heads, tokens, backend="torch")
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), ("unpack", dtype, nb, nh, bs, hd)
            checked += 1
torch.cuda.synchronize()
print(f"KV-PACK-CUDA-OK: {checked} regions, pack and unpack, triton == torch bitwise")

# one large region: 8 heads x 4096 tokens x 128, bf16 (8 MiB), blocks of 16 shuffled over 512
cache, blocks = make(512, 8, 16, 128, (0, 4096), torch.bfloat16)
cache, blocks = cache.to(dev), blocks.to(dev)
out = torch.empty(8, 4096, 128, dtype=cache.dtype, device=dev)
nbytes = 2 * out.numel() * out.element_size()  # read + write
for backend in ("triton", "torch"):
    ms = do_bench(lambda: pack_kv(cache, blocks, (0, 8), (0, 4096), out, backend=backend), return_mode="median")
    print(f"pack 8x4096x128 bf16, {backend}: {1e3 * ms:.1f} us median, {nbytes / ms / 1e6:.0f} GB/s (read+write)")
EOF
# eager and compiled apart: a failure of the compiled step leaves the eager rows (and HF's) whole.
# First run on an H200 (bench/RESULTS.md): eager 82 s; compiled B=8,16 with CUDA graphs about
# 125 s (compile 38 + 46 s); bf16 compiled B=16 about 80 s (compile 32 s).
step sampler_cuda 90 python3 bench/sampler.py --device cuda --repeats 3 # the sampler's noise on the device
step realistic_fp32_eager 130 "${GEN[@]}" --workload realistic --ours fifo,longest_first --repeats 2 --gemm-repeats 20
step realistic_fp32_compiled 170 "${GEN[@]}" --workload realistic --ours fifo:compiled --repeats 2 --gemm-repeats 20
step realistic_bf16 120 "${GEN[@]}" --workload realistic --ours fifo,fifo:compiled --repeats 2 --gemm-repeats 20 \
    --dtype bfloat16 --batches 16
step uniform_fp32 40 "${GEN[@]}" --workload uniform

echo "=== summary ($((SECONDS - T0)) s in all)"
printf '%s' "$SUMMARY"
