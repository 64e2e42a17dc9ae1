"""The README's code blocks run as written: every ``reshard`` / ``torchrun`` command's config checks
for its ranks (the launcher's ``--check``: keys, values and layouts, without starting the job), the
test command is the one CI runs, and every Python block runs on the 2 ranks it is written for."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tests import dist_harness

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[list[str]]:
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


SHELL = [c for b in _blocks("bash") for c in _commands(b)]


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(_blocks("python")) >= 4 and sum(c[0] == "reshard" for c in SHELL) >= 10


@pytest.mark.parametrize("words", [c for c in SHELL if c[0] == "reshard"], ids=lambda c: " ".join(c[:4]))
def test_each_reshard_command_checks(words):
    from reshard.recipes.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*words[1:], "--check"]) == 0
    assert out.getvalue().startswith("ok: the ")


def test_the_torchrun_command_checks_for_its_world():
    from reshard.recipes.preflight import check

    [words] = [c for c in SHELL if c[0] == "torchrun"]
    flags = dict(zip(words[1::2], words[2::2]))
    world = int(flags["--nnodes"]) * int(flags["--nproc-per-node"])
    job = words[words.index("-m") + 1].rsplit(".", 1)[1]
    check(job, words[words.index("-m") + 2 :], world)


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"\n{ci}\n" in f"\n{_blocks('bash')[1]}"


def _run_block(code: str) -> str:
    """Execute a README Python block on this rank (the harness's process group stands in for
    torchrun's: the block's own ``init_process_group`` is skipped when one exists)."""
    code = code.replace('dist.init_process_group("gloo")', 'dist.is_initialized() or dist.init_process_group("gloo")')
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md python block", "exec"), {"__name__": "__readme__"})
    return out.getvalue()


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_each_python_block_runs_on_two_ranks(index):
    code = _blocks("python")[index]
    assert "--nproc-per-node 2" in code.splitlines()[0]  # each block says how it is run
    outputs = dist_harness.run(2, _run_block, code, timeout=240)
    assert len(outputs) == 2
