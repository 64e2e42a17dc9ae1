"""Prefix caching: full KV blocks shared by the tokens they hold (``engine/prefix.py``).

References: the same requests with ``prefix_caching=False`` and HF ``generate``; the prompt
tokens the steps computed (``EngineStats.prompt_tokens_computed``) against the distinct prompts'
tokens; the pool's block counts before and after.
"""

import pytest
import torch

from tests import dist_harness

BLOCK = 4
PAGED = {"kv_block_size": BLOCK, "kv_tokens": 512, "max_batch_size": 8, "max_seq_len": 96}


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _samples(prompts, n, max_new=8, temperature=0.0):
    """``n`` requests per prompt, sample ``j`` seeded ``7 + j`` (as ``LLM`` expands ``n``)."""
    from reshard.parallel import Request, SamplingParams

    requests = []
    for p in prompts:
        for j in range(n):
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=40, seed=7 + j)
            requests.append(Request(len(requests), p, params))
    return requests


def check_computed_once(on: dict, off: dict, prompts, expected, n: int, temperature: float) -> None:
    """A run with the prefix cache (``on``) against one without (``off``), each ``{"tokens",
    "fed", "hits"}`` for ``n`` samples of each of ``prompts``: the same tokens (greedy: HF's
    ``expected``); without, every prompt token computed and no hit; with, each prompt computed
    once plus, per other sample, its last partial block (never shared)."""
    assert on["tokens"] == off["tokens"], (n, temperature)
    if temperature == 0.0:
        assert on["tokens"] == [t for t in expected for _ in range(n)]
    assert off["fed"] == n * sum(map(len, prompts)) and off["hits"] == 0
    tails = sum(len(p) - (len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert on["fed"] == sum(map(len, prompts)) + (n - 1) * tails, (n, on["fed"])


def _run(model, requests, **config):
    from reshard.parallel import Engine, EngineConfig

    engine = Engine(model, EngineConfig(**{**PAGED, **config}))
    steps = []
    engine.events.on("step_ready", lambda index, step: steps.append({s.request.id for s in step.seqs}))
    tokens = [c.output_ids for c in engine.generate(requests)]
    slots = engine.policy.slots
    return dict(
        tokens=tokens,
        fed=engine.stats.prompt_tokens_computed,
        first=steps[0],
        queries=engine.stats.prefix_cache_queries,
        hits=engine.stats.prefix_cache_hits,
        balanced=engine.stats.kv_blocks_allocated == engine.stats.kv_blocks_freed,
        idle=slots.idle(),
    )


def _samples_job(path, prompts, n, temperature):
    import torch.distributed as dist

    from reshard.parallel import ParallelDims, parallelize

    world = dist.get_world_size()
    model = parallelize(path, ParallelDims(tp=world, world_size=world))
    requests = _samples(prompts, n, temperature=temperature)
    return {"on": _run(model, requests), "off": _run(model, requests, prefix_caching=False)}


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "tp2"])
def test_n_samples_compute_their_prompt_once_and_equal_the_uncached_run(checkpoints, hf_reference, world):
    """n = 1 and n = 8 over two prompts, greedy and seeded sampling: the same tokens with the
    cache on and off (greedy: HF's); with n = 8 the prompt tokens computed are each distinct
    prompt's once plus, per other sample, its last partial block (never shared)."""
    path = checkpoints["llama"]
    prompts = [_prompt(23, 1), _prompt(17, 2)]
    expected = hf_reference(path, prompts, 8)
    for n in (1, 8):
        for temperature in (0.0, 0.8):
            for rank in dist_harness.run(world, _samples_job, path, prompts, n, temperature):
                on, off = rank["on"], rank["off"]
                check_computed_once(on, off, prompts, expected, n, temperature)
                assert on["hits"] == (n - 1) * sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
                assert on["queries"] == n * sum(map(len, prompts))
                # each prompt's first sample in the first step: the others wait for its blocks, not the queue
                assert on["first"] == {0, n}, on["first"]
                assert on["balanced"] and on["idle"]


