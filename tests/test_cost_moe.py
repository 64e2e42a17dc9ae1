"""The cost model on mixture-of-experts models (issue 37, item 6): total vs active parameters
against the published figures, HF configs of each family, expert weight reads, expert
parallelism's memory, all-to-all and skew, Seesaw moves of expert tensors, Shift as SP x EP (the
engine's layout: experts over all sp*tp GPUs in both modes), and the planner ranking MoE layouts
instead of refusing them. Pure arithmetic: no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from reshard.parallel.cost import moe
from reshard.parallel.cost import roofline as cost
from reshard.parallel.cost import technique_models as models
from reshard.parallel.cost.collectives import all_gather_time, all_to_all_time, roofline_time
from reshard.parallel.cost.profiles import MODELS, hardware, model, model_from_config
from reshard.parallel.cost.roofline import ParallelConfig, parse_notation

H200 = hardware("h200")


def _compose(overrides):
    from reshard.recipes.schema import compose

    return compose("plan", overrides)


# published (total, active) parameters: the Qwen3-30B-A3B model card ("30.5B in total and 3.3B
# activated"), Mistral's Mixtral announcement ("46.7B total parameters but only uses 12.9B
# parameters per token"), Meta's Llama 4 Scout card ("17B active parameters ... 109B total");
# Scout's 109B also counts its vision encoder, which the text model here leaves out (107.8B)
PUBLISHED = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "mixtral-8x7b": (46.7e9, 12.9e9), "llama4-scout": (109e9, 17e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_match_the_published_figures_within_2_percent(name):
    m, (total, active) = MODELS[name], PUBLISHED[name]
    assert moe.model_params(m) == pytest.approx(total, rel=0.02)
    assert moe.model_params(m, active=True) == pytest.approx(active, rel=0.02)
    assert cost.model_bytes(m) == moe.model_params(m) * 2  # memory holds every expert
    assert MODELS[f"{name}-fp8"].dtype_bytes == 1


def _qwen3(**extra):
    cfg = dict(
        model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936, torch_dtype="bfloat16",
    )  # fmt: skip
    return cfg | extra


def test_hf_configs_of_each_family_give_the_builtin_profiles_and_their_dense_layers():
    assert model_from_config(_qwen3(), name="q") == dataclasses.replace(MODELS["qwen3-30b-a3b"], name="q")
    saved = {k: v for k, v in _qwen3().items() if k != "num_experts"} | {"num_local_experts": 128}
    assert model_from_config(saved, name="q") == model_from_config(_qwen3(), name="q")  # as transformers 5 saves it
    q = model_from_config(_qwen3(mlp_only_layers=[0], decoder_sparse_step=2), name="q")
    assert q.moe_layers == tuple(range(1, 48, 2)) and q.intermediate == 6144  # layer 0 dense, odd layers MoE
    shared = model_from_config(_qwen3(model_type="qwen2_moe", shared_expert_intermediate_size=512), name="q2")
    assert shared.shared_intermediate == 512
    mixtral = dict(
        model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000, torch_dtype="bfloat16",
    )  # fmt: skip
    assert model_from_config(mixtral, name="x") == dataclasses.replace(MODELS["mixtral-8x7b"], name="x")
    text = dict(
        model_type="llama4_text", num_hidden_layers=48, hidden_size=5120, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048,
    )  # fmt: skip
    scout = model_from_config({"model_type": "llama4", "text_config": text, "torch_dtype": "bfloat16"}, name="s")
    assert scout == dataclasses.replace(MODELS["llama4-scout"], name="s")
    maverick_like = model_from_config(text | {"interleave_moe_layer_step": 2}, name="m")
    assert maverick_like.moe_layers == tuple(range(1, 48, 2)) and maverick_like.intermediate == 16384
    assert model_from_config(text | {"moe_layers": [5, 0]}, name="m").moe_layers == (0, 5)


def test_moe_configs_the_model_cannot_read_are_refused_by_name():
    deepseek = _qwen3(model_type="deepseek_v3", n_routed_experts=256)
    with pytest.raises(ValueError, match=r"\(num_experts=128, n_routed_experts=256\); .* model_type is 'deepseek_v3'"):
        model_from_config(deepseek, name="ds")
    lacking = {k: v for k, v in _qwen3().items() if k != "moe_intermediate_size"}
    with pytest.raises(ValueError, match=r"^config.json of 'q' \(qwen3_moe\) lacks 'moe_intermediate_size'"):
        model_from_config(lacking, name="q")


def test_distinct_experts_is_k_for_one_token_and_all_experts_for_many():
    assert moe.distinct_experts(128, 8, 1) == pytest.approx(8)
    assert moe.distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert moe.distinct_experts(128, 8, 10_000) == pytest.approx(128)
    counts = [moe.distinct_experts(128, 8, b) for b in (1, 2, 8, 64, 512)]
    assert counts == sorted(counts) and 8 < counts[2] < 64 < counts[-1] < 128
    with pytest.raises(ValueError, match=r"experts_per_token \(9\) must be in 1..experts \(8\)"):
        moe.distinct_experts(8, 9, 1)


def test_a_decode_step_reads_the_experts_its_tokens_touch_not_all_of_them():
    m, one = MODELS["qwen3-30b-a3b"], ParallelConfig()
    acts = 8 * (2 * m.hidden + 3 * m.expert_intermediate) * 2  # 8 routed rows in and out
    expected = (8 * moe.expert_params(m) * 2 + acts) / H200.mem_bw  # batch 1: k experts, memory-bound
    assert moe.expert_time(m, H200, one, 1) == pytest.approx(expected)
    weights = moe.distinct_experts(128, 8, 64) * moe.expert_params(m) * 2  # ~127 of 128 experts, not 64 x 8
    assert moe.expert_time(m, H200, one, 64) == pytest.approx((weights + 64 * acts) / H200.mem_bw)


def test_expert_parallel_memory_divides_the_experts_over_ep():
    m = MODELS["qwen3-30b-a3b"]
    experts = len(m.moe_layers) * m.experts * moe.expert_params(m) * 2
    d8, d8e8, t8e8 = (parse_notation(t) for t in ("D8", "D8E8", "T8E8"))
    assert cost.weight_bytes_per_gpu(m, d8) == cost.model_bytes(m)  # every replica holds every expert
    assert cost.weight_bytes_per_gpu(m, d8) - cost.weight_bytes_per_gpu(m, d8e8) == pytest.approx(experts * 7 / 8)
    assert cost.weight_bytes_per_gpu(m, t8e8) == pytest.approx(cost.model_bytes(m) / 8)
    scout = MODELS["llama4-scout"]  # 216 GB in bf16: two replicas do not fit two H200s, an expert pool does
    assert "weights" in cost.infeasible_reason(scout, H200, parse_notation("D2"), 1000)
    assert cost.infeasible_reason(scout, H200, parse_notation("D2E2"), 1000) is None


def test_all_to_all_bytes_per_token_and_their_time_over_the_link():
    m = MODELS["qwen3-30b-a3b"]
    ranks = 8 * (1 - (7 / 8) ** 8)  # distinct ranks a token's 8 uniform choices reach: 5.25
    assert (
        moe.all_to_all_bytes_per_token(m, 8) == pytest.approx(2 * 2048 * 2 * ranks * 7 / 8) == pytest.approx(37640.09)
    )
    assert moe.all_to_all_bytes_per_token(m, 1) == 0
    free = dataclasses.replace(H200, link_bw=math.inf, link_latency=0.0)
    d8e8, tokens = parse_notation("D8E8"), 64
    comm = moe.expert_time(m, H200, d8e8, tokens) - moe.expert_time(m, free, d8e8, tokens)
    expected = tokens * moe.all_to_all_bytes_per_token(m, 8) / H200.link_bw + 2 * 7 * H200.link_latency
    assert comm == pytest.approx(expected)  # dispatch + combine: 7 messages each
    t8e8 = parse_notation("T8E8")  # inside the tp group: no all-to-all
    assert moe.expert_time(m, H200, t8e8, tokens) == moe.expert_time(m, free, t8e8, tokens)


def test_skew_multiplies_the_busiest_ranks_expert_time_and_needs_ep():
    m = MODELS["qwen3-30b-a3b"]
    skewed = dataclasses.replace(m, expert_skew=2.0)
    t8e8, t8 = parse_notation("T8E8"), parse_notation("T8")
    assert moe.expert_time(skewed, H200, t8e8, 256) == pytest.approx(2 * moe.expert_time(m, H200, t8e8, 256))
    assert cost.decode_step_time(skewed, H200, t8e8, 256, 1000) > cost.decode_step_time(m, H200, t8e8, 256, 1000)
    assert cost.decode_step_time(skewed, H200, t8, 256, 1000) == cost.decode_step_time(m, H200, t8, 256, 1000)
    capped = dataclasses.replace(m, expert_skew=100.0)  # the busiest of 2 ranks does at most all the work
    assert moe.expert_time(capped, H200, parse_notation("T8E2"), 256) == pytest.approx(
        2 * moe.expert_time(m, H200, parse_notation("T8E2"), 256)
    )


def test_ep_notation_and_the_layouts_the_engine_runs():
    assert {c.notation for c in cost.configs(2, experts=True)} == {"T2", "D2", "P2", "T2E2", "D2E2"}
    assert len(cost.configs(8, experts=True)) == 21 and len(cost.configs(8)) == 10
    for text in ("T8E4", "D8E8", "D2T4E2", "T4P2E4"):
        assert parse_notation(text).notation == text
    with pytest.raises(ValueError, match=r"'D4E8': experts over the replicas need ep \(8\) == dp \(4\)"):
        parse_notation("D4E8")
    with pytest.raises(ValueError, match=r"ep \(4\) must divide tp \(2\)"):
        parse_notation("T2E4")
    shift = parse_notation("S2T4E8")  # Shift's SP x EP base: experts over all 8 GPUs
    assert shift == ParallelConfig(sp=2, tp=4, ep=8, shift_ep=True) and shift.notation == "S2T4E8" and shift.dispatch
    assert not parse_notation("T8E8").shift_ep  # inside the tp group: no all-to-all
    with pytest.raises(ValueError, match=r"ep \(2\) must equal sp\*tp \(4\) with dp and pp 1"):
        parse_notation("S2T2E2")
    with pytest.raises(ValueError, match=r"^sp \(2\) x ep \(4\): with SP the experts span all sp\*tp \(4\) GPUs"):
        ParallelConfig(sp=2, tp=2, ep=4)
    ulysses_only = cost.infeasible_reason(MODELS["qwen3-30b-a3b"], H200, ParallelConfig(sp=2), 10)
    assert ulysses_only == "sp (2) on MoE model 'qwen3-30b-a3b' runs as SP x EP: experts over all sp*tp GPUs (shift_ep)"
    assert "dense" in cost.infeasible_reason(model("llama3-15b"), H200, parse_notation("T2E2"), 10)
    mixtral_ep16 = cost.infeasible_reason(MODELS["mixtral-8x7b"], H200, ParallelConfig(tp=16, ep=16), 10)
    assert mixtral_ep16 == "experts (8) not divisible by ep (16)"


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "llama4-scout"])
def test_shift_holds_a_moe_models_experts_once_over_all_gpus_and_copies_the_rest(name):
    """SP x EP as the engine runs it: per GPU the base holds attention, router, shared expert and
    the ends over tp, and 1/8 of the experts; the full-TP copy holds the same non-expert weights
    over 8 and no expert; a switch moves 0 expert bytes (the old layout, experts TP over tp and
    replicated over sp, would move 2.5x all of them)."""
    from reshard.parallel.cost.techniques import shift_copy_bytes
    from reshard.parallel.cost.transitions import expert_switch_bytes

    m, e = MODELS[name], 2
    base, full = models.shift_layouts(m, 2, 8)
    assert (base, full) == (ParallelConfig(sp=2, tp=4, ep=8, shift_ep=True), ParallelConfig(tp=8, ep=8, shift_ep=True))
    rest = m.layers * (moe.attention_params(m) + moe.shared_ffn_params(m)) + moe.embedding_params(m)
    experts = m.layers * m.experts * moe.expert_params(m)
    assert cost.weight_bytes_per_gpu(m, base) == pytest.approx(rest * e / 4 + experts * e / 8)
    assert shift_copy_bytes(m, 8) == pytest.approx(rest * e / 8)
    assert expert_switch_bytes(m, base, full) == 0
    assert expert_switch_bytes(m, ParallelConfig(sp=2, tp=4), ParallelConfig(tp=8)) == experts * e * 5 / 2
    row = models.shift_base(m, H200, 8)
    assert row is not None and row.shift_ep and row.ep == 8


def test_shift_moe_time_is_the_routed_share_plus_all_to_all_and_all_gather():
    """Each GPU runs 1/8 of the routed rows (times the skew) and dispatches 1/8 of the step's
    tokens by all-to-all, once to each GPU holding one of its experts and one row back; the
    outputs are all-gathered over tp (SP mode, the sp
    shard's rows) or over all 8 GPUs (full TP); only a shared expert keeps an all-reduce."""
    m, tokens, e, k = MODELS["qwen3-30b-a3b"], 512, 2, 8
    base, full = models.shift_layouts(m, 2, 8)
    flops = 2 * k * moe.expert_params(m) * tokens / 8
    reads = moe.distinct_experts(128, k, tokens) * moe.expert_params(m) * e / 8
    compute = roofline_time(H200, flops, reads + tokens * k / 8 * (2 * m.hidden + 3 * m.expert_intermediate) * e)
    reached = 8 * (1 - (7 / 8) ** k)  # the distinct GPUs a token's k choices reach: its rows
    a2a = 2 * all_to_all_time(H200, tokens / 8 * reached * m.hidden * e, 8)
    sp_mode = compute + a2a + all_gather_time(H200, tokens / 2 * m.hidden * e, 4)
    assert moe.expert_time(m, H200, base, tokens) == pytest.approx(sp_mode)
    tp_mode = compute + a2a + all_gather_time(H200, tokens * m.hidden * e, 8)
    assert moe.expert_time(m, H200, full, tokens) == pytest.approx(tp_mode)
    no_latency = dataclasses.replace(H200, link_latency=0.0)  # bytes over the link, per GPU
    sent = tokens / 8 * moe.all_to_all_bytes_per_token(m, 8) + 3 / 4 * tokens / 2 * m.hidden * e
    assert moe.dispatch_time(m, no_latency, base, tokens) == pytest.approx(sent / H200.link_bw)
    skewed = dataclasses.replace(m, expert_skew=2.0)
    assert moe.expert_time(skewed, H200, base, tokens) == pytest.approx(2 * compute + sp_mode - compute)
    assert moe.ffn_all_reduces(m, base, sparse=True) == 0  # the experts come back by all-gather
    assert moe.ffn_all_reduces(m, ParallelConfig(tp=8), sparse=True) == 1
    assert moe.ffn_all_reduces(MODELS["llama4-scout"], full, sparse=True) == 1  # its shared expert's


def test_seesaw_moves_of_expert_tensors_are_the_lower_bound():
    m = MODELS["mixtral-8x7b"]
    experts = m.layers * m.experts * moe.expert_params(m) * 2
    t8, t8e8, d8, d8e8 = (parse_notation(t) for t in ("T8", "T8E8", "D8", "D8E8"))
    assert cost.transition_bytes(m, t8, t8e8) == experts * 7 / 8  # each rank gathers its expert whole
    assert cost.transition_bytes(m, d8, d8e8) == 0  # every replica already holds its experts
    assert cost.transition_bytes(m, d8e8, d8) == experts * 7  # 8 replicas each fetch the 7/8 they lack


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "llama4-scout"])
def test_the_planner_ranks_expert_parallel_layouts_of_moe_models(name):
    from reshard.recipes.plan import make_plan, summary_lines

    plan = make_plan(_compose([f"model={name}", "hardware=h200", "num_gpus=2", "workload=sharegpt"]))
    names = [r["layout"] for r in plan["ranked"]]
    rates = [r["tokens_per_s"] for r in plan["ranked"]]
    assert len(names) >= 10 and rates == sorted(rates, reverse=True) and rates[-1] > 0
    assert {"T2E2", "D2E2"} <= set(names) and "sidp" not in {r["kind"] for r in plan["ranked"]}
    assert plan["moe"]["total_params"] == moe.model_params(MODELS[name]) and plan["sidp_threshold"] is None
    assert "parameters, " in summary_lines(plan) and "active per token" in summary_lines(plan)
    shift = [r for r in plan["ranked"] if r["kind"] == "shift"]
    assert len(shift) == (name != "llama4-scout")  # Scout's bf16 base and copy leave no KV room on 2
    assert all(r["layout"] == "Shift S2E2|T2E2" and r["note"].endswith("0 bytes at a switch") for r in shift)
    skewed = make_plan(_compose([f"model={name}", "hardware=h200", "num_gpus=2", "workload=sharegpt", "expert_skew=2"]))
    rate = {r["layout"]: r["tokens_per_s"] for r in skewed["ranked"]}
    assert rate["D2E2"] < dict(zip(names, rates))["D2E2"]


