"""Pipeline-parallel execution (the prefill layout of Seesaw): stages x micro-batches vs HF."""

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts


def _pp_generate(path, dp, pp, tp, prompts, max_new, microbatches=2, stages=None):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.pipeline import parallelize_pipeline

    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dist.get_world_size(), stages=stages)
    model = parallelize_pipeline(path, dims)
    engine = Engine(model, EngineConfig(num_microbatches=microbatches, max_batch_size=4, max_seq_len=128))
    requests = [Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(prompts)]
    return [c.output_ids for c in engine.generate(requests)], model.parallel_info.load_stats, engine.runner.layer_ids


@pytest.mark.parametrize("dp,pp,tp", [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)], ids=["P2", "P4", "D2P2", "T2P2"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pipeline_tokens_match_hf(four_layer, hf_reference, family, dp, pp, tp):
    path, prompts = four_layer[family], _prompts()
    expected = hf_reference(path, prompts, MAX_NEW)
    results = dist_harness.run(dp * pp * tp, _pp_generate, path, dp, pp, tp, prompts, MAX_NEW)
    for tokens, stats, layer_ids in results:
        assert tokens == expected
        assert len(layer_ids) == 4 // pp
        assert stats.bytes_read < stats.checkpoint_bytes / (pp * tp) * 1.6  # only its stage's slices


def test_pipeline_stages_replicate_kv_heads_match_hf(four_layer, hf_reference):
    """T2P2 on Mistral (1 KV head): each stage replicates it over its own 2 tp ranks."""
    path, prompts = four_layer["mistral"], _prompts()
    expected = hf_reference(path, prompts, MAX_NEW)
    for tokens, stats, layer_ids in dist_harness.run(4, _pp_generate, path, 1, 2, 2, prompts, MAX_NEW):
        assert tokens == expected
        assert len(layer_ids) == 2
        assert stats.bytes_read < stats.checkpoint_bytes / 4 * 1.6  # only its stage's slices


def _too_many_stages(path):
    import torch.distributed as dist

    from reshard.parallel import ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline

    parallelize_pipeline(path, ParallelDims(pp=4, world_size=dist.get_world_size()))


def test_more_stages_than_layers_is_rejected(checkpoints):
    with pytest.raises(RuntimeError, match=r"pipeline stages \(4\) exceed the model's layers \(2\)"):
        dist_harness.run(4, _too_many_stages, checkpoints["llama"])


def test_uneven_stages_match_hf(four_layer, hf_reference):
    """P2 with 3 layers on the first stage and 1 on the last (which also runs the LM head)."""
    path, prompts = four_layer["llama"], _prompts()
    expected = hf_reference(path, prompts, MAX_NEW)
    results = dist_harness.run(2, _pp_generate, path, 1, 2, 1, prompts, MAX_NEW, 2, (3, 1))
    assert [r[0] for r in results] == [expected, expected]
    assert [len(r[2]) for r in results] == [3, 1]


def test_balanced_stages_give_the_last_stage_fewer_layers():
    from transformers import LlamaConfig

    from reshard.parallel import ParallelDims
    from reshard.parallel.model.pipeline import balanced_stages

    small_head = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, vocab_size=1000)
    big_head = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, vocab_size=32000)
    assert balanced_stages(small_head, 2) == (4, 4)
    # the head (32000 x 768) weighs about 4 decoder layers: the last stage's reads ~ the others'
    assert balanced_stages(big_head, 2) == (6, 2)
    assert balanced_stages(big_head, 4) == (3, 2, 2, 1)
    assert balanced_stages(big_head, 1) == (8,)
    with pytest.raises(ValueError, match=r"pipeline stages \(9\) must be in 1..8"):
        balanced_stages(big_head, 9)
    with pytest.raises(ValueError, match=r"stages \(4, 0\) must give each of the pp\(2\) stages >= 1 layer"):
        ParallelDims(pp=2, world_size=2, stages=(4, 0))


