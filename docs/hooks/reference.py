"""MkDocs hooks: the pages generated from the code, so that no fact is copied by hand.

* ``reference/configuration.md``: every key of every job and strategy, with its default, type and
  note, read from the config dataclasses (the source ``reshard <job> --keys`` prints) and, for a
  field without a note of its own, the comment beside it in ``conf/<job>.yaml``.
* ``<!-- hardware-table -->`` in a page: the planner's hardware profiles
  (:data:`reshard.parallel.cost.profiles.HARDWARE`), with their AWS names.
* mkdocstrings reads the packages where ``pyproject.toml`` maps them (``reshard.parallel`` lives in
  ``parallel/``): a tree of links in the temporary directory gives griffe the import layout.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import html
import inspect
import io
import json
import re
import shutil
import tempfile
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import tomllib
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = "reference/configuration.md"
HARDWARE_MARK = "<!-- hardware-table -->"


# ---- the import layout for griffe ----------------------------------------------------------------
def source_tree(root: Path = ROOT) -> Path:
    """A directory where ``reshard/`` holds ``pyproject.toml``'s package-dir mapping as links
    (``reshard/parallel`` -> ``parallel/``, ...), rebuilt on every call; returns it."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = Path(tempfile.gettempdir()) / f"reshard-docs-{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / "reshard"
    package.mkdir(parents=True)
    for entry in (root / mapping["reshard"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "reshard":
            assert name.count(".") == 1, f"package-dir maps a nested package {name}: link it here"
            (package / name.split(".")[1]).symlink_to(root / folder)
    return tree


@event_priority(100)  # before mkdocstrings reads its handler's options
def on_config(config):
    handler = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    handler["paths"] = [str(source_tree())]
    return config


# ---- the configuration reference -----------------------------------------------------------------
def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, CONFIG_PAGE, content=configuration_page()))
    return files


def configuration_page() -> str:
    """The configuration reference, in Markdown."""
    from reshard.parallel.engine import registered
    from reshard.recipes.cli import JOBS

    lines = [
        "# Configuration reference",
        "",
        "Generated when the site is built, from the config dataclasses that Hydra checks every YAML and",
        "override against (the source `reshard <job> --keys` prints). Set a key on the command line as",
        "`key=value`; `--check` checks a config without running it. A note comes from the field's",
        "docstring or comment, else from its line in `conf/<job>.yaml`.",
        "",
    ]
    generate = entries("generate", [])
    for job in JOBS:
        mine = generate if job == "generate" else entries(job, [])
        if job == "serve" and [e[0] for e in mine] == [e[0] for e in generate]:
            lines += ["## `reshard serve`", "", "The keys of `reshard generate`; `serve.*` are its server's.", ""]
            continue
        lines += [f"## `reshard {job}`", ""]
        lines += _sections([e for e in mine if not e[0].startswith("parallel.")], level="###")
    lines += ["## Strategies (`parallel=<name>`)", ""]
    for name in registered():
        mine = [e for e in entries("generate", [f"parallel={name}"]) if e[0].startswith("parallel.")]
        lines += [f"### `parallel={name}`", "", *_table(mine)]
    return "\n".join(lines) + "\n"


def entries(job: str, overrides: list[str]) -> list[tuple[str, str, str, str]]:
    """``(key, default, type, note)`` of every key of ``job``'s config with ``overrides``, in the
    order ``reshard <job> --keys`` prints them."""
    from reshard.recipes import schema

    yaml_notes = _yaml_notes(job, overrides)
    derived = {k for k, v in _yaml_values(job).items() if v.startswith("${") and k in yaml_notes}
    notes: dict[type, dict[str, str]] = {}
    out = []

    def walk(node: Any, path: str) -> None:
        for spec in dataclasses.fields(node):
            value = getattr(node, spec.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{path}{spec.name}.")
                continue
            note = _note(type(node), spec.name, notes) or yaml_notes.get(path + spec.name, "")
            if path + spec.name in derived:  # the value shown is the default strategy's
                note = f"{note} Default: {yaml_notes[path + spec.name]}".strip()
            out.append((path + spec.name, json.dumps(value, default=repr), str(spec.type), note))

    walk(schema.compose(job, overrides), "")
    return out


def _sections(rows: list[tuple[str, str, str, str]], *, level: str) -> list[str]:
    """One table per config section (the first part of the key); top-level keys last."""
    heads = list(dict.fromkeys(key.split(".")[0] for key, *_ in rows if "." in key))
    out = []
    for head in heads:
        out += [f"{level} `{head}`", "", *_table([r for r in rows if r[0].startswith(head + ".")])]
    top = [r for r in rows if "." not in r[0] and r[0] != "parallel"]
    return out + ([f"{level} Top-level keys", "", *_table(top)] if top else [])


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | default | type | note |", "|---|---|---|---|"]
    lines += [
        f"| `{key}` | {_code(value)} | {_code(kind)} | {_cell(_markdown(note))} |" for key, value, kind, note in rows
    ]
    return [*lines, ""]


def _cell(text: str) -> str:
    """``text`` on one line, safe inside a table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as inline code inside a table cell (a backslash before ``|`` would show in a code span)."""
    return "<code>" + html.escape(" ".join(text.split())).replace("|", "&#124;") + "</code>"


def _markdown(text: str) -> str:
    """A docstring's reST roles and double backticks as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def _note(cls: type, name: str, notes: dict[type, dict[str, str]]) -> str:
    """The note of field ``name`` in ``cls`` or the first base class that declares it
    (``notes``: each class's notes, filled as they are read)."""
    for klass in cls.__mro__:
        if klass not in notes:
            notes[klass] = field_notes(klass)
        if notes[klass].get(name):
            return notes[klass][name]
    return ""


def field_notes(cls: type) -> dict[str, str]:
    """Each annotated field of ``cls``'s own body and its note: the docstring under it, else the
    comment at the end of its line, else the comment lines right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = _comments(source)
    [body] = ast.parse(source).body
    notes = {}
    for i, node in enumerate(body.body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            notes[node.target.id] = _docstring_after(body.body, i) or _comment_at(comments, node)
    return notes


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the comment is the whole line)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.strip().startswith("#")
            out[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    return out


def _docstring_after(body: list[ast.stmt], i: int) -> str:
    nxt = body[i + 1] if i + 1 < len(body) else None
    if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
        return inspect.cleandoc(nxt.value.value)
    return ""


def _comment_at(comments: dict[int, tuple[str, bool]], node: ast.AnnAssign) -> str:
    trailing = comments.get(node.end_lineno)
    if trailing and not trailing[1]:
        return trailing[0]
    above, line = [], node.lineno - 1
    while line in comments and comments[line][1]:
        above.insert(0, comments[line][0])
        line -= 1
    return " ".join(above)


def _yaml_notes(job: str, overrides: list[str]) -> dict[str, str]:
    """Full key -> the comment on its line in ``conf/<job>.yaml`` (and the strategy's YAML)."""
    notes = _yaml_comments(ROOT / "conf" / f"{job}.yaml", "")
    if job == "serve":
        notes = {**_yaml_comments(ROOT / "conf" / "generate.yaml", ""), **notes}
    for override in overrides:
        name = override.split("=", 1)[1]
        notes.update(_yaml_comments(ROOT / "conf" / "parallel" / f"{name}.yaml", "parallel."))
    return notes


def _yaml_values(job: str) -> dict[str, str]:
    """Full key -> its value as written in ``conf/<job>.yaml`` (an interpolation is resolved when
    the config is composed: by the strategy chosen)."""
    return {key: value for key, (value, _) in _yaml_lines(ROOT / "conf" / f"{job}.yaml", "").items()}


def _yaml_comments(path: Path, prefix: str) -> dict[str, str]:
    return {key: comment for key, (_, comment) in _yaml_lines(path, prefix).items() if comment}


def _yaml_lines(path: Path, prefix: str) -> dict[str, tuple[str, str]]:
    """Full key -> (its value as written, the comment on its line) in the YAML file ``path``."""
    if not path.is_file():
        return {}
    lines, stack = {}, []
    for line in path.read_text().splitlines():
        match = re.match(r"^( *)([A-Za-z_]\w*):(.*?)(?:#\s?(.*))?$", line)
        if match is None:
            continue
        indent, name, value, comment = match.groups()
        stack = [s for s in stack if s[0] < len(indent)] + [(len(indent), name)]
        lines[prefix + ".".join(s[1] for s in stack)] = (value.strip(), (comment or "").strip())
    return lines


# ---- the API reference ---------------------------------------------------------------------------
def on_page_content(html_text: str, page, config, files) -> str:
    """The docstrings' reST roles (``:class:`~reshard.x.Y```) as plain code (``Y``) in the API pages."""
    if not page.file.src_uri.startswith("reference/api/"):
        return html_text
    return re.sub(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>~?([^<]*)</code>", _role, html_text)


def _role(match: re.Match) -> str:
    name = match.group(1)
    short = name.rsplit(".", 1)[-1] if match.group(0).split("<code>")[1].startswith("~") else name
    return f"<code>{short}</code>"


# ---- the planner's hardware ----------------------------------------------------------------------
def on_page_markdown(markdown: str, page, config, files) -> str:
    if HARDWARE_MARK in markdown:
        markdown = markdown.replace(HARDWARE_MARK, hardware_table())
    return markdown


def hardware_table() -> str:
    """Every hardware profile the planner knows, as a Markdown table."""
    from reshard.parallel.cost.profiles import HARDWARE, MACHINES

    aliases = {profile: machine for machine, profile in MACHINES.items()}
    head = ["`hardware=`", "also", "memory GB", "memory GB/s", "dense TFLOP/s", "link", "link GB/s", "topology"]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, hw in HARDWARE.items():
        also = f"`{aliases[name]}`" if name in aliases else ""
        levels = ", ".join(f"{lv.name} ({lv.size} GPUs)" for lv in hw.topology) or "one flat link"
        rows.append(
            f"| `{name}` | {also} | {hw.memory / 1e9:.1f} | {hw.mem_bw / 1e9:.0f} | {hw.flops / 1e12:.0f} | "
            f"{hw.link} | {hw.link_bw / 1e9:.1f} | {levels} |"
        )
    return "\n".join(rows)
