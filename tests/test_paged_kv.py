"""Paged KV cache: a block pool with a block table per slot, capacity counted in tokens.

Oracle: each request generated alone in a contiguous cache (and HF generate for whole runs).
"""

import pytest
import torch

from tests import dist_harness


def test_paged_write_read_matches_contiguous():
    """The same writes into a contiguous and a paged cache read back identically (any order of blocks)."""
    from reshard.kv import KVCache, KVSpec

    base = dict(num_layers=2, num_slots=3, num_heads=2, max_seq_len=20, head_dim=4)
    flat, paged = KVCache(KVSpec(**base)), KVCache(KVSpec(**base, block_size=4, num_blocks=12))
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(12, generator=g).tolist()
    lengths = [7, 13, 1]
    paged.assign(0, blocks[:2]), paged.assign(1, blocks[2:6]), paged.assign(2, blocks[6:7])
    slots = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    for layer in range(2):
        k, v = torch.randn(len(slots), 2, 4, generator=g), torch.randn(len(slots), 2, 4, generator=g)
        for cache in (flat, paged):
            cache.write(layer, *cache.locate(slots, positions), k, v)
        for slot, n in enumerate(lengths):
            for a, b in zip(flat.read_slot(layer, slot, n), paged.read_slot(layer, slot, n)):
                assert torch.equal(a, b)
        kf, _ = flat.read(layer, slice(0, 3), 13)
        kp, _ = paged.read(layer, slice(0, 3), 13)
        for slot, n in enumerate(lengths):
            assert torch.equal(kf[slot, :, :n], kp[slot, :, :n])
    assert paged.spec.capacity_tokens == 48 < flat.spec.capacity_tokens == 60


def _requests(n, seed=0, sampled=False):
    from reshard.parallel import Request, SamplingParams

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 256, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(
            max_new_tokens=int(torch.randint(1, 24, (1,), generator=g)), temperature=0.8 if sampled else 0.0, seed=3
        )
        out.append(Request(i, prompt, params))
    return out


def _paged_job(path, tp, compile):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize

    world = dist.get_world_size()
    model = parallelize(path, ParallelDims(dp=world // tp, tp=tp, world_size=world))
    out = {}
    for sampled in (False, True):
        reqs = _requests(14, sampled=sampled)
        engine = Engine(
            model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_block_size=8, kv_tokens=120, compile=compile)
        )
        paged = [c.output_ids for c in engine.generate(reqs)]
        alone = [
            Engine(model, EngineConfig(max_batch_size=1, max_seq_len=64)).generate([r])[0].output_ids for r in reqs
        ]
        s = engine.stats
        out[sampled] = dict(
            same=paged == alone,
            allocated=s.kv_blocks_allocated,
            freed=s.kv_blocks_freed,
            peak=s.kv_blocks_peak,
            capacity=engine.kv.spec.capacity_tokens,
            contiguous=4 * 64,
            blocks=engine.kv.spec.num_blocks,
        )
    return out


@pytest.mark.parametrize("world,tp,compile", [(1, 1, False), (2, 2, False), (2, 1, False), (1, 1, True)])
def test_mixed_lengths_in_a_small_paged_cache_equal_each_request_alone(checkpoints, world, tp, compile):
    """A cache of 120 tokens (< 4 slots x 64): admission waits for blocks, finished sequences
    give theirs back (counted), and every request's tokens (greedy and sampled) equal it run alone."""
    for r in dist_harness.run(world, _paged_job, checkpoints["llama"], tp, compile, timeout=300)[0].values():
        assert r["same"]
        assert r["capacity"] == 120 < r["contiguous"]
        assert r["allocated"] == r["freed"] > r["blocks"]  # blocks were reused
        assert 0 < r["peak"] <= r["blocks"]


def _too_big_job(path):
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=64, kv_block_size=8, kv_tokens=32))
    engine.generate([Request(7, list(range(3, 33)), SamplingParams(max_new_tokens=10))])


def test_a_request_larger_than_the_paged_cache_is_refused(checkpoints):
    with pytest.raises(
        RuntimeError,
        match=r"request 7: prompt length \(30\) \+ max_new_tokens \(10\) = 40 KV "
        r"tokens needs 5 blocks of 8 but the paged cache holds 4 \(32 tokens\)",
    ):
        dist_harness.run(1, _too_big_job, checkpoints["llama"])


def test_a_block_longer_than_a_sequence_is_refused_before_the_cache_is_made():
    """Every slot would take one block of that many positions (``block_size=10**6``: a cache of
    gigabytes, allocated until the machine killed the process)."""
    from reshard.parallel import EngineConfig

    config = EngineConfig(max_batch_size=4, kv_block_size=10**6)
    with pytest.raises(
        ValueError, match=r"^engine.kv_block_size \(1000000\) is longer than a sequence \(max_seq_len 512\)$"
    ):
        config.paged_tokens(512)
    assert EngineConfig(max_batch_size=4, kv_block_size=512).paged_tokens(512) == 4 * 512
