"""Ring replication of KV (DejaVu 4.2.3): rank x's KV mirrored on rank x + 1 every step,
acknowledged per request and step; TP and pipeline layouts."""

import pytest
import torch

from tests import dist_harness


def _job(path, pp, paged, dp=1):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.fault.ring import RingReplication
    from reshard.parallel.model.pipeline import parallelize_pipeline

    world = dist.get_world_size()
    model = parallelize_pipeline(path, ParallelDims(dp=dp, pp=pp, tp=world // (pp * dp), world_size=world))
    kw = dict(kv_block_size=8, kv_tokens=160) if paged else {}
    engine = Engine(
        model, EngineConfig(max_batch_size=3, max_seq_len=48, num_microbatches=pp, replicas="lockstep", **kw)
    )
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


def _batched_job(path, dp, every):
    """``replicate_every=every``: after every step whose message has landed (and after the drain)
    each rank compares its mirror with the source rank's KV at every position its live sequences
    wrote; 6 requests in 3 slots of each replica retire at different steps and reuse slots."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
    from reshard.parallel.fault.ring import RingReplication

    world = dist.get_world_size()
    model = parallelize(path, ParallelDims(dp=dp, tp=world // dp, world_size=world))
    engine = Engine(model, EngineConfig(max_batch_size=3, max_seq_len=48, replicas="lockstep"))
    ring = RingReplication(engine, replicate_every=every)
    checks, last = [], {}

    def check(step, seqs) -> None:  # after the ring's listener: the message before this step is in
        if ring.landed == ring.stream.steps - 1:  # a message landed: steps before this one are all in
            checks.append(_compare(ring, seqs if step.kind == "decode" else None))
        last["seqs"] = seqs if step.kind == "decode" else []

    for event in ("step_end", "idle"):
        engine.events.on(event, check)
    reqs = [
        Request(i, list(range(3 + i, 10 + 3 * i)), SamplingParams(max_new_tokens=4 + 3 * (i % 3))) for i in range(6)
    ]
    engine.generate(reqs)
    ring.drain()
    final = _compare(ring, last["seqs"])  # every position of the last step's sequences
    messages, steps = ring.stream.directions[0].messages, ring.stream.steps
    ring.close()
    return checks, final, messages, steps


def _compare(ring, seqs) -> tuple[int, bool]:
    """(positions compared, whether the mirror holds the source's KV at all of them): ``seqs``
    are this rank's live sequences (None: not a decode step, nothing compared), compared up to
    ``cached`` (what the steps before hold)."""
    import torch.distributed as dist

    kv = ring.stream.send_cache
    mine = (torch.stack(kv.k + kv.v), None if seqs is None else [(s.slot, s.num_computed_tokens) for s in seqs])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    source, live = everyone[ring.source]
    if live is None:
        return 0, True
    mirror = torch.stack(ring.mirror.k + ring.mirror.v)  # (2 * layers, slots, heads, positions, head_dim)
    same = [torch.equal(mirror[:, slot, :, :n], source[:, slot, :, :n]) for slot, n in live]
    return sum(n for _, n in live), all(same)


@pytest.mark.parametrize("dp", [1, 2])
def test_batched_replication_mirrors_every_live_sequence(four_layer, dp):
    """replicate_every=3, TP2 (dp=1) or two data-parallel replicas (dp=2): the mirror equals the
    source's KV for every live sequence after each landed message and after the drain, with
    sequences retiring and slots reused in between; fewer messages than steps."""
    for checks, final, messages, steps in dist_harness.run(2, _batched_job, four_layer["llama"], dp, 3):
        assert all(same for _, same in checks) and final[1], (checks, final)
        assert sum(n for n, _ in checks) > 0 and final[0] > 0
        assert len(checks) >= steps // 3 and messages <= steps // 2


def test_replicate_every_below_one_is_refused():
    from reshard.kv.stream import TokenStream
    from reshard.recipes.config import FaultConfig

    with pytest.raises(ValueError, match=r"fault.replicate_every must be an int >= 1 \(steps per message\), got 0"):
        FaultConfig(replicate=True, replicate_every=0)
    with pytest.raises(ValueError, match=r"replicate_every must be >= 1 \(steps per message\), got 0"):
        TokenStream(None, None, None, every=0)
