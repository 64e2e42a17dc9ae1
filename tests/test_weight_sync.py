"""RL weight sync: FSDP2 training model -> TP / Shift rollout model, colocated, split and overlapping.

Oracle: the training parameters gathered whole (``full_tensor()`` on ascending meshes) and sliced
to each rollout shard's box by plain indexing; tokens against HF ``generate`` on those weights.
"""

import pytest
import torch

from tests import dist_harness


def _trained(path, ranks, seed=0, layout="fsdp", inner=2):
    """The training model (FSDP2 by default) after one Adam step on a seeded batch (so its
    weights differ from the file)."""
    from reshard.parallel.strategies.rollout import train_model

    model = train_model(path, ranks, layout, inner=inner)
    if model is None:
        return None, None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full(model):
    """Every parameter whole, from its FSDP shards (None on ranks without the model)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _sliced_equal(rollout, full: dict) -> list[str]:
    """Names of rollout tensors (parameters and weight copies) that differ from the sliced oracle
    (converted to the rollout's dtype: bitwise what converting the full tensor gives)."""
    import torch.distributed as dist

    from reshard import Layout
    from reshard.layout import box_slices
    from reshard.parallel.model.weight_sync import rollout_tensors

    bad = []
    for key, t in rollout_tensors(rollout).items():
        box = Layout.of_dtensor(t).box(dist.get_rank())
        want = full[key.split("@")[0]][box_slices(box)].to(t.dtype) if box is not None else None
        if box is not None and not torch.equal(t.to_local(), want):
            bad.append(key)
    return bad


def _ptrs(model):
    from reshard.parallel.model.weight_sync import rollout_tensors

    return {k: t.to_local().data_ptr() for k, t in rollout_tensors(model).items()}


def _colocated_job(path, layout, method, bucket):
    import torch.distributed as dist

    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    world = list(range(dist.get_world_size()))
    train, opt = _trained(path, world)
    rollout = rollout_model(path, layout, world)
    before = _ptrs(rollout)
    opt_state = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)} for k, s in opt.state.items()}
    sync = model_sync(train, rollout, bucket_bytes=bucket, method=method)
    stats = sync.sync(1)
    full = _full(train)
    unchanged = all(torch.equal(v, opt.state[k][n]) for k, s in opt_state.items() for n, v in s.items())
    return dict(
        bad=_sliced_equal(rollout, full),
        same_ptrs=_ptrs(rollout) == before,
        received=stats.bytes_received,
        planned=stats.planned_bytes,
        lower=sync.lower_bound_bytes,
        peak=stats.peak_extra_bytes,
        version=rollout.parallel_info.weight_version.step,
        opt_unchanged=unchanged,
        tokens=_greedy_tokens(rollout),
        reference=_hf_tokens(path, full),
    )


def _greedy_tokens(model):
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams

    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=64))
    reqs = [Request(i, [3 + i, 17, 40 + i], SamplingParams(max_new_tokens=6)) for i in range(3)]
    return [c.output_ids for c in engine.generate(reqs)]


