"""The ``reshard`` launcher: config errors before any rank starts, one line per outcome (user error,
Ctrl-C, a recovered failure), one run directory per job and nothing left behind."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a terminal's foreground job takes Ctrl-C: SIGINT at its default, whatever this process has (a
# shell without job control starts a background command, pytest included, with SIGINT ignored,
# and an ignored signal stays ignored through fork and exec)
FOREGROUND = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def _reshard(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FOREGROUND, sys.executable, "-m", "reshard.recipes.cli", *args],
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
        (
            ["generate", "modle.path=x"],
            r"^error: modle: Key 'modle' not in 'GenerateConfig' \(did you mean 'model'\?\)$",
            False,
        ),
        (
            ["generate", "generation.max_new_tokens=-1"],
            r"^error: generation.max_new_tokens must be >= 1, got -1$",
            False,
        ),
        (
            ["generate", "model.path=/nonexistent/ckpt"],
            r"^error: model.path '/nonexistent/ckpt' is not a directory",
            False,
        ),
        (
            ["generate", "workload.prompts_file=/"],
            r"^error: workload.prompts_file '/' is a directory; give a JSONL file$",
            False,
        ),
        (
            ["rollout", "train.reward=no_such_module:f"],
            r"^error: train.reward 'no_such_module:f' cannot be imported",
            False,
        ),
        (
            ["rollout", "--nproc", "2", "rollout.tp=3"],
            r"^error: rollout on 2 ranks: rollout.tp \(3\) must divide",
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
    # a hub id the ranks cannot resolve offline (a local path that is no checkpoint fails in the launcher)
    p = _reshard(["generate", "--nproc", "2", "model.path=no-such-org/no-such-model", "progress=false"], tmp_path)
    out, _ = p.communicate(timeout=120)
    lines = _lines(out)
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "no-such-org" in lines[0]
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


def test_a_process_that_freezes_its_heap_still_exits_through_its_handlers_with_every_object_frozen():
    """``freeze_heap`` (every rank, the command): the objects alive at the call and, at exit,
    those made after it are frozen before the final collections, and the ``atexit`` handlers
    still run (this one was registered first, so it runs after the freeze). A supervisor's fork
    server freezes what it imported by importing its last preload."""
    ranks = (
        "import atexit, gc\n"
        "from reshard.recipes.exits import freeze_heap\n"
        "atexit.register(lambda: print(gc.get_freeze_count() > at_call + 5000, flush=True))\n"
        "freeze_heap()\n"
        "at_call = gc.get_freeze_count()\n"
        "print(at_call > 0, flush=True)\n"
        "made_after = [[i] for i in range(10000)]\n"
    )
    server = "import gc\nimported = [[i] for i in range(10000)]\nimport reshard.parallel.fault.frozen\n"
    server += "print(gc.get_freeze_count() > 10000, flush=True)\n"
    for code in (ranks, server):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and set(proc.stdout.split()) == {"True"}, (proc.stdout, proc.stderr[-2000:])


def test_a_jobs_imports_run_with_the_collector_paused_and_the_job_with_it_running(capsys):
    """``python -m reshard.recipes.<job>`` (Python holds ``"-m"`` in ``sys.argv[0]`` while it finds
    the module) imports with the cyclic collector paused, and ``freeze_heap`` (a job's first step)
    resumes it; a program that imports the package keeps it running; a supervisor's fork server
    pauses it for its preload and resumes it with the preload frozen; the command resumes it
    whichever way it ends."""
    from reshard.recipes.cli import main

    job = "import gc, sys\nsys.argv[0] = '-m'\nimport reshard.recipes\nprint(not gc.isenabled())\n"
    job += "from reshard.recipes.exits import freeze_heap\nfreeze_heap()\nprint(gc.isenabled())\n"
    program = "import gc, reshard.recipes.exits\nprint(gc.isenabled())\n"
    server = "import gc, reshard.parallel.fault.paused\nprint(not gc.isenabled())\n"
    server += "import reshard.parallel.fault.frozen\nprint(gc.isenabled() and gc.get_freeze_count() > 0)\n"
    for code in (job, program, server):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and set(proc.stdout.split()) == {"True"}, (code, proc.stdout, proc.stderr[-2000:])
    assert main(["generate", "engine.max_batch_size=0"]) == 2 and gc.isenabled()
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["generate", "--check"]) == 0 and gc.isenabled()


def test_a_sweep_key_is_refused_by_name_and_a_run_dir_is_honoured_as_given(tmp_path, capsys, monkeypatch):
    from reshard.recipes.cli import _run_dir, main

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "hydra.sweep.dir=sweeps"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: hydra.sweep.dir: reshard runs one job per launch (no sweeps); set hydra.run.dir"
    )
    assert _run_dir(["a=1", "hydra.run.dir=runs/x", "b=2"]) == (Path("runs/x"), ["a=1", "b=2"])


def _node(rank: int, port: int, ckpt: str, run_dir: Path, extra: list[str], cwd: Path) -> subprocess.Popen:
    """One "machine" of a two-node job: the launcher in a mount + IPC namespace of its own with a
    private /dev/shm (the two share only the loopback network and the checkpoint)."""
    args = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    args += ["--nproc", "1", f"model.path={ckpt}", f"hydra.run.dir={run_dir}", "progress=false", *extra]
    launcher = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -m reshard.recipes.cli generate " + " ".join(
        args
    )
    return subprocess.Popen(
        ["unshare", "--mount", "--ipc", "--propagation", "private", "sh", "-c", launcher],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def _private_namespaces() -> bool:
    probe = ["unshare", "--mount", "--ipc", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.tp=1"], ids=["tp-across-nodes", "dp-across-nodes"])
def test_two_launchers_as_two_nodes_run_one_job_and_write_where_hydra_run_dir_says(
    tmp_path, checkpoints, hf_reference, layout
):
    """``--nnodes 2`` on loopback: each launcher a node in its own mount and IPC namespace (a
    private /dev/shm, as two machines have); TP across the nodes and DP groups across them give
    HF's tokens, in node 0's ``hydra.run.dir`` exactly."""
    if not _private_namespaces():
        pytest.skip("unshare --mount --ipc is not permitted here (needs root or user namespaces)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = checkpoints["llama"]
    extra = [layout, "workload.num_requests=4", "workload.prompt_len_max=20", "generation.max_new_tokens=6"]
    nodes = [_node(r, port, ckpt, tmp_path / f"node{r}", extra, tmp_path) for r in (0, 1)]
    outs = [p.communicate(timeout=180)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    lines = [json.loads(line) for line in (tmp_path / "node0" / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert [o["output_ids"] for o in lines] == hf_reference(ckpt, [o["prompt_ids"] for o in lines], 6)
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["layout"] == ("T2" if layout.endswith("2") else "D2")
    assert not (tmp_path / "outputs").exists()  # no outputs/<date>/<time> beside the directory named


def test_a_stop_held_through_a_ranks_start_ends_it_quietly_at_its_first_instruction():
    """The launcher starts each rank with SIGINT and SIGTERM blocked (``rank.BLOCKED_START``): a
    Ctrl-C during its interpreter's start (``site`` and its ``.pth`` imports) is held, not a
    "Fatal Python error" per rank. Here one is pending before the start; the rank exits 130 at
    its first instruction, with no output (the launcher says the one line)."""
    from reshard.recipes.rank import BLOCKED_START

    pending = (
        "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
        "os.kill(os.getpid(), signal.SIGINT); os.execv(sys.argv[1], sys.argv[1:])"
    )
    rank = [sys.executable, "-S", "-c", BLOCKED_START, "generate", "progress=false"]
    proc = subprocess.run([sys.executable, "-c", pending, *rank], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "")


@pytest.mark.parametrize("after", [1.0, 3.0, 8.0])
def test_ctrl_c_at_any_moment_of_start_up_is_one_line_and_leaves_nothing(tmp_path, after):
    """Ctrl-C while the launcher imports (1 s), while it starts the ranks or they import (3 s),
    and once they load or generate (8 s): exit 130, one line, no process, nothing in /dev/shm, no
    empty run directory."""
    shm_before = _shm()
    args = ["generate", "--nproc", "2", "workload.num_requests=300", "generation.max_new_tokens=64", "progress=false"]
    p = _reshard(args, tmp_path)
    time.sleep(after)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    lines = _lines(out)
    assert p.returncode == 130 and len(lines) == 1 and lines[0].startswith("interrupted: "), out
    time.sleep(0.5)
    assert _running_in(tmp_path) == [] and _shm() <= shm_before
    assert all(list(d.iterdir()) for d in _run_dirs(tmp_path))  # a run directory left holds what finished


def _rank_stops() -> None:
    from reshard.recipes.launch import _Stops

    _Stops(drains=False).install()


def _launcher_stops() -> None:
    from reshard.recipes.cli import _note_interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert _note_interrupts()[1] is not None


@pytest.mark.parametrize("install", [_rank_stops, _launcher_stops], ids=["rank", "launcher"])
def test_a_ctrl_c_inside_an_import_stops_once_the_import_is_done(tmp_path, monkeypatch, install):
    """The 8 s case above, as it failed once: the Ctrl-C landed while a rank imported
    huggingface_hub.hf_api, in a ``__set_name__``; Python 3.11 turned the KeyboardInterrupt into
    a RuntimeError and huggingface_hub printed ``Error importing ...`` before the one line. The
    stop, held back, raises after the import, which completes."""
    module = "set_name_interrupted"
    (tmp_path / f"{module}.py").write_text(
        "import os, signal, time\n"
        "class Field:\n"
        "    def __set_name__(self, owner, name):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(0.2)\n"
        "class HfUri:\n"
        "    _raw = Field()\n"
        "DONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        install()
        with pytest.raises(KeyboardInterrupt) as raised:
            importlib.import_module(module)
            time.sleep(600)  # (cut short: a stop sent again to the main thread ends a blocking call)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        imported = sys.modules.pop(module, None)
    assert getattr(imported, "DONE", False), "the import was cut short"
    assert all(Path(entry.path).name != f"{module}.py" for entry in raised.traceback)


def test_ranks_end_when_their_launcher_dies(tmp_path):
    """A launcher gone while its ranks generate (as one is when a Ctrl-C reached it while torch's
    agent was still starting ranks, each in a session of its own, so that the agent never held
    them) takes its ranks with it: each gets SIGINT (the parent-death signal ``BLOCKED_START``
    asks for) and stops as at a Ctrl-C. Past their start a ``generate`` job's ranks use no store
    the launcher holds, so without it they would generate on for minutes; here no process is
    left, nothing in /dev/shm, and the launcher's output pipe, which they share, closes."""
    shm_before = _shm()
    args = ["generate", "--nproc", "2", "workload.num_requests=5000", "generation.max_new_tokens=64", "progress=false"]
    p = _reshard(args, tmp_path)  # (a job of minutes)
    try:
        deadline = time.monotonic() + 120
        while not _finished_some(tmp_path) and time.monotonic() < deadline:  # the ranks generate
            time.sleep(0.2)
        assert _finished_some(tmp_path), "no request finished"
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)  # (the ranks hold the pipe until they end)
        time.sleep(0.5)
        assert _running_in(tmp_path) == [] and _shm() <= shm_before
    finally:  # (a failure leaves no rank generating on beside the rest of the suite)
        for pid in _running_in(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_whose_launcher_is_gone_before_it_starts_exits_at_once():
    """``BLOCKED_START`` compares its parent with the launcher's pid the environment names: a rank
    whose parent is another (the launcher died before the parent-death signal was set, and the
    rank was adopted) exits 130 at once, saying nothing; one whose parent is the launcher goes on
    to its job (here one that does not exist: an import error), whatever the launcher's pid (a
    container's launcher is pid 1)."""
    from reshard.recipes.exits import LAUNCHER_PID_ENV
    from reshard.recipes.rank import BLOCKED_START

    rank = [sys.executable, "-S", "-c", BLOCKED_START, "no_such_job"]
    for launcher, code in ((os.getpid() + 1_000_000, 130), (os.getpid(), 1)):
        env = {**os.environ, LAUNCHER_PID_ENV: str(launcher)}
        proc = subprocess.run(rank, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == code, (launcher, proc.stderr)
        assert ("No module named 'reshard.recipes.no_such_job'" in proc.stderr) == (code == 1), proc.stderr


def _finished_some(cwd: Path) -> bool:
    """Whether a run directory under ``cwd`` has a request in its ``finished.jsonl``."""
    return any(path.stat().st_size > 0 for d in _run_dirs(cwd) for path in d.glob("finished.jsonl"))


def _cut_short_by_a_ctrl_c(argv) -> int:
    """A launcher's start-up whose import a Ctrl-C cut short and which then failed with another
    error, as numpy's half-made module did (a ``RecursionError``, in a run under heavy load)."""
    with contextlib.suppress(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    raise RecursionError("maximum recursion depth exceeded")


@pytest.fixture
def default_sigint():
    """SIGINT handled by Python's own handler, as in a launcher's process (pytest run as a shell's
    background job starts with SIGINT ignored), and the handler found restored after."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


def test_a_ctrl_c_that_an_import_turns_into_another_error_is_still_one_line(monkeypatch, capsys, default_sigint):
    from reshard.recipes import cli

    monkeypatch.setattr(cli, "_main", _cut_short_by_a_ctrl_c)
    assert cli.main(["generate"]) == 130
    assert capsys.readouterr().err == "interrupted: before any rank started (nothing ran)\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler it replaced, back
    monkeypatch.setattr(cli, "_main", lambda argv: _raise(RecursionError("not interrupted")))
    with pytest.raises(RecursionError, match="not interrupted"):  # without a Ctrl-C, the error is the error
        cli.main(["generate"])


def _raise(error: BaseException) -> int:
    raise error


def _running_in(cwd: Path) -> list[int]:
    """Processes (not zombies) whose working directory is ``cwd``: the launcher and its ranks."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cwd").resolve() == cwd.resolve():
                state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                found += [int(proc.name)] if state != "Z" else []
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_what_the_launcher_can_know_fails_there_in_one_line(tmp_path, capsys, monkeypatch):
    """A checkpoint whose config.json is not JSON, a cache directory that cannot be written and a
    collective timeout of 0 reached the ranks as tracebacks; the launcher refuses each by name."""
    from reshard.recipes.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    (tmp_path / "afile").write_text("")
    cases = [
        (["generate", f"model.path={tmp_path / 'ckpt'}"], r"^error: model.path '.*ckpt': its config.json is not JSON"),
        (
            ["generate", f"model.cache_dir={tmp_path / 'afile' / 'x'}"],
            r"^error: model.cache_dir '.*' cannot be written",
        ),
    ]
    for args, match in cases:
        assert main(args) == 2
        lines = _lines(capsys.readouterr().err)
        assert len(lines) == 1 and re.match(match, lines[0]), lines
    monkeypatch.setenv("RESHARD_COLLECTIVE_TIMEOUT", "0")
    assert main(["generate"]) == 2
    assert _lines(capsys.readouterr().err) == [
        "error: RESHARD_COLLECTIVE_TIMEOUT must be a positive number of seconds, got '0'"
    ]
    assert not (tmp_path / "outputs").exists()
