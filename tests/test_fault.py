"""Failures without supervision: a rank SIGKILLed mid-decode ends the attempt and torchrun's restart
runs the job again from scratch (tokens equal a failure-free run's); the fault keys are checked,
and the retired whole-job restart with a KV ring is refused naming what replaces it (failures
kept inside the job, with their KV: ``fault.migrate``, tests/test_fault_isolation.py)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests import dist_harness
from tests.test_recipe import _run_recipe

COMMON = ["progress=false", "workload.num_requests=6", "workload.prompt_len_max=40", "generation.max_new_tokens=12"]


def _launch(tmp_path, name, overrides, restarts=0, world=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        str(restarts),
        "-m",
        "reshard.recipes.generate",
        f"hydra.run.dir={tmp_path / name}",
        *COMMON,
        *overrides,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)


def _run(tmp_path, name, overrides, restarts=0, world=2):
    proc = _launch(tmp_path, name, overrides, restarts, world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(line)["output_ids"] for line in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
    return outputs, json.loads((tmp_path / name / "summary.json").read_text())


_REFERENCES: dict = {}


@pytest.fixture
def reference(tmp_path_factory):
    """The failure-free run's tokens for (world, overrides), once per session: the same recipe
    (``run_generate``) in the test harness's process pool, which saves a torchrun job per reference."""

    def get(overrides, world=2):
        key = (world, tuple(overrides))
        if key not in _REFERENCES:
            run_dir = tmp_path_factory.mktemp("ref")
            dist_harness.run(world, _run_recipe, [*COMMON, *overrides], str(run_dir))
            lines = (run_dir / "outputs.jsonl").read_text().splitlines()
            _REFERENCES[key] = [json.loads(line)["output_ids"] for line in lines]
        return _REFERENCES[key]

    return get


def test_without_supervision_a_killed_rank_restarts_the_job_from_scratch(tmp_path, reference):
    expected = reference([])
    tokens, summary = _run(tmp_path, "scratch", ["fault.kill_at=[1,5]"], restarts=1)
    assert tokens == expected and summary["failures"] == 1 and "fault" not in summary


def test_a_failure_torchrun_does_not_restart_ends_the_job_and_keeps_what_finished(tmp_path, reference):
    two = ["engine.max_batch_size=2"]  # 6 requests of 12 new tokens, two at a time: the first two finish by step 13
    expected = reference(two)
    proc = _launch(tmp_path, "ft", [*two, "fault.kill_at=[0,20]"])
    assert proc.returncode != 0
    kept = [json.loads(line) for line in (tmp_path / "ft" / "finished.jsonl").read_text().splitlines()]
    assert kept and all(k["output_ids"] == expected[k["id"]] for k in kept)


def test_the_retired_whole_job_restart_is_refused_naming_its_replacement():
    from reshard.recipes.config import FaultConfig

    with pytest.raises(ValueError) as err:
        FaultConfig(replicate=True)
    assert str(err.value) == (
        "fault.replicate=true (the whole-job restart with a KV ring) is retired: fault.migrate=kv keeps each "
        "rank's KV through a failure inside the job (fault.migrate=reprefill where a strategy cannot mirror it)"
    )


def test_kill_at_is_validated():
    from reshard.recipes.config import FaultConfig

    for bad in ([1], [[1, 2], [3]], [1, -2], []):
        with pytest.raises(
            ValueError,
            match=r"fault.kill_at must be \[rank, step\] \(two ints >= 0\), a list "
            r"of them \(one per attempt\) or null, got ",
        ):
            FaultConfig(kill_at=bad)
    assert FaultConfig(kill_at=[[1, 16], [0, 14]]).kills() == [(1, 16), (0, 14)]
    assert FaultConfig(kill_at=[2, 5]).kills() == [(2, 5)]
    with pytest.raises(ValueError, match=re.escape("fault.inject must be kill or hang, got 'freeze'")):
        FaultConfig(inject="freeze")
    with pytest.raises(ValueError, match=re.escape("fault.inject=hang needs fault.migrate: the heartbeat")):
        FaultConfig(kill_at=[1, 5], inject="hang")