def _system_prompt_job(path):
    from reshard.parallel import parallelize

    system = _prompt(20, 3)
    prompts = [system + _prompt(5 + i, 10 + i) for i in range(4)]
    out = _run(parallelize(path), _samples(prompts, 1))
    out["reference"] = _run(parallelize(path), _samples(prompts, 1), prefix_caching=False)["tokens"]
    out["lengths"] = [len(p) for p in prompts]
    return out


def test_a_shared_system_prompt_is_computed_once(checkpoints):
    """Four requests that share a 20-token system prompt: its five blocks are computed once."""
    r = dist_harness.run(1, _system_prompt_job, checkpoints["llama"])[0]
    assert r["tokens"] == r["reference"]
    assert r["fed"] == sum(r["lengths"]) - 3 * 20 and r["hits"] == 3 * 20


def _changed(path):
    """The checkpoint's HF model with every weight times 0.8."""
    from tests.test_llm import _hf

    model = _hf(path)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.8)
    return model.eval()


def _weights_job(path):
    from reshard import LLM

    prompt = _prompt(30, 4)
    with LLM(path, max_seq_len=96, kv_block_size=BLOCK, kv_tokens=256) as llm:
        first = llm.generate([prompt])[0].outputs[0].token_ids
        again = llm.generate([prompt])[0].outputs[0].token_ids
        hits = llm.engine.stats.prefix_cache_hits
        llm.load_weights(_changed(path).state_dict())
        after = llm.generate([prompt])[0].outputs[0].token_ids
        hits_after = llm.engine.stats.prefix_cache_hits
        llm.generate([prompt])
        hits_repeat = llm.engine.stats.prefix_cache_hits
    return dict(first=first, again=again, hits=hits, after=after, hits_after=hits_after, hits_repeat=hits_repeat)


def test_weights_written_drop_the_cache(checkpoints, hf_reference):
    """A prompt computed, computed again from the cache (a hit), then the weights changed
    through ``load_weights``: the same prompt gives the new weights' HF tokens, with no hit; the
    next call hits again (under the new weights)."""
    from tests.test_llm import _hf_generate

    path = checkpoints["llama"]
    r = dist_harness.run(1, _weights_job, path)[0]
    prompt = _prompt(30, 4)
    assert r["first"] == r["again"] == hf_reference(path, [prompt], 16)[0] and r["hits"] > 0
    assert r["after"] == _hf_generate(_changed(path), prompt, 16)[0] != r["first"]
    assert r["hits_after"] == r["hits"] < r["hits_repeat"]


def _eviction_job(path):
    from reshard.parallel import parallelize

    model = parallelize(path)
    prompts = [_prompt(13 + i % 5, 20 + i) for i in range(24)]  # ~24 x 4 full blocks > the pool's 40
    requests = _samples(prompts, 1, max_new=6)
    tight = dict(kv_tokens=40 * BLOCK, max_batch_size=4)
    out = [_run(model, requests, **tight), _run(model, requests[::-1], **tight)]
    return out, _run(model, requests, prefix_caching=False)["tokens"]


def test_more_prefixes_than_blocks_evict_and_leak_nothing(checkpoints):
    """24 distinct prompts through a pool of 40 blocks (every block cached at some point, most
    evicted): the same tokens as without the cache, and every block back at the end."""
    (forward, backward), reference = dist_harness.run(1, _eviction_job, checkpoints["llama"])[0]
    assert forward["tokens"] == reference and backward["tokens"] == reference[::-1]
    assert forward["balanced"] and forward["idle"] and backward["balanced"] and backward["idle"]


def _groups_job(path, prompts, n):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize
    from reshard.parallel.engine.request import EngineStats

    model = parallelize(path, ParallelDims.from_world(dp=dist.get_world_size()))
    engine = Engine(model, EngineConfig(**PAGED))
    tokens = [c.output_ids for c in engine.generate(_samples(prompts, n))]
    return tokens, EngineStats.total(engine.group_stats).prefix_cache_hits


