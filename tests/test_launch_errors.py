"""The launcher's own errors, each found by trying the thing before any rank starts: a master port
in use, a master address that does not resolve, a node that never comes (a line while waiting, one
line at ``--rdzv-timeout``), directories that cannot be written (as root too); and a compiled
decode step says when it compiles and how long it took."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests import dist_harness
from tests.test_cli import _lines, _reshard, _running_in, _shm

NODE = ["generate", "--nproc", "1", "progress=false", "--master-addr", "127.0.0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, nnodes: int, port: int, timeout_s: float, cwd: Path) -> subprocess.Popen:
    args = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-port", str(port)]
    return _reshard([*NODE, *args, "--rdzv-timeout", str(timeout_s)], cwd)


def _ended(p: subprocess.Popen, timeout: float = 120) -> list[str]:
    out, _ = p.communicate(timeout=timeout)
    assert "Traceback" not in out and "frame #" not in out, out
    return _lines(out)


@pytest.mark.timeout(120)
def test_a_master_port_in_use_is_one_line_on_node_0(tmp_path):
    """Was a 16-line ``DistNetworkError`` traceback (exit 1)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = _node(0, 2, port, 300, tmp_path)
        lines = _ended(p)
    assert p.returncode == 2 and len(lines) == 1, lines
    assert re.match(rf"^error: --master-port {port} is in use on this machine \(.+\); ", lines[0]), lines[0]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_another_node_facing_a_port_that_never_answers_gives_up_at_the_rendezvous_timeout(tmp_path):
    """Node 1 reaching a listener that is not node 0's store (the port was taken): it hung forever."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()  # accepts connections, never answers
        port = held.getsockname()[1]
        p = _node(1, 2, port, 2, tmp_path)
        lines = _ended(p)
    assert p.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: 127.0.0.1:{port} did not answer as node 0's rendezvous within 2 s"), lines


@pytest.mark.timeout(120)
def test_a_master_addr_that_does_not_resolve_is_one_line(tmp_path):
    p = _reshard([*NODE, "--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid"], tmp_path)
    lines = _ended(p)
    assert p.returncode == 2 and len(lines) == 1, lines
    assert re.match(r"^error: --master-addr 'no-such-host.invalid' does not resolve \(.+\)$", lines[0]), lines[0]


@pytest.mark.timeout(120)
def test_a_node_that_never_comes_is_awaited_aloud_then_one_line_and_nothing_left(tmp_path):
    """``--nnodes 2`` with node 0 alone: it waited silently (900 s); now a line while waiting and one
    error at ``--rdzv-timeout``, no rank started, no process or shared memory left."""
    shm_before, port = _shm(), _free_port()
    p = _node(0, 2, port, 2, tmp_path)
    lines = _ended(p)
    assert p.returncode == 1, lines
    assert lines == [
        f"waiting for 1 more node(s) at 127.0.0.1:{port} (--rdzv-timeout 2 s)...",
        f"error: 1 of 2 nodes did not join within 2 s: no --node-rank 1 at 127.0.0.1:{port} (start each on its "
        f"machine with the same --master-addr and --master-port, or raise --rdzv-timeout)",
    ]
    assert _running_in(tmp_path) == [] and _shm() <= shm_before
    assert not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_a_node_waiting_for_node_0_says_so_and_gives_up_in_one_line(tmp_path):
    port = _free_port()
    p = _node(1, 2, port, 2, tmp_path)
    lines = _ended(p)
    assert p.returncode == 1, lines
    assert lines[0] == f"waiting for node 0 at 127.0.0.1:{port} (--rdzv-timeout 2 s)..."
    assert lines[1:] == [
        f"error: node 0 did not answer at 127.0.0.1:{port} within 2 s (start it with --node-rank 0 and the "
        f"same --master-addr and --master-port, or raise --rdzv-timeout)"
    ]


@pytest.mark.timeout(180)
def test_every_node_that_came_ends_with_the_same_line_when_one_never_comes(tmp_path):
    """Three nodes, node 2 never starts: node 1 (the shorter timeout) gives up first and node 0 ends
    with its line, read from the store (not a store error when the other closes)."""
    port = _free_port()
    first = _node(0, 3, port, 120, tmp_path)
    assert first.stdout.readline().startswith("waiting for 2 more node(s)")  # node 0's store is up
    second = _node(1, 3, port, 3, tmp_path)
    rest0, lines1 = _ended(first), _ended(second)
    error = f"error: 1 of 3 nodes did not join within 3 s: no --node-rank 2 at 127.0.0.1:{port} "
    assert (first.returncode, second.returncode) == (1, 1), (rest0, lines1)
    assert len(rest0) == 1 and rest0[0].startswith(error), rest0
    assert lines1 == [f"waiting for 1 more node(s) at 127.0.0.1:{port} (--rdzv-timeout 3 s)...", rest0[0]]


def _unwritable_dir() -> Path:
    """A directory no file can be made in, root or not (sysfs); skips where it can be written."""
    try:
        (Path("/sys") / ".reshard-probe").touch()
    except OSError:
        return Path("/sys")
    pytest.skip("/sys is writable here")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", ["model.cache_dir", "hydra.run.dir"])
def test_an_unwritable_directory_is_one_line_before_any_rank_starts(tmp_path, key):
    """As root, ``os.access`` passed and rank 0 failed in 116 lines: the write is tried."""
    where = _unwritable_dir() / "reshard-test"
    p = _reshard(["generate", "--nproc", "2", f"{key}={where}"], tmp_path)
    lines = _ended(p)
    assert p.returncode == 2 and len(lines) == 1, lines
    assert re.match(rf"^error: {key} '{where}' cannot be written \('/sys': .+\)$", lines[0]), lines[0]


def test_a_cache_dir_that_holds_the_checkpoint_is_only_read(tmp_path, capsys, monkeypatch):
    """The built-in checkpoint is made in ``model.cache_dir`` only when it is not there: a cache
    that cannot be written is refused until it holds it, then accepted (as a shared read-only cache)."""
    import tempfile

    from reshard.parallel.model.tiny_models import BUILTIN_NAME
    from reshard.recipes.cli import main

    cache, real = tmp_path / "cache", tempfile.NamedTemporaryFile

    def refused_in_cache(*args, dir=None, **kwargs):
        if Path(dir) == cache:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused_in_cache)
    cache.mkdir()
    assert main(["generate", "--check", f"model.cache_dir={cache}"]) == 2
    assert _lines(capsys.readouterr().err) == [
        f"error: model.cache_dir '{cache}' cannot be written ('{cache}': Permission denied)"
    ]
    (cache / BUILTIN_NAME).mkdir()
    (cache / BUILTIN_NAME / "config.json").write_text("{}")
    assert main(["generate", "--check", f"model.cache_dir={cache}"]) == 0
    assert list(tmp_path.glob("**/.reshard-write-check-*")) == []


def _compile_messages(path: str) -> list[str]:
    """This rank's runner log lines over a compiled-decode generation (Dynamo with its ``eager``
    backend: the real tracing and graph counts, without Inductor's minutes)."""
    import functools
    import logging
    from unittest import mock

    import torch

    from tests.test_generate import _generate, _prompts

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("reshard.parallel.engine.runner")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend="eager")):
            _generate(path, _prompts(3), 6, compile=True)
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    return [r.getMessage() for r in records]


