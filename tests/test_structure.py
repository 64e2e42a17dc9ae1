"""The house rules, checked statically: one import root, strategies independent of each other, Hydra
only in the recipes. No process, no torch: these read the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"reshard": "reshard", "reshard.layers": "layers", "reshard.parallel": "parallel",
            "reshard.recipes": "recipes", "reshard.conf": "conf"}  # fmt: skip
SHADOWABLE = ("layers", "parallel", "recipes", "conf")  # names users give their own files
STRATEGIES = ROOT / "parallel" / "strategies"


def _modules() -> dict[str, Path]:
    """Every library module by its import name (``reshard.parallel.engine.loop`` -> its file)."""
    out = {}
    for name, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((name, *parts))] = path
    return out


def _imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _strategy_of(module: str) -> str | None:
    """``reshard.parallel.strategies.seesaw.policy`` -> ``seesaw``; None outside the strategies."""
    prefix = "reshard.parallel.strategies."
    return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None


def test_library_imports_only_under_one_root():
    """No library module imports ``layers``, ``parallel``, ``recipes`` or ``conf`` as top-level
    names (they are ``reshard.*``), and none imports relatively."""
    offenders = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                offenders.append(f"{path}:{node.lineno}: relative import")
        offenders += [f"{path}: imports {n}" for n in _imports(path) if n.split(".")[0] in SHADOWABLE]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("strategy", sorted(p.stem for p in STRATEGIES.iterdir() if p.stem != "__init__"))
def test_no_strategy_imports_another(strategy):
    mine = STRATEGIES / strategy
    files = list(mine.rglob("*.py")) if mine.is_dir() else [STRATEGIES / f"{strategy}.py"]
    other = {
        f"{path.name}: {name}"
        for path in files
        for name in _imports(path)
        if _strategy_of(name) not in (None, strategy)
    }
    assert not other, f"strategy {strategy} imports another strategy: {sorted(other)}"


def test_only_recipes_touch_hydra():
    offenders = [
        f"{path}: imports {name}"
        for module, path in _modules().items()
        if not module.startswith("reshard.recipes")
        for name in _imports(path)
        if name.split(".")[0] in ("hydra", "omegaconf")
    ]
    assert not offenders, "\n".join(offenders)


def test_strategies_are_discovered_not_listed():
    """The registry finds every strategy module of the package: no list or tuple of their names."""
    names = {p.stem for p in STRATEGIES.iterdir() if p.stem not in ("__init__", "__pycache__")}
    tree = ast.parse((ROOT / "parallel" / "engine" / "registry.py").read_text())
    lists = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.List | ast.Tuple | ast.Set)
        and sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2
    ]
    assert not lists, f"registry.py lists strategy names at lines {lists}"