def test_data_parallel_groups_get_the_requests_whose_prefix_they_hold(checkpoints, hf_reference):
    """Two engine groups, two prompts of 40 tokens x 4 samples, all arrived at once: the router
    sends each prompt's samples to the group it sent the prompt to first, so each prompt is
    computed once in the job (the groups' hits count 3 samples x 9 shared blocks per prompt;
    spread by load alone, a prompt's samples would compute it in both groups)."""
    path = checkpoints["llama"]
    prompts = [_prompt(40, 31), _prompt(40, 32)]
    tokens, hits = dist_harness.run(2, _groups_job, path, prompts, 4)[0]
    assert tokens == [t for t in hf_reference(path, prompts, 8) for _ in range(4)]
    assert hits == 2 * 3 * (39 // BLOCK) * BLOCK


def _sidp_job(path, prompts, n, mode):
    from reshard.parallel.engine import EngineConfig, make_strategy

    runs = {}
    for cached in (True, False):
        strategy = make_strategy({"strategy": "sidp", "mode": mode, "interval": 2})
        engine = strategy.build(path, EngineConfig(**PAGED, prefix_caching=cached))
        tokens = [c.output_ids for c in engine.generate(_samples(prompts, n))]
        runs[cached] = dict(tokens=tokens, fed=engine.stats.prompt_tokens_computed, hits=engine.stats.prefix_cache_hits)
        engine.close()
    return runs


@pytest.mark.parametrize("mode", ["was", "cas"])
def test_sidp_samples_compute_their_prompt_once(checkpoints, hf_reference, mode):
    """SiDP (two replicas sharing an FFN owner pool) takes the same batching path as the default
    policy: with n = 4 each prompt is computed once plus the other samples' last partial blocks,
    and the tokens equal the uncached run and HF's."""
    path = checkpoints["llama"]
    prompts = [_prompt(23, 1), _prompt(17, 2)]
    expected = [t for t in hf_reference(path, prompts, 8) for _ in range(4)]
    for rank in dist_harness.run(2, _sidp_job, path, prompts, 4, mode):
        on, off = rank[True], rank[False]
        assert on["tokens"] == off["tokens"] == expected
        assert off["fed"] == 4 * sum(map(len, prompts)) and off["hits"] == 0
        tails = sum(len(p) - (len(p) - 1) // BLOCK * BLOCK for p in prompts)
        assert on["fed"] == sum(map(len, prompts)) + 3 * tails and on["hits"] > 0


def _llm_default_job(path):
    from reshard import LLM, SamplingParams

    params = SamplingParams(n=8, temperature=0.8, max_tokens=8)
    runs = {}
    for name, cache in (("default", {}), ("contiguous", {"kv_block_size": None})):
        with LLM(path, max_model_len=96, seed=0, **cache) as llm:
            samples = llm.generate([_prompt(30, 4)], params)[0].outputs
            stats = llm.engine.stats
            runs[name] = dict(
                paged=llm.engine.kv.spec.paged,
                tokens=[s.token_ids for s in samples],
                fed=stats.prompt_tokens_computed,
                hits=stats.prefix_cache_hits,
            )
    return runs


def test_llm_computes_n_samples_prompt_once_by_default(checkpoints):
    """``LLM`` with no cache keys runs a paged cache (blocks of 16) and so the prefix cache: n = 8
    samples of a 30-token prompt compute it once plus 7 last partial blocks (14 tokens each), and
    sample what contiguous slots (``kv_block_size=None``, every sample its whole prompt) do."""
    r = dist_harness.run(1, _llm_default_job, checkpoints["llama"])[0]
    default, contiguous = r["default"], r["contiguous"]
    assert default["paged"] and not contiguous["paged"]
    assert default["tokens"] == contiguous["tokens"] and len(set(map(tuple, default["tokens"]))) > 1
    assert contiguous["fed"] == 8 * 30 and contiguous["hits"] == 0
    assert default["fed"] == 30 + 7 * 14 and default["hits"] == 7 * 16
