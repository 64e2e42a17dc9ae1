"""SiDP: FFN owner pool with WaS (prefetch into slots, peak shifting) and CaS (activations to the
owner, fused GEMM, dummy skipping); tokens equal HF generate in every mode."""

import time

import pytest

from tests import dist_harness

PROMPTS = [[5, 9, 11, 2, 7], [3, 4], list(range(20, 37)), [8] * 9, [100, 101, 102]]
MAX_NEW = [3, 5, 4, 6, 18]  # the last request runs on alone: the other replicas run dummy steps


def _job(path, mode, shift=True, threshold=1.0):
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import EngineConfig, make_strategy

    strategy = make_strategy(
        {"strategy": "sidp", "mode": mode, "threshold": threshold, "peak_shifting": shift, "interval": 2}
    )
    engine = strategy.build(path, EngineConfig(max_batch_size=3, max_seq_len=64))
    reqs = [Request(i, p, SamplingParams(max_new_tokens=m)) for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    tokens = [c.output_ids for c in engine.generate(reqs)]
    pool = engine.policy.pool
    layer = sum(w.numel() * w.element_size() for w in pool.slot_tensors[0])
    owned = sum(1 for o in pool.owner if o == pool.rank)
    return dict(
        tokens=tokens,
        summary=strategy.summary(engine),
        expected_ffn=owned * layer,
        counters={**vars(pool.counters), **vars(engine.policy.fetcher.counters)},  # the layer's and the fetches'
        modes=list(engine.stats.modes),
        non_owned=len(pool.owner) - owned,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["was", "cas", "auto"])
def test_tokens_equal_hf_in_every_mode(four_layer, hf_reference, world, mode):
    path = four_layer["llama"]
    expected = [out[:m] for out, m in zip(hf_reference(path, PROMPTS, max(MAX_NEW)), MAX_NEW)]
    results = dist_harness.run(world, _job, path, mode, timeout=240)
    for r in results:
        assert r["tokens"] == expected
        s = r["summary"]
        assert s["ffn_bytes_per_rank"] == r["expected_ffn"] == s["ffn_bytes_replicated"] // world
        assert s["dummy_steps"] > 0  # the tail: most replicas idle
        assert r["modes"] == results[0]["modes"]  # the group agrees on every step's mode
    if mode == "auto":
        assert results[0]["summary"]["mode_switches"] >= 1 and set(results[0]["modes"]) == {"sidp:was", "sidp:cas"}
    for r in results:  # a dummy step fetches and ships nothing: only steps with rows count
        c = r["counters"]
        assert c["fetches"] == c["active_steps"]["sidp:was"] * r["non_owned"]
        assert c["cas_layers"] == c["active_steps"]["sidp:cas"] * r["non_owned"]
    assert sum(r["counters"]["dummy_steps"] for r in results) == results[0]["summary"]["dummy_steps"] > 0
    if mode == "cas":  # idle replicas shipped nothing; their owners skipped them
        assert sum(r["counters"]["dummy_skips"] for r in results) > 0
        assert all(r["counters"]["fetch_bytes"] == 0 for r in results)


@pytest.mark.parametrize("shift,readers", [(True, 1), (False, 3)])
def test_peak_shifting_gives_each_owner_one_reader(four_layer, shift, readers):
    results = dist_harness.run(4, _job, four_layer["llama"], "was", shift, timeout=240)
    assert max(r["counters"]["max_concurrent_readers"] for r in results) == readers


def test_orchestrator_hysteresis_never_flaps():
    from reshard.layers.owner_pool import CAS, WAS
    from reshard.parallel.strategies.sidp import choose_mode

    mode, modes = None, []
    for batch in [2, 9, 9.9, 7, 6.5, 10.1, 9, 7.4, 5.9, 6.2, 7.5]:  # b* = 8, band [6, 10]
        mode = choose_mode(batch, mode, 8.0, 0.25)
        modes.append(mode)
    assert modes == [CAS, CAS, CAS, CAS, CAS, WAS, WAS, WAS, CAS, CAS, CAS]


def _gain_job(path):
    from reshard.parallel.engine import EngineConfig, make_strategy
    from reshard.parallel.strategies.sidp import kv_bytes_per_token

    strategy = make_strategy({"strategy": "sidp", "slots": 2, "prefetch_depth": 2})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=64, kv_block_size=8, kv_tokens=64))
    s = strategy.summary(engine)
    spec = engine.kv.spec
    freed = s["ffn_bytes_replicated"] - s["ffn_bytes_per_rank"] - s["slot_bytes"]
    per_block = spec.bytes // (spec.num_blocks + 1)  # the allocation holds a scratch block too
    grown = (spec.num_blocks - 64 // spec.block_size) * per_block  # real bytes beyond the 64 tokens asked
    return grown, freed, s["kv_capacity_tokens"], s["kv_tokens_gained"], kv_bytes_per_token(spec)


def test_freed_ffn_memory_becomes_kv_capacity(tmp_path):
    """8 layers over 2 ranks with 2 slots: each rank frees 2 layers' FFN, and the paged store is
    allocated that much bigger (a real allocation, within one block of the freed bytes)."""
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    path = str(make_tiny_checkpoint("llama", tmp_path / "deep", num_hidden_layers=8))
    for grown, freed, capacity, gained, per_token in dist_harness.run(2, _gain_job, path):
        assert gained == freed // per_token > 0 and capacity > 64
        assert freed - 8 * per_token < grown <= freed


def _overlap_job(path):
    """WaS with 2 slots; every layer computes 40 ms longer (a stand-in for a bigger model) and every
    fetch takes 120 ms longer (a slower link). Returns the compute thread's ``layer_before`` /
    ``layer_after`` events and the housekeeper's ``fetch_begin`` / ``fetch_end``, in one list in
    the order they happened, and the layers this rank owns."""
    import torch.distributed as dist

    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import EngineConfig, make_strategy

    engine = make_strategy({"strategy": "sidp", "mode": "was", "slots": 2}).build(
        path, EngineConfig(max_batch_size=2, max_seq_len=64)
    )
    events = []  # appended from both threads: one order

    def fetched(event, layer):
        events.append((event, layer))
        if event == "fetch_begin":
            time.sleep(0.12)

    engine.policy.fetcher.on_fetch = fetched
    engine.events.on("layer_before", lambda i, h, ctx: events.append(("compute_begin", i)), layout="was")
    engine.events.on("layer_before", lambda i, h, ctx: time.sleep(0.04), layout="was")
    engine.events.on("layer_after", lambda i, h, ctx: events.append(("compute_end", i)), layout="was")
    world = dist.get_world_size()
    engine.generate([Request(i, [5 + i, 6, 7], SamplingParams(max_new_tokens=6)) for i in range(2 * world)])
    pool = engine.policy.pool
    return events, [j for j, owner in enumerate(pool.owner) if owner == pool.rank]


def test_was_hides_fetches_behind_compute(four_layer):
    """Each fetched layer's weights move while the previous layer computes: its fetch begins before
    that layer's compute ends, and ends after it (no step fetches its layers up front, or each
    layer only when its forward asks). How much time that hides is a figure for bench/ (the
    "SiDP: WaS overlap" entry of bench/RESULTS.md), not for a test."""
    for events, owned in dist_harness.run(2, _overlap_job, four_layer["llama"]):
        fetched = sorted({j for event, j in events if event == "fetch_begin"})
        assert fetched and not set(fetched) & set(owned)
        for j in [j for j in fetched if j > 0]:
            begins = [at for at, e in enumerate(events) if e == ("fetch_begin", j)]
            ends = [at for at, e in enumerate(events) if e == ("fetch_end", j)]
            previous = [at for at, e in enumerate(events) if e == ("compute_end", j - 1)]
            assert len(begins) == len(ends) == len(previous) > 0, (j, events)
            for begin, previous_end, end in zip(begins, previous, ends):  # one step each
                assert begin < previous_end < end, (j, events)


def _profiled_job(path):
    from reshard.parallel.engine import EngineConfig, make_strategy

    strategy = make_strategy({"strategy": "sidp", "threshold": None})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=32))
    return strategy.summary(engine)


