"""Sharded checkpoint loading: bytes read per rank, hub-id resolution, broken files."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests import dist_harness


def _bytes_read(path):
    from reshard.parallel import parallelize

    stats = parallelize(path).parallel_info.load_stats
    return stats.bytes_read, stats.checkpoint_bytes


def _attached(path):
    """Attributes ``parallelize`` / ``parallelize_shift`` add to the HF model, and their records."""
    import dataclasses

    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.parallel import ParallelDims, ParallelInfo, parallelize
    from reshard.parallel.strategies.shift import parallelize_shift

    with torch.device("meta"):
        plain = set(vars(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))))
    world = dist.get_world_size()
    out = []
    for model in (parallelize(path), parallelize_shift(path, ParallelDims(sp=world, world_size=world))):
        info = model.parallel_info
        assert isinstance(info, ParallelInfo)
        fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "dims"}
        out.append((set(vars(model)) - plain, info.dims.shape, fields))
    return out


def test_parallelize_attaches_one_record(checkpoints):
    for (tp_new, tp_shape, tp_info), (shift_new, shift_shape, shift_info) in dist_harness.run(
        2, _attached, checkpoints["llama"]
    ):
        assert tp_new == shift_new == {"parallel_info"}  # nothing else is stapled on the model
        assert tp_shape == (1, 1, 1, 2) and shift_shape == (1, 1, 2, 1)  # (dp, pp, sp, tp)
        assert tp_info["load_stats"].bytes_read > 0 and tp_info["extra_weight_bytes"] == 0
        assert shift_info["load_stats"].bytes_read > 0 and shift_info["extra_weight_bytes"] > 0
        assert tp_info["kv_replication"] is None and shift_info["kv_replication"] >= 1
        for info in (tp_info, shift_info):
            assert info["weight_version"].step is None and info["weight_version"].pending is None
            assert info["replicated_ffn_bytes"] is None and info["kv_tokens_asked"] is None


def test_parallel_info_of_a_plain_model_is_refused():
    from torch import nn

    from reshard.parallel import parallel_info

    with pytest.raises(ValueError, match=r"^Linear has no parallel_info \(got NoneType\): build it with"):
        parallel_info(nn.Linear(2, 2))


def _expected_share(path: str, tp: int) -> int:
    """Independent oracle: bytes one rank must read under the TP plan (replicated tensors in full)."""
    config = json.loads((Path(path) / "config.json").read_text())
    n_kv = config["num_key_value_heads"]
    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shape = f.get_slice(name).get_shape()
                numel = 1
                for s in shape:
                    numel *= s
                if "norm" in name:
                    share = 1
                elif "k_proj" in name or "v_proj" in name:
                    share = min(tp, n_kv)  # KV heads replicated when tp > n_kv
                else:
                    share = tp
                total += numel * 4 // share
    return total


@pytest.mark.parametrize("world,family", [(2, "llama"), (4, "llama"), (4, "mistral"), (2, "llama-multi")])
def test_each_rank_reads_only_its_share(checkpoints, world, family):
    path = checkpoints[family]
    results = dist_harness.run(world, _bytes_read, path)
    expected = _expected_share(path, world)
    checkpoint_bytes = results[0][1]
    for read, _ in results:
        assert read == expected
        assert read < checkpoint_bytes / world * 1.35  # only norms (and replicated KV) beyond 1/world


def test_hub_id_resolves_offline_from_cache(checkpoints, tmp_path, monkeypatch):
    from reshard.parallel import resolve_checkpoint

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
    shutil.copytree(checkpoints["llama"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert resolve_checkpoint("tiny-org/tiny-llama").resolve() == snapshot.resolve()
    with pytest.raises(ValueError, match="tiny-org/absent"):
        resolve_checkpoint("tiny-org/absent")


def test_missing_shard_file_is_named(checkpoints, tmp_path):
    from reshard.parallel import CheckpointReader

    copy = Path(shutil.copytree(checkpoints["llama-multi"], tmp_path / "ck"))
    victim = sorted(copy.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        CheckpointReader(copy)


def test_truncated_file_is_named(checkpoints, tmp_path):
    from reshard.parallel import CheckpointReader

    copy = Path(shutil.copytree(checkpoints["llama"], tmp_path / "ck"))
    f = copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=re.escape("model.safetensors is truncated")):
        CheckpointReader(copy)


def test_reader_reads_only_the_box(checkpoints):
    from reshard.parallel import CheckpointReader

    reader = CheckpointReader(checkpoints["llama"])
    piece = reader.read("model.embed_tokens.weight", ((10, 20), (0, 64)))
    with safe_open(str(Path(checkpoints["llama"]) / "model.safetensors"), framework="pt") as f:
        full = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(piece, full[10:20])
    assert reader.bytes_read == 10 * 64 * 4


def _load(path, allow_unused=False):
    from reshard.parallel import parallelize

    parallelize(path, allow_unused=allow_unused)
    return "loaded"


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_config_disagreeing_with_the_weights_is_refused(checkpoints, tmp_path):
    """Half the hidden size in config.json: HF says "size mismatch"; so do we, before any read."""
    path = _edit_config(Path(checkpoints["llama"]), tmp_path / "half", hidden_size=32)
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint tensor 'model.embed_tokens.weight' in .*model.safetensors "
        r"is \[256, 64\] torch.float32 but parameter 'model.embed_tokens.weight' "
        r"is \[256, 32\] torch.float32",
    ):
        dist_harness.run(1, _load, path)


def test_vocab_larger_than_the_weights_is_refused(checkpoints, tmp_path):
    """vocab_size above the embedding's rows: named with both shapes (was a RuntimeError about size 0)."""
    path = _edit_config(Path(checkpoints["llama"]), tmp_path / "vocab", vocab_size=512)
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint tensor 'model.embed_tokens.weight' in .*model.safetensors "
        r"is \[256, 64\] torch.float32 but parameter 'model.embed_tokens.weight' "
        r"is \[512, 64\] torch.float32",
    ):
        dist_harness.run(1, _load, path)


