"""The documentation site says what the code says. ``mkdocs build --strict`` passes (no broken
link, anchor or cross-reference); the API reference renders the front door; the configuration
reference holds every key of every job and strategy; every key a page names exists; every code
block of ``docs/`` runs or is checked, as ``tests/test_readme.py`` does for the README; and the
figures are the ones ``bench/figures.py`` draws from the benches' recorded results."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dist_harness
from tests.test_readme import README, ROOT, blocks, check_command, commands, run_block

DOCS = ROOT / "docs"
PAGES = {p.relative_to(DOCS).as_posix(): p.read_text() for p in sorted(DOCS.rglob("*.md"))}
LANGUAGES = ("bash", "python", "mermaid")  # every fenced block is one of these (text output is prose)
SECTIONS = ("workload", "generation", "engine", "fault", "serve", "parallel", "rollout", "train")


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """``(page, index, body)`` of every ``lang`` block of ``docs/``."""
    return [(page, i, body) for page, text in PAGES.items() for i, body in enumerate(blocks(text, lang))]


SHELL = [(page, words) for page, _, body in _blocks("bash") for words in commands(body)]
PYTHON = _blocks("python")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with ``mkdocs build --strict`` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def _html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def test_the_site_builds_strict_with_every_page(site):
    built = {p.relative_to(site).parent.as_posix() for p in site.rglob("index.html")}
    for page in PAGES:
        assert (page[:-3].removesuffix("index").rstrip("/") or ".") in built, page
    assert "reference/configuration" in built


@pytest.mark.parametrize(
    "page, anchor",
    [
        ("reference/api/reshard", "reshard.LLM"),
        ("reference/api/reshard", "reshard.SamplingParams"),
        ("reference/api/reshard", "reshard.redistribute"),
        ("reference/api/parallel", "reshard.parallel.EngineConfig"),
        ("reference/api/parallel", "reshard.parallel.engine.EngineCore"),
        ("reference/api/layers", "reshard.layers.ParallelLinear"),
        ("reference/api/integrations", "reshard.integrations.trl.RolloutFunc"),
        ("reference/api/integrations", "reshard.integrations.verl.Rollout"),
    ],
)
def test_the_api_reference_renders(site, page, anchor):
    html = _html(site, page)
    assert f'id="{anchor}"' in html
    assert re.search(rf'id="{re.escape(anchor)}".*?class="doc doc-contents', html, flags=re.S), anchor


@pytest.fixture(scope="module")
def job_keys() -> dict[str, list[str]]:
    """Every key of every job (``parallel.*``: the default strategy's) and of every built-in
    strategy (not those other tests register in this process)."""
    from reshard.parallel.engine import registered, strategy_class
    from reshard.recipes.cli import JOBS
    from reshard.recipes.preflight import flat_defaults

    keys = {job: [k for k, _ in flat_defaults(job, [])] for job in JOBS}
    for name in [n for n in registered() if strategy_class(n).__module__.startswith("reshard.parallel.strategies")]:
        keys[f"parallel={name}"] = [k for k, _ in flat_defaults("generate", [f"parallel={name}"])]
    return keys


def test_every_config_key_is_in_the_configuration_reference(site, job_keys):
    html = _html(site, "reference/configuration")
    sections = {m.group(1): m.start() for m in re.finditer(r'<h3 id="(parallel\w+)"', html)}
    for group, keys in job_keys.items():
        text = html
        if group.startswith("parallel="):  # a strategy's keys, in its own section
            name = group.split("=")[1]
            start = sections[f"parallel{name}"]
            text = html[start : min([s for s in sections.values() if s > start], default=len(html))]
        missing = [
            k
            for k in keys
            if (k.startswith("parallel.") == group.startswith("parallel=")) and f"<code>{k}</code>" not in text
        ]
        assert not missing, f"{group}: keys missing from the configuration reference: {missing}"


def test_every_config_key_a_page_names_exists(job_keys):
    """A key renamed in the dataclasses breaks a page that still names it (README included)."""
    known = {k for keys in job_keys.values() for k in keys}
    prefixes = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    pattern = rf"`((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_.]*|(?:model|sync)\.[a-z_.]+(?==))(=[^`]*)?`"
    named = {
        (page, m.group(1)) for page, text in [("README.md", README), *PAGES.items()] for m in re.finditer(pattern, text)
    }
    files = re.compile(r"\.(py|png|json|jsonl|yaml|md)$")  # `parallel.py`, `rollout.png`: files, not keys
    unknown = sorted((p, k) for p, k in named if k not in known and k not in prefixes and not files.search(k))
    assert not unknown, f"keys named in the docs that no config has: {unknown}"
    assert len(named) > 40  # the pattern finds the pages' keys


def test_every_fenced_block_is_run_or_checked():
    fences = [lang for text in PAGES.values() for lang in re.findall(r"^ *```(\w*) *$", text, flags=re.M)]
    labelled = [lang for lang in fences if lang]
    assert len(labelled) * 2 == len(fences), "a block without a language (every block opens with one)"
    assert set(labelled) <= set(LANGUAGES), f"blocks of a language nothing checks: {set(labelled) - set(LANGUAGES)}"
    assert len(SHELL) >= 20 and len(PYTHON) >= 8


@pytest.mark.parametrize("page, words", SHELL, ids=[f"{page}: {' '.join(words[:4])}" for page, words in SHELL])
def test_each_docs_command_checks(page, words):
    check_command(words)


def _how_run(code: str) -> int:
    """Ranks a block runs on: 2 (``torchrun --nproc-per-node 2``), 1 (``python example.py``), or 0
    (compiled and its imports resolved: a block that needs a server or a trainer)."""
    first = code.splitlines()[0]
    assert first.startswith("# "), f"a Python block says how it is run in its first line: {first!r}"
    if "--nproc-per-node 2" in first:
        return 2
    return 1 if first.startswith("# python example.py") else 0


@pytest.mark.parametrize("page, index, code", PYTHON, ids=[f"{page}#{index}" for page, index, _ in PYTHON])
def test_each_docs_python_block_runs_or_checks(page, index, code):
    ranks = _how_run(code)
    if ranks:
        outputs = dist_harness.run(ranks, run_block, code, f"docs/{page} python block {index}", timeout=240)
        assert len(outputs) == ranks
        return
    tree = ast.parse(code, f"docs/{page}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            assert all(hasattr(module, a.name) for a in node.names), f"{page}: {ast.unparse(node)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


def test_most_docs_python_blocks_run():
    assert sum(_how_run(code) > 0 for *_, code in PYTHON) >= len(PYTHON) - 3


def _figures_module():
    spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "bench" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_figures_are_what_bench_figures_draws(tmp_path):
    """Byte for byte (the figures are saved without the software's name): a table of
    bench/RESULTS.md changed without rerunning ``python bench/figures.py`` fails here."""
    drawn = _figures_module().draw(tmp_path)
    kept = sorted((DOCS / "figures").glob("*.png"))
    assert sorted(p.name for p in drawn) == [p.name for p in kept]
    for path in kept:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name
        assert path.read_bytes() == (tmp_path / path.name).read_bytes(), f"{path.name}: rerun python bench/figures.py"


def test_every_figure_is_shown_on_a_page():
    for path in (DOCS / "figures").glob("*.png"):
        assert any(f"figures/{path.name})" in text for text in PAGES.values()), path.name


def test_a_missing_results_section_is_named():
    module = _figures_module()
    with pytest.raises(ValueError, match="no section '## nothing'"):
        module.section("# Benchmark results\n", "## nothing")


def test_every_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local and all((ROOT / link).exists() for link in local), [x for x in local if not (ROOT / x).exists()]