def test_threshold_profiled_by_a_sweep_is_the_same_on_every_rank(four_layer):
    summaries = dist_harness.run(2, _profiled_job, four_layer["llama"])
    assert summaries[0]["threshold_profiled"] and summaries[0]["threshold"] in (1, 2, 4, 8, 16, 32, 64)
    assert len({s["threshold"] for s in summaries}) == 1


def _default_gain_job(path):
    from reshard.parallel.engine import EngineConfig, make_strategy

    strategy = make_strategy({"strategy": "sidp"})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=64, kv_block_size=8, kv_tokens=64))
    s = strategy.summary(engine)
    return s["kv_tokens_gained"], s["kv_capacity_tokens"], strategy.report(s)


def test_the_default_slots_leave_a_kv_gain_and_the_report_says_it(four_layer):
    """4 layers over 2 ranks: by default each rank fetches 1 layer ahead into 1 slot (not 2 slots
    for its 2 non-owned layers, which would hold as much FFN as replication), so the paged cache
    grows and the printed line states by how much."""
    for gained, capacity, lines in dist_harness.run(2, _default_gain_job, four_layer["llama"]):
        assert gained > 0 and capacity > 64
        assert f"+{gained} KV tokens, allocated (64 asked -> {capacity})" in lines[1]


def _busy_prompts() -> list[list[int]]:
    """Twelve seeded prompts of 10-29 tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 250, (int(torch.randint(10, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(12)
    ]


def _chunked_job(path, mode):
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import EngineConfig, make_strategy

    strategy = make_strategy({"strategy": "sidp", "mode": mode, "threshold": 1.0, "interval": 2})
    # 16 tokens asked (SiDP adds what the freed FFN bytes hold): too few blocks for 4 slots of 30 new tokens
    config = EngineConfig(max_batch_size=4, max_seq_len=64, max_prefill_tokens=8, kv_block_size=4, kv_tokens=16)
    engine = strategy.build(path, config)
    reqs = [Request(i, p, SamplingParams(max_new_tokens=30)) for i, p in enumerate(_busy_prompts())]
    tokens = [c.output_ids for c in engine.generate(reqs)]
    s = engine.stats
    steps = s.prefill_steps + s.decode_steps + s.mixed_steps
    return dict(tokens=tokens, modes=len(s.modes), steps=steps, mixed=s.mixed_steps, preemptions=s.preemptions)


@pytest.mark.parametrize("mode", ["was", "cas"])
def test_prompt_chunks_beside_decodes_and_preemption_equal_hf(four_layer, hf_reference, mode):
    """SiDP on the token budget (8 tokens a step: prompt chunks beside decode tokens, a replica
    whose share is decode tokens only decoding every slot) and a paged cache too small for its
    batch (preemption): HF's tokens, in CaS too (the owner sizes each replica's rows by that
    replica's own share), and one mode decision per step run."""
    path = four_layer["llama"]
    expected = hf_reference(path, _busy_prompts(), 30)
    for r in dist_harness.run(2, _chunked_job, path, mode, timeout=240):
        assert r["tokens"] == expected
        assert r["mixed"] > 0 and r["preemptions"] > 0
        assert r["modes"] == r["steps"]