def _pp_cached(path, dims_kw, n, temperature, pipeline):
    """n samples of two prompts through a pipeline (``pipeline``: drained or in flight) on a paged
    cache, prefix cache on and off, prompts chunked by a budget of 8 tokens a step: tokens, prompt
    tokens computed, hits and each step's kind."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline
    from tests.test_prefix_cache import PAGED, _prompt, _samples

    model = parallelize_pipeline(path, ParallelDims(**dims_kw, world_size=dist.get_world_size()))
    requests = _samples([_prompt(23, 1), _prompt(17, 2)], n, temperature=temperature)
    out = {}
    for cached in (True, False):
        config = EngineConfig(**PAGED, max_prefill_tokens=8, prefix_caching=cached, pipeline=pipeline)
        engine = Engine(model, config)
        kinds = []
        engine.events.on("step_ready", lambda index, step, seen=kinds: seen.append(step.kind))
        tokens = [c.output_ids for c in engine.generate(requests)]
        s = engine.stats
        out[cached] = dict(tokens=tokens, fed=s.prompt_tokens_computed, hits=s.prefix_cache_hits, kinds=kinds)
    return out


@pytest.mark.parametrize(
    "dims_kw,pipeline",
    [({"pp": 2}, "drain"), ({"pp": 2, "tp": 2}, "drain"), ({"pp": 2}, "inflight")],
    ids=["P2", "T2P2", "P2-inflight"],
)
def test_a_pipeline_mixes_steps_and_caches_prefixes(four_layer, hf_reference, dims_kw, pipeline):
    """A pipeline on the token budget: prompt chunks share steps with decode tokens (drained: two
    micro-batches of sequences through the stages; in flight: each micro-batch's own steps), and
    on a paged cache n = 8 samples compute their prompt once (in flight, the first stage's notes
    carry a new sequence's cached blocks to the later stage). Tokens equal the uncached run's
    (greedy: HF's) for n = 1 and 8, greedy and seeded sampling, on every stage; prompt tokens
    computed are each prompt's once plus, per other sample, its last partial block."""
    from tests.test_prefix_cache import _prompt, check_computed_once

    path = four_layer["llama"]
    prompts = [_prompt(23, 1), _prompt(17, 2)]
    expected = hf_reference(path, prompts, 8)
    ranks = dims_kw["pp"] * dims_kw.get("tp", 1)
    for n, temperature in ((1, 0.0), (8, 0.0), (8, 0.8)):
        first, *later = dist_harness.run(ranks, _pp_cached, path, dims_kw, n, temperature, pipeline)
        for rank in later:  # (in flight, the first stage admits: its counters are the job's)
            assert [rank[c]["tokens"] for c in (True, False)] == [first[c]["tokens"] for c in (True, False)]
        for rank in [first] if pipeline == "inflight" else [first, *later]:
            check_computed_once(rank[True], rank[False], prompts, expected, n, temperature)
            assert "mixed" in rank[True]["kinds"] and "mixed" in rank[False]["kinds"]


def _drained_microbatches(path, chunked):
    """Three prompts through a drained P2 (8 slots, 2 micro-batches; the prompts take slots 0-2,
    one slot range; chunked: 8 prompt tokens a step): each step's kind, its sequences and how
    often this stage ran its first layer."""
    import dataclasses

    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=2, world_size=dist.get_world_size()))
    config = EngineConfig(
        num_microbatches=2, max_batch_size=8, max_seq_len=128, chunked_prefill=chunked, pipeline="drain"
    )
    if chunked:
        config = dataclasses.replace(config, max_prefill_tokens=8)
    engine = Engine(model, config)
    steps, first = [], engine.runner.layer_ids[0]
    engine.events.on("step_begin", lambda step, seqs: steps.append([step.kind, len(seqs), 0]))
    engine.events.on("layer_before", lambda i, h, ctx: steps[-1].__setitem__(2, steps[-1][2] + (i == first)))
    requests = [Request(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(_prompts()[:3])]
    return [c.output_ids for c in engine.generate(requests)], steps


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "mixed"])
def test_a_drained_pipeline_cuts_every_prompt_step_into_its_micro_batches(four_layer, hf_reference, chunked):
    """Whole-prompt steps and mixed steps take the runner's one flat-batch path, which cuts a
    drained pipeline's step into ``num_microbatches`` parts by sequence (so the stages overlap)
    even where every sequence sits in one micro-batch's slot range; tokens equal HF's."""
    path = four_layer["llama"]
    expected = hf_reference(path, _prompts()[:3], 6)
    for tokens, steps in dist_harness.run(2, _drained_microbatches, path, chunked):
        assert tokens == expected
        prompt_steps = [(n, calls) for kind, n, calls in steps if kind != "decode"]
        assert prompt_steps and {k for k, *_ in steps} >= ({"prefill"} if not chunked else {"mixed"})
        assert all(calls == min(2, n) for n, calls in prompt_steps), steps
        assert any(n >= 2 for n, _ in prompt_steps), steps
