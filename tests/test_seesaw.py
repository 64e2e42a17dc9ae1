"""Seesaw: prefill layout -> decode layout transitions, CPU KV tier, schedulers, against HF."""

import inspect
import itertools

import pytest
import torch

from tests import dist_harness
from tests.test_generate import _prompts
from tests.tolerance import assert_close_reduced, hf_prompt_kv

MAX_NEW = [12, 5, 9, 12, 3, 7, 12, 6]  # per request: different output lengths
LAYOUTS = {
    "P4-T4": (dict(pp=4), dict(tp=4)),
    "D2P2-T4": (dict(dp=2, pp=2), dict(tp=4)),
    "P2-T2": (dict(pp=2), dict(tp=2)),
    "P4-T2P2": (dict(pp=4), dict(pp=2, tp=2)),
    "D2P2-D2T2": (dict(dp=2, pp=2), dict(dp=2, tp=2)),
}
BUDGET = 60  # CPU KV tokens: the longest prompt (40) fits, a few prompts at once do not


def _dims(world, degrees):
    from reshard.parallel import ParallelDims

    return ParallelDims(**degrees, world_size=world)


def _seesaw(
    path,
    layouts,
    *,
    budget=BUDGET,
    scheduler="transition_minimizing",
    weights="move",
    max_batch_size=3,
    compile=False,
    **paged,
):
    import torch.distributed as dist

    from reshard.parallel import EngineConfig
    from reshard.parallel.strategies.seesaw import LayoutSwitch, seesaw_engine

    world = dist.get_world_size()
    switch = LayoutSwitch(path, _dims(world, layouts[0]), _dims(world, layouts[1]), weights=weights)
    config = EngineConfig(max_batch_size=max_batch_size, max_seq_len=128, compile=compile, **paged)
    return seesaw_engine(switch, config, cpu_kv_budget=budget, scheduler=scheduler)


def _requests(prompts, max_new):
    from reshard.parallel import Request, SamplingParams

    return [Request(i, p, SamplingParams(max_new_tokens=m)) for i, (p, m) in enumerate(zip(prompts, max_new))]


def _checkpoint_boxes_equal(model, path) -> bool:
    """Every parameter shard this rank holds is bitwise the checkpoint's slice."""
    import torch.distributed as dist

    from reshard import Layout
    from reshard.parallel.model.checkpoint import CheckpointReader

    reader, rank = CheckpointReader(path), dist.get_rank()
    for name, p in model.named_parameters():
        box = Layout.of_dtensor(p).box(rank)
        if box is not None and not torch.equal(p.to_local(), reader.read(name, box)):
            return False
    return True


def _generate_and_check(path, layouts, prompts, max_new, weights):
    """Tokens, transition accounting, and the weights of both trees after all the transitions."""
    engine = _seesaw(path, layouts, weights=weights)
    tokens = [c.output_ids for c in engine.generate(_requests(prompts, max_new))]
    switch, stats = engine.policy.switch, engine.stats
    weights_ok = [_checkpoint_boxes_equal(switch.models[switch.active], path)]
    switch.switch("prefill" if switch.active == "decode" else "decode")
    weights_ok.append(_checkpoint_boxes_equal(switch.models[switch.active], path))
    full = sum(p.numel() * p.element_size() for p in switch.models["decode"].parameters())
    history = [(h.bytes, h.lower_bound_bytes, h.peak_weight_bytes / full) for h in switch.history]
    engine.close()
    return tokens, stats.transitions, history, weights_ok


@pytest.mark.parametrize(
    "layout,weights",
    [
        ("P4-T4", "move"),
        ("P4-T4", "reload"),
        ("D2P2-T4", "move"),
        ("D2P2-T4", "reload"),
        ("P2-T2", "move"),
        ("P4-T2P2", "move"),
        ("D2P2-D2T2", "move"),
    ],
)
def test_seesaw_tokens_match_hf(four_layer, hf_reference, layout, weights):
    path, prompts = four_layer["llama"], _prompts(8)
    full = hf_reference(path, prompts, max(MAX_NEW))
    expected = [out[:m] for out, m in zip(full, MAX_NEW)]
    pre, dec = LAYOUTS[layout]
    world = max(p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1) for p in (pre, dec))
    results = dist_harness.run(world, _generate_and_check, path, LAYOUTS[layout], prompts, MAX_NEW, weights)
    for tokens, transitions, history, weights_ok in results:
        assert tokens == expected
        assert transitions >= 3  # the small CPU KV budget forces several round trips
        assert weights_ok == [True, True]
        assert all(b > 0 and peak > 0 for b, _, peak in history)  # every transition accounted
        if weights == "move":
            assert all(b == lb for b, lb, _ in history), history