def test_unused_checkpoint_tensors_are_an_error_unless_allowed(checkpoints, tmp_path):
    path = _edit_config(Path(checkpoints["llama"]), tmp_path / "one-layer", num_hidden_layers=1)
    with pytest.raises(
        RuntimeError,
        match=r"9 tensors in the checkpoint at .* are not used by the model built "
        r"from its config.json: \['model.layers.1.input_layernorm.weight'",
    ):
        dist_harness.run(1, _load, path)
    assert dist_harness.run(1, _load, path, True) == ["loaded"]


def test_index_pointing_to_the_wrong_file_names_file_and_index(checkpoints, tmp_path):
    import shutil

    src = Path(checkpoints["llama-multi"])
    shutil.copytree(src, tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    wrong = next(f for f in files if f != index["weight_map"]["lm_head.weight"])
    index["weight_map"]["lm_head.weight"] = wrong
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        RuntimeError,
        match=rf"tensor 'lm_head.weight' is listed for .*{wrong} but that file "
        r"does not contain it \(index .*model.safetensors.index.json\)",
    ):
        dist_harness.run(1, _load, str(tmp_path / "m"))


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    import struct

    from reshard.parallel import CheckpointReader

    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 12) + bytes(range(200, 212)) + b"\x00" * 64)
    with pytest.raises(
        ValueError, match=r"model.safetensors is not a safetensors file \(its header is not a JSON object\)"
    ):
        CheckpointReader(tmp_path)


def test_the_librarys_own_saves_and_loads_show_no_transformers_bars(tmp_path, capfd):
    """Making a tiny checkpoint and the rollout trainer's load print none of transformers' progress
    bars (one per rank: a second voice in a job's output), and leave its bars as they were."""
    from transformers.utils import logging as hf_logging

    from reshard.parallel.model.tiny_models import make_tiny_checkpoint
    from reshard.parallel.strategies.rollout import _load_train

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        path = make_tiny_checkpoint("llama", tmp_path / "sharded", seed=0, max_shard_size="40KB")
        assert len(list(path.glob("*.safetensors"))) > 1  # (transformers' writer bar counts shards)
        _load_train(path)
        err = capfd.readouterr().err
        assert "Writing model shards" not in err and "Loading weights" not in err, err
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_a_config_key_is_read_from_the_file_and_asked_of_autoconfig_only_where_the_file_lacks_it(
    checkpoints, tmp_path, monkeypatch
):
    """``config_value``: what the supervisor and the server read (model type, vocabulary, context)
    equals ``AutoConfig``'s, read without it; a key the file lacks is ``AutoConfig``'s default."""
    import transformers

    from reshard.parallel.model.checkpoint import config_value

    keys = ("model_type", "vocab_size", "max_position_embeddings")
    expected = {f: transformers.AutoConfig.from_pretrained(p) for f, p in checkpoints.items()}
    asked = []
    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path: asked.append(path) or real(path))
    for family, path in checkpoints.items():
        assert {k: config_value(path, k) for k in keys} == {k: getattr(expected[family], k) for k in keys}
    assert asked == []  # every key was in the file
    shutil.copytree(checkpoints["llama"], tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    default = transformers.LlamaConfig().max_position_embeddings
    assert config_value(tmp_path / "llama", "max_position_embeddings") == default != 0
    assert asked == [tmp_path / "llama"]