def _hf_tokens(path, full):
    """HF generate on the whole trained weights, single process (the unsharded reference)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.load_state_dict(full)
    out = []
    for i in range(3):
        ids = torch.tensor([[3 + i, 17, 40 + i]])
        gen = ref.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, 3:].tolist())
    return out


@pytest.mark.parametrize("method", ["planned", "full_tensor", "broadcast"])
def test_colocated_fsdp_to_tp_is_exact_in_place_at_the_lower_bound(checkpoints, method):
    results = dist_harness.run(2, _colocated_job, checkpoints["llama"], "tp", method, 4096)
    for r in results:
        assert r["bad"] == [] and r["same_ptrs"] and r["version"] == 1 and r["opt_unchanged"]
        assert r["tokens"] == r["reference"]
    received = sum(r["received"] for r in results)
    if method == "planned":
        assert received == results[0]["planned"] == results[0]["lower"] > 0
        assert max(r["peak"] for r in results) <= 4096  # the staging budget
    else:  # the baselines move more than the lower bound
        assert received == results[0]["planned"] > results[0]["lower"]


def _split_job(path, layout, train_ranks, rollout_ranks):
    import torch.distributed as dist

    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_engine, rollout_model

    train, _ = _trained(path, train_ranks)
    rollout = rollout_model(path, layout, rollout_ranks)
    holds_rollout = dist.get_rank() in rollout_ranks
    sync = model_sync(train, rollout if holds_rollout else None, bucket_bytes=1 << 16)
    stats = sync.sync(3)
    full = _full(train) if train is not None else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, full)
    full = next(f for f in everyone if f is not None)
    out = dict(received=stats.bytes_received, lower=sync.lower_bound_bytes)
    if holds_rollout:
        from reshard.parallel import Request, SamplingParams

        reqs = [Request(i, [5 + i, 9, 11, 2], SamplingParams(max_new_tokens=5)) for i in range(2)]
        engine = rollout_engine(rollout, layout, max_batch_size=2, max_seq_len=32, threshold=4)  # Shift: SP prefill
        out.update(
            bad=_sliced_equal(rollout, full),
            version=rollout.parallel_info.weight_version.step,
            tokens=[c.output_ids for c in engine.generate(reqs)],
        )
        if dist.get_rank() == rollout_ranks[0]:
            out["reference"] = _hf_tokens_prompts(path, full, [r.prompt_ids for r in reqs], 5)
    return out


def _hf_tokens_prompts(path, full, prompts, n):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.load_state_dict(full)
    return [
        ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]


@pytest.mark.parametrize(
    "layout,train_ranks,rollout_ranks",
    [
        ("tp", [0, 1], [2, 3]),  # split: disjoint halves
        ("tp", [0, 1, 2, 3], [2, 3]),  # overlapping
        ("shift", [0, 1, 2, 3], [0, 1, 2, 3]),  # colocated, Shift's full-TP weight copies synced too
        ("shift", [0, 1], [2, 3]),  # split, Shift on the rollout ranks (its copies live there only)
    ],
)
def test_split_and_overlapping_ranks(checkpoints, layout, train_ranks, rollout_ranks):
    results = dist_harness.run(4, _split_job, checkpoints["llama"], layout, train_ranks, rollout_ranks)
    assert sum(r["received"] for r in results) == results[0]["lower"] > 0
    for rank in rollout_ranks:
        assert results[rank]["bad"] == [] and results[rank]["version"] == 3
        assert results[rank]["tokens"] == results[rollout_ranks[0]]["reference"]


def _mismatch_job(train_path, rollout_path, what):
    import torch.distributed as dist

    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    world = list(range(dist.get_world_size()))
    train, _ = _trained(train_path, world)
    rollout = rollout_model(rollout_path, "tp", world)
    model_sync(train, rollout)


def test_a_shape_or_name_mismatch_is_an_error_on_every_rank(checkpoints, tmp_path):
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    wide = make_tiny_checkpoint("llama", tmp_path / "wide", intermediate_size=192)
    with pytest.raises(
        RuntimeError,
        match=r"failed on ranks \[0, 1\][\s\S]*ValueError: parameter "
        r"'model.layers.0.mlp.down_proj.weight': the source holds "
        r"\[64, 128\] torch.float32 but the destination \[64, 192\]",
    ):
        dist_harness.run(2, _mismatch_job, checkpoints["llama"], str(wide), "shape")
    deep = make_tiny_checkpoint("llama", tmp_path / "deep", num_hidden_layers=3)
    with pytest.raises(
        RuntimeError,
        match=r"failed on ranks \[0, 1\][\s\S]*ValueError: 9 source tensors "
        r"are not copied to the destination: \['model.layers.2",
    ):
        dist_harness.run(2, _mismatch_job, str(deep), checkpoints["llama"], "names")


def _async_job(path):
    """Split ranks: the trainers run a forward/backward while the sync runs in the background; the
    rollout side refuses to generate until the sync is applied."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams
    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    train, _opt = _trained(path, [0, 1])
    rollout = rollout_model(path, "tp", [2, 3])
    mine = rollout if dist.get_rank() >= 2 else None
    sync = model_sync(train, mine, bucket_bytes=1 << 14)
    expected = _full(train) if train is not None else None
    handle = sync.start(7)
    out = {}
    if train is not None:  # overlap: the next step's compute (not its optimizer step)
        ids = torch.arange(24).view(2, 12) % train.config.vocab_size
        train(input_ids=ids, labels=ids).loss.backward()
    else:
        engine = Engine(mine, EngineConfig(max_batch_size=2, max_seq_len=32))
        try:
            engine.generate([Request(0, [5, 6], SamplingParams(max_new_tokens=2))])
            out["refused"] = False
        except RuntimeError as e:
            out["refused"] = "half-synced" in str(e)
    stats = handle.wait(timeout=60)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, expected)
    if mine is not None:
        out.update(
            bad=_sliced_equal(mine, everyone[0]),
            version=mine.parallel_info.weight_version.step,
            pending=mine.parallel_info.weight_version.pending,
        )
        out["generated"] = len(
            Engine(mine, EngineConfig(max_batch_size=2, max_seq_len=32)).generate(
                [Request(0, [5, 6], SamplingParams(max_new_tokens=2))]
            )
        )
    out["received"] = stats.bytes_received
    return out