def _tokens(path, layouts, prompts, max_new, compile=False):
    engine = _seesaw(path, layouts, compile=compile)
    tokens = [c.output_ids for c in engine.generate(_requests(prompts, max_new))]
    transitions = engine.stats.transitions
    engine.close()
    return tokens, transitions


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_seesaw_other_families_match_hf(four_layer, hf_reference, family):
    """Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral (1 KV head: replicated 4x in T4, sliding window)."""
    path, prompts = four_layer[family], _prompts(8)
    full = hf_reference(path, prompts, max(MAX_NEW))
    expected = [out[:m] for out, m in zip(full, MAX_NEW)]
    for tokens, transitions in dist_harness.run(4, _tokens, path, LAYOUTS["P4-T4"], prompts, MAX_NEW):
        assert tokens == expected and transitions >= 3


def test_seesaw_pipeline_stages_replicate_one_kv_head(four_layer, hf_reference):
    """P2T2 -> T4 on Mistral (1 KV head): each prefill stage replicates it over its 2 tp ranks,
    the decode layout over all 4; the KV is re-sharded through the tier."""
    path, prompts = four_layer["mistral"], _prompts(8)
    expected = [out[:m] for out, m in zip(hf_reference(path, prompts, max(MAX_NEW)), MAX_NEW)]
    layouts = (dict(pp=2, tp=2), dict(tp=4))
    for tokens, transitions in dist_harness.run(4, _tokens, path, layouts, prompts, MAX_NEW):
        assert tokens == expected and transitions >= 3


@pytest.mark.timeout(600)
def test_seesaw_compiled_decode_matches_hf(four_layer, hf_reference):
    path, prompts = four_layer["llama"], _prompts(8)
    expected = [out[:m] for out, m in zip(hf_reference(path, prompts, max(MAX_NEW)), MAX_NEW)]
    results = dist_harness.run(2, _tokens, path, LAYOUTS["P2-T2"], prompts, MAX_NEW, True, timeout=500)
    for tokens, transitions in results:
        assert tokens == expected and transitions >= 3


def _sampled(path, prompts, layouts):
    """Seeded sampling: Seesaw with dp replicas (tokens drawn on one replica) vs a static TP4 engine."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, seed=3)
    requests = [Request(i, p, params) for i, p in enumerate(prompts)]
    engine = _seesaw(path, layouts)
    seesaw = [c.output_ids for c in engine.generate(requests)]
    engine.close()
    static = Engine(
        parallelize(path, _dims(dist.get_world_size(), dict(tp=4))), EngineConfig(max_batch_size=3, max_seq_len=128)
    )
    return seesaw, [c.output_ids for c in static.generate(requests)]


@pytest.mark.parametrize("layout", ["D2P2-T4", "D2P2-D2T2"])
def test_seeded_sampling_is_layout_independent(four_layer, layout):
    for seesaw, static in dist_harness.run(4, _sampled, four_layer["llama"], _prompts(6), LAYOUTS[layout]):
        assert seesaw == static


def _swapped_in_kv(path, layouts, prompts):
    """Per request, per decode-layout layer: (K, V) for the prompt swapped in from the tier, and the
    same from a pure decode-layout prefill; and this rank's KV heads (first, count)."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, parallelize

    engine = _seesaw(path, layouts, budget=200, max_batch_size=len(prompts))
    engine.generate(_requests(prompts, [2] * len(prompts)))  # prefill, swap out, swap in, 1 decode step
    seesaw_kv = engine.runners["decode"].kv
    slots = dict(engine.policy.tiered.slot_of)  # request id -> the decode slot it was loaded into
    engine.close()
    pure = Engine(
        parallelize(path, _dims(dist.get_world_size(), layouts[1])),
        EngineConfig(max_batch_size=len(prompts), max_seq_len=128),
    )
    pure.prompt_logits(prompts)  # request i's KV in slot i
    assert pure.kv.spec.head_start == seesaw_kv.spec.head_start
    swapped = [
        [(k[slots[i], :, : len(p)], v[slots[i], :, : len(p)]) for k, v in zip(seesaw_kv.k, seesaw_kv.v)]
        for i, p in enumerate(prompts)
    ]
    prefilled = [
        [(k[i, :, : len(p)], v[i, :, : len(p)]) for k, v in zip(pure.kv.k, pure.kv.v)] for i, p in enumerate(prompts)
    ]
    return swapped, prefilled, (seesaw_kv.spec.head_start, seesaw_kv.spec.num_heads)


