"""DejaVu micro-batch swapping: device KV for 2 of D = 4 micro-batches, host KV for all; the same
tokens as everything resident (and as HF generate), with the device KV memory measured."""

import pytest

from tests import dist_harness

PROMPTS = [
    [5, 9, 11, 2, 7],
    [3, 4],
    list(range(20, 37)),
    [8] * 9,
    [100, 101, 102],
    [60, 61, 62, 63],
    [7, 7, 1],
    list(range(40, 52)),
    [90, 3],
    [11, 12, 13, 14, 15, 16],
]


def _job(path, pp, swap, chunked=True, prefill_chunk=None):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.pipeline import parallelize_pipeline

    world = dist.get_world_size()
    model = parallelize_pipeline(path, ParallelDims(pp=pp, tp=world // pp, world_size=world))
    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=64,
        num_microbatches=4,
        kv_swap=swap,
        chunked_prefill=chunked,
        max_prefill_tokens=16,
        prefill_chunk=prefill_chunk,
    )
    engine = Engine(model, config)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=7)) for i, p in enumerate(PROMPTS)])
    runner = engine.runner
    host = runner.swap.host.spec.bytes if swap else runner.kv.spec.bytes
    moved = (runner.swap.bytes_in, runner.swap.bytes_out) if swap else (0, 0)
    return [c.output_ids for c in out], runner.kv.spec.bytes, host, moved, engine.stats.mixed_steps


@pytest.mark.parametrize("world,pp", [(1, 1), (2, 2)])
def test_swapping_two_of_four_microbatches_gives_the_same_tokens(four_layer, hf_reference, world, pp):
    """On the token budget (a 16-token budget: prompts in chunks beside decode tokens), each
    mixed step's micro-batches swapped in and out around them; and in whole-prompt steps."""
    path = four_layer["llama"]
    expected = hf_reference(path, PROMPTS, 7)
    resident = dist_harness.run(world, _job, path, pp, False)
    swapped = dist_harness.run(world, _job, path, pp, True)
    for (tokens, device, _, _, mixed), (swap_tokens, swap_device, host, (bytes_in, bytes_out), swap_mixed) in zip(
        resident, swapped
    ):
        assert tokens == swap_tokens == expected
        assert swap_mixed > 0 and mixed > 0  # mixed steps, swapped (pipeline stages: drained with swapping)
        assert swap_device * 2 == device == host  # room for 2 of 4 micro-batches on the device
        assert bytes_in > 0 and bytes_out > 0
    for tokens, _, _, _, mixed in dist_harness.run(world, _job, path, pp, True, False):
        assert tokens == expected and mixed == 0  # engine.chunked_prefill=false: whole-prompt steps
    if pp == 1:  # (pipeline stages refuse a chunk cap)
        for tokens, _, _, _, mixed in dist_harness.run(world, _job, path, pp, True, True, 4):
            assert tokens == expected and mixed > swap_mixed  # at most 4 tokens of a prompt a step


def _bad_job(path):
    from reshard.parallel import Engine, EngineConfig, parallelize

    Engine(parallelize(path), EngineConfig(max_batch_size=4, num_microbatches=1, kv_swap=True))


def test_swapping_needs_micro_batches(checkpoints):
    with pytest.raises(RuntimeError, match=r"kv_swap needs num_microbatches >= 2 \(got 1\)"):
        dist_harness.run(1, _bad_job, checkpoints["llama"])


def _connector_refused(path):
    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.parallel.engine.connector import KVConnector

    class Elsewhere(KVConnector):  # a connector that would load KV into the device regions
        pass

    engine = Engine(parallelize(path), EngineConfig(max_batch_size=4, num_microbatches=2, kv_swap=True))
    with pytest.raises(ValueError) as err:
        engine.connector.add(Elsewhere())
    return str(err.value)


def test_a_swapping_engine_refuses_a_kv_connector_naming_both(checkpoints):
    (message,) = dist_harness.run(1, _connector_refused, checkpoints["llama"])
    assert message == (
        "a KV connector (Elsewhere) cannot load into this engine: "
        "engine.kv_swap=True keeps the KV of layout 'main' in host memory"
    )