def test_async_sync_overlaps_training_compute_and_versions_the_weights(checkpoints):
    results = dist_harness.run(4, _async_job, checkpoints["llama"])
    for r in results[2:]:
        assert r["refused"] and r["bad"] == [] and r["version"] == 7 and r["pending"] is None
        assert r["generated"] == 1


def _release_job(path):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams
    from reshard.parallel.strategies.rollout import rollout_model

    model = rollout_model(path, "tp", list(range(dist.get_world_size())))
    engine = Engine(model, EngineConfig(max_batch_size=2, max_seq_len=32))
    reqs = [Request(0, [5, 6, 7], SamplingParams(max_new_tokens=4))]
    first = engine.generate(reqs)[0].output_ids
    freed = engine.release_memory()
    released = not engine.kv.allocated
    again = engine.generate(reqs)[0].output_ids
    return freed, released, engine.kv.allocated, first == again


def test_kv_cache_is_released_between_rollouts_and_reacquired(checkpoints):
    for freed, released, reacquired, same in dist_harness.run(2, _release_job, checkpoints["llama"]):
        assert freed > 0 and released and reacquired and same


def _compiled_job(path):
    """A compiled decode step keeps its graph across a sync (storages written in place) and
    decodes with the new weights."""
    import torch._dynamo.utils as dynamo_utils

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams
    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    train, opt = _trained(path, [0])
    rollout = rollout_model(path, "tp", [0])
    engine = Engine(rollout, EngineConfig(max_batch_size=2, max_seq_len=32, compile=True))
    reqs = [Request(i, [5 + i, 9, 11], SamplingParams(max_new_tokens=5)) for i in range(2)]
    model_sync(train, rollout).sync(1)
    first = [c.output_ids for c in engine.generate(reqs)]
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    ids = torch.arange(24).view(2, 12) % train.config.vocab_size
    train(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model_sync(train, rollout).sync(2)
    second = [c.output_ids for c in engine.generate(reqs)]
    full = _full(train)
    return dict(
        first=first,
        second=second,
        graphs=graphs,
        recompiled=dynamo_utils.counters["stats"]["unique_graphs"] - graphs,
        reference=_hf_tokens_prompts(path, full, [r.prompt_ids for r in reqs], 5),
    )


def test_compiled_decode_survives_a_sync(checkpoints):
    [r] = dist_harness.run(1, _compiled_job, checkpoints["llama"], timeout=300)
    assert r["graphs"] > 0 and r["recompiled"] == 0  # compiled once, not again after the sync
    assert r["second"] == r["reference"]
    assert r["first"] != r["second"]  # the new weights are the ones decoding


def _permuted_job():
    """Source Shard(0) on [0, 1], destination Shard(1) on the non-ascending mesh [1, 0]: every
    destination shard is the full tensor sliced by its box (local slicing as the oracle)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from reshard import empty_dtensor
    from reshard.sync import WeightSync

    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    src = distribute_tensor(full, DeviceMesh("cpu", torch.tensor([0, 1])), (Shard(0),), src_data_rank=None)
    dst = empty_dtensor((6, 10), DeviceMesh("cpu", torch.tensor([1, 0])), (Shard(1),), dtype=torch.float32)
    ptr = dst.to_local().data_ptr()
    stats = WeightSync({"w": src}, {"w": dst}).sync(1)
    cols = slice(0, 5) if dist.get_rank() == 1 else slice(5, 10)  # rank 1 is coordinate 0 of [1, 0]
    return torch.equal(dst.to_local(), full[:, cols]), dst.to_local().data_ptr() == ptr, stats.bytes_received


def test_sync_into_a_mesh_of_non_ascending_ranks():
    results = dist_harness.run(2, _permuted_job)
    assert all(same and in_place for same, in_place, _ in results)
    assert sum(r[2] for r in results) == 2 * 3 * 5 * 4  # each rank lacks half of its 6 x 5 box (fp32)


def _partial_destination_job():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from reshard import empty_dtensor
    from reshard.sync import WeightSync

    mesh = DeviceMesh("cpu", torch.tensor([0, 1]))
    src = distribute_tensor(torch.zeros(4, 4), mesh, (Shard(0),), src_data_rank=None)
    dst = empty_dtensor((4, 4), mesh, (Partial(),), dtype=torch.float32)
    try:
        WeightSync({"w": src}, {"w": dst})
    except ValueError as e:
        return str(e)
    return None


def test_a_sync_into_a_partial_destination_is_refused_on_every_rank():
    """A sync writes whole values (and a delta or baseline copy would not divide a Partial(sum)
    destination), so a Partial destination is one clear error on every rank, not a silently
    doubled weight."""
    message = "a weight sync writes whole values; destination 'w' is Partial"
    assert dist_harness.run(2, _partial_destination_job) == [message, message]


def _overlapping_syncs(order: str):
    """A second sync issued while a background one is in flight waits for it: the bytes and
    the version label are the second's, every time (issue 23: once, both ranks ended labelled
    with the first step after the second had returned)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from reshard import empty_dtensor
    from reshard.sync import WeightSync, WeightVersion

    full = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    src = distribute_tensor(full, DeviceMesh("cpu", torch.tensor([0, 1])), (Shard(0),), src_data_rank=None)
    dst = empty_dtensor((64, 256), DeviceMesh("cpu", torch.tensor([0, 1])), (Shard(1),), dtype=torch.float32)
    version = WeightVersion()
    sync = WeightSync({"w": src}, {"w": dst}, version=version)
    outcomes = []
    for trial in range(4):
        first = sync.start(2 * trial + 1)
        if order == "sync":
            sync.sync(2 * trial + 2)
        else:
            sync.start(2 * trial + 2).wait()
        outcomes.append((first.done(), version.step, version.pending))
    return outcomes, torch.equal(dst.full_tensor(), full)


