"""Global efficiency factors of the cost model, fitted on published measurements.

The cost model (:mod:`parallel.cost.roofline`) is physical: FLOPs, bytes, link bandwidth and
latency, memory, from datasheets and model configs. Real systems reach a fraction of the peaks;
:class:`Efficiency` is the short, named list of what may be fitted to account for that, each one
global (the same for every model, layout, workload and row): achieved fractions of peak FLOP/s, of
memory bandwidth and of link bandwidth in collectives (per link type: PCIe, NVLink), a multiplier
of the per-message link latency, and a per-step overhead, one per kind of serving engine
(:data:`ENGINES`): an overhead is global across the rows measured on that kind of engine, and each
paper's rows name theirs (:mod:`parallel.cost.papers`; with today's rows, in effect one per paper).
Nothing else can be fitted (:func:`fit` refuses other names), so a fit cannot encode one row's
answer.

:func:`fit` searches those factors (every combination of a log grid) to minimise a loss over
the *training* rows it is given, and sees nothing else: the held-out rows are predicted with the
result (``bench/cost_vs_papers.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import pickle
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType

from reshard.parallel.cost.profiles import Hardware


@dataclass(frozen=True)
class Efficiency:
    """What is fitted (defaults: the datasheet peaks, no overhead)."""

    compute: float = 1.0  # achieved fraction of peak dense FLOP/s
    memory: float = 1.0  # achieved fraction of peak memory bandwidth
    pcie: float = 1.0  # achieved fraction of link bandwidth in collectives and sends over PCIe
    nvlink: float = 1.0  # the same over NVLink (and any other link)
    socket: float = 1.0  # the same over the link between CPU sockets (a topology level of kind "socket")
    latency: float = 1.0  # multiplier of the per-message link latency
    sync_overhead: float = 0.0  # seconds per forward step of a stage on a "sync" engine (ENGINES)
    async_overhead: float = 0.0  # the same on an "async" engine

    def apply(self, hw: Hardware, *, engine: str) -> Hardware:
        """``hw`` as it performs: peaks scaled, latency multiplied, ``hw.step_overhead`` the
        overhead of ``engine`` (one of :data:`ENGINES`)."""
        link = self.link(hw.link)
        collectives = {k: (lat * self.latency, bw * link) for k, (lat, bw) in hw.collectives.items()}
        levels = tuple(
            dataclasses.replace(lv, bw=lv.bw * self.link(lv.kind), latency=lv.latency * self.latency)
            for lv in hw.topology
        )
        return dataclasses.replace(
            hw,
            topology=levels,
            flops=hw.flops * self.compute,
            mem_bw=hw.mem_bw * self.memory,
            link_bw=hw.link_bw * link,
            link_latency=hw.link_latency * self.latency,
            collectives=collectives,
            step_overhead=getattr(self, overhead_of(engine)),
        )

    def seen_by(self, engine: str) -> Efficiency:
        """These factors with every other engine's overhead at 0: what a row measured on ``engine``
        reads (two points that differ only in another engine's overhead cost it the same)."""
        read = overhead_of(engine)
        return dataclasses.replace(self, **{name: 0.0 for name in OVERHEADS.values() if name != read})

    def link(self, kind: str) -> float:
        """The factor of a link of ``kind``: ``pcie``, ``socket``, else ``nvlink`` (NVLink, a calibrated
        machine's ``gloo``; a topology's level kinds are checked where the level is made)."""
        return {"pcie": self.pcie, "socket": self.socket}.get(kind, self.nvlink)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


FITTABLE = tuple(f.name for f in dataclasses.fields(Efficiency))

# The kind of serving engine a measurement ran on, and the factor that holds its per-step overhead:
# what a step costs beyond the roofline (the engine's CPU work per step: scheduling, preparing
# inputs, processing outputs; and whatever else a step pays that the model lacks). That is
# software, not hardware, so each kind has its own fitted value.
# "sync": every per-step task runs in the step loop, between GPU steps, in one process: vLLM 0.5
#   (Seesaw's baseline, 0.5.4; vLLM's blog "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency
#   Reduction", 2024-09-05, profiled 0.5.3 serving Llama 3 8B on one H100 online: scheduling 29% of
#   the time, the API server 33%), Seesaw's 2024 engine (assumed: section 5.1 describes one scheduler
#   sending each step to workers through shared queues, and no overlap of that work with the step),
#   and reshard's loop (admit, policy, step, sample, agree on tokens, retire: parallel.engine.loop;
#   its cost is not measured on a GPU here), so the planner's default.
# "async": output processing and request intake run beside the step loop: vLLM V1 (the default
#   engine from 0.8; vLLM's blog "vLLM V1: A Major Upgrade to vLLM's Core Architecture", 2025-01-27:
#   the engine core's schedule-and-execute loop in its own process, tokenization, detokenization and
#   streaming in another, a persistent batch): Shift's rows (vLLM v0.9.2) and SiDP's (vLLM 0.10.1).
OVERHEADS = MappingProxyType({"sync": "sync_overhead", "async": "async_overhead"})
ENGINES = tuple(OVERHEADS)


def overhead_of(engine: str) -> str:
    """The :class:`Efficiency` factor that holds ``engine``'s per-step overhead; ``ValueError``
    naming ``engine`` when it is not one of :data:`ENGINES`."""
    if engine not in OVERHEADS:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return OVERHEADS[engine]


# ``python bench/cost_vs_papers.py``'s fit on the A10 and H200 rows (bench/RESULTS.md, "Cost model
# vs the papers"); ``recipes.plan efficiency=fitted`` uses it; a test re-fits around it
FITTED = Efficiency(
    compute=0.35, memory=1.0, pcie=1.0, nvlink=0.25, socket=0.25, latency=0.1, sync_overhead=0.016, async_overhead=0.008
)
EFFICIENCIES = MappingProxyType({"datasheet": Efficiency(), "fitted": FITTED})

# the values each factor may take (log-spaced; the overhead in seconds)
GRID: MappingProxyType[str, tuple[float, ...]] = MappingProxyType(
    {
        "compute": (0.1, 0.15, 0.25, 0.35, 0.5, 0.7, 1.0),
        "memory": (0.4, 0.55, 0.7, 0.85, 1.0),
        "pcie": (0.15, 0.25, 0.4, 0.6, 1.0),
        "nvlink": (0.25, 0.5, 1.0),
        "socket": (0.25, 0.5, 1.0),
        "latency": (0.1, 0.25, 0.5, 1.0, 2.0, 4.0),
        "sync_overhead": (0.0, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3),
        "async_overhead": (0.0, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3),
    }
)


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` if every one is a field of :class:`Efficiency`; else a ``ValueError`` naming them."""
    unknown = [n for n in names if n not in FITTABLE]
    if unknown or not names:
        raise ValueError(f"only global efficiency factors can be fitted, {list(FITTABLE)}; got {list(names)}")
    return tuple(names)


Loss = Callable[[Efficiency, Sequence], float]
Report = Callable[[str], None] | None


def fit(
    loss: Loss,
    rows: Sequence,
    names: Sequence[str] = FITTABLE,
    *,
    grid: dict[str, tuple[float, ...]] | None = None,
    workers: int = 1,
    report: Report = None,
) -> tuple[Efficiency, float]:
    """The :class:`Efficiency` minimising ``loss(efficiency, rows)`` over every combination of
    ``grid`` values of the factors ``names`` (the others stay at their defaults; ties keep the
    first in grid order), and its loss. ``loss`` sees ``rows`` and nothing else; ``workers`` and
    ``report``: :func:`grid_losses`'s."""
    names, grid = check_names(names), grid or GRID
    missing = [n for n in names if n not in grid]
    if missing:
        raise ValueError(f"the grid has no values for {missing}; it has {sorted(grid)}")
    points = [Efficiency(**dict(zip(names, values))) for values in itertools.product(*(grid[n] for n in names))]
    best, best_loss = Efficiency(), math.inf
    for trial, trial_loss in zip(points, grid_losses(loss, rows, points, workers=workers, report=report)):
        if trial_loss < best_loss - 1e-12:
            best, best_loss = trial, trial_loss
    return best, best_loss


def grid_losses(
    loss: Loss,
    rows: Sequence,
    points: Sequence[Efficiency],
    *,
    workers: int = 1,
    report: Report = None,
) -> list[float]:
    """``loss(point, rows)`` of every point, in order: in this process, or with ``workers > 1`` in
    that many spawned processes (``loss`` and ``rows`` must pickle: a module-level function);
    ``report`` gets a line when a chunk of points ends past another tenth of the grid."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    if workers > 1:
        _check_pickles(loss, rows)
    size = max(1, min(500, len(points) // (4 * workers)))
    chunks = [points[i : i + size] for i in range(0, len(points), size)]
    if workers == 1:
        return _gather((_chunk_losses(loss, rows, c) for c in chunks), len(points), report)
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        done = pool.map(_chunk_losses, itertools.repeat(loss), itertools.repeat(rows), chunks)
        return _gather(done, len(points), report)


def _check_pickles(loss: Loss, rows: Sequence) -> None:
    """``ValueError`` naming ``loss`` when it or ``rows`` cannot reach a worker process."""
    try:
        pickle.dumps((loss, rows))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        msg = (
            f"workers > 1 sends the loss and rows to worker processes; the loss {loss!r} or its rows do not pickle: {e}"
        )
        raise ValueError(msg) from e


def _chunk_losses(loss: Loss, rows: Sequence, points: Sequence[Efficiency]) -> list[float]:
    """One chunk of :func:`grid_losses` (in a worker process when there are several)."""
    return [loss(p, rows) for p in points]


def _gather(chunks: Iterable[list[float]], total: int, report: Report) -> list[float]:
    """The chunks' losses in order, a line to ``report`` each time another tenth is done."""
    out: list[float] = []
    for chunk in chunks:
        tenths = len(out) * 10 // max(total, 1)
        out += chunk
        if report is not None and len(out) * 10 // max(total, 1) > tenths:
            report(f"fit: {len(out)} of {total} points, best loss so far {min(out):.3f}")
    return out


def log_ratio(best: float, got: float) -> float:
    """``log(best / got)``: 0 when ``got`` is the best, growing as it falls behind (inf at 0)."""
    return math.inf if got <= 0 else math.log(best / got)
