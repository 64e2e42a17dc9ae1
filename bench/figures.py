"""The documentation's figures, drawn from the benchmarks' recorded results.

    python bench/figures.py                    # writes docs/figures/*.png
    python bench/figures.py --out /tmp/figs    # somewhere else

Every number comes from ``bench/RESULTS.md`` (the tables each bench printed, recorded with their
command, machine and commit) or from a plot a bench or a run wrote itself (``bench/serve.py --png``,
an online run's ``latency.png``); nothing is typed in here. Each figure names the section of
``RESULTS.md`` it reads, so a rerun that replaces a table there is one command away from the docs:
rerun this script.
"""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
MACHINE = "2 CPU cores, gloo, torch 2.13.0+cpu"


# ---- reading RESULTS.md --------------------------------------------------------------------------
def section(text: str, heading: str) -> str:
    """The body of the section whose heading line is ``heading`` (e.g. ``"## shift (issue 4)"``), up
    to the next heading of the same or a higher level; ``ValueError`` naming it when it is missing."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    if heading not in lines:
        raise ValueError(f"bench/RESULTS.md has no section {heading!r}")
    start = lines.index(heading) + 1
    end = start
    while end < len(lines) and not _ends(lines[end], level):
        end += 1
    return "\n".join(lines[start:end])


def _ends(line: str, level: int) -> bool:
    """Whether ``line`` is a heading of ``level`` or higher (fewer ``#``)."""
    match = re.match(r"^(#+) ", line)
    return match is not None and len(match.group(1)) <= level


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every pipe table of ``text``, each a list of rows keyed by the header's cells."""
    found, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) > 2:
            found.append([dict(zip(block[0], row)) for row in block[2:]])
        block = []
    return found


def table_with(text: str, column: str) -> list[dict[str, str]]:
    """The last table of ``text`` that has a column named ``column`` (later reruns come last)."""
    matching = [t for t in tables(text) if column in t[0]]
    if not matching:
        raise ValueError(f"no table with a column {column!r} in this section of bench/RESULTS.md")
    return matching[-1]


def number(cell: str) -> float:
    """The first number in a cell: ``"53.5 (54.9, 55.5)"`` -> 53.5, ``"**1.17x**"`` -> 1.17."""
    match = re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))
    if match is None:
        raise ValueError(f"no number in the cell {cell!r}")
    return float(match.group())


