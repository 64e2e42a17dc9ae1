"""A failure the job does not recover from, as the console shows it: the failing rank's one line
(a user error's, or an exception's naming ``ranks.log``), then the launcher's one line naming the
rank that failed first -- not a rank stopped after it -- and exit status 1 (2 for a user error).
The other ranks leave once stopped (none waits out a timeout), their tracebacks go to the run
directory's ``ranks.log``, no process aborts at exit and nothing is left in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from reshard.parallel.fault.supervisor import ChildSpec, Supervisor
from reshard.recipes.exits import RANKS_LOG, STOPPED, failed, root_cause
from tests.test_cli import _lines, _reshard, _run_dirs, _running_in, _shm

SMALL = ["progress=false", "workload.num_requests=8", "generation.max_new_tokens=16"]


@dataclass
class Ended:
    """A finished ``reshard`` command: its exit status, console lines and run directory's ``ranks.log``."""

    code: int
    lines: list[str]
    log: str


def _run(args: list[str], cwd: Path, timeout: float) -> Ended:
    shm_before = _shm()
    p = _reshard(args, cwd)
    try:
        out, _ = p.communicate(timeout=timeout)
    except BaseException:
        _stop(p)
        raise
    return _ended(p, out, cwd, shm_before)


def _stop(p: subprocess.Popen) -> None:
    """Kill the command's process group (a test that timed out leaves nothing running)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def _ended(p: subprocess.Popen, out: str, cwd: Path, shm_before: set[str]) -> Ended:
    assert "Traceback" not in out and "terminate called" not in out and "Error executing job" not in out, out
    assert _running_in(cwd) == [] and _shm() <= shm_before, out
    logs = [d / RANKS_LOG for d in _run_dirs(cwd) if (d / RANKS_LOG).exists()]
    return Ended(p.returncode, _lines(out), logs[0].read_text() if logs else "")


def _entries(log: str) -> list[str]:
    """The ``--- <who>: <how>`` heads of ``ranks.log``, in the order written."""
    return [line for line in log.splitlines() if line.startswith("--- ")]


@pytest.mark.timeout(90)
def test_a_killed_rank_is_named_not_the_peer_its_death_cut_short(tmp_path):
    """Rank 1 SIGKILLed at step 3 without supervision: rank 0, in a collective with it, raised
    "Connection closed by peer" and the launcher said "rank 0 failed (killed by SIGTERM)" after
    a 121-line traceback. Now one line names rank 1; rank 0's traceback is in ranks.log."""
    ended = _run(["generate", "--nproc", "2", "fault.kill_at=[1,3]", *SMALL], tmp_path, 80)
    assert ended.code == 1 and len(ended.lines) == 1, ended.lines
    assert re.match(
        r"^error: rank 1 failed \(killed by SIGKILL\)(; \d+ finished requests kept in .+)?$", ended.lines[0]
    )
    assert [h.split(" (pid")[0] for h in _entries(ended.log)] == ["--- rank 0"], ended.log
    assert "stopped after another rank failed" in ended.log and "by peer" in ended.log


@pytest.mark.timeout(120)
def test_a_supervised_failure_past_max_respawns_is_two_lines_naming_the_rank_whose_engine_died(tmp_path):
    """One TP2 group under ``fault.migrate=kv``, rank 1's engine SIGKILLed, no respawn allowed:
    both supervisors give up. Was a traceback per rank (189 lines at 4 ranks) ending with the
    launcher naming rank 0, torn down after it; now rank 1's line, then the launcher's."""
    args = ["generate", "--nproc", "2", "parallel.tp=2", "fault.migrate=kv", "fault.kill_at=[1,5]"]
    args += ["fault.max_respawns=0", "fault.warm_spare=false", *SMALL]
    ended = _run(args, tmp_path, 110)
    assert ended.code == 1 and len(ended.lines) == 2, ended.lines
    [run_dir] = _run_dirs(tmp_path)
    assert ended.lines[0] == (
        "error: rank 1: engine group 0 failed 1 times, more than fault.max_respawns (0); last exit code -9 "
        f"(SIGKILL) (RuntimeError; its traceback in {run_dir.resolve() / RANKS_LOG})"
    )
    assert re.match(r"^error: rank 1 failed \(exit status 1, see above\)", ended.lines[1]), ended.lines
    heads = {h.split(" (pid")[0]: h.split("): ")[-1] for h in _entries(ended.log)}
    assert heads == {  # rank 0's engine (its all-reduce cut short) and both supervisors
        "--- rank 0, engine group 0.0": "its group may not be respawned again",
        "--- rank 0": "stopped after another rank failed",
        "--- rank 1": "failed first",
    }, ended.log