@pytest.mark.timeout(300)
def test_a_compiled_decode_step_says_when_it_compiles_and_how_long_it_took_on_rank_0_only(checkpoints):
    rank0, rank1 = dist_harness.run(2, _compile_messages, checkpoints["llama"], timeout=240)
    assert rank1 == []
    assert re.match(
        r"^compiling the decode step \(a first run on this machine can take minutes; cached afterwards in .+\)$",
        rank0[0],
    ), rank0
    assert re.match(r"^compiled the decode step in \d+\.\d s$", rank0[1]), rank0
    assert all(re.match(r"^compiled the decode step for a new shape in \d+\.\d s$", m) for m in rank0[2:]), rank0


def test_a_cache_dir_under_home_is_the_home_for_the_check_and_the_ranks(tmp_path, monkeypatch):
    """``model.cache_dir='~/models'`` (quoted for Hydra) is the home's ``models`` (as a shell reads it), for the
    launcher's write check and for the ranks that build the checkpoint: never a ``./~`` folder."""
    from reshard.parallel.model.tiny_models import BUILTIN_NAME, builtin_checkpoint
    from reshard.recipes.cli import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--check", "model.cache_dir='~/models'"]) == 0
    assert builtin_checkpoint("~/models") == tmp_path / "home" / "models" / BUILTIN_NAME
    assert (tmp_path / "home" / "models" / BUILTIN_NAME / "config.json").exists() and not (tmp_path / "~").exists()
