"""Ulysses SP attention (Shift parallelism's base mode) and its full-TP shift mode vs one device."""

import copy

import pytest
import torch

from tests import dist_harness
from tests.tolerance import assert_close_reduced

N_TOKENS = 11  # not divisible by any SP degree tested: exercises the padding


def _reference(heads, kv, head_dim, qk_norm, seed=0):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from reshard.parallel.model.tiny_models import tiny_config

    family = "qwen3" if qk_norm else "llama"
    config = tiny_config(
        family, hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    module = (Qwen3Attention if qk_norm else LlamaAttention)(config, 0)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return config, module, LlamaRotaryEmbedding(config)


def _run(sp, tp, heads, kv, head_dim, qk_norm, mode, copy):
    import torch.distributed as dist

    from reshard.layers.ulysses import SHIFT_WEIGHTS, UlyssesAttention
    from reshard.layers.weights import use_weights
    from reshard.parallel import ParallelDims
    from reshard.parallel.model.parallelize import copy_full_state
    from reshard.parallel.strategies.shift import base_mesh, shift_meshes

    config, ref, rope = _reference(heads, kv, head_dim, qk_norm)
    dims = ParallelDims(sp=sp, tp=tp, world_size=dist.get_world_size())
    attn = UlyssesAttention(
        config.hidden_size,
        heads,
        kv,
        head_dim,
        meshes=shift_meshes(dims, kv),
        qk_norm=qk_norm,
        rms_norm_eps=config.rms_norm_eps,
    )
    copy_full_state(attn, {k: v.detach() for k, v in ref.state_dict().items()})
    extra = attn.add_shift_layouts(copy=copy)
    x = torch.randn(1, N_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(1, N_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(N_TOKENS)[None]
    coord = base_mesh(dims).get_coordinate()  # (s, t)
    if mode == "sp":
        nl = -(-N_TOKENS // sp)
        x_in = torch.nn.functional.pad(x, (0, 0, 0, nl * sp - N_TOKENS))[:, coord[0] * nl : (coord[0] + 1) * nl]
        pos_in = torch.nn.functional.pad(pos, (0, nl * sp - N_TOKENS))[:, coord[0] * nl : (coord[0] + 1) * nl]
        g_in = torch.nn.functional.pad(grad_out, (0, 0, 0, nl * sp - N_TOKENS))[:, coord[0] * nl : (coord[0] + 1) * nl]
    else:
        x_in = x
        pos_in = pos
        g_in = grad_out
    x_in = x_in.clone().requires_grad_(True)
    with use_weights(SHIFT_WEIGHTS if mode == "tp" else None):  # the mode is chosen per forward
        out = attn(x_in, rope(x_in, pos_in), sequence_parallel=mode == "sp")[0]
    (out * g_in).sum().backward()
    # weight grads are partial over the sp axis in SP mode (each rank saw its tokens): sum them
    grads = {}
    for name, p in attn.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if mode == "sp":
            dist.all_reduce(g, group=base_mesh(dims).get_group(0))
            if "norm" in name:  # a replicated weight applied to this rank's heads only
                dist.all_reduce(g, group=base_mesh(dims).get_group(1))
        grads[name] = g
    return out.detach(), x_in.grad, grads, coord, extra


CASES = [  # sp, tp, heads, kv, head_dim, qk_norm
    (2, 1, 4, 4, 8, False),  # MHA
    (4, 1, 8, 4, 8, False),  # GQA, KV heads divide SP
    (4, 1, 8, 2, 8, True),  # KV heads < SP: replication (Algorithm 1), Qwen3 q/k norm
    (2, 1, 4, 1, 8, False),  # one KV head
    (2, 2, 8, 2, 8, False),  # SP x TP = 2 x 2, replication inside each TP shard
    (2, 2, 8, 4, 8, True),  # SP x TP, KV heads split
    (3, 2, 6, 2, 8, False),  # the paper's Figure 7: 6 ranks, SP = 3, TP = 2
]


@pytest.mark.parametrize("mode", ["sp", "tp"])
@pytest.mark.parametrize("case", CASES, ids=[f"sp{c[0]}xtp{c[1]}-h{c[2]}-kv{c[3]}" for c in CASES])
def test_ulysses_attention_matches_single_device(case, mode):
    sp, tp, heads, kv, head_dim, qk_norm = case
    config, ref, rope = _reference(heads, kv, head_dim, qk_norm)
    x = torch.randn(1, N_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    grad_out = torch.randn(1, N_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(2))
    expected = ref(x, rope(x, torch.arange(N_TOKENS)[None]), None)[0]
    (expected * grad_out).sum().backward()
    x64 = x.detach().double()
    with torch.no_grad():
        expected64 = copy.deepcopy(ref).double()(x64, rope(x64, torch.arange(N_TOKENS)[None]), None)[0]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    nl = -(-N_TOKENS // sp)
    for out, x_grad, grads, (s, t), _ in dist_harness.run(sp * tp, _run, *case, mode, True):
        lo, hi = (s * nl, min((s + 1) * nl, N_TOKENS)) if mode == "sp" else (0, N_TOKENS)
        assert_close_reduced(out[0, : hi - lo], expected[0, lo:hi].detach(), expected64[0, lo:hi], msg=f"rank {s, t}")
        torch.testing.assert_close(x_grad[0, : hi - lo], x.grad[0, lo:hi], rtol=1e-4, atol=1e-4)
        if mode == "sp":  # base shards: rows (q/k/v) or columns (o) of tp shard t
            for name, g in grads.items():
                full = ref_grads[name]
                dim = 1 if name.startswith("o_proj.weight") else 0
                if "norm" in name:
                    expect = full
                else:
                    expect = full.chunk(tp, dim)[t]
                torch.testing.assert_close(g, expect, rtol=1e-4, atol=1e-4, msg=name)


def test_slice_and_copy_layouts_agree_and_cost_what_they_say():
    case = (2, 2, 8, 2, 8, False)
    copy = dist_harness.run(4, _run, *case, "tp", True)
    sliced = dist_harness.run(4, _run, *case, "tp", False)
    for (a, *_, extra_copy), (b, *_, extra_slice) in zip(copy, sliced):
        torch.testing.assert_close(a, b)
        assert extra_slice == 0
        # separate shift weights: q, o: 1/(sp*tp) of 64x64 each; k, v: one KV head's rows
        assert extra_copy == (2 * 64 * 64 // 4 + 2 * 8 * 64) * 4


def test_head_errors_name_the_values():
    from reshard.layers.ulysses import check_shift_heads

    with pytest.raises(ValueError, match=r"query heads \(6\) must be divisible by SP x TP \(2 x 2 = 4\)"):
        check_shift_heads(6, 2, 2, 2)
    with pytest.raises(ValueError, match=r"KV heads per tp shard \(3\) and SP \(2\) divide neither way"):
        check_shift_heads(12, 3, 2, 1)
    with pytest.raises(ValueError, match=r"KV heads \(3\) must be divisible by tp \(2\)"):
        check_shift_heads(12, 3, 2, 2)