@pytest.mark.parametrize("layout", ["P4-T4", "D2P2-T4"])
def test_kv_swapped_in_equals_pure_decode_layout(four_layer, layout):
    """Same math, different layouts: the reduction order differs, so values agree to the reduction
    tolerance of HF's float64 keys and values for this rank's heads, not bitwise."""
    prompts = _prompts(3)
    hf32 = hf_prompt_kv(four_layer["qwen3"], prompts, torch.float32)
    hf64 = hf_prompt_kv(four_layer["qwen3"], prompts, torch.float64)
    results = dist_harness.run(4, _swapped_in_kv, four_layer["qwen3"], LAYOUTS[layout], prompts)
    for rank, (swapped, prefilled, (first, count)) in enumerate(results):
        assert count >= 1
        heads = slice(first, first + count)
        for i, layer in itertools.product(range(len(prompts)), range(len(hf64[0]))):
            for which, name in ((0, "k"), (1, "v")):
                want32 = hf32[i][layer][which][heads]
                want64 = hf64[i][layer][which][heads]
                where = f"rank {rank} request {i} layer {layer} {name}"
                assert_close_reduced(swapped[i][layer][which], want32, want64, msg=f"{where} swapped in")
                assert_close_reduced(prefilled[i][layer][which], want32, want64, msg=f"{where} prefilled")


def _scheduler_counters(path, prompts, max_new):
    out = {}
    for name in ("transition_minimizing", "prefill_prioritizing", "decode_prioritizing"):
        engine = _seesaw(path, LAYOUTS["P2-T2"], budget=120, scheduler=name)
        tokens = [c.output_ids for c in engine.generate(_requests(prompts, max_new))]
        out[name] = (engine.stats.transitions, engine.stats.mean_decode_batch, tokens)
        engine.close()
    return out


def test_transition_minimizing_beats_both_baselines(four_layer):
    prompts = _prompts(8)
    out = dist_harness.run(2, _scheduler_counters, four_layer["llama"], prompts, MAX_NEW)[0]
    tm, pp, dp = (out[k] for k in ("transition_minimizing", "prefill_prioritizing", "decode_prioritizing"))
    assert tm[0] < pp[0], (tm, pp)  # fewer transitions than prefill-prioritizing
    assert tm[1] > dp[1], (tm, dp)  # larger mean decode batch than decode-prioritizing
    assert tm[2] == pp[2] == dp[2]  # and the same tokens


def _build_error(path, prefill, decode, budget):
    engine = _seesaw(path, (prefill, decode), budget=budget)
    try:
        engine.generate(_requests([[5] * 8], [2]))
    finally:
        engine.close()


@pytest.mark.parametrize(
    "prefill,decode,message",
    [
        (dict(pp=4), dict(tp=2), r"dp\(1\) \* pp\(1\) \* sp\(1\) \* tp\(2\) = 2 != world_size\(4\)"),
        (dict(pp=4), dict(tp=4), r"pipeline stages \(4\) exceed the model's layers \(2\)"),
        (dict(dp=4), dict(tp=4), r"attention heads \(6\) must be divisible by tensor parallel size \(4\)"),
        (dict(dp=2, tp=2), dict(tp=4), r"prompt of 8 tokens does not fit the CPU KV tier \(cpu_kv_budget=4"),
    ],
)
def test_clear_errors(checkpoints, tmp_path, prefill, decode, message):
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    path = checkpoints["llama"]
    if "heads" in message:
        path = str(
            make_tiny_checkpoint(
                "llama", tmp_path / "h6", seed=0, num_attention_heads=6, num_key_value_heads=2, hidden_size=96
            )
        )
    budget = 4 if "KV tier" in message else BUDGET
    with pytest.raises(RuntimeError, match=message):
        dist_harness.run(4, _build_error, path, prefill, decode, budget)


