"""Bad input gives a ValueError that names the offending values."""

import re

import pytest

from tests import dist_harness


def _parallelize(path, **dims):
    from reshard.parallel import ParallelDims, parallelize

    dims = ParallelDims.from_world(**dims) if dims else None
    parallelize(path, dims)


def _long_prompt(path):
    from reshard.parallel import Engine, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), max_seq_len=32)
    engine.generate([Request(7, list(range(3, 30)), SamplingParams(max_new_tokens=10))])


@pytest.mark.parametrize(
    "heads,kv,match",
    [
        (6, 2, r"Number of attention heads \(6\) must be divisible by tensor parallel size \(4\)"),
        (4, 3, r"attention heads \(4\) must be a multiple of KV heads \(3\)"),
    ],
)
def test_heads_not_divisible(tmp_path, heads, kv, match):
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        "llama", tmp_path / "m", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=96
    )
    with pytest.raises(RuntimeError, match=match):
        dist_harness.run(4, _parallelize, str(path))


def test_kv_heads_and_tp_divide_neither_way():
    from reshard.layers import check_head_split

    with pytest.raises(ValueError, match=r"KV heads \(3\) and tensor parallel size \(2\) divide neither way"):
        check_head_split(6, 3, 2)
    check_head_split(8, 2, 4)  # replication helps: no error


def test_world_size_not_matching_mesh(checkpoints):
    from reshard.parallel import ParallelDims

    with pytest.raises(ValueError, match=r"dp\(1\) \* pp\(1\) \* sp\(1\) \* tp\(4\) = 4 != world_size\(2\)"):
        ParallelDims(tp=4, world_size=2)
    with pytest.raises(RuntimeError, match=r"= 4 != world_size\(2\)"):
        dist_harness.run(2, _parallelize, checkpoints["llama"], tp=4)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from reshard.parallel import ParallelDims, parallelize

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*supported: llama, mistral, qwen2, qwen3"
    ):
        parallelize(str(tmp_path), ParallelDims(world_size=1))


def test_prompt_longer_than_max(checkpoints):
    with pytest.raises(
        RuntimeError, match=r"request 7: prompt length \(27\) \+ max_new_tokens \(10\) = 37 exceeds max_seq_len \(32\)"
    ):
        dist_harness.run(1, _long_prompt, checkpoints["llama"])


def test_not_a_checkpoint(tmp_path):
    from reshard.parallel import CheckpointReader

    with pytest.raises(ValueError, match=re.escape("no model.safetensors or model.safetensors.index.json")):
        CheckpointReader(tmp_path)


def _bad_requests(path, case):
    from reshard.parallel import Engine, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), max_seq_len=64)
    p = SamplingParams(max_new_tokens=2)
    requests = {
        "duplicate": [Request(3, [5, 6], p), Request(4, [7], p), Request(3, [8], p)],
        "bool": [Request(0, [5, True, 6], p)],
        "float": [Request(1, [5, 6.0], p)],
    }[case]
    engine.generate(requests)


@pytest.mark.parametrize(
    "case,match",
    [
        ("duplicate", r"request id 3 appears more than once"),
        ("bool", r"request 0: token ids must be ints, got \[True\]"),
        ("float", r"request 1: token ids must be ints, got \[6.0\]"),
    ],
)
def test_bad_requests_name_the_request(checkpoints, case, match):
    with pytest.raises(RuntimeError, match=match):
        dist_harness.run(1, _bad_requests, checkpoints["llama"], case)


@pytest.mark.parametrize(
    "text,match",
    [
        ('[1, 2]\n{"prompt_ids": [3, 4\n', r"prompts.jsonl:2: invalid JSON \(Expecting"),
        ("[1, true, 2]\n", r"prompts.jsonl:1: expected a non-empty token-id list or a text"),
        ('{"prompt_ids": [1], "arrival": -2}\n', r"prompts.jsonl:1: arrival must be a number of seconds >= 0, got -2"),
        ('[1]\n{"text": "hi", "arrival": "soon"}\n', r"prompts.jsonl:2: arrival must be .* got 'soon'"),
    ],
)
def test_prompts_file_errors_name_file_and_line(tmp_path, text, match):
    from reshard.recipes.generate import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_prompts(path, tmp_path)
