"""Pipelines that stay full: micro-batches in flight across decode steps (PP2, PP4) vs HF
``generate`` and vs the drained pipeline; one harness launch per pipeline depth."""

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts
from tests.test_groups import _requests

LATE = 0.05  # seconds after the start: the online request arrives while the others decode


def _stage_runs(path, pp, prompts, max_new):
    """Every engine run of one pipeline depth, on every stage: in flight (greedy, seeded, with a
    late arrival) and drained (seeded); each with the stage's :class:`PipelineRecord`."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=pp, world_size=dist.get_world_size()))
    kw = dict(num_microbatches=pp, max_batch_size=8, max_seq_len=128)
    inflight = Engine(model, EngineConfig(pipeline="inflight", **kw))
    drained = Engine(model, EngineConfig(pipeline="drain", **kw))
    assert Engine(model, EngineConfig(**kw)).flow is not None  # in flight is the default for pp > 1

    def run(engine, new=max_new, **req):
        completions = engine.generate(_requests(prompts, new, **req))
        return [c.output_ids for c in completions], [c.timing for c in completions], engine.flow.record

    arrivals = [0.0] * (len(prompts) - 1) + [LATE]
    greedy = run(inflight)
    online = run(inflight, arrivals=arrivals, new=[4 * max_new] * (len(prompts) - 1) + [max_new])
    sampled = run(inflight, temperature=0.9)
    return greedy, online, sampled, drained.generate(_requests(prompts, max_new, temperature=0.9)), drained.flow


@pytest.mark.parametrize("pp", [2, 4], ids=["PP2", "PP4"])
def test_inflight_pipeline_matches_hf_and_keeps_microbatches_in_flight(four_layer, hf_reference, pp):
    path, prompts = four_layer["llama"], _prompts(8)  # every micro-batch has work at PP4
    expected = hf_reference(path, prompts, 4 * MAX_NEW)
    results = dist_harness.run(pp, _stage_runs, path, pp, prompts, MAX_NEW)
    (tokens, _, head), (late_tokens, timings, _), (sampled, _, _), drained, no_flow = results[0]
    assert tokens == [t[:MAX_NEW] for t in expected]
    assert sampled == [c.output_ids for c in drained] and sampled != tokens  # seeded: as the drained engine
    assert no_flow is None
    # the late request was admitted while the others decoded, and changed none of their tokens
    assert late_tokens == expected[:-1] + [expected[-1][:MAX_NEW]]
    late = timings[-1]
    assert late.started >= LATE and late.started < min(t.finished for t in timings[:-1])
    # micro-batches really were in flight across steps: every stage ran every launched step
    assert head.peak == pp and head.overlapped >= head.steps // 2
    for rank, (greedy, online, sampled_run, _, _) in enumerate(results):
        assert greedy[0] == tokens and online[0] == late_tokens and sampled_run[0] == sampled  # every rank
        assert greedy[2].steps == head.steps, f"stage {rank} ran {greedy[2].steps} of {head.steps} steps"


def _refused(path, pipeline, tp):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=2, tp=tp, world_size=dist.get_world_size()))
    try:
        Engine(model, EngineConfig(pipeline=pipeline, num_microbatches=2, max_batch_size=4, max_seq_len=128))
    except ValueError as e:
        return str(e)
    return None


def test_inflight_refuses_what_it_cannot_run(four_layer):
    path = four_layer["llama"]
    assert dist_harness.run(2, _refused, path, "overlap", 1)[0] == (
        "engine.pipeline must be one of ['inflight', 'drain'] or None, got 'overlap'"
    )
    assert "one rank per stage (tp=1, sp=1), got tp=2" in dist_harness.run(4, _refused, path, "inflight", 2)[0]
