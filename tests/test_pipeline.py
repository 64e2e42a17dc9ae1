"""Pipeline-parallel execution (the prefill layout of Seesaw): stages x micro-batches vs HF."""

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts


def _pp_generate(path, dp, pp, tp, prompts, max_new, microbatches=2):
    import torch.distributed as dist

    from reshard.parallel import Engine, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.pipeline import parallelize_pipeline

    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dist.get_world_size())
    model = parallelize_pipeline(path, dims)
    engine = Engine(model, num_microbatches=microbatches, max_batch_size=4, max_seq_len=128)
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