def test_scheduler_policies_unit():
    from reshard.parallel.strategies.seesaw.schedulers import SchedState, make_scheduler

    s = SchedState(queued=5, next_fits_tier=True, buffered=2, running=3, free_slots=1)
    assert make_scheduler("transition_minimizing").next_phase("prefill", s) == "prefill"
    assert make_scheduler("prefill_prioritizing").next_phase("prefill", s) == "decode"  # 2 waiting >= 1 slot
    full = SchedState(queued=5, next_fits_tier=False, buffered=6, running=3, free_slots=1)
    assert make_scheduler("transition_minimizing").next_phase("prefill", full) == "decode"
    idle = SchedState(queued=5, next_fits_tier=True, buffered=0, running=3, free_slots=1)
    assert make_scheduler("transition_minimizing").next_phase("decode", idle) == "prefill"
    assert make_scheduler("decode_prioritizing").next_phase("decode", idle) == "decode"
    assert make_scheduler("prefill_prioritizing").next_phase("decode", idle) == "prefill"
    with pytest.raises(ValueError, match=r"scheduler 'fifo' is not one of"):
        make_scheduler("fifo")


def _kv_memory(path):
    """Which KV caches hold memory in each phase."""
    engine = _seesaw(path, LAYOUTS["P2-T2"], scheduler="decode_prioritizing")
    kv = {phase: engine.runners[phase].kv for phase in ("prefill", "decode")}
    before = (kv["prefill"].allocated, kv["decode"].allocated)
    engine.generate(_requests(_prompts(4), [4] * 4))
    after = (kv["prefill"].allocated, kv["decode"].allocated)
    released, transitions = engine.stats.kv_bytes_released, engine.stats.transitions
    engine.close()
    return before, after, released, transitions, kv["prefill"].spec.bytes


def test_each_phase_gives_up_its_kv_cache(four_layer):
    for before, after, released, transitions, prefill_bytes in dist_harness.run(2, _kv_memory, four_layer["llama"]):
        assert before == (True, False) and after == (False, True)  # ends in decode
        assert transitions >= 3 and released >= 2 * prefill_bytes


def _cache_changeovers(path):
    """The order of the steps' cache moves and the tier's loads, with which caches held memory
    at each load; and the tokens."""
    engine = _seesaw(path, LAYOUTS["P2-T2"], scheduler="prefill_prioritizing")
    kv = {phase: engine.runners[phase].kv for phase in ("prefill", "decode")}
    order = []
    engine.events.on("step_scheduled", lambda step: order.append(("step", step.kind, step.moves)))
    tiered, load = engine.policy.tiered, engine.policy.tiered.load

    def loaded(seq, n):
        order.append(("load", kv["prefill"].allocated, kv["decode"].allocated))
        load(seq, n)

    tiered.load = loaded
    tokens = [c.output_ids for c in engine.generate(_requests(_prompts(8), MAX_NEW))]
    engine.close()
    return order, tokens


def test_the_engine_changes_the_caches_over_before_the_decode_side_loads_from_the_tier(four_layer, hf_reference):
    """Seesaw's policy names its cache lifecycle as moves the engine makes (no barrier of its
    own): each entry to decode is a wait step that gives the prefill cache up and restores the
    decode one, and every load from the tier comes after one, into the decode cache alone."""
    from reshard.parallel.engine.step import ReleaseKV, RestoreKV
    from reshard.parallel.strategies.seesaw import policy

    assert "torch.distributed" not in inspect.getsource(policy)  # (it joins no collective of its own)
    changeover = (ReleaseKV("prefill"), RestoreKV("decode"))
    full = hf_reference(four_layer["llama"], _prompts(8), max(MAX_NEW))
    expected = [out[:m] for out, m in zip(full, MAX_NEW)]
    for order, tokens in dist_harness.run(2, _cache_changeovers, four_layer["llama"]):
        assert tokens == expected
        steps = [e for e in order if e[0] == "step"]
        assert sum(e == ("step", "wait", changeover) for e in steps) >= 2  # (prefill-prioritizing: several entries)
        loads = [i for i, e in enumerate(order) if e[0] == "load"]
        assert loads and all(order[i][1:] == (False, True) for i in loads)
        for i in loads:  # the last step with cache moves before a load changed the caches over to decode
            moved = [e for e in order[:i] if e[0] == "step" and e[2]]
            assert moved[-1] == ("step", "wait", changeover), order[: i + 1]


def _shm_files_while_running(path):
    import os

    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    engine = _seesaw(path, LAYOUTS["P2-T2"], weights="reload")
    engine.generate(_requests(_prompts(2), [3, 3]))
    leftover = [f for f in os.listdir(root) if f.startswith("reshard-")] if root else []
    engine.close()
    return leftover


