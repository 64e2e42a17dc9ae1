"""Bad input gives a ValueError that names the offending values."""

import functools
import json
import os
import re
import subprocess
import sys
import weakref

import pytest

from tests import dist_harness


def _parallelize(path, **dims):
    from reshard.parallel import ParallelDims, parallelize

    dims = ParallelDims.from_world(**dims) if dims else None
    parallelize(path, dims)


def _long_prompt(path):
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_seq_len=32))
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
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_seq_len=64))
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


def test_a_request_arriving_at_a_clocks_time_is_refused_not_waited_for():
    import time

    from reshard.parallel import Request

    now = time.time()
    with pytest.raises(ValueError, match=f"^request 3: arrival is seconds after the start, got {now}"):
        Request(3, [5], arrival=now)
    assert Request(3, [5], arrival=7200.0).arrival == 7200.0  # (a trace two hours long)


@pytest.mark.parametrize(
    "ids,got",
    [(b"Hi", "bytes b'Hi'"), ("Hi", "str 'Hi'"), ((5, 6), r"tuple \(5, 6\)"), ("tensor", r"Tensor tensor\(\[5, 6\]\)")],
)
def test_a_request_whose_prompt_ids_are_not_a_list_is_refused_naming_them(ids, got):
    """A text's bytes (iterated, ints: read as token ids before), a tuple or a tensor."""
    import torch

    from reshard.parallel import Request

    with pytest.raises(ValueError, match=f"^request 7: prompt_ids must be a list of ints, got {got}$"):
        Request(7, torch.tensor([5, 6]) if ids == "tensor" else ids)


@pytest.mark.parametrize(
    "text,match",
    [
        ('[1, 2]\n{"prompt_ids": [3, 4\n', r"prompts.jsonl:2: invalid JSON \(Expecting"),
        ("[1, true, 2]\n", r"prompts.jsonl:1: expected a non-empty token-id list, a text or chat messages"),
        ('{"prompt_ids": [1], "arrival": -2}\n', r"prompts.jsonl:1: arrival must be a number of seconds >= 0, got -2"),
        ('[1]\n{"text": "hi", "arrival": "soon"}\n', r"prompts.jsonl:2: arrival must be .* got 'soon'"),
        # a clock's time, not an offset: the run slept until then (years)
        (
            '{"prompt_ids": [1], "arrival": 1764700000.5}\n',
            r"prompts.jsonl:1: arrival is seconds after the start, got 1764700000.5 \(a wall-clock time\?\)$",
        ),
        # two prompts in one object: one of them was ignored, silently
        (
            '{"prompt_ids": [1], "text": "hi"}\n',
            r"prompts.jsonl:1: an object names its prompt by one of \[.*got keys \['prompt_ids', 'text'\]$",
        ),
        ('[1]\n{"textt": "hi"}\n', r"prompts.jsonl:2: an object names its prompt by one of \[.*got keys \['textt'\]$"),
    ],
)
def test_prompts_file_errors_name_file_and_line(tmp_path, text, match):
    from reshard.recipes.prompts import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_prompts(path, tmp_path)


