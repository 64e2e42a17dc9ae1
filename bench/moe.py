"""The MoE layer: its grouped GEMM against a per-expert loop (HF's way), and one MoE block's step with
the experts split per expert (TP: every rank a slice of every expert) or per rank (EP).

Run from the repo root:

    OMP_NUM_THREADS=2 python bench/moe.py                                        # grouped GEMM vs loop
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/moe.py --step   # TP2, EP2, DPxEP2 block

Shapes: Qwen3-30B-A3B's expert width scaled down (hidden 1024, expert intermediate 384, 16
experts, 4 per token), fp32, random weights; tokens 8 (a decode step's batch), 64 and 512 (a
prefill). ``--step``: the whole :class:`SparseMoE` block (router, dispatch, grouped GEMM, the
all-reduce or all-to-alls) on a TP, EP or data-parallel-attention x EP layout of the same weights;
medians of ``--repeats`` calls, the slowest rank's; the all-to-all bytes against their lower bound.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import med, parser, rerun_command  # bench/ is not a package

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 384, 16, 4
TOKENS = (8, 64, 512)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--step", action="store_true", help="the MoE block on EP vs TP layouts (under torchrun)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if args.step:
        _step(args)
    else:
        _gemm(args)


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return med(times)


def _routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``TOP_K`` distinct experts (uniform) and softmax weights."""
    experts = torch.rand(tokens, EXPERTS, generator=gen).topk(TOP_K, dim=-1).indices
    return torch.softmax(torch.rand(tokens, TOP_K, generator=gen), -1), experts


