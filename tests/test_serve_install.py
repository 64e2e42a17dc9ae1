"""``reshard serve`` after the README's first set-up command (``pip install -e .``, no extra): its
HTTP packages are base requirements of the installed distribution, the server starts on the
default model with ``--nproc 1`` and answers, and an install that still lacks them gets one line
naming the pip command (exit 2, no traceback) before any rank starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from importlib import metadata

import pytest

from tests.test_readme import README, blocks, commands
from tests.test_serve import launch_server, stop

NEW = 6


def _base_requirements() -> set[str]:
    """The names the installed ``reshard`` requires without any extra (lower case)."""
    base = [r for r in metadata.requires("reshard") or [] if "extra ==" not in r.replace('"', "").replace("'", "")]
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in base}


def _first_setup_command() -> list[list[str]]:
    """The README's first set-up command, split at ``&&``."""
    return commands(blocks(README, "bash")[0])


def test_the_first_setup_command_installs_the_server_packages_as_base_requirements():
    pip, install, run = _first_setup_command()
    assert pip[:2] == ["pip", "install"] and pip[2].startswith("torch==")
    assert install == ["pip", "install", "-e", "."]  # the package alone: no extra
    assert run[0] == "reshard"
    assert {"fastapi", "uvicorn"} <= _base_requirements(), (
        f"reshard's base requirements {sorted(_base_requirements())} lack the server's; "
        "if pyproject.toml has them, this install is older: pip install -e ."
    )
    [script] = metadata.entry_points(group="console_scripts", name="reshard")
    assert script.value == "reshard.recipes.cli:entry"  # the command the tests below run


def _complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.timeout(300)
def test_reshard_serve_nproc_1_on_the_default_model_answers_a_completion(tmp_path, hf_reference):
    from transformers import AutoTokenizer

    from reshard.parallel.model.tiny_models import BUILTIN_NAME

    env = {**os.environ, "RESHARD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    server = launch_server(tmp_path / "run", ["--nproc", "1"], env)  # the default model, built under env's cache
    try:
        body = {"model": BUILTIN_NAME, "prompt": "Hello there", "max_tokens": NEW, "temperature": 0}
        out = _complete(server.url, body)
    finally:
        assert stop(server) == 0, server.log.read_text()
    path = str(tmp_path / "cache" / BUILTIN_NAME)  # the default model the job built
    tokenizer = AutoTokenizer.from_pretrained(path)
    [want] = hf_reference(path, [tokenizer("Hello there")["input_ids"]], NEW)
    assert out["model"] == BUILTIN_NAME
    assert out["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert out["usage"]["completion_tokens"] == len(want)


def test_a_missing_http_package_is_one_line_naming_the_pip_command(tmp_path):
    """An install from before FastAPI was a base requirement (simulated: ``import fastapi`` fails)."""
    block = "import sys; sys.modules['fastapi'] = None; from reshard.recipes.cli import entry; entry()"
    run = subprocess.run(
        [sys.executable, "-c", block, "serve", "--nproc", "1", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2, lines
    assert len(lines) == 1, lines
    assert re.fullmatch(r"error: reshard serve needs fastapi, .*`pip install -e \.`.*", lines[0]), lines
    assert not (tmp_path / "run").exists()  # nothing started
