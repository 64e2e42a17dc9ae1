"""Mixture-of-experts models (Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE with its gated shared
expert, Llama 4 text with its sigmoid top-1 router, shared expert, chunked attention and NoPE
layer) loaded from the hub's per-expert safetensors into expert-parallel layers: tokens equal HF
``generate`` on 1 rank, TP2 (each expert split), EP2, EP2 x TP2 / EP4 on 4 ranks, and data-parallel
attention with the experts over the replicas (all-to-all dispatch) on 2 and 4 ranks; with pipeline
stages, Seesaw, DejaVu, Shift (SP x EP) and SiDP (an expert pool); a routing skew that sends nearly
every token to one rank's experts drops none; RL sync from FSDP2 / HSDP at the lower bound; a
checkpoint missing an expert's tensor, or with one of the wrong shape, is refused by name."""

from __future__ import annotations

import os

import pytest
import torch

from tests import dist_harness

NEW = 8
PROMPTS = [[5, 9, 11, 13, 2 + 5, 40], [40, 41, 42], [7, 8, 100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, str]:
    from reshard.parallel.model.tiny_models import MOE_FAMILIES, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("moe")
    return {f: str(make_tiny_checkpoint(f, root / f, seed=0)) for f in MOE_FAMILIES}


@pytest.fixture(scope="module")
def skewed(moe, tmp_path_factory) -> str:
    """Qwen3-MoE whose routers prefer the upper half of the experts (EP2: rank 1's) for every token."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("moe-skew") / "qwen3_moe"
    shutil.copytree(moe["qwen3_moe"], path)
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):  # (E, D): rows 4..7 scaled up, 0..3 damped
            weights[name] = torch.cat([w[:4] * 0.1, w[4:] * 8.0])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _tokens(path: str, tp: int, ep: int, sampled: bool = False) -> list[list[int]]:
    from reshard import LLM, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.8 if sampled else 0.0, seed=7 if sampled else None)
    with LLM(path, tp=tp, ep=ep, max_seq_len=64) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "llama4_text"]


def _block(model, path: str):
    """Layer 1's MoE block of ``model`` as a function of ``x (B, S, D)`` (Llama 4's returns a pair)."""
    layer = model.model.layers[1]
    block = layer.feed_forward if hasattr(layer, "feed_forward") else layer.mlp
    return lambda x: block(x)[0].reshape(x.shape) if "llama4" in path else block(x)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_equals_hf(moe, hf_reference, family):
    assert _tokens(moe[family], 1, 1) == hf_reference(moe[family], PROMPTS, NEW)


def test_a_moe_block_equals_hf_block_and_its_grouped_gemm_equals_a_loop(moe):
    """The layer against HF's own module (outputs, every family), and the grouped GEMM against a
    per-expert loop (plain PyTorch)."""
    from transformers import AutoModelForCausalLM

    from reshard import LLM
    from reshard.layers.moe import grouped_swiglu

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    for path in moe.values():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with LLM(path, max_seq_len=64) as llm, torch.no_grad():
            ours = _block(llm.engine.model, path)(x)
        torch.testing.assert_close(ours, _block(hf, path)(x), atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(*shape, generator=gen) for shape in ((4, 6, 8), (4, 6, 8), (4, 8, 6)))
    expert = torch.tensor([0, 0, 0, 2, 3, 3])  # expert 1 gets none
    rows = torch.randn(6, 8, generator=gen)
    silu = torch.nn.functional.silu
    loop = torch.stack([down[e] @ (silu(gate[e] @ r) * (up[e] @ r)) for r, e in zip(rows, expert.tolist())])
    got = grouped_swiglu(rows, expert, torch.bincount(expert, minlength=4), gate, up, down, silu)
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)


def _ranks(path: str, layouts: list[tuple[int, int]], sampled: bool = False) -> list[list[list[int]]]:
    return [_tokens(path, tp, ep, sampled) for tp, ep in layouts]


def _dejavu_sides(path: str, prompt_ep: int, token_ep: int) -> list[list[int]]:
    """DejaVu on 4 ranks: the prompt side TP2 with ``prompt_ep``, the token side TP2 with ``token_ep``."""
    from reshard import LLM, SamplingParams
    from reshard.parallel.strategies.dejavu.strategy import SideConfig

    sides = dict(prompt=SideConfig(tp=2, ep=prompt_ep), token=SideConfig(tp=2, ep=token_ep), prompt_ranks=2)
    with LLM(path, strategy="dejavu", max_seq_len=64, **sides) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_and_ep2_equal_hf_greedy_and_one_rank_sampled(moe, hf_reference, family):
    expected, sampled = hf_reference(moe[family], PROMPTS, NEW), _tokens(moe[family], 1, 1, sampled=True)
    for per_layout in dist_harness.run(2, _ranks, moe[family], [(2, 1), (2, 2), (1, 2)]):
        assert per_layout == [expected, expected, expected]  # TP2, EP2, DP-attention x EP2
    for per_layout in dist_harness.run(2, _ranks, moe[family], [(2, 2), (1, 2)], sampled=True):
        assert per_layout == [sampled, sampled]  # EP2, DP-attention x EP2


def _families(paths: list[str], layouts: list[tuple[int, int]]) -> list[list[list[list[int]]]]:
    return [_ranks(path, layouts) for path in paths]


def test_ep2_x_tp2_ep4_dp_attention_x_ep4_dejavu_and_shift_on_four_ranks_equal_hf(moe, hf_reference):
    expected = [hf_reference(moe[f], PROMPTS, NEW) for f in FAMILIES]
    layouts = [(4, 2), (4, 4), (1, 4), (2, 2)]  # EP2 x TP2, EP4, DP-attention x EP4, DP2 groups of EP2
    for per_family in dist_harness.run(4, _families, [moe[f] for f in FAMILIES], layouts):
        assert per_family == [[e] * 4 for e in expected]  # (3 prompts on DP4: a replica idles)
    path = moe["qwen2_moe"]  # DejaVu: EP2 prompts, TP2 tokens; Shift SP2 x TP2, experts over the 4 ranks
    assert dist_harness.run(4, _dejavu_sides, path, 2, 1) == [expected[FAMILIES.index("qwen2_moe")]] * 4
    for family in ("qwen2_moe", "llama4_text"):  # (Llama 4: its NoPE / chunked layers under Ulysses SP)
        assert dist_harness.run(4, _shift, moe[family]) == [(expected[FAMILIES.index(family)], 0)] * 4


def _shift(path: str) -> tuple[list[list[int]], int]:
    """Shift SP2 x TP2 (threshold 4: the prefill in SP, decode in TP): its tokens and switch bytes."""
    from reshard import LLM, SamplingParams

    with LLM(path, strategy="shift", sp=2, threshold=4, max_seq_len=64) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
        assert llm.engine.stats.steps_by_mode["sp"] > 0 and llm.engine.stats.steps_by_mode["tp"] > 0
        return tokens, llm.engine.stats.switch_bytes


def test_a_skewed_routing_drops_no_token(skewed, hf_reference):
    """Most tokens' experts on rank 1 (EP2, and data-parallel attention x EP2 where the all-to-alls'
    splits are uneven): the tokens are still HF's (no capacity, no drop)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(skewed, dtype=torch.float32).eval()
    with torch.no_grad():
        _, _, chosen = hf.model.layers[1].mlp.gate(hf.model.embed_tokens(torch.tensor(PROMPTS[0])))
    assert (chosen >= 4).float().mean() > 0.75  # the skew holds: most choices are rank 1's experts
    expected = hf_reference(skewed, PROMPTS, NEW)
    for per_layout in dist_harness.run(2, _ranks, skewed, [(2, 2), (1, 2)]):
        assert per_layout == [expected, expected]  # EP2 in the tp group; DP-attention x EP2: uneven all-to-alls


