"""What a supervised job (``fault.migrate``) prints of a failure it recovers from: its summary and
one ``recovered:`` line per failure. The tracebacks of the engines it went on without (a killed
rank's tensor-parallel peer, whose collective failed with it) go to the run directory's
``ranks.log`` (a failure it does not recover from: ``tests/test_failure_output.py``)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from reshard.parallel.fault.supervisor import ChildSpec, Supervisor
from reshard.recipes.exits import RANKS_LOG
from tests.test_cli import _lines, _reshard, _run_dirs


def _fails_in_its_first_generation(spec: ChildSpec) -> None:
    """A child engine: the first generation raises, the next one serves to the end."""
    if spec.generation == 0:
        raise ValueError(f"engine {spec.endpoint} broke")


def _supervisor(log, *, max_respawns: int = 3, served: bool = True) -> Supervisor:
    """One rank's supervisor of ``_fails_in_its_first_generation``, in a group of its own."""
    ready = (lambda spec: True) if served else (lambda spec: False)
    return Supervisor(
        dist.HashStore(), 0, 0, (0,), _fails_in_its_first_generation,
        max_respawns=max_respawns, warm_spare=False, ready=ready, recovered_log=log,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_a_recovered_kill_prints_its_story_and_the_survivors_traceback_goes_to_the_run_directory(tmp_path):
    # one TP2 group: rank 1's engine is SIGKILLed at step 5; rank 0's engine, in an all-reduce with
    # it, fails with "Connection closed/reset by peer" and is replaced with it
    args = ["generate", "--nproc", "2", "parallel.tp=2", "fault.migrate=kv", "fault.kill_at=[1,5]"]
    args += ["fault.warm_spare=false", "progress=false", "workload.num_requests=8", "generation.max_new_tokens=16"]
    p = _reshard(args, tmp_path)
    out, _ = p.communicate(timeout=220)
    lines = _lines(out)
    assert p.returncode == 0, out
    [run_dir] = _run_dirs(tmp_path)
    deaths = json.loads((run_dir / "summary.json").read_text())["fault"]["deaths"]
    story = [line for line in lines if line.startswith("recovered:")]
    assert len(story) == len(deaths) == 1 and story == lines[-1:], out
    assert story[0].startswith("recovered: rank 1 died (SIGKILL)"), out
    assert not [line for line in lines if "Traceback" in line or "Error" in line], out
    events = [json.loads(line) for line in (run_dir / "supervision.jsonl").read_text().splitlines()]
    replaced = [(e["rank"], e["endpoint"], e["code"]) for e in events if e["event"] == "replaced"]
    assert replaced == [(0, "0.0", 1)], events  # the survivor raised (exit status 1) before it was replaced
    log = (run_dir / RANKS_LOG).read_text()
    assert log.startswith("--- rank 0, engine group 0.0 (pid ") and "replaced after its group's peer died" in log
    assert "Traceback (most recent call last)" in log and "by peer" in log, log


@pytest.mark.timeout(60)
def test_a_respawned_engines_traceback_goes_to_the_log_not_stderr(tmp_path, capfd):
    log = tmp_path / RANKS_LOG
    supervisor = _supervisor(log)
    supervisor.run()
    assert [(f.generation, f.exitcode) for f in supervisor.failures] == [(0, 1)]
    text = log.read_text()
    assert text.startswith("--- rank 0, engine group 0.0 (pid ") and "died (exit code 1), respawned" in text
    assert "ValueError: engine 0.0 broke" in text
    assert "Traceback" not in capfd.readouterr().err


def test_a_death_by_an_exception_points_to_its_traceback_in_the_run_directory():
    from reshard.recipes.exits import story_lines

    death = {"rank": 1, "hung": False, "died_s": 2.0, "seen_s": 2.1, "rejoined_s": None, "endpoint": "1.0"}
    death |= {"adopted": [], "resumed": [4], "reprefilled_tokens": 30}
    raised, killed = death | {"exitcode": 1}, death | {"exitcode": -9}
    assert story_lines({"fault": {"deaths": [raised, killed]}}) == [
        "recovered: rank 1 died (exit status 1, its traceback in ranks.log) at 2.0 s; "
        "1 request(s) prefilled again on live groups (30 tokens)",
        "recovered: rank 1 died (SIGKILL) at 2.0 s; 1 request(s) prefilled again on live groups (30 tokens)",
    ]
