"""The README's code blocks run as written: every ``reshard`` / ``torchrun`` command's config checks
for its ranks (the launcher's ``--check``: keys, values and layouts, without starting the job),
every other command names what exists (a bench script and its flags, a test file, an extra of
``pyproject.toml``), the test command is the one CI runs, and every Python block runs on the 2
ranks it is written for (and, where it says so, as ``python example.py``: one plain process).
``tests/test_docs.py`` applies the same checks to ``docs/``."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests import dist_harness

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of ``text``'s fenced blocks of language ``lang`` (at any indentation)."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", text, flags=re.S | re.M)
    return [re.sub(rf"^{indent}", "", body, flags=re.M) for indent, body in found]


def commands(block: str) -> list[list[str]]:
    """Each logical command of a shell block (continuations joined, comments dropped), as words,
    split at ``&&``."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1 :]
    return out


SHELL = [c for b in blocks(README, "bash") for c in commands(b)]


def check_command(words: list[str]) -> None:
    """Check one shell command of the docs without running its job; fails naming what is wrong.
    Environment assignments in front (``OMP_NUM_THREADS=1``) are skipped."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    checks = {
        "reshard": _check_reshard,
        "torchrun": _check_torchrun,
        "python": _check_python,
        "pip": _check_pip,
        "mkdocs": lambda w: _expect(w[1] in ("serve", "build"), w),
        "ruff": lambda w: _expect(w[1] in ("check", "format"), w),
    }
    _expect(bool(words) and words[0] in checks, words)
    checks[words[0]](words)


def _expect(ok: bool, words: list[str]) -> None:
    assert ok, f"no check passes for the command {' '.join(words)!r}"


def _check_reshard(words: list[str]) -> None:
    from reshard.recipes.cli import main

    keys = "--keys" in words  # prints the keys and runs nothing; anything else gets --check
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(words[1:] if keys else [*words[1:], "--check"]) == 0, words
    if keys:
        assert re.match(r"\w+(\.\w+)* = ", out.getvalue()), out.getvalue()[:200]
    else:
        assert out.getvalue().startswith("ok: the "), out.getvalue()


def _check_torchrun(words: list[str]) -> None:
    """A recipe's config checks for the launcher's world; a script exists and takes the flags."""
    from reshard.recipes.preflight import check

    world = int(_flag(words, "--nnodes", "1")) * int(_flag(words, "--nproc-per-node", "1"))
    if "-m" in words:
        job = words[words.index("-m") + 1].rsplit(".", 1)[1]
        check(job, words[words.index("-m") + 2 :], world)
        return
    [script] = [w for w in words if w.endswith(".py")]
    _check_script(script, words[words.index(script) + 1 :])


def _flag(words: list[str], name: str, default: str) -> str:
    """The value after flag ``name`` in ``words`` (``default`` without the flag)."""
    return words[words.index(name) + 1] if name in words else default


def _check_python(words: list[str]) -> None:
    if words[1:3] == ["-m", "pytest"]:
        paths = [w.split("::")[0] for w in words[3:] if not w.startswith("-")]
        assert paths and all((ROOT / p).exists() for p in paths), words
        return
    _check_script(words[1], words[2:])


def _check_script(script: str, args: list[str]) -> None:
    """``script`` exists and names every ``--flag`` of ``args`` (as ``"--flag"`` or as the
    ``"flag"`` key of a sizes dict that ``bench/_common.py`` turns into flags)."""
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    source = path.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        key = flag[2:].replace("-", "_")
        assert f'"{flag}"' in source or f'"{key}"' in source, f"{script} takes no {flag}"


def _check_pip(words: list[str]) -> None:
    """``pip install`` of a pinned torch or of this project with extras that ``pyproject.toml`` has."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert words[1] == "install", words
    for arg in (w for w in words[2:] if w != "-e"):
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if match is None:
            assert re.fullmatch(r"torch==[\d.]+", arg), f"pip installs {arg!r}, which the docs do not pin"
            continue
        assert all(e in extras for e in (match.group(1) or "").split(",") if e), f"no extra in {arg!r}"


def run_block(code: str, name: str = "README.md python block") -> str:
    """Execute a docs Python block on this rank (the harness's process group stands in for
    torchrun's: the block's own ``init_process_group`` is skipped when one exists)."""
    code = code.replace('dist.init_process_group("gloo")', 'dist.is_initialized() or dist.init_process_group("gloo")')
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, name, "exec"), {"__name__": "__readme__"})
    return out.getvalue()


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(blocks(README, "python")) >= 4 and sum(c[0] == "reshard" for c in SHELL) >= 10


@pytest.mark.parametrize("words", [c for c in SHELL if c[0] == "reshard"], ids=lambda c: " ".join(c[:4]))
def test_each_reshard_command_checks(words):
    check_command(words)


@pytest.mark.parametrize("words", [c for c in SHELL if c[0] != "reshard"], ids=lambda c: " ".join(c[:4]))
def test_each_other_command_checks(words):
    check_command(words)


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"\n{ci}\n" in f"\n{blocks(README, 'bash')[1]}"


def test_a_command_nothing_checks_fails():
    with pytest.raises(AssertionError, match="no check passes"):
        check_command(["curl", "http://127.0.0.1:8000/metrics"])
    with pytest.raises(AssertionError, match="takes no --no-such-flag"):
        check_command(["python", "bench/figures.py", "--no-such-flag"])
    with pytest.raises(AssertionError, match="no extra"):
        check_command(["pip", "install", "-e", ".[no-such-extra]"])


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 200


@pytest.mark.parametrize("index", range(len(blocks(README, "python"))))
def test_each_python_block_runs_on_two_ranks(index):
    code = blocks(README, "python")[index]
    assert "--nproc-per-node 2" in code.splitlines()[0]  # each block says how it is run
    outputs = dist_harness.run(2, run_block, code, timeout=240)
    assert len(outputs) == 2


@pytest.mark.parametrize(
    "index", [i for i, b in enumerate(blocks(README, "python")) if "python example.py" in b.split("\n")[0]]
)
def test_each_block_that_says_so_runs_as_a_plain_process(tmp_path, index):
    """``python example.py``: no launcher, no process group made beforehand (LLM makes its own
    one-rank group and ends it)."""
    (tmp_path / "example.py").write_text(blocks(README, "python")[index])
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("print(" in blocks(README, "python")[index]) == bool(proc.stdout.strip()), proc.stdout
    said = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert not said, proc.stderr[-3000:]  # (transformers' from_pretrained shows its progress)