def _loop(x, weights, experts, gate, up, down) -> torch.Tensor:
    """HF's experts forward: one pass per expert hit over the tokens that chose it."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        token, slot = torch.where(experts == e)
        h = F.linear(F.silu(F.linear(x[token], gate[e])) * F.linear(x[token], up[e]), down[e])
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


def _gemm(args) -> None:
    from reshard.layers.moe import grouped_swiglu

    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) * 0.02 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02
    print(f"grouped GEMM vs per-expert loop: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert inter {INTER}")
    print(f"{'tokens':>7} {'loop ms':>9} {'grouped ms':>11} {'loop/grouped':>13} {'max |diff|':>11}")
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        weights, experts = _routing(tokens, gen)

        def grouped():
            token, slot = torch.nonzero(experts >= 0, as_tuple=True)
            expert = experts[token, slot]
            order = torch.argsort(expert, stable=True)
            token, slot, expert = token[order], slot[order], expert[order]
            y = grouped_swiglu(x[token], expert, torch.bincount(expert, minlength=EXPERTS), gate, up, down, F.silu)
            return torch.zeros_like(x).index_add_(0, token, y * weights[token, slot, None])

        diff = (grouped() - _loop(x, weights, experts, gate, up, down)).abs().max().item()
        loop_s = _timed(lambda: _loop(x, weights, experts, gate, up, down), args.repeats)
        grouped_s = _timed(grouped, args.repeats)
        print(f"{tokens:>7} {loop_s * 1e3:>9.2f} {grouped_s * 1e3:>11.2f} {loop_s / grouped_s:>12.2f}x {diff:>11.1e}")
    print(f"command: {rerun_command('moe.py', None, one_thread=False)}")


def _step(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for ep, dispatch in ((1, False), (world, False), (world, True)):
        block, label = _block(world, ep, dispatch)
        for tokens in TOKENS:
            mine = tokens // world if dispatch else tokens  # data-parallel attention: each rank its share
            x = torch.randn(1, mine, HIDDEN, generator=torch.Generator().manual_seed(tokens + dist.get_rank()))
            with torch.no_grad():
                s = _timed(lambda: block(x), args.repeats)
                sent, lower = _a2a_bytes(block, x) if dispatch else (tokens * HIDDEN * 4, 0)
            totals = torch.tensor([s, sent, lower], dtype=torch.float64)
            dist.all_reduce(totals[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(totals[1:])
            rows.append((label, tokens, *totals.tolist()))
    if dist.get_rank() == 0:
        _print_steps(rows, world)
        print(f"command: {rerun_command('moe.py', world)}")
    dist.destroy_process_group()


def _block(world: int, ep: int, dispatch: bool):
    """The MoE block on ``world`` ranks: TP (``ep=1``), EP inside the tp group, or (``dispatch``)
    data-parallel attention with the experts over the replicas; seeded weights, equal in each."""
    from reshard.layers import GroupedExperts, SparseMoE, TopKGate
    from reshard.parallel.model.dims import ParallelDims
    from reshard.parallel.model.plans import expert_mesh

    dims = (
        ParallelDims(dp=world, ep=world, world_size=world)
        if dispatch
        else ParallelDims(tp=world, ep=ep, world_size=world)
    )
    tp_mesh = dims.mesh("tp")
    router = TopKGate(HIDDEN, EXPERTS, TOP_K, mesh=tp_mesh, renormalize=True)
    experts = GroupedExperts(EXPERTS, HIDDEN, INTER, mesh=expert_mesh(dims, tp_mesh))
    gen = torch.Generator().manual_seed(0)
    for t in (router.weight, experts.gate_proj, experts.up_proj, experts.down_proj):
        t.data.to_local().copy_(torch.randn(t.to_local().shape, generator=gen) * 0.02)
    label = f"DPxEP{world}" if dispatch else f"EP{ep}" if ep > 1 else f"TP{world}"
    return SparseMoE(router, experts, tp_mesh, dispatch=dispatch), label


def _a2a_bytes(block, x: torch.Tensor) -> tuple[int, int]:
    """This rank's all-to-all bytes sent in one forward of ``block`` (counted at
    ``all_to_all_split``: counts, rows, expert ids and weights, results back) and their lower
    bound: a token's hidden vector to each other rank holding one of its experts, once, and one
    summed result back."""
    import reshard.layers.moe as moe

    sent, original = [0], moe.all_to_all_split

    def counting(t, out_splits, in_splits, mesh, axis):
        me = mesh.get_local_rank(axis)
        per_row = t[0].numel() * t.element_size() if t.shape[0] else 0
        sent[0] += sum(n for i, n in enumerate(in_splits) if i != me) * per_row
        return original(t, out_splits, in_splits, mesh, axis)

    moe.all_to_all_split = counting
    try:
        block(x)
    finally:
        moe.all_to_all_split = original
    flat = x.reshape(-1, x.shape[-1])
    _, chosen = block.route(flat)  # (T, k)
    mesh = block.experts.gate_proj.device_mesh
    owner = chosen // (EXPERTS // mesh.size(0))  # (T, k)
    remote = {(t, r) for t, r in zip(*torch.nonzero(owner != mesh.get_local_rank(0), as_tuple=True))}
    pairs = {(t.item(), owner[t, c].item()) for t, c in remote}
    return sent[0], 2 * len(pairs) * HIDDEN * flat.element_size()


def _print_steps(rows: list, world: int) -> None:
    print(f"MoE block, {world} ranks: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert inter {INTER}")
    print("TP / EP: the tp group's tokens on every rank, one all-reduce (bytes: its payload, summed over ranks)")
    print("DPxEP: each rank its tokens/world own tokens, all-to-all dispatch (bytes: sent by all ranks)")
    print(f"{'layout':>7} {'tokens':>7} {'ms':>8} {'comm bytes':>11} {'lower bound':>12} {'ratio':>6}")
    for layout, tokens, s, sent, lower in rows:
        ratio = f"{sent / lower:.2f}" if lower else "-"
        bound = f"{int(lower):>12}" if lower else f"{'-':>12}"
        print(f"{layout:>7} {tokens:>7} {s * 1e3:>8.2f} {int(sent):>11} {bound} {ratio:>6}")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    main()
