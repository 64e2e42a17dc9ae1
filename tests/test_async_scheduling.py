"""Async scheduling (``EngineConfig.async_scheduling``): step n+1 is scheduled while step n
computes, before step n's tokens are agreed.

References: the same requests with it off and HF ``generate`` (greedy); the engine's
``step_scheduled`` / ``step_agreed`` events for the order; the cache's slot and block counts.
"""

import pytest
import torch

from tests import dist_harness
from tests.test_prefix_cache import _changed, _prompt

STOPS = list(range(3, 40))  # sampled requests meet one of these early: finishes no length predicts
CONFIGS = {
    "contiguous": dict(max_batch_size=4, max_seq_len=64, max_prefill_tokens=16),
    # 16 blocks of 4 for 4 slots: preemption; every prompt twice: prefix hits
    "paged-pressure": dict(max_batch_size=4, max_seq_len=64, max_prefill_tokens=16, kv_block_size=4, kv_tokens=64),
}


def _requests():
    """Ten requests: prompt lengths 3-29, 1-11 new tokens; even ids greedy (no stop list), odd ids
    sampled (seeded) with a stop list; ids 5-9 repeat the prompts of 0-4."""
    from reshard.parallel import Request, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [_prompt(int(torch.randint(3, 30, (1,), generator=g)), i) for i in range(5)] * 2
    requests = []
    for i, prompt in enumerate(prompts):
        new = int(torch.randint(1, 12, (1,), generator=g))
        sampled = dict(temperature=0.8, seed=i, stop_token_ids=STOPS) if i % 2 else {}
        requests.append(Request(i, prompt, SamplingParams(max_new_tokens=new, **sampled)))
    return requests


def _job(path, config):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize

    world = dist.get_world_size()
    model = parallelize(path, ParallelDims(tp=world, world_size=world))
    out = {}
    for on in (False, True):
        engine = Engine(model, EngineConfig(**config, async_scheduling=on))
        order = []
        engine.events.on("step_scheduled", lambda step, order=order: order.append("scheduled"))
        engine.events.on("step_agreed", lambda index, step, tokens, order=order: order.append("agreed"))
        tokens = [c.output_ids for c in engine.generate(_requests())]
        stats = engine.stats
        out[on] = dict(
            tokens=tokens,
            order=order,
            ahead=engine.schedules_ahead(),
            preemptions=stats.preemptions,
            hits=stats.prefix_cache_hits,
            idle=engine.policy.slots.idle(),
        )
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "tp2"])
def test_async_scheduling_on_and_off_give_the_same_tokens(checkpoints, hf_reference, config, world):
    """Greedy and seeded sampled requests, stop tokens met early, chunked prompts, (paged) KV
    pressure with preemption and prefix hits: the same tokens with async scheduling on and off,
    the greedy ones HF's; on, each step after the first is scheduled before the step before it
    is agreed (off, after); every slot and block back at the end."""
    path = checkpoints["llama"]
    requests = _requests()
    greedy = [r for r in requests if r.sampling.temperature == 0.0]
    reference = [
        hf_reference(path, [r.prompt_ids], r.sampling.max_new_tokens)[0][: r.sampling.max_new_tokens] for r in greedy
    ]
    for rank in dist_harness.run(world, _job, path, CONFIGS[config]):
        off, on = rank[False], rank[True]
        assert on["tokens"] == off["tokens"]
        assert [on["tokens"][r.id] for r in greedy] == reference
        assert any(len(on["tokens"][r.id]) < r.sampling.max_new_tokens for r in requests if r.id % 2)  # stopped early
        assert (off["ahead"], on["ahead"]) == (False, True)
        assert off["order"] == ["scheduled", "agreed"] * (len(off["order"]) // 2)
        assert on["order"][:3] == ["scheduled", "scheduled", "agreed"]  # step 1 scheduled before step 0 agreed
        assert on["order"].count("agreed") == on["order"].count("scheduled") - 1  # (the last one: nothing left)
        assert on["idle"] and off["idle"]
        if config == "paged-pressure":
            assert on["preemptions"] > 0 and off["preemptions"] > 0 and on["hits"] > 0


def _weights_job(path):
    from reshard import LLM
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine.core import EngineCore

    prompt, other = _prompt(30, 4), _prompt(20, 5)
    with LLM(path, max_seq_len=96, kv_block_size=4, kv_tokens=256, async_scheduling=True) as llm:
        llm.generate([prompt])  # its blocks cached
        core = EngineCore(llm.engine)
        core.add_request(Request(0, other, SamplingParams(max_new_tokens=16)))
        core.step()  # the other prompt computed; the next step scheduled ahead of its agreement
        core.add_request(Request(1, prompt, SamplingParams(max_new_tokens=16)))
        while 1 not in llm.engine.policy.running:  # taken at a step's agreement, admitted by the next one scheduled
            core.step()
        ahead = [s.request.id for s in core.ahead.seqs if not s.output]  # admitted by the step ahead
        shared = llm.engine.policy.running[1].num_computed_tokens  # the cached prompt's blocks it shares
        hits_before = llm.engine.stats.prefix_cache_hits - shared
        llm.load_weights(_changed(path).state_dict())
        done = core.run()
        hits = llm.engine.stats.prefix_cache_hits
    return dict(ahead=ahead, shared=shared, tokens=done[1].output_ids, hits=hits, hits_before=hits_before)


def test_weights_written_after_a_step_was_scheduled_ahead_drop_what_it_admitted(checkpoints):
    """A request admitted by a step scheduled ahead, sharing cached blocks, then the weights
    written before that step runs: the request is admitted again without them, and its tokens
    are the new weights' HF tokens."""
    from tests.test_llm import _hf_generate

    path = checkpoints["llama"]
    r = dist_harness.run(1, _weights_job, path)[0]
    assert r["ahead"] == [1] and r["shared"] > 0  # admitted ahead, matching the old weights' blocks
    assert r["hits"] == r["hits_before"]  # (the undone match is not counted)
    assert r["tokens"] == _hf_generate(_changed(path), _prompt(30, 4), 16)[0]