@pytest.mark.parametrize("order", ["sync", "start"])
def test_a_sync_started_while_another_is_in_flight_waits_for_it(order):
    for outcomes, same in dist_harness.run(2, _overlapping_syncs, order):
        assert same and outcomes == [(True, 2 * t + 2, None) for t in range(4)], outcomes


def _verified_job():
    """A sync checked with ``verify``: passes as written; one element flipped in one rank's
    destination shard afterwards is caught, on every rank, naming the tensor and the rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard import empty_dtensor
    from reshard.sync import WeightSync

    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 10, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}
    ranks = DeviceMesh("cpu", torch.tensor([0, 1]))
    src = {
        "w": distribute_tensor(full["w"], ranks, (Shard(0),), src_data_rank=None),
        "b": distribute_tensor(full["b"], ranks, (Replicate(),), src_data_rank=None),
    }
    dst = {
        "w": empty_dtensor((6, 10), DeviceMesh("cpu", torch.tensor([1, 0])), (Shard(1),), dtype=torch.float32),
        "b": empty_dtensor((7,), ranks, (Shard(0),), dtype=torch.bfloat16),
    }
    sync = WeightSync(src, dst)
    sync.sync(1, verify=True)  # nothing raised: what was written is the source
    if dist.get_rank() == 1:
        dst["w"].to_local()[2, 3] += 1.0  # a corrupted destination element
    try:
        sync.verify()
    except RuntimeError as e:
        return str(e)
    return None


def test_verify_catches_a_corrupted_destination_shard_on_every_rank():
    for message in dist_harness.run(2, _verified_job):
        assert message == (
            "weight sync verification failed: 1 destination shard(s) differ from the source: 'w' on rank 1"
        )


def _train_layout_job(path, layout, inner, train_ranks, rollout, rollout_ranks, dtype):
    """A real training layout after an Adam step, synced into a rollout model (``rollout`` =
    (strategy, tp, pp)) in ``dtype``, verified; every rank's shards against the full-tensor oracle."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    train, _ = _trained(path, train_ranks, layout=layout, inner=inner)
    model = rollout_model(path, rollout[0], rollout_ranks, tp=rollout[1], pp=rollout[2], dtype=dtype)
    mine = model if dist.get_rank() in rollout_ranks else None
    sync = model_sync(train, mine)
    stats = sync.sync(1, verify=True)
    full = _full(train) if train is not None else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, full)
    full = everyone[train_ranks[0]]
    placements = {str(p.placements) for p in train.parameters() if isinstance(p, DTensor)} if train else set()
    out = {"placements": placements, "received": stats.bytes_received, "lower": sync.lower_bound_bytes}
    if mine is not None:
        out.update(bad=_sliced_equal(mine, full), version=mine.parallel_info.weight_version.step)
        if dtype is None and dist.get_rank() == rollout_ranks[0]:
            out.update(tokens=_greedy_tokens(mine), reference=_hf_tokens(path, full))
        elif dtype is None:
            _greedy_tokens(mine)  # the engine is collective over the rollout ranks
    return out


