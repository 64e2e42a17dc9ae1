"""Ring replication of KV (DejaVu 4.2.3): rank x's KV mirrored on rank x + 1 every step,
acknowledged per request and step; TP and pipeline layouts."""

import pytest
import torch

from tests import dist_harness


def _job(path, pp, paged, dp=1):
    import torch.distributed as dist

    from reshard.parallel import Engine, ParallelDims, Request, SamplingParams
    from reshard.parallel.fault.ring import RingReplication
    from reshard.parallel.model.pipeline import parallelize_pipeline

    world = dist.get_world_size()
    model = parallelize_pipeline(path, ParallelDims(dp=dp, pp=pp, tp=world // (pp * dp), world_size=world))
    kw = dict(kv_block_size=8, kv_tokens=160) if paged else {}
    engine = Engine(model, max_batch_size=3, max_seq_len=48, num_microbatches=pp, replicas="lockstep", **kw)
    ring = RingReplication(engine)
    reqs = [Request(i, list(range(3 + i, 12 + 2 * i)), SamplingParams(max_new_tokens=5 + i)) for i in range(5)]
    engine.generate(reqs)
    ring.drain()
    steps = ring.stream.steps
    ring.close()
    kv = engine.kv
    mine = _written(kv)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return torch.equal(_written(ring.mirror), everyone[ring.source]), dict(ring.acked), steps


def _written(kv):
    """Every position sequences wrote (the scratch column / block excluded)."""
    if kv.spec.paged:
        return torch.cat([k[:-1] for k in kv.k + kv.v])
    return torch.cat([k[:, :, : kv.spec.max_seq_len] for k in kv.k + kv.v])


@pytest.mark.parametrize("pp,paged", [(1, False), (2, False), (1, True)])
def test_every_rank_mirrors_its_ring_predecessor(four_layer, pp, paged):
    for same, acked, steps in dist_harness.run(2, _job, four_layer["llama"], pp, paged):
        assert same
        assert sorted(acked) == [0, 1, 2, 3, 4] and max(acked.values()) == steps - 1


@pytest.mark.parametrize("paged", [False, True])
def test_data_parallel_replicas_mirror_each_other(four_layer, paged):
    """dp=2: each rank runs other sequences than the rank it mirrors (and idles once its own
    finish); the mirror still equals the predecessor's cache, and acknowledges its requests."""
    results = dist_harness.run(2, _job, four_layer["llama"], 1, paged, 2)
    for same, acked, _steps in results:
        assert same and acked
    assert sorted(set(results[0][1]) | set(results[1][1])) == [0, 1, 2, 3, 4]
    assert not set(results[0][1]) & set(results[1][1])  # each mirrors the other replica's requests