def test_a_missing_or_misshapen_expert_is_refused_by_name(moe, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from reshard import LLM

    for case in ("missing", "shape"):
        path = tmp_path / case
        shutil.copytree(moe["mixtral"], path)
        weights = load_file(path / "model.safetensors")
        name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
        if case == "missing":
            del weights[name]
        else:
            weights[name] = weights[name][:, :-1].contiguous()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        message = (
            rf"lacks expert tensor '{name}' \(for 'model.layers.1.mlp.experts.up_proj'\)"
            if case == "missing"
            else rf"tensor '{name}' .* is \[48, 63\] .* parameter 'model.layers.1.mlp.experts.up_proj' is \[48, 64\]"
        )
        with pytest.raises(ValueError, match=message):
            LLM(str(path), max_seq_len=64)


def _strategies(path: str) -> dict[str, list | str]:
    """Per strategy: its tokens, or the first line of its refusal."""
    from reshard import LLM, SamplingParams
    from reshard.layers.weights import weight_copies

    out = {}
    from reshard.parallel.strategies.seesaw.strategy import LayoutConfig

    ep_to_tp = dict(strategy="seesaw", prefill=LayoutConfig(tp=2, ep=2), decode=LayoutConfig(tp=2))
    layouts = [("pp2", dict(strategy="tp", pp=2)), ("seesaw", {}), ("seesaw_ep", ep_to_tp), ("dejavu", {})]
    layouts.append(("shift", dict(threshold=4)))
    layouts.append(("dp_ep_microbatches", dict(strategy="tp", tp=1, ep=2, num_microbatches=2)))
    for name, keys in layouts + [("sidp", dict(threshold=1.0))]:
        try:
            with LLM(path, strategy=keys.pop("strategy", name), max_seq_len=64, **keys) as llm:
                out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
                if name.startswith("seesaw"):  # its transitions' weight bytes (experts included), their lower bound
                    out[f"{name}_moves"] = [(h.bytes, h.lower_bound_bytes) for h in llm.engine.policy.switch.history]
                if name == "shift":  # its modes, bytes at switches, the KV storage seen, the full-TP copies
                    stats = llm.engine.stats
                    out["shift_stats"] = (stats.steps_by_mode, stats.switch_bytes, stats.kv_storage)
                    out["shift_copies"] = sorted(weight_copies(llm.engine.model))
        except ValueError as e:
            out[name] = str(e).splitlines()[0]
    return out


def test_pipeline_seesaw_dejavu_shift_sp_x_ep_and_sidp_run_moe(moe, hf_reference):
    """Pipeline stages, Seesaw (P2 prefill, T2 decode) and DejaVu's sides load the experts like the
    tp plan: tokens equal HF; Seesaw's transitions (P2 prefill <-> T2 decode, and EP2 prefill:
    whole experts per rank <-> T2 decode: every expert split) move the expert tensors with the rest
    at the lower bound. Shift SP x EP (SP2 prefill, TP2 decode, experts over both ranks in one layout):
    tokens equal HF, 0 bytes at the switch, one KV storage, and no expert has a full-TP copy
    (only the dense layer 0's FFN and the attention do). SiDP with its expert pool (the dense layer
    0 replicated): tokens equal HF. Micro-batches with the experts over the replicas (each replica
    would split its tokens its own way, unpairing the all-to-alls): one line, not a hang."""
    path = moe["qwen3_moe"]
    expected = hf_reference(path, PROMPTS, NEW)
    for out in dist_harness.run(2, _strategies, path):
        assert (
            out["pp2"] == out["seesaw"] == out["seesaw_ep"] == out["dejavu"] == out["shift"] == out["sidp"] == expected
        )
        for moves in (out["seesaw_moves"], out["seesaw_ep_moves"]):
            assert moves and all(moved == lower > 0 for moved, lower in moves), moves
        steps, switch_bytes, kv_seen = out["shift_stats"]
        assert (
            steps["sp"] > 0
            and steps["tp"] > 0
            and switch_bytes == 0
            and kv_seen
            and kv_seen.count(kv_seen[0]) == len(kv_seen)
        )
        assert out["dp_ep_microbatches"].startswith("engine.num_microbatches (2) must be 1 with the experts over the")
        assert out["shift_copies"] and not [k for k in out["shift_copies"] if "experts" in k or "layers.1.mlp" in k]
        assert any(k.startswith("model.layers.0.mlp.") for k in out["shift_copies"]), out["shift_copies"]


def _greedy(model) -> list[list[int]]:
    model.eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones(1, len(p))
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def test_a_moe_module_in_memory_is_copied_and_synced_after_a_training_step(moe):
    """``LLM(model=module)`` splits transformers' fused experts into ours (the module untouched);
    after an optimizer step ``sync_weights`` copies them again: bitwise equal, tokens HF's."""
    from transformers import AutoModelForCausalLM

    from reshard import LLM, SamplingParams
    from reshard.parallel.model.weight_sync import split_fused
    from tests.test_weight_sync import _sliced_equal

    module = AutoModelForCausalLM.from_pretrained(moe["mixtral"], dtype=torch.float32).train()
    fused = module.model.layers[1].mlp.experts.gate_up_proj
    with LLM(module, max_seq_len=64) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
        assert module.training and module.model.layers[1].mlp.experts.gate_up_proj is fused  # untouched
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        ids = torch.tensor([PROMPTS[2]])
        module(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        llm.sync_weights(module)
        full = {k: v for n, t in module.state_dict().items() for k, v in split_fused(n, t)}
        assert _sliced_equal(llm.engine.model, full) == []
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
    assert after == _greedy(module) and after != first


def _moe_sync(path: str, layout: str, tp: int, ep: int) -> dict:
    """FSDP2 (or HSDP) training model of ``path``, one Adam step, synced into an LLM of TP ``tp``
    and EP ``ep``: rollout tensors unlike the sliced full ones, bytes received and the lower bound,
    tokens and HF's of the synced weights. Then a bf16 LLM of the same layout synced twice with
    ``delta=True`` and ``verify=True``, the second after the experts alone changed: bitwise the
    full tensors converted, the second sending less than the first."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from reshard import LLM, SamplingParams
    from reshard.parallel.model.weight_sync import model_sync, split_fused
    from tests.test_weight_sync import _full, _sliced_equal, _trained

    transposed = "llama4" in path
    with LLM(path, tp=tp, ep=ep, max_seq_len=64) as llm:
        model, _ = _trained(path, list(range(dist.get_world_size())), layout=layout)
        sync = model_sync(model, llm.engine.model)
        stats = sync.sync(1)
        full = _full(model)
        bad = _sliced_equal(llm.engine.model, {k: v for n, t in full.items() for k, v in split_fused(n, t, transposed)})
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
    with LLM(path, tp=tp, ep=ep, max_seq_len=64, dtype="bfloat16") as bf16:
        delta = model_sync(model, bf16.engine.model, delta=True)
        first = delta.sync(1, verify=True).bytes_received
        with torch.no_grad():  # an update of the experts alone: the delta carries them, nothing else
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.to_local().mul_(2.0)
        second = delta.sync(2, verify=True).bytes_received
        after = {k: v for n, t in _full(model).items() for k, v in split_fused(n, t, transposed)}
        bad_delta = _sliced_equal(bf16.engine.model, after)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.load_state_dict(full)
    return dict(
        bad=bad, received=stats.bytes_received, lower=sync.lower_bound_bytes, tokens=tokens, ref=_greedy(reference),
        bad_delta=bad_delta, first=first, second=second, lower_bf16=delta.lower_bound_bytes,
    )  # fmt: skip


@pytest.mark.parametrize(
    "family, layout, tp, ep",
    [("llama4_text", "fsdp", 4, 2), ("qwen3_moe", "hsdp", 4, 4)],
    ids=["fsdp-ep2xtp2-llama4", "hsdp-ep4-qwen3"],
)
def test_rl_sync_of_experts_from_fsdp2_and_hsdp_is_bitwise_at_the_lower_bound(moe, family, layout, tp, ep):
    """FSDP2 shards the fused experts over dim 0 (the experts); their gate / up halves (Llama 4's
    input-major ones transposed) stay DTensors, so the planned sync moves exactly the bytes each
    rank lacks: into EP2 x TP2 (each expert split over 2 ranks) and EP4, on 4 ranks; converted to
    bf16 while packed and, after an update of the experts alone, as a delta, verified, bitwise."""
    results = dist_harness.run(4, _moe_sync, moe[family], layout, tp, ep)
    assert sum(r["received"] for r in results) == results[0]["lower"] > 0
    assert results[0]["lower_bf16"] == results[0]["lower"] // 2  # converted while packed: bf16 bytes move
    assert sum(r["first"] for r in results) >= results[0]["lower_bf16"]  # (a delta sync's first: dense + headers)
    assert sum(r["second"] for r in results) < sum(r["first"] for r in results)  # a delta
    for r in results:
        assert r["bad"] == [] and r["tokens"] == r["ref"] and r["bad_delta"] == []


def test_a_checkpoint_of_transformers_fused_experts_loads_as_the_hubs(moe, hf_reference, tmp_path):
    """transformers' in-memory layout (``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj``)
    saved as it is: the gate and up rows split, tokens equal HF's."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(moe["qwen2_moe"], tmp_path / "fused", ignore=shutil.ignore_patterns("*.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(moe["qwen2_moe"], dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    assert _tokens(str(tmp_path / "fused"), 1, 1) == hf_reference(moe["qwen2_moe"], PROMPTS, NEW)


SIDP_NEW = (3, 5, NEW)  # the last request runs on alone: the other replica runs dummy steps


def _sidp(path: str) -> dict[str, dict]:
    """SiDP over 2 replicas, mode was / cas / auto (b* = 1.5 rows per replica, decided every 2
    steps): tokens, step modes and the expert pool's counters and bytes."""
    from reshard import LLM, SamplingParams

    out = {}
    for mode in ("was", "cas", "auto"):
        with LLM(path, strategy="sidp", mode=mode, threshold=1.5, interval=2, max_seq_len=64, max_batch_size=3) as llm:
            params = [SamplingParams(max_new_tokens=n) for n in SIDP_NEW]
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            pool, summary = llm.engine.policy.pools.experts, llm.engine.stats.summary()
            out[mode] = dict(
                tokens=tokens, summary=summary, counters=vars(pool.counters), owned=pool.owned_bytes(),
                whole=pool.whole_bytes(), layers=len(pool.blocks),
            )  # fmt: skip
    return out


def test_sidp_expert_pool_runs_was_cas_and_auto_with_tokens_equal_hf(moe, hf_reference):
    """SiDP's expert pool on Mixtral (2 MoE layers) over 2 replicas: each rank owns half of every
    layer's experts. WaS gathers a layer's experts whole (the next layer's gather started when a
    layer's forward starts: prefetched), receiving exactly the half it lacks; CaS gathers nothing
    (tokens travel to the owners by all-to-all); auto switches between them. Every replica runs
    every step (dummy steps join the gathers and all-to-alls); tokens equal HF in every mode."""
    path = moe["mixtral"]
    expected = [t[:n] for t, n in zip(hf_reference(path, PROMPTS, NEW), SIDP_NEW)]
    for out in dist_harness.run(2, _sidp, path):
        for mode, r in out.items():
            assert r["tokens"] == expected, mode
            assert r["owned"] * 2 == r["whole"] and r["summary"]["dummy_steps"] > 0
            c, steps = r["counters"], r["summary"]["mode_steps"]
            assert (
                c["gathers"] == steps["was"] * r["layers"]
                and c["gather_bytes"] == c["gathers"] * r["whole"] // r["layers"] // 2
            )
            assert c["prefetched"] == steps["was"] * (r["layers"] - 1)
        assert out["was"]["summary"]["mode_steps"]["cas"] == out["cas"]["summary"]["mode_steps"]["was"] == 0
        assert out["auto"]["summary"]["mode_switches"] >= 1 and min(out["auto"]["summary"]["mode_steps"].values()) > 0


def test_llama4_attention_equals_hf_at_every_position_and_each_of_its_variants_matters(moe):
    """Prompt logits of a 20-token prompt through Llama 4 (layer 0: RoPE over interleaved pairs,
    chunks of 8, so two chunk boundaries, and the L2 q/k norm; layer 1: NoPE, its queries' temperature
    above 1 from position 3) equal HF's forward; without the chunking, the temperature or the L2
    norm they do not (each variant is exercised, not only matched)."""
    from transformers import AutoModelForCausalLM

    from reshard import LLM
    from reshard.layers.attention import PositionScheme

    path, prompt = moe["llama4_text"], list(range(30, 50))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    with LLM(path, max_seq_len=64) as llm:
        torch.testing.assert_close(llm.engine.prompt_logits([prompt])[0], want, atol=1e-4, rtol=1e-4)
        first, nope = (layer.self_attn for layer in llm.engine.model.model.layers)
        variants = [(first, "sliding_window", None), (nope, "position_scheme", PositionScheme(rope=False))]
        for attn, field, value in [*variants, (first, "position_scheme", PositionScheme())]:
            kept = getattr(attn, field)
            setattr(attn, field, value)
            changed = llm.engine.prompt_logits([prompt])[0]
            setattr(attn, field, kept)
            assert (changed - want).abs().max() > 1e-3, (field, value)


TRITON_SCRIPT = """
import torch, torch.nn.functional as F
from reshard.layers.grouped_gemm import grouped_swiglu
g = torch.Generator().manual_seed(0)
E, D, I = 5, 40, 24  # an expert with no row, one of 37 rows (3 tiles of 16), one of 1
gate, up, down = (torch.randn(*s, generator=g) / 4 for s in ((E, I, D), (E, I, D), (E, D, I)))
expert = torch.tensor([0] * 3 + [2] * 37 + [3] + [4] * 17)
x, counts = torch.randn(expert.numel(), D, generator=g), torch.bincount(expert, minlength=E)
loop = torch.stack([down[e] @ (F.silu(gate[e] @ r) * (up[e] @ r)) for r, e in zip(x, expert.tolist())])
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    args = [t.to(dtype) for t in (x, gate, up, down)]
    ours = grouped_swiglu(args[0], expert, counts, *args[1:], F.silu, backend="triton").float()
    torch_ = grouped_swiglu(args[0], expert, counts, *args[1:], F.silu, backend="torch").float()
    torch.testing.assert_close(ours, loop, atol=tol, rtol=tol)
    torch.testing.assert_close(ours, torch_, atol=tol, rtol=tol)
print("TRITON-OK")
"""


def test_triton_grouped_gemm_matches_torch_and_a_loop_under_the_interpreter():
    """The Triton grouped GEMM (one program per tile of one expert's rows, no padding) against the
    batched-matmul backend and a per-expert loop, fp32 and fp16, with uneven counts, an expert of
    no rows and one of several tiles. (bf16 is left out: Triton 3.9's interpreter computes
    ``tl.dot`` of bf16 inputs wrong, by ~1e10 on a 16 x 16 product, while fp16 and fp32 are right.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # (read when triton is imported: a fresh process)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "TRITON-OK" in proc.stdout, proc.stdout + proc.stderr


def test_grouped_gemm_backends_are_checked_by_name():
    from reshard.layers.grouped_gemm import check_backend, grouped_swiglu

    with pytest.raises(
        ValueError, match=r"grouped GEMM backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"
    ):
        check_backend("cuda")
    rows, expert = torch.zeros(2, 4), torch.tensor([0, 0])
    weights = (torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), torch.zeros(1, 4, 3))
    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors: Triton runs only in its interpreter
        with pytest.raises(ValueError, match=r"backend='triton' (needs CUDA tensors or TRITON_INTERPRET=1|but triton)"):
            grouped_swiglu(rows, expert, torch.tensor([2]), *weights, torch.nn.functional.silu, backend="triton")