def test_shared_memory_files_are_unlinked_once_mapped(four_layer):
    """A crash cannot leave the CPU tier or the weight copy behind in /dev/shm."""
    for leftover in dist_harness.run(2, _shm_files_while_running, four_layer["llama"]):
        assert leftover == []


def _die_while_mapping():
    import os

    import torch.distributed as dist

    from reshard.kv import CPUKVTier, TierSpec
    from reshard.shm import map_shared

    def factory(path):
        tier = CPUKVTier(TierSpec(1, 2, 4, capacity_tokens=8), path)
        if dist.get_rank() == 1:
            os._exit(1)  # injected fault: a rank dies after mapping, before the others are done
        return tier

    map_shared("reshard-faulttest", factory)


@pytest.mark.skipif(not __import__("os").path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_rank_dying_while_mapping_leaves_no_shared_memory_file():
    import os

    before = set(os.listdir("/dev/shm"))
    with pytest.raises((RuntimeError, TimeoutError)):
        dist_harness.run(2, _die_while_mapping, timeout=30)
    left = {f for f in os.listdir("/dev/shm") if f.startswith("reshard-")} - before
    assert left == set()


def _paged_tokens(path, layouts, prompts, max_new):
    engine = _seesaw(path, layouts, kv_block_size=8, kv_tokens=96)
    tokens = [c.output_ids for c in engine.generate(_requests(prompts, max_new))]
    s = engine.stats
    out = tokens, s.kv_blocks_allocated, s.kv_blocks_freed, engine.runners["decode"].kv.spec.capacity_tokens
    engine.close()
    return out


def test_seesaw_with_a_paged_decode_cache_matches_hf(four_layer, hf_reference):
    """The CPU tier swaps requests into a paged decode cache (96 tokens < 3 slots x 128)."""
    path, prompts = four_layer["llama"], _prompts(8)
    expected = [out[:m] for out, m in zip(hf_reference(path, prompts, max(MAX_NEW)), MAX_NEW)]
    for tokens, allocated, freed, capacity in dist_harness.run(
        2, _paged_tokens, path, LAYOUTS["P2-T2"], prompts, MAX_NEW
    ):
        assert tokens == expected and allocated == freed > 0 and capacity == 96


def _samples(path, layouts, prompts, n, max_new, temperature, share=True):
    """``n`` samples of each prompt (request ``i * n + j``, seeds differing), through Seesaw and
    through a static TP engine; Seesaw's prompt tokens computed and what its tier holds after."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    def params(i, j):  # the first sample of prompt 1 ends at its prefill, its siblings go on
        return SamplingParams(max_new_tokens=1 if (i, j) == (1, 0) else max_new, temperature=temperature, seed=10 + j)

    requests = [Request(i * n + j, p, params(i, j)) for i, p in enumerate(prompts) for j in range(n)]
    engine = _seesaw(path, layouts, prefix_caching=share)
    seesaw = [c.output_ids for c in engine.generate(requests)]
    tiered, kept = engine.policy.tiered, sorted(engine.policy.tier.ranges)  # (retained prompts)
    engine.reset_prefix_cache()  # (as a weight write does: what is retained goes)
    left = (dict(engine.policy.tier.ranges), tiered.holders, tiered.entry_of, engine.policy.siblings)
    fed = engine.stats.prompt_tokens_computed, engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits
    engine.close()
    static = Engine(
        parallelize(path, _dims(dist.get_world_size(), dict(tp=2))),
        EngineConfig(max_batch_size=3, max_seq_len=128, prefix_caching=False),
    )
    return seesaw, [c.output_ids for c in static.generate(requests)], fed, left, kept


@pytest.mark.parametrize("temperature,share", [(0.0, True), (0.9, True), (0.9, False)])
def test_n_samples_of_a_prompt_are_prefilled_once_and_share_its_tier_kv(four_layer, hf_reference, temperature, share):
    """GRPO's shape: 4 samples per prompt. Each prompt is computed once in the prefill layout;
    the other samples load its KV from the CPU tier but for the last prompt token, which their
    first decode step feeds. Tokens equal a static TP engine's without sharing (and HF's when
    greedy); after, the tier holds only retained prompts (none without sharing), and nothing once
    the prefix cache is reset."""
    path, prompts, n = four_layer["llama"], _prompts(3), 4
    expected = hf_reference(path, prompts, 6)
    runs = dist_harness.run(2, _samples, path, LAYOUTS["P2-T2"], prompts, n, 6, temperature, share)
    for seesaw, static, fed, left, kept in runs:
        assert seesaw == static
        assert left == ({}, {}, {}, {})
        assert all(k[0] == "retained" for k in kept) and (len(kept) > 0) == share, kept
        if temperature == 0.0:
            assert seesaw == [e[: 1 if (i, j) == (1, 0) else 6] for i, e in enumerate(expected) for j in range(n)]
        if not share:  # (prefix_caching=False) every sample prefilled whole, then its prefill's token fed
            assert fed == (n * sum(map(len, prompts)) + n * len(prompts) - 1, 0, 0)
            continue
        # each prompt once, each sibling its last token, and each first sample that runs on its
        # prefill's token (which ends a resumed request's prompt): all but prompt 1's
        assert fed[0] == sum(map(len, prompts)) + (n - 1) * len(prompts) + len(prompts) - 1
        # every sample's prompt looked up; each sibling a hit of all but its last token
        assert fed[1:] == (n * sum(map(len, prompts)), (n - 1) * sum(len(p) - 1 for p in prompts))


def _first_prefill_step(path, layouts, prompts, n):
    """A Seesaw engine and its ``EngineCore`` holding ``n`` greedy samples of each prompt
    (request ``i * n + j``), stepped once (the first prefill step); with that step's outputs."""
    from reshard.parallel import EngineCore, Request, SamplingParams

    engine = _seesaw(path, layouts)
    core = EngineCore(engine)
    for i, p in enumerate(prompts):
        for j in range(n):
            core.add_request(Request(i * n + j, p, SamplingParams(max_new_tokens=6)))
    return engine, core, core.step()