# ---- the figures ---------------------------------------------------------------------------------
def engine_vs_hf(text: str, plt, out: Path) -> Path:
    """Ours / HF ``generate`` on the realistic offline workload, per setup, batch and admission."""
    rows = table_with(section(text, "### Realistic offline workload"), "ours/HF")
    labels = [f"{r['setup']} B={r['B']}\n{r['ours (admission)']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(rows)), [number(r["ours/HF"]) for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    ax.set(ylabel="useful tokens/s, ours / HF generate")
    ax.set_title(f"Engine vs HF generate: 99.5M Llama, 32 requests, {MACHINE}", fontsize=9)
    return _save(fig, out / "engine-vs-hf.png")


def shift(text: str, plt, out: Path) -> Path:
    """Shift, SP-only and the plain TP engine against TP-only on the bursty trace (the last run)."""
    rows = table_with(section(text, "## shift (issue 4)"), "TTFT burst")
    metrics = ["TTFT long", "TTFT burst", "TPOT", "gen tok/s", "wire bytes"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    _grouped_bars(ax, rows, "engine", metrics)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(ylabel="ratio vs TP-only (times: lower is better)")
    ax.set_title(f"Shift on a bursty trace, SP4 / TP4 on 4 ranks, {MACHINE}", fontsize=9)
    return _save(fig, out / "shift.png")


def seesaw(text: str, plt, out: Path) -> Path:
    """Throughput of the static layouts and the Seesaw pairs on 4 ranks, both workloads."""
    body = section(text, "## Seesaw (issue 5)")
    pattern = r"^(long-in|balanced)\s+((?:static|seesaw) \S+)\s+[\d.]+\s+([\d.]+)"
    rows = re.findall(pattern, body, flags=re.M)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, workload in zip(axes, ("long-in", "balanced")):
        mine = [(engine, float(tps)) for w, engine, tps in rows if w == workload]
        colors = ["tab:orange" if e.startswith("seesaw") else "tab:blue" for e, _ in mine]
        ax.barh([e for e, _ in mine], [t for _, t in mine], color=colors)
        ax.set(title=workload, xlabel="(prompt + generated) tokens/s")
    fig.suptitle(f"Seesaw vs static layouts, tiny Llama, 4 ranks on {MACHINE}", fontsize=9)
    return _save(fig, out / "seesaw.png")


def sidp(text: str, plt, out: Path) -> Path:
    """Decode step time against the batch per replica: replicated DP, WaS, CaS, an all-gather."""
    rows = table_with(section(text, "### After the zero-copy fetch (commit badd64d)"), "WaS ms/step")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    batch = [number(r["b per replica"]) for r in rows]
    for column in ("DP ms/step", "WaS ms/step", "CaS ms/step", "all-gather ms/step"):
        ax.plot(batch, [number(r[column]) for r in rows], marker="o", label=column.split()[0])
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequences per replica (b)", ylabel="decode step, ms")
    ax.set_title(f"SiDP decode step vs replicated DP, 2 replicas, {MACHINE}", fontsize=9)
    ax.legend()
    return _save(fig, out / "sidp.png")


def rl_sync(text: str, plt, out: Path) -> Path:
    """Weight-sync seconds per training layout: ours against ``full_tensor`` and a broadcast."""
    rows = table_with(
        section(text, "## Training layouts, dtype conversion, verify and delta sync (issue 23)"), "sync s"
    )
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        seconds = [number(_row(rows, scenario=s, method=method)["sync s"]) for s in scenarios]
        ax.bar([j + i * width for j in range(len(scenarios))], seconds, width, label=method)
    ax.set_xticks([j + width for j in range(len(scenarios))], scenarios, fontsize=7, rotation=20, ha="right")
    ax.set(ylabel="sync seconds (lower is better)")
    ax.set_title(f"RL weight sync, 159.9M Llama, 4 ranks on {MACHINE}", fontsize=9)
    ax.legend()
    return _save(fig, out / "rl-sync.png")


def online(text: str, plt, out: Path) -> Path:
    """Throughput, TTFT and TPOT (p50) against the arrival rate, one line per layout."""
    rows = table_with(section(text, "### 4. Arrival-rate sweep on 4 ranks"), "TTFT p50")
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, column in zip(axes, ("tok/s", "TTFT p50", "TPOT p50")):
        for layout in layouts:
            mine = [r for r in rows if r["layout"] == layout]
            ax.plot([number(r["rate (req/s)"]) for r in mine], [number(r[column]) for r in mine], marker="o")
        unit = "tokens/s" if column == "tok/s" else "ms, log scale"
        ax.set(xlabel="arrival rate (requests/s)", ylabel=f"{column} [{unit}]")
        if column != "tok/s":
            ax.set_yscale("log")
    fig.legend(layouts, loc="lower center", ncol=len(layouts), fontsize=8)
    fig.suptitle(f"Online serving, 32 requests, Poisson arrivals, 4 ranks on {MACHINE}", fontsize=9)
    return _save(fig, out / "online.png", bottom=0.1)


def serve_latency(_text: str, _plt, out: Path) -> Path:
    """The end-to-end latency plot ``bench/serve.py --png bench/serve`` wrote (its run's own figure)."""
    return Path(shutil.copyfile(ROOT / "bench" / "serve-latency.png", out / "serve-latency.png"))


def online_run(_text: str, _plt, out: Path) -> Path:
    """The ``latency.png`` an online run of ``reshard generate`` wrote into its run directory, kept
    as ``bench/online-run-latency.png`` (its command is in ``bench/RESULTS.md``)."""
    return Path(shutil.copyfile(ROOT / "bench" / "online-run-latency.png", out / "online-run-latency.png"))


FIGURES: tuple[Callable, ...] = (engine_vs_hf, shift, seesaw, sidp, rl_sync, online, serve_latency, online_run)


# ---- drawing -------------------------------------------------------------------------------------
def _row(rows: list[dict[str, str]], **match: str) -> dict[str, str]:
    """The one row whose cells equal ``match``."""
    [row] = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return row


def _grouped_bars(ax, rows: list[dict[str, str]], key: str, metrics: list[str]) -> None:
    """On ``ax``, one group of bars per metric, one bar per row (labelled by its ``key`` cell)."""
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax.bar([j + i * width for j in range(len(metrics))], [number(row[m]) for m in metrics], width, label=row[key])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], metrics)
    ax.legend(fontsize=8)


def _save(fig, path: Path, bottom: float = 0.0) -> Path:
    """Write ``fig`` to ``path`` as a PNG without the software's name, so a rerun on the same data
    gives the same bytes (``bottom``: the share of the height kept for a legend); returns ``path``."""
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


def draw(out: Path, results: Path = RESULTS) -> list[Path]:
    """Draw every figure of :data:`FIGURES` into ``out``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    text = results.read_text()
    written = []
    for figure in FIGURES:
        written.append(figure(text, plt, out))
        plt.close("all")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "figures", help="where the PNGs go")
    args = p.parse_args()
    for path in draw(args.out):
        print(path)


if __name__ == "__main__":
    main()
