"""Shift parallelism end to end: HF parity with per-step SP/TP switches over one KV cache."""

import pytest
import torch

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts
from tests.tolerance import assert_close_reduced, hf_prompt_kv


def _shift_generate(path, sp, tp, threshold, prompts, max_new, *, copy=True, snapshot_kv=False, chunked=True):
    import torch.distributed as dist

    from reshard.parallel import EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.strategies.shift import parallelize_shift, shift_engine

    dims = ParallelDims(sp=sp, tp=tp, world_size=dist.get_world_size())
    model = parallelize_shift(path, dims, shift_weights="copy" if copy else "slice")
    config = EngineConfig(max_batch_size=4, max_seq_len=128, chunked_prefill=chunked)
    engine = shift_engine(model, config, threshold=threshold)
    assert engine.runners["sp"].kv is engine.runners["tp"].kv  # one cache for both modes
    lengths = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    requests = [Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    tokens = [c.output_ids for c in engine.generate(requests)]
    pointers = [k.data_ptr() for k in engine.kv.k] + [v.data_ptr() for v in engine.kv.v]
    spec = engine.kv.spec
    heads = (spec.head_start, spec.num_heads)
    kv = ([(k.clone(), v.clone()) for k, v in zip(engine.kv.k, engine.kv.v)], heads) if snapshot_kv else None
    return tokens, engine.stats, pointers, kv


@pytest.mark.parametrize("sp,tp", [(2, 2), (4, 1)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shift_tokens_match_hf_with_switches(checkpoints, hf_reference, family, sp, tp):
    """Whole-prompt steps alternating with decode steps (``chunked_prefill=False``)."""
    path, prompts = checkpoints[family], _prompts()
    lengths = [MAX_NEW, 3, MAX_NEW, 5, MAX_NEW, 7]  # early finishers shrink the batch below the threshold
    expected = [t[:n] for t, n in zip(hf_reference(path, prompts, MAX_NEW), lengths)]
    # threshold 3: prefills and 4-request decode steps run SP, decode steps of <= 3 requests run TP
    run = dist_harness.run(sp * tp, _shift_generate, path, sp, tp, 3, prompts, lengths, chunked=False)
    for tokens, stats, pointers, _ in run:
        assert tokens == expected
        assert stats.steps_by_mode["sp"] > 0 and stats.steps_by_mode["tp"] > 0
        assert stats.mode_switches >= 2
        assert all(seen == pointers[: len(seen)] for seen in stats.kv_storage)  # same cache tensors
        assert stats.switch_bytes == 0


def test_slice_weights_generate_the_same(checkpoints):
    path, prompts = checkpoints["llama"], _prompts(4)
    copy = dist_harness.run(4, _shift_generate, path, 2, 2, 3, prompts, 6)
    sliced = dist_harness.run(4, _shift_generate, path, 2, 2, 3, prompts, 6, copy=False)
    assert [r[0] for r in copy] == [r[0] for r in sliced]


def test_kv_written_in_sp_equals_pure_tp(checkpoints):
    """Prefill only (one token generated): SP mode everywhere vs TP mode everywhere, same slots.

    Each rank holds the same KV heads at the same positions in both runs. Values agree to fp32
    rounding, not bitwise: CPU GEMMs round differently when the matrix shape changes (SP projects
    N/sp tokens x the tp shard's heads, TP all N tokens x one block's heads); both lie within the
    reduction tolerance of HF's float64 keys and values for this rank's heads. A wrong head order
    would differ by O(1).
    """
    path, prompts = checkpoints["llama"], _prompts(4)
    sp_run = dist_harness.run(4, _shift_generate, path, 2, 2, 0, prompts, 1, snapshot_kv=True)
    tp_run = dist_harness.run(4, _shift_generate, path, 2, 2, 10**6, prompts, 1, snapshot_kv=True)
    hf32 = hf_prompt_kv(path, prompts, torch.float32)
    hf64 = hf_prompt_kv(path, prompts, torch.float64)
    for rank, ((_, sp_stats, _, (sp_kv, heads)), (_, tp_stats, _, (tp_kv, tp_heads))) in enumerate(zip(sp_run, tp_run)):
        assert sp_stats.steps_by_mode["tp"] == 0 and tp_stats.steps_by_mode["sp"] == 0
        assert heads == tp_heads  # same heads on the same rank: no movement needed
        first, count = heads
        for layer, ((k1, v1), (k2, v2)) in enumerate(zip(sp_kv, tp_kv)):
            assert k1.shape == k2.shape
            for slot, p in enumerate(prompts):  # request i is admitted into slot i
                for name, ours, which in (("k sp", k1, 0), ("v sp", v1, 1), ("k tp", k2, 0), ("v tp", v2, 1)):
                    want32 = hf32[slot][layer][which][first : first + count]
                    want64 = hf64[slot][layer][which][first : first + count]
                    got = ours[slot, :, : len(p)]
                    assert_close_reduced(got, want32, want64, msg=f"rank {rank} layer {layer} slot {slot} {name}")
            assert k1.abs().max() > 0.1  # the cache really holds these tokens' keys


def _shift_compiled(path, prompts, lengths):
    import torch._dynamo

    torch._dynamo.reset()
    from reshard.parallel import EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.strategies.shift import parallelize_shift, shift_engine

    out = {}
    for compile in (False, True):
        model = parallelize_shift(path, ParallelDims(sp=2, tp=1, world_size=2))
        engine = shift_engine(model, EngineConfig(max_batch_size=4, max_seq_len=64, compile=compile), threshold=2)
        requests = [Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        out[compile] = ([c.output_ids for c in engine.generate(requests)], dict(engine.stats.steps_by_mode))
    return out


@pytest.mark.timeout(600)
def test_compiled_shift_decode_matches_eager_in_both_modes(checkpoints):
    prompts, lengths = _prompts(6), [8, 3, 8, 5, 8, 6]
    for out in dist_harness.run(2, _shift_compiled, checkpoints["llama"], prompts, lengths, timeout=500):
        assert out[True][0] == out[False][0]
        assert out[True][1] == out[False][1] and min(out[True][1].values()) > 0


def _shift_cached(path, sp, tp, n, temperature):
    """n samples of two prompts on a paged cache, prefix cache on and off, prompts chunked by a
    budget of 8 tokens a step: tokens, prompt tokens computed, hits and each step's (mode, kind)."""
    import torch.distributed as dist

    from reshard.parallel import EngineConfig, ParallelDims
    from reshard.parallel.strategies.shift import parallelize_shift, shift_engine
    from tests.test_prefix_cache import BLOCK, PAGED, _prompt, _samples

    model = parallelize_shift(path, ParallelDims(sp=sp, tp=tp, world_size=dist.get_world_size()))
    requests = _samples([_prompt(23, 1), _prompt(17, 2)], n, temperature=temperature)
    out = {}
    for cached in (True, False):
        config = EngineConfig(**PAGED, max_prefill_tokens=8, prefix_caching=cached)
        assert config.kv_block_size == BLOCK
        engine = shift_engine(model, config, threshold=3)
        steps = []
        engine.events.on("step_ready", lambda index, step, seen=steps: seen.append((step.layout, step.kind)))
        tokens = [c.output_ids for c in engine.generate(requests)]
        s = engine.stats
        out[cached] = dict(tokens=tokens, fed=s.prompt_tokens_computed, hits=s.prefix_cache_hits, steps=steps)
    return out


@pytest.mark.parametrize("family,sp,tp", [("llama", 2, 1), ("qwen3", 2, 2)])
def test_shift_mixes_prompt_chunks_and_decodes_and_caches_prefixes(checkpoints, hf_reference, family, sp, tp):
    """The default path: a token budget of 8 cuts prompts into chunks that share steps with
    decodes, in SP mode (over 3 tokens) and TP mode; on a paged cache, n = 8 samples compute
    their prompt once. Tokens equal the uncached run's (greedy: HF's) for n = 1 and 8, greedy
    and seeded sampling; prompt tokens computed are each prompt's once plus, per other sample,
    its last partial block."""
    from tests.test_prefix_cache import _prompt, check_computed_once

    path = checkpoints[family]
    prompts = [_prompt(23, 1), _prompt(17, 2)]
    expected = hf_reference(path, prompts, 8)
    for n, temperature in ((1, 0.0), (8, 0.0), (8, 0.8)):
        for rank in dist_harness.run(sp * tp, _shift_cached, path, sp, tp, n, temperature):
            on, off = rank[True], rank[False]
            check_computed_once(on, off, prompts, expected, n, temperature)
            for run in (on, off):
                assert ("sp", "mixed") in run["steps"] and any(mode == "tp" for mode, _ in run["steps"]), run["steps"]