def _samples_across_a_weight_write(path, layouts, prompts, n):
    """The samples of ``_samples`` (greedy) through ``EngineCore``, the weights' version bumped
    (as a sync does) once the first prefill step ran: the siblings not loaded yet then."""
    from reshard.parallel.model.info import parallel_info

    engine, core, outputs = _first_prefill_step(path, layouts, prompts, n)
    waiting = [r.id for r in core.queue if r.kv_source and r.id in engine.policy.tiered.entry_of]
    parallel_info(engine.runners["decode"].model).weight_version.writes += 1
    while core.has_unfinished():
        outputs += core.step()
    tokens = {}
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    tiered = engine.policy.tiered
    engine.reset_prefix_cache()
    left = (dict(engine.policy.tier.ranges), tiered.holders, tiered.entry_of)
    fed = engine.stats.prompt_tokens_computed
    engine.close()
    return [tokens[k] for k in sorted(tokens)], waiting, fed, left


def test_siblings_not_loaded_when_the_weights_change_are_prefilled_anew(four_layer, hf_reference):
    """A sibling takes its prompt's KV from the tier only under the weights it was computed with:
    after a write, those still waiting go back to the queue and are prefilled again (more prompt
    tokens computed), with the same tokens here (the version moved, not the values)."""
    path, prompts, n = four_layer["llama"], _prompts(3), 4
    expected = hf_reference(path, prompts, 6)
    once = sum(map(len, prompts)) + (n - 1) * len(prompts) + len(prompts)  # without the write
    for tokens, waiting, fed, left in dist_harness.run(
        2, _samples_across_a_weight_write, path, LAYOUTS["P2-T2"], prompts, n
    ):
        assert tokens == [e for e in expected for _ in range(n)]
        assert waiting and fed > once  # siblings waited at the write, and were computed again
        assert left == ({}, {}, {})


def _abort_waiting(path, layouts, prompts, n):
    """``n`` greedy samples of each prompt through ``EngineCore``; after the first prefill step,
    one sibling and one resumed first sample, both waiting for a decode slot, are aborted."""
    engine, core, outputs = _first_prefill_step(path, layouts, prompts, n)
    policy = engine.policy
    sibling = next(r.id for r in core.queue if r.kv_source and r.id in policy.tiered.entry_of)
    leader = next(r.id for r in core.queue if r.kv_source and r.id not in policy.tiered.entry_of)
    waiting = [core.status(rid).name for rid in (sibling, leader)]  # (in the engine's queue)
    assert not policy.waiting()  # (the policy keeps no queue of its own)
    core.abort([sibling, leader])
    return (sibling, leader), waiting, *_to_the_end(engine, core, outputs)