def test_a_prompts_file_takes_vllms_and_trls_keys_as_its_own(tmp_path):
    """``{"prompt_token_ids": ...}`` as ``{"prompt_ids": ...}``; ``{"prompt": text}`` as ``{"text": ...}``
    and ``{"prompt": [messages]}`` (TRL's conversational prompt) as ``{"messages": ...}``."""
    from reshard.parallel.model.tiny_models import builtin_checkpoint
    from reshard.recipes.prompts import read_prompts

    chat = [{"role": "user", "content": "hi there"}]
    lines = [{"prompt_token_ids": [3, 4]}, {"prompt_ids": [3, 4]}, {"prompt": "hi there"}, {"text": "hi there"}]
    lines += [{"prompt": chat}, {"messages": chat}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ids, _ = read_prompts(path, builtin_checkpoint())
    assert ids[0] == ids[1] == [3, 4] and ids[2] == ids[3] and ids[4] == ids[5] and ids[2] != ids[4]


# ---- inputs a user's battery found accepted silently: each refused in one line naming key and value ----
def _compose(name, overrides):
    from reshard.recipes.schema import compose

    return compose(name, overrides)


@pytest.mark.parametrize(
    "recipe,overrides,match",
    [
        ("generate", ["parallel=sidp", "compile=true"], r"^compile=true is not supported by parallel=sidp"),
        (
            "generate",
            ["parallel=dejavu", "compile=true"],
            r"^parallel=dejavu runs contiguous, eager KV caches on the device; got engine.kv_block_size=None, "
            r"compile=True and kv_swap=False",
        ),
        (
            "generate",
            ["parallel=dejavu", "engine.kv_swap=true", "engine.num_microbatches=2"],
            r"^parallel=dejavu runs contiguous, eager KV caches on the device; got engine.kv_block_size=None, "
            r"compile=False and kv_swap=True",
        ),
        (
            "generate",
            ["fault.migrate=reprefill", "fault.heartbeat_s=0.001"],
            r"^fault.heartbeat_s must be >= 0.1 s .* got 0.001$",
        ),
        (
            "generate",
            ["workload.prompts_file=p.jsonl", "workload.num_requests=100"],
            r"^workload.num_requests=100 shapes the synthetic workload; with workload.prompts_file=p.jsonl",
        ),
        (
            "generate",
            ["workload.prompts_file=p.jsonl", "workload.prompt_len_max=64"],
            r"^workload.prompt_len_max=64 shapes the synthetic workload",
        ),
        (
            "rollout",
            ["rollout.train_ranks=2"],
            r"^rollout.train_ranks=2 splits the ranks .* rollout.colocated=true trains and rolls out on every rank",
        ),
    ],
)
def test_inputs_once_ignored_are_refused_by_name(recipe, overrides, match):
    with pytest.raises(ValueError, match=match):
        _compose(recipe, overrides)


def test_a_kill_outside_the_world_is_refused_before_anything_loads():
    from reshard.recipes.config import FaultConfig

    FaultConfig(kill_at=[1, 3]).check_world(2)
    with pytest.raises(ValueError, match=r"^fault.kill_at \[5, 3\] names rank 5, outside the job's 2 ranks \(0..1\)$"):
        FaultConfig(kill_at=[5, 3]).check_world(2)
    with pytest.raises(ValueError, match=r"fault.kill_at \[2, 9\] names rank 2"):  # the second attempt's kill
        FaultConfig(kill_at=[[0, 4], [2, 9]]).check_world(2)


def test_the_job_refuses_a_kill_outside_the_world(tmp_path):
    from tests.test_recipe import _run_recipe

    with pytest.raises(RuntimeError, match=r"fault.kill_at \[5, 3\] names rank 5, outside the job's 1 ranks"):
        dist_harness.run(1, _run_recipe, ["fault.kill_at=[5,3]", "progress=false"], str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before any output


def test_a_prompts_file_is_checked_against_max_seq_len_by_its_own_prompts(tmp_path):
    """engine.max_seq_len is checked against the file's longest prompt (not workload.prompt_len_max,
    which does not apply), naming the file and the request."""
    from reshard.recipes.prompts import build_requests

    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2, 3]\n" + json.dumps(list(range(40))) + "\n")
    cfg = _compose("generate", [f"workload.prompts_file={path}", "engine.max_seq_len=64"])  # 128 + 32 > 64: fine
    with pytest.raises(
        ValueError, match=r"prompts.jsonl: the prompt of request 1 \(40 tokens\) \+ generation.max_new_"
    ):
        build_requests(cfg, tmp_path, 256)
    path.write_text("[1, 2, 3]\n" + json.dumps(list(range(30))) + "\n\n")  # 30 + 32 <= 64; a blank end is fine
    assert [len(r.prompt_ids) for r in build_requests(cfg, tmp_path, 256)] == [3, 30]


@pytest.mark.parametrize(
    "data,match",
    [
        (b"[1, 2]\n\n[3]\n", r"prompts.jsonl:2: blank line \(one prompt per line; only the end may be blank\)"),
        (b'"caf\xe9"\n', r"workload.prompts_file '.*prompts.jsonl' is not UTF-8 text \(byte 4: invalid"),
    ],
)
def test_prompts_files_with_blank_lines_or_other_encodings_are_refused(tmp_path, data, match):
    from reshard.recipes.prompts import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        read_prompts(path, tmp_path)


def test_sidp_look_ahead_and_slots_beyond_the_layers_to_fetch_are_refused():
    from reshard.parallel.strategies.sidp.fetch import check_slots

    check_slots(2, 2, prefetch_depth=2, peak_shifting=True, layers=4)  # 2 owned, 2 fetched per rank
    with pytest.raises(
        ValueError,
        match=r"^parallel.prefetch_depth \(10\) exceeds the FFN layers a rank fetches \(2: 4 layers, 2 owned",
    ):
        check_slots(10, 2, prefetch_depth=10, peak_shifting=True, layers=4)
    with pytest.raises(ValueError, match=r"^parallel.slots \(3\) exceeds the FFN layers a rank fetches \(2"):
        check_slots(3, 2, prefetch_depth=2, peak_shifting=True, layers=4)


def test_plan_refuses_moe_configs_of_unknown_families_by_name_and_configs_that_are_not_json(tmp_path):
    from reshard.recipes.plan import make_plan

    phimoe = dict(
        model_type="phimoe", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    untyped = {k: v for k, v in phimoe.items() if k != "model_type"}
    supported = r"\['llama4_text', 'mixtral', 'qwen2_moe', 'qwen3_moe'\]"
    for folder, config, family in (("phimoe", phimoe, "'phimoe'"), ("untyped", untyped, "None")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
        refused = (
            rf"^config.json of '.*{folder}' is a Mixture-of-Experts model \(num_local_experts=8\); the cost model "
            rf"has MoE profiles for model_type in {supported}, and this config's model_type is {family}$"
        )
        with pytest.raises(ValueError, match=refused):
            make_plan(_compose("plan", [f"model={tmp_path / folder}"]))
    bad = tmp_path / "broken.json"
    bad.write_text("{'hidden_size': 4096}")
    with pytest.raises(ValueError, match=r"^model '.*broken.json': .*broken.json is not a JSON config \(Expecting"):
        make_plan(_compose("plan", [f"model={bad}"]))


def test_seesaws_default_names_the_null_degree_that_cannot_split_the_heads(checkpoints):
    from reshard.parallel.strategies.seesaw.strategy import SeesawStrategy

    strategy = SeesawStrategy()
    with pytest.raises(
        ValueError,
        match=r"^parallel.decode.tp is null, so the rest of the 3 ranks: 3; Number of attention heads \(4\) must be "
        r"divisible by tensor parallel size \(3\)\. \(set parallel.decode.tp\)$",
    ):
        strategy._check_heads(checkpoints["llama"], strategy.layouts(3))


# ---- a refusal on every rank ends each process with status 1 and the error last (issue 35) --------
_DISAGREEING_SCRIPT = """
import datetime

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from reshard import redistribute, slice_to_dtensor
from reshard.mesh import cached_mesh

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
mesh = cached_mesh(torch.arange(2), ("x",))
t = slice_to_dtensor(torch.arange(16.0).view(4, 4), mesh, (Shard(0),))
redistribute(t, mesh, (Shard(1),) if dist.get_rank() == 1 else (Replicate(),))  # rank 1 asks for another layout
dist.barrier()  # never reached: the ValueError leaves the script, the process group never destroyed
"""


def test_a_refusal_on_every_rank_exits_with_status_1_and_the_error_last(tmp_path):
    """Two real processes (what torchrun starts) let the ValueError leave the script: each exits
    with status 1, its stderr ends with the error, and nothing aborts at exit (no SIGABRT,
    no "terminate called without an active exception")."""
    script = tmp_path / "disagree.py"
    script.write_text(_DISAGREEING_SCRIPT)
    port = str(dist_harness._free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", OMP_NUM_THREADS="1")
        env.update(RANK=str(rank), LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(script)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        stderrs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, err) in enumerate(zip(procs, stderrs)):
        assert "terminate called" not in err, f"rank {rank}:\n{err}"
        assert p.returncode == 1, f"rank {rank} exited with {p.returncode}:\n{err}"
        lines = [line.removeprefix(f"[rank{rank}]: ") for line in err.rstrip().splitlines()]  # torch's prefix
        assert lines[-1].startswith("ValueError: ranks called the move with different arguments (rank 0 vs rank 1"), err
        assert "Traceback (most recent call last):" in lines, err


def _tensors_held_after_refusals(tries):
    """For each of ``tries`` refused moves: how many of the tensors its all-gathers exchanged were
    still alive (held by the backend's thread) when the ValueError reached the caller, of how many."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import Replicate, Shard

    from reshard import redistribute, slice_to_dtensor
    from reshard.mesh import cached_mesh

    mesh = cached_mesh(torch.arange(2), ("x",))
    t = slice_to_dtensor(torch.arange(16.0).view(4, 4), mesh, (Shard(0),))
    target = (Shard(1),) if dist.get_rank() == 1 else (Replicate(),)
    exchanged: list = []
    original = distributed_c10d.all_gather

    @functools.wraps(original)
    def recording(tensor_list, tensor, *args, **kwargs):  # weak references: they keep nothing alive
        exchanged.extend(weakref.ref(x) for x in (*tensor_list, tensor))
        return original(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = distributed_c10d.all_gather = recording  # one object under both names
    held = []
    try:
        for _ in range(tries):
            exchanged.clear()
            try:
                redistribute(t, mesh, target)
            except ValueError:  # counted at once: code that releases the GIL first (pytest.raises) hides it
                held.append((sum(r() is not None for r in exchanged), len(exchanged)))
    finally:
        dist.all_gather = distributed_c10d.all_gather = original
    return held


def test_a_refusal_leaves_no_tensor_in_the_backend():
    """The cause of the abort: gloo's worker thread drops a collective's tensors after ``wait()``
    returns, and dropping one takes the GIL; an interpreter that finalizes first ends that thread
    inside a C++ destructor (SIGABRT). The refusal returns only once every tensor it exchanged is
    gone (before the fix, 3 or 6 of the 9 were still held on every try)."""
    for rank, held in enumerate(dist_harness.run(2, _tensors_held_after_refusals, 5)):
        assert len(held) == 5 and all(total > 0 for _, total in held), held  # refused, the exchanges seen
        assert [alive for alive, _ in held] == [0] * 5, f"rank {rank}: {held}"


def _different_requests(path):
    """A TP2 engine whose rank 1 passes (a) one prompt token changed, (b) one request fewer, then
    (c) the same list; then DP2 engine groups given (a), then (c): the refusals each rank raises,
    and the tokens of each (c)."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path, ParallelDims.from_world(tp=dist.get_world_size())), EngineConfig(max_seq_len=64))
    prompts = [[5, 9, 11, 2, 7], [40, 41, 42], [3, 4]]
    mine = [list(p) for p in prompts]
    if dist.get_rank() == 1:
        mine[1][2] = 43  # same shapes: without the check, rank 1 would get rank 0's completion for it

    def requests(lists):
        return [Request(i, p, SamplingParams(max_new_tokens=3)) for i, p in enumerate(lists)]

    errors = []
    for attempt in (requests(mine), requests(prompts)[: 3 - dist.get_rank()]):
        try:
            engine.generate(attempt)
        except ValueError as e:
            errors.append(str(e))
    same = engine.generate(requests(prompts))
    groups = Engine(parallelize(path, ParallelDims.from_world(dp=2)), EngineConfig(max_seq_len=64))  # engine groups
    try:
        groups.generate(requests(mine))
    except ValueError as e:
        errors.append(str(e))
    return errors, [c.output_ids for c in same], [c.output_ids for c in groups.generate(requests(prompts))]


def test_ranks_passing_different_requests_get_one_clear_error(checkpoints, hf_reference):
    """Ranks that run one engine, or one job of engine groups, but pass different request lists
    (a prompt token, or a count) each raise a ValueError naming the request or the counts; the
    engine serves the next call."""
    path = checkpoints["llama"]
    results = dist_harness.run(2, _different_requests, path)
    expected = hf_reference(path, [[5, 9, 11, 2, 7], [40, 41, 42], [3, 4]], 3)
    for errors, tokens, grouped in results:
        assert len(errors) == 3, errors
        for error in errors[0], errors[2]:  # one engine over both ranks; two engine groups (a router)
            assert error.startswith("ranks passed different requests to generate: request 1 (id 1 on rank ")
            assert "differs between rank 0 and rank 1" in error
        assert errors[1].startswith("ranks passed different requests to generate: rank 0 passed 3, rank 1 passed 2")
        assert tokens == expected and grouped == expected