@pytest.mark.parametrize(
    "world,layout,inner,train_ranks,rollout,rollout_ranks,dtype,placement",
    [
        # torchtitan's 2-D FSDP x TP (2 x 2): q/k/v/gate/up are (_StridedShard(0, sf=2), Shard(0))
        (4, "fsdp_tp", 2, [0, 1, 2, 3], ("tp", 4, 1), [0, 1, 2, 3], None, "_StridedShard(dim=0, sf=2), Shard(dim=0)"),
        (4, "fsdp_tp", 2, [0, 1, 2, 3], ("shift", None, 1), [0, 1, 2, 3], torch.bfloat16, "Shard(dim=0), Shard(dim=1)"),
        # HSDP 2 x 2 (Replicate x Shard) -> TP2 on two other ranks, fp32 -> bf16 on the way (6 ranks)
        (6, "hsdp", 2, [0, 1, 2, 3], ("tp", 2, 1), [4, 5], torch.bfloat16, "Replicate(), Shard(dim=0)"),
        # HSDP 2 x 2 -> two pipeline stages of TP2 on the same ranks
        (4, "hsdp", 2, [0, 1, 2, 3], ("tp", 2, 2), [0, 1, 2, 3], None, "Replicate(), Shard(dim=0)"),
    ],
    ids=["fsdp_tp-tp4", "fsdp_tp-shift-bf16", "hsdp-split-tp2-bf16", "hsdp2x2-pp2xtp2"],
)
def test_sync_from_real_training_layouts_is_bitwise(
    checkpoints, world, layout, inner, train_ranks, rollout, rollout_ranks, dtype, placement
):
    results = dist_harness.run(
        world, _train_layout_job, checkpoints["llama"], layout, inner, train_ranks, rollout, rollout_ranks, dtype
    )
    assert any(placement in p for p in results[train_ranks[0]]["placements"]), results[train_ranks[0]]["placements"]
    for r in rollout_ranks:
        assert results[r]["bad"] == [] and results[r]["version"] == 1, (r, results[r])
    assert sum(r["received"] for r in results) == results[0]["lower"]  # the lower bound, bf16 bytes when converting
    first = results[rollout_ranks[0]]
    if dtype is None:  # fp32 rollout: greedy tokens equal HF generate on the full trained weights
        assert first["tokens"] == first["reference"] and len(first["tokens"]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_checksum_adds_up_over_boxes_and_changes_with_any_element_or_swap(dtype):
    """What ``verify`` relies on: the checksum of a box is the sum of its pieces' (sent from
    different ranks), and one changed element or two swapped rows change it (float64 values
    converted from float32 have all-zero low bits: the 64-bit arithmetic still sees them)."""
    from reshard.sync import _checksum, _checksum_mask

    x = (torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    whole = ((0, 64), (0, 48))
    pieces = [((0, 20), (0, 48)), ((20, 64), (0, 10)), ((20, 64), (10, 48))]
    total = _checksum(x, whole, whole)
    assert total == sum(_checksum(x, whole, p) for p in pieces) & _checksum_mask(dtype)
    changed, swapped = x.clone(), x.clone()
    changed[3, 5] = x[3, 6]
    swapped[[1, 2]] = x[[2, 1]]
    assert _checksum(changed, whole, whole) != total and _checksum(swapped, whole, whole) != total


def _delta_recovery_job():
    """Delta syncs of a matrix and a 0-d scalar: a corrupted destination element found by
    ``verify`` is repaired by the next sync (every rank drops its delta cache: dense), and a
    scalar that does not change still syncs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    from reshard import empty_dtensor, slice_to_dtensor
    from reshard.sync import WeightSync

    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(8, 6, generator=g), "s": torch.tensor(3.0)}
    ranks = DeviceMesh("cpu", torch.tensor([0, 1]))
    src = {"w": slice_to_dtensor(full["w"], ranks, (Shard(0),)), "s": full["s"].clone()}
    dst = {
        "w": empty_dtensor((8, 6), DeviceMesh("cpu", torch.tensor([1, 0])), (Shard(1),), dtype=torch.bfloat16),
        "s": empty_dtensor((), ranks, (Replicate(),), dtype=torch.bfloat16),
    }
    sync = WeightSync(src, dst, delta=True)
    out = {"dense": sync.sync(1, verify=True).bytes_received}
    src["w"].to_local()[0, 0] += 1.0  # one element changes: the next sync sends a delta
    out["delta"] = sync.sync(2, verify=True).bytes_received
    if dist.get_rank() == 1:
        dst["w"].to_local()[2, 1] += 1.0  # corrupted behind the sync's back
    try:
        sync.verify()
        out["caught"] = False
    except RuntimeError:
        out["caught"] = True
    out["repaired"] = sync.sync(3, verify=True).bytes_received  # dense again: verify passes
    out["scalar"] = float(dst["s"].to_local())
    return out


def test_delta_sync_recovers_from_a_corrupted_destination_and_syncs_scalars():
    for r in dist_harness.run(2, _delta_recovery_job):
        assert r["caught"] and r["scalar"] == 3.0, r
        assert r["delta"] < r["dense"] and r["repaired"] >= r["dense"] - 16, r  # dense (headers aside)