def _to_the_end(engine, core, outputs):
    """Step ``core`` until nothing is unfinished: each request's tokens and last status
    (``outputs``: those of the steps before), and what the tier holds once the prefix cache is
    reset (then the engine is closed)."""
    while core.has_unfinished():
        outputs += core.step()
    tokens, status = {}, {}
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        status[out.request_id] = out.status.name
    engine.reset_prefix_cache()
    tiered = engine.policy.tiered
    left = (dict(engine.policy.tier.ranges), tiered.holders, tiered.entry_of)
    engine.close()
    return tokens, status, left


def test_aborting_requests_that_wait_for_a_decode_slot_ends_them_and_frees_their_tier_kv(four_layer, hf_reference):
    path, prompts, n = four_layer["llama"], _prompts(3), 4
    expected = hf_reference(path, prompts, 6)
    runs = dist_harness.run(2, _abort_waiting, path, LAYOUTS["P2-T2"], prompts, n)
    for aborted, waiting, tokens, status, left in runs:
        assert waiting == ["WAITING_FOR_KV"] * 2  # their KV in the tier, waiting for a decode slot
        assert [status[rid] for rid in aborted] == ["FINISHED_ABORTED"] * 2
        for rid in set(tokens) - set(aborted):
            assert tokens[rid] == expected[rid // n] and status[rid] == "FINISHED_LENGTH", rid
        assert left == ({}, {}, {})  # the aborted ones' holds on the tier went with them (the rest once reset)


def _calls_through_the_tier(path, layouts, calls):
    """One Seesaw engine, ``generate`` once per entry of ``calls`` (a list of prompts, greedy, 6
    new tokens each; ``"scale"``: every weight times 0.8 in place, written as a sync writes):
    each call's tokens and its (prompt tokens computed, prefix-cache queries, hits); what the
    tier holds after, and once the prefix cache is reset."""
    from reshard.parallel.model.info import parallel_info

    engine, out = _seesaw(path, layouts), []
    for prompts in calls:
        if prompts == "scale":
            model = engine.runners[engine.policy.switch.active].model  # (the layout holding the weights)
            with torch.inference_mode():  # (moved weights are inference tensors)
                for p in model.parameters():
                    p.to_local().mul_(0.8)
            parallel_info(model).weight_version.writes += 1
            continue
        s = engine.stats
        before = (s.prompt_tokens_computed, s.prefix_cache_queries, s.prefix_cache_hits)
        tokens = [c.output_ids for c in engine.generate(_requests(prompts, [6] * len(prompts)))]
        s = engine.stats
        after = (s.prompt_tokens_computed, s.prefix_cache_queries, s.prefix_cache_hits)
        out.append((tokens, tuple(b - a for a, b in zip(before, after))))
    kept = sorted(engine.policy.tier.ranges)
    engine.reset_prefix_cache()
    tiered = engine.policy.tiered
    left = (dict(engine.policy.tier.ranges), tiered.holders, tiered.entry_of, tiered.matched)
    engine.close()
    return out, kept, left


def test_the_tier_keeps_prompts_for_later_calls_until_the_weights_change(four_layer, hf_reference):
    """Seesaw's CPU tier as a prefix cache across calls: a prompt computed in one call is kept in
    the tier after its loads. In the next call the same prompt and a chat's next turn (the prompt
    plus 3 tokens) skip the prefill layout: they load it from the tier and compute only the last
    prompt token and the 3 new ones in the decode layout; a new prompt is prefilled (its first
    token then fed), as is one that shares 16 tokens but has more than that left. After a weight
    write the same prompt gives the new weights' HF tokens with no
    hit. Tokens equal HF's throughout; nothing is left once the prefix cache is reset."""
    from tests.test_llm import _hf_generate
    from tests.test_prefix_cache import _changed

    path = four_layer["llama"]
    a, b, c = _prompts(4)[1], _prompts(4)[2], _prompts(6)[5]  # 23, 9 and 14 tokens
    turn = [*a, 7, 8, 9]
    short = [*a[:16], *range(100, 120)]  # 16 shared, 20 more: prefilled (more left than shared)
    calls = [[a, b], [a, turn, c], [short], "scale", [a]]
    expected = [hf_reference(path, p, 6) for p in ([a, b], [a, turn, c], [short])]
    changed = _hf_generate(_changed(path), a, 6)[0]
    for out, kept, left in dist_harness.run(2, _calls_through_the_tier, path, LAYOUTS["P2-T2"], calls):
        (first, fed1), (second, fed2), (third, fed3), (fourth, fed4) = out
        assert [first, second, third] == expected and fourth == [changed] != [expected[0][0]]
        assert fed1 == (len(a) + len(b) + 2, len(a) + len(b), 0)  # (each prefill's token fed to decode)
        assert fed2 == (1 + 3 + len(c) + 1, len(a) + len(turn) + len(c), (len(a) - 1) + len(a))
        assert fed3 == (len(short) + 1, len(short), 0)
        assert fed4 == (len(a) + 1, len(a), 0)  # the weights changed: no hit
        assert kept and all(k[0] == "retained" for k in kept), kept
        assert left == ({}, {}, {}, {})


def _a_turn_beside_decodes(path, a, x, turn):
    """Prompt ``a`` kept in the tier by a first call; then ``x`` runs through ``EngineCore`` and,
    once it decodes, a chat's next turn ``turn`` (``a`` plus 3 tokens) is added: the decode
    layout's steps (counts per sequence) and both requests' tokens."""
    from reshard.parallel import EngineCore, Request, SamplingParams

    engine = _seesaw(path, LAYOUTS["P2-T2"])
    engine.generate(_requests([a], [6]))
    steps = []
    engine.events.on("step_ready", lambda index, step: steps.append((step.layout, list(step.num_tokens))))
    core, outputs = EngineCore(engine), []
    core.add_request(Request(1, x, SamplingParams(max_new_tokens=12)))
    while ("decode", [1]) not in steps:
        outputs += core.step()
    core.add_request(Request(2, turn, SamplingParams(max_new_tokens=6)))
    tokens, _, _ = _to_the_end(engine, core, outputs)
    return [counts for layout, counts in steps if layout == "decode"], tokens


def test_a_chats_next_turn_takes_its_tail_beside_the_decode_tokens(four_layer, hf_reference):
    """Seesaw's decode side runs on the token budget: a turn whose prompt the tier holds but for
    its 3 new tokens computes them in the same step as the running request's decode token (not in
    a step of its own, alternating with decode steps). Tokens equal HF's."""
    path = four_layer["llama"]
    a, x = _prompts(4)[1], _prompts(6)[5]
    turn = [*a, 7, 8, 9]
    expected_x, expected_turn = hf_reference(path, [x], 12)[0], hf_reference(path, [turn], 6)[0]
    for decode_steps, tokens in dist_harness.run(2, _a_turn_beside_decodes, path, a, x, turn):
        assert tokens == {1: expected_x, 2: expected_turn}
        assert [1, 3] in decode_steps, decode_steps  # x's decode token and the turn's 3 new prompt tokens
        assert [3] not in decode_steps, decode_steps


def _abort_before_the_swap_out(path, layouts, prompts):
    """Greedy requests through ``EngineCore``, every swap-out into the tier slowed by 0.3 s; after
    the first prefill step, while its swap-outs are still running, the first request (waiting for a
    decode slot) is aborted. Its status, the others' tokens and what the tier holds after a reset."""
    import time

    from reshard.parallel import EngineCore

    engine = _seesaw(path, layouts)
    tier, swap_out = engine.policy.tier, engine.policy.tier.swap_out

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return swap_out(*args, **kwargs)

    tier.swap_out = slow
    core = EngineCore(engine)
    for r in _requests(prompts, [6] * len(prompts)):
        core.add_request(r)
    outputs = core.step()
    core.abort([0])
    tokens, status, left = _to_the_end(engine, core, outputs)
    return status, tokens, left


def test_aborting_a_request_whose_prompt_is_still_going_out_to_the_tier_keeps_the_tier_whole(four_layer, hf_reference):
    """An aborted request's prompt may be kept in the tier for later requests: it is kept (or
    freed) only once its swap-out is written, so the tier's books stay the same on every rank and
    nothing is left once the prefix cache is reset. The others' tokens equal HF's."""
    path, prompts = four_layer["llama"], _prompts(3)
    expected = hf_reference(path, prompts, 6)
    for status, tokens, left in dist_harness.run(2, _abort_before_the_swap_out, path, LAYOUTS["P2-T2"], prompts):
        assert status[0] == "FINISHED_ABORTED" and [tokens[i] for i in (1, 2)] == expected[1:], (status, tokens)
        assert left == ({}, {}, {})