def test_expert_skew_is_refused_below_one_and_on_a_dense_model():
    from reshard.recipes.plan import make_plan

    with pytest.raises(ValueError, match=r"expert_skew must be >= 1.0 \(the busiest rank over the mean\), got 0.5"):
        _compose(["expert_skew=0.5"])
    with pytest.raises(
        ValueError, match=r"expert_skew \(2.0\) needs a mixture-of-experts model; 'llama3-15b' is dense"
    ):
        make_plan(_compose(["model=llama3-15b", "expert_skew=2"]))


def test_shift_fig14_orderings_hold_at_16k_inputs_with_the_datasheet_peaks():
    """Shift's Fig. 14 (8 x H200, FP8): Shift (SP x EP) above TP on both MoE models and DP above
    TP, SP and Shift on Qwen3-30B-A3B, at the middle of its input axis (bench/RESULTS.md has every
    length: at 2k and 4k the model puts Shift under TP on Qwen3-30B-A3B, by 9-10%)."""
    from reshard.parallel.cost.fit import Efficiency
    from reshard.parallel.cost.papers import SHIFT_FIG14
    from reshard.parallel.cost.validate import fig14_agreement

    rows = [dataclasses.replace(r, input_lens=(16384,)) for r in SHIFT_FIG14]
    found = fig14_agreement(rows, Efficiency())
    assert [f["agrees"] for f in found] == [True, True, True], found
    assert {f["claim"] for f in found} == {r.key for r in SHIFT_FIG14} and len(found) == 3
