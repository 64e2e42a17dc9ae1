"""recipes.rollout: the GRPO loop learns, syncs at the lower bound, and the baselines give the
same weights and tokens bit for bit; its config rejects bad values by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dist_harness


def _compose(overrides):
    from reshard.recipes.schema import compose

    return compose("rollout", overrides)


def test_default_run_learns_and_syncs_at_the_lower_bound(tmp_path):
    """The no-argument job on 4 ranks: reward of the last 5 iterations >= first 5 + 0.3."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "reshard.recipes.rollout",
        "hydra.run.dir=" + str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == summary["iterations"] == 30
    assert summary["reward_last5"] >= summary["reward_first5"] + 0.3, summary
    assert all(m["sync_bytes"] == m["lower_bound_bytes"] > 0 for m in metrics)
    assert all(m["peak_mib"]["train"] > 0 and m["peak_mib"]["rollout"] > m["peak_mib"]["train"] for m in metrics[1:])
    assert (tmp_path / "run" / "rollout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run(overrides, run_dir):
    import torch.distributed as dist

    from reshard.recipes.rollout import run_rollout

    run_rollout(_compose(overrides), Path(run_dir))
    if dist.get_rank() == 0:
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("placement", [["rollout.colocated=false", "rollout.layout=shift"], ["rollout.tp=2"]])
def test_baselines_give_bitwise_identical_weights_and_tokens(tmp_path, placement):
    """Split ranks (train on 2, Shift on the other 2) and colocated TP2 x DP2: ours vs the
    full-tensor and gather+broadcast baselines, iteration by iteration."""
    runs = {}
    for method in ("planned", "full_tensor", "broadcast"):
        overrides = ["train.iterations=3", "progress=false", f"sync.method={method}", *placement]
        runs[method] = dist_harness.run(4, _run, overrides, str(tmp_path / method))[0]
    digests = {m: [(r["weights_digest"], r["tokens_digest"]) for r in rs] for m, rs in runs.items()}
    assert digests["planned"] == digests["full_tensor"] == digests["broadcast"]
    assert len({w for w, _ in digests["planned"]}) == 3  # the weights do change every iteration
    for m in runs["planned"]:
        assert m["sync_bytes"] == m["lower_bound_bytes"]
    for m in runs["full_tensor"] + runs["broadcast"]:
        assert m["sync_bytes"] > m["lower_bound_bytes"]


def test_delta_sync_from_fsdp_tp_into_bf16_equals_dense_bitwise_and_moves_fewer_bytes(tmp_path):
    """The recipe with a 2-D FSDP2 x TP trainer (2 x 2) and bf16 rollout weights (TP4), every
    sync verified, at an RL learning rate: dense and delta syncs give the same weights and
    tokens iteration by iteration, and after the first (dense) sync delta moves fewer bytes."""
    base = [
        "train.iterations=4",
        "progress=false",
        "train.layout=fsdp_tp",
        "rollout.dtype=bfloat16",
        "train.learning_rate=1e-5",
        "sync.verify_every=1",
    ]
    dense = dist_harness.run(4, _run, base, str(tmp_path / "dense"))[0]
    delta = dist_harness.run(4, _run, [*base, "sync.delta=true"], str(tmp_path / "delta"))[0]
    pairs = [(r["weights_digest"], r["tokens_digest"]) for r in dense]
    assert pairs == [(r["weights_digest"], r["tokens_digest"]) for r in delta]
    assert len({w for w, _ in pairs}) == 4  # bf16 weights do change every iteration
    assert all(m["sync_bytes"] == m["lower_bound_bytes"] for m in dense)
    sent = [m["sync_bytes"] for m in delta]
    assert sent[0] > delta[0]["lower_bound_bytes"]  # the first sync is dense (plus 8-byte headers per chunk)
    assert all(b < m["lower_bound_bytes"] for b, m in zip(sent[1:], delta[1:])), sent


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.layout=pp", r"rollout.layout must be one of \['shift', 'tp'\], got 'pp'"),
        ("rollout.colocated=maybe", r"^rollout.colocated: Value 'maybe' is not a valid bool"),
        ("sync.method=nccl", r"sync.method must be one of \['planned', 'full_tensor', 'broadcast'\], got 'nccl'"),
        ("sync.bucket_mb=0", r"sync.bucket_mb must be > 0, got 0"),
        ("train.group_size=1", r"train.group_size must be >= 2"),
        ("train.learning_rate=fast", r"^train.learning_rate: Value 'fast' could not be converted to Float"),
        ("train.iterations=0", r"train.iterations must be > 0, got 0"),
        ("train.layout=zero3", r"train.layout must be one of \['fsdp', 'fsdp_tp', 'hsdp'\], got 'zero3'"),
        ("rollout.dtype=int8", r"rollout.dtype must be one of \['float32', 'bfloat16', 'float16'\] or null, got 'int"),
        ("sync.delta=true sync.method=broadcast", r"sync.delta=true runs the planned method only"),
        ("+train.epochs=3", r"^train.epochs: Key 'epochs' not in 'TrainConfig' \(given 3\)"),
    ],
)
def test_bad_rollout_config_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        _compose(override.split())


