"""The ``reshard`` launcher: config errors before any rank starts, one line per outcome (user error,
Ctrl-C, a recovered failure), one run directory per job and nothing left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _reshard(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "reshard.recipes.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job is
        **kw,
    )


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


def _run_dirs(cwd: Path) -> list[Path]:
    return sorted(p for p in (cwd / "outputs").glob("*/*") if p.is_dir())


def _shm() -> set[str]:
    """/dev/shm's entries, without Python multiprocessing's semaphores (the test harness's own)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-")}


def _left_running(run_dir: Path) -> str:
    """Processes whose command line names ``run_dir`` (the ranks get it as ``hydra.run.dir``)."""
    return subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize(
    "args,match,console",
    [
        (
            ["generate", "--nproc", "2", "engine.max_batch_sise=4"],
            r"^error: engine.max_batch_sise: Key 'max_batch_sise' not in 'EngineConfig' \(given '4'\) "
            r"\(did you mean 'engine.max_batch_size'\?\)$",
            True,  # the console script itself: nothing else printed
        ),
        (
            ["generate", "--nproc", "2", "fault.kill_at=[5,3]"],
            r"^error: fault.kill_at \[5, 3\] names rank 5, outside",
            False,  # its main() in this process (the same code path, without a Python start)
        ),
        (
            ["generate", "--nproc", "3", "parallel.tp=2"],
            r"^error: parallel.tp \(2\) must divide the world size \(3\)$",
            False,
        ),
    ],
)
def test_a_config_error_is_one_line_before_any_rank_starts(tmp_path, args, match, console, capsys, monkeypatch):
    if console:
        p = _reshard(args, tmp_path)
        out, _ = p.communicate(timeout=60)
        code = p.returncode
    else:
        from reshard.recipes.cli import main

        monkeypatch.chdir(tmp_path)
        code = main(args)
        out = capsys.readouterr().err
    lines = _lines(out)
    assert code == 2 and len(lines) == 1, out
    assert re.match(match, lines[0]), lines[0]
    assert not (tmp_path / "outputs").exists()  # no rank ran, no run directory


def test_a_rank_side_user_error_exits_2_in_one_line_and_leaves_no_run_directory(tmp_path):
    p = _reshard(["generate", "--nproc", "2", "model.path=/nonexistent/ckpt", "progress=false"], tmp_path)
    out, _ = p.communicate(timeout=120)
    lines = _lines(out)
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/ckpt" in lines[0]
    assert _run_dirs(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm-to-the-launcher"])
def test_ctrl_c_prints_one_line_keeps_finished_requests_and_leaves_nothing(tmp_path, signum):
    """Ctrl-C mid-generation (SIGINT to the job's process group, as a terminal sends it): one line,
    exit 130, finished requests kept; no process and nothing in /dev/shm left. SIGTERM to the
    launcher alone (its ranks see it as a stop): the same exit, the same last line, the same
    nothing left (a supervised job's Ctrl-C: tests/test_fault_isolation.py)."""
    shm_before = _shm()
    args = ["generate", "--nproc", "2", "workload.num_requests=300", "generation.max_new_tokens=64", "progress=false"]
    p, t0 = _reshard(args, tmp_path), time.time()
    finished = None
    while finished is None and time.time() - t0 < 120 and p.poll() is None:
        found = [f for f in (tmp_path / "outputs").glob("*/*/finished.jsonl") if f.stat().st_size > 0]
        finished = found[0] if found else None
        time.sleep(0.1)
    assert finished is not None, "no request finished within 120 s"
    if signum == signal.SIGINT:
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    else:
        os.kill(p.pid, signum)
    out, _ = p.communicate(timeout=60)
    lines = _lines(out)
    assert p.returncode == 130 and (len(lines) == 1 or signum == signal.SIGTERM), out
    done = len(finished.read_text().splitlines())
    assert lines[-1] == f"interrupted: {done} of 300 requests finished, kept in {finished.resolve()}"
    assert all(json.loads(line)["output_ids"] for line in finished.read_text().splitlines())
    assert _run_dirs(tmp_path) == [finished.parent]
    time.sleep(0.5)
    assert _left_running(finished.parent) == "" and _shm() <= shm_before


def test_a_recovered_failure_is_told_as_a_story_exits_0_in_one_run_directory(tmp_path):
    """Supervised DP2 groups, rank 1's engine SIGKILLed at step 5: the job recovers inside itself
    (its requests adopted with their KV), exits 0, and the last line says what happened."""
    args = ["generate", "--nproc", "2", "parallel.tp=1", "fault.migrate=kv", "fault.kill_at=[1,5]"]
    args += ["fault.warm_spare=false", "progress=false", "workload.num_requests=8", "generation.max_new_tokens=16"]
    p = _reshard(args, tmp_path)
    out, _ = p.communicate(timeout=240)
    lines = _lines(out)
    assert p.returncode == 0, out
    assert re.match(
        r"^recovered: rank 1 died \(SIGKILL\) at [\d.]+ s; \d request\(s\) adopted with their KV by another group, "
        r"\d+ token\(s\) computed again",
        lines[-1],
    ), lines[-1]
    [run_dir] = _run_dirs(tmp_path)
    assert len((run_dir / "outputs.jsonl").read_text().splitlines()) == 8
    assert json.loads((run_dir / "summary.json").read_text())["layout"] == "D2"
    assert not any("Error executing job" in line or "exitcode" in line for line in lines), out


def test_plan_runs_in_the_launchers_process(tmp_path):
    p = _reshard(["plan", "model=llama3-15b", "hardware=a10", "num_gpus=4", "top=3"], tmp_path)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    [run_dir] = _run_dirs(tmp_path)
    assert json.loads((run_dir / "plan.json").read_text())["ranked"]


def test_story_lines_tell_each_recovery_in_one_line():
    """The summary keys of supervised deaths and of a torchrun restart, as the launcher tells them
    (the jobs behind these keys: tests/test_fault_isolation.py, tests/test_fault.py)."""
    from reshard.recipes.cli import story_lines

    death = {"rank": 2, "exitcode": -9, "hung": False, "died_s": 3.25, "seen_s": 3.3, "rejoined_s": 4.1}
    death |= {"adopted": [[7, 12, 1], [9, 30, 1]], "resumed": [7, 9], "reprefilled_tokens": 0, "endpoint": "2.0"}
    assert story_lines({"fault": {"deaths": [death]}}) == [
        "recovered: rank 2 died (SIGKILL) at 3.2 s; 2 request(s) adopted with their KV by another group, "
        "2 token(s) computed again; its group served again 0.8 s later"
    ]
    weights = {"2": {"0": ["checkpoint", 1.5], "1": ["3.0", 0.4]}}
    assert story_lines({"fault": {"deaths": [death], "weights_from": weights}})[0].endswith(
        "; its group served again 0.8 s later with group 3's weights"
    )
    hosted = death | {"endpoint": "0.0", "adopted_by": "0.1"}  # a lockstep group's KV, kept by its supervisors
    assert story_lines({"fault": {"deaths": [hosted]}})[0].startswith(
        "recovered: rank 2 died (SIGKILL) at 3.2 s; 2 request(s) adopted with their KV by its group's next "
        "generation (its supervisors kept their KV), 2 token(s) computed again"
    )
    assert story_lines({"failures": 1}) == ["recovered: 1 whole-job restart(s) after a rank failed, each from scratch"]
    assert story_lines({"failures": 0}) == [] and story_lines({}) == []