@pytest.mark.timeout(120)
def test_a_user_error_on_one_rank_ends_every_rank_at_once(tmp_path):
    """``reshard serve`` on a port in use: only rank 0 (the HTTP server's) finds the error. Rank 1,
    waiting for the router, took the launcher's SIGTERM as a drain and was SIGKILLed 30 s later
    (the job ended 30.4 s after rank 0's line); now it stops at once."""
    shm_before = _shm()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = _reshard(["serve", "--nproc", "2", "--port", str(port), "progress=false"], tmp_path)
        try:
            said = [p.stdout.readline()]
            while said[-1] and not said[-1].startswith("error: "):
                said.append(p.stdout.readline())
            p.wait(timeout=15)  # (a rank left waiting would hold the job for 30 s)
        except BaseException:
            _stop(p)
            raise
    ended = _ended(p, "".join(said) + p.stdout.read(), tmp_path, shm_before)
    assert ended.code == 2, ended.lines
    assert ended.lines[-1] == f"error: serve.host:serve.port = 127.0.0.1:{port}: cannot listen there (in use?)"
    assert ended.log == ""  # rank 1 was stopped while it waited: nothing raised there


@dataclass
class _Failure:
    """What ``root_cause`` reads of torch's ``ProcessFailure``."""

    exitcode: int
    timestamp: int


def test_the_root_cause_is_the_first_failure_that_is_not_a_rank_stopped_after_it(tmp_path, capsys):
    # in the order torch's agent saw them: rank 0 and 2 stopped (SIGTERM, caught or not), rank 3 killed
    seen = {0: _Failure(-15, 100), 2: _Failure(130, 100), 3: _Failure(-9, 100), 1: _Failure(1, 101)}
    assert root_cause(seen) == (3, seen[3])
    assert root_cause({0: _Failure(130, 100), 1: _Failure(-15, 100)})[0] == 0  # every rank stopped: the first seen
    assert root_cause({}) is None and set(STOPPED) == {130, -15, -2}
    (tmp_path / "finished.jsonl").write_text('{"id": 0}\n')
    assert failed(type("ChildFailed", (Exception,), {"failures": seen})(), tmp_path) == 1
    kept = (tmp_path / "finished.jsonl").resolve()
    assert capsys.readouterr().err == f"error: rank 3 failed (killed by SIGKILL); 1 finished requests kept in {kept}\n"
    user = {0: _Failure(130, 100), 1: _Failure(2, 100)}  # a user error: its rank said the line
    assert failed(type("ChildFailed", (Exception,), {"failures": user})(), tmp_path) == 2
    assert capsys.readouterr().err == ""


def _raises(spec: ChildSpec) -> None:
    """A child engine that fails at once."""
    raise ValueError(f"engine {spec.endpoint} broke")


@pytest.mark.parametrize(
    "served,message",
    [
        (False, "rank 0: its engine failed before it could serve (exit code 1: ValueError: engine 0.0 broke; "),
        (True, "rank 0: engine group 0 failed 1 times, more than fault.max_respawns (0); last exit code 1: "),
    ],
    ids=["before-serving", "past-max-respawns"],
)
@pytest.mark.timeout(60)
def test_a_supervisor_that_gives_up_names_its_engines_error_and_keeps_its_traceback(tmp_path, capfd, served, message):
    """A start-up error, and a death past ``fault.max_respawns``: the ``RuntimeError`` carries the
    engine's error in one line; its traceback goes to the log, not stderr."""
    log = tmp_path / RANKS_LOG
    supervisor = Supervisor(
        dist.HashStore(), 0, 0, (0,), _raises, max_respawns=0, warm_spare=False,
        ready=lambda spec: served, recovered_log=log,
    )  # fmt: skip
    with pytest.raises(RuntimeError) as e:
        supervisor.run()
    assert str(e.value).startswith(message) and "broke; its traceback in ranks.log" in str(e.value), str(e.value)
    assert "Traceback" not in capfd.readouterr().err
    [head] = _entries(log.read_text())
    assert head.startswith("--- rank 0, engine group 0.0 (pid ") and "ValueError: engine 0.0 broke" in log.read_text()