def test_uneven_training_batch_is_named(tmp_path):
    with pytest.raises(
        RuntimeError,
        match=r"train.prompts \(3\) x train.group_size \(3\) = 9 sequences do not "
        r"split evenly over the 2 data-parallel training ranks",
    ):
        dist_harness.run(2, _run, ["train.prompts=3", "train.group_size=3", "progress=false"], str(tmp_path))


def answer_reward(prompts, completions, completion_ids, answer, log, **_):
    """A task's reward, as ``train.reward`` names it: the fraction of the completion's tokens equal
    to its line's ``answer``; every call is logged (rank, prompts, answers, rewards) to ``log``."""
    rewards = [sum(t == a for t in c) / len(c) for c, a in zip(completion_ids, answer)]
    with open(log[0], "a") as f:
        f.write(json.dumps([int(os.environ["RANK"]), prompts, answer, rewards, completions == completion_ids]) + "\n")
    return rewards


@pytest.mark.parametrize("source", ["prompts_file", "prompts_dataset"])
def test_a_task_of_its_own_prompts_file_and_reward_function(tmp_path, source):
    """``train.prompts_file`` lines (token ids and an "answer" field), or the same rows as a
    ``datasets`` dataset saved to disk (``train.prompts_dataset``), cycle through the iterations,
    each repeated ``group_size`` times; ``train.reward`` scores them as TRL calls its reward
    functions (prompts, completions, the lines' fields as keyword lists): the metrics' rewards are
    its values."""
    log = tmp_path / "calls.jsonl"
    lines = [
        {"prompt_ids": [5, 6, 7], "answer": 8, "log": str(log)},
        {"prompt_ids": [9, 10], "answer": 12, "log": str(log)},
    ]
    lines.append({"prompt_ids": [20, 21, 22, 23], "answer": 30, "log": str(log)})
    prompts = tmp_path / "task.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    if source == "prompts_dataset":
        from datasets import Dataset

        prompts = tmp_path / "task-dataset"
        Dataset.from_list(lines).save_to_disk(str(prompts))
    overrides = [
        f"train.{source}={prompts}", "train.reward=tests.test_rollout:answer_reward", "train.iterations=3",
        "train.prompts=2", "train.group_size=2", "progress=false",
    ]  # fmt: skip
    metrics = dist_harness.run(2, _run, overrides, str(tmp_path / "run"))[0]
    calls = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line)[0] == 0]
    order = [[0, 0, 1, 1], [2, 2, 0, 0], [1, 1, 2, 2]]  # two lines per iteration, from the top again at the end
    assert [call[1] for call in calls] == [[lines[i]["prompt_ids"] for i in o] for o in order]
    assert [call[2] for call in calls] == [[lines[i]["answer"] for i in o] for o in order]
    assert all(call[4] for call in calls)  # no tokenizer in the built-in policy: completions are token ids
    assert [m["reward"] for m in metrics] == pytest.approx([sum(call[3]) / 4 for call in calls])


def test_a_prompts_dataset_is_read_offline_and_named_where_it_is_not(tmp_path):
    """TRL's "prompt" column (a text or a conversation) becomes a line's "text" / "messages"; a
    dataset not found offline, a missing split and both prompt sources are one line each."""
    from datasets import Dataset, DatasetDict

    from reshard.recipes.rl_task import _as_line, load_rows

    chat = [{"role": "user", "content": "hi"}]
    assert _as_line({"prompt": "w1 w2", "answer": 3}) == {"text": "w1 w2", "answer": 3}
    assert _as_line({"prompt": chat}) == {"messages": chat}
    DatasetDict({"test": Dataset.from_list([{"prompt": "w1"}])}).save_to_disk(str(tmp_path / "d"))
    assert load_rows(str(tmp_path / "d"), "test") == [{"prompt": "w1"}]
    with pytest.raises(ValueError, match=r"train.prompts_split 'train' is not a split of '.*d': \['test'\]"):
        load_rows(str(tmp_path / "d"), "train")
    with pytest.raises(ValueError, match=r"train.prompts_dataset 'no-such/dataset-xyz' was not found offline"):
        load_rows("no-such/dataset-xyz", "train")
    with pytest.raises(ValueError, match=r"train.prompts_file=a.jsonl and train.prompts_dataset=d: give one"):
        _compose(["train.prompts_file=a.jsonl", "train.prompts_dataset=d"])
