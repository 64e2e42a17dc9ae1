"""The cost model's predictions for published measurements (:mod:`parallel.cost.papers`).

For a Seesaw Fig. 10 row the paper names the best static layout it measured and the Seesaw pair
it ran; the model ranks every static layout and every pair of the same GPUs that keeps ``dp`` (the
paper's Seesaw re-shards only TP and PP, section 4.1). A row agrees when
the measured winner's predicted throughput is close to the model's own best (the ratio
``measured / best`` near 1): a model that ranks the measured winner low would send a user to
another layout.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from reshard.parallel.cost import roofline as cost
from reshard.parallel.cost import technique_models as models
from reshard.parallel.cost.fit import FITTABLE, OVERHEADS, Efficiency, Loss, Report, fit, log_ratio, overhead_of
from reshard.parallel.cost.papers import (
    VLLM_MAX_NUM_SEQS,
    Claim,
    LayoutWinner,
    Measured,
    Ordering,
    Ratio,
    StreamRow,
    Trend,
)
from reshard.parallel.cost.profiles import Hardware, hardware, model, workload
from reshard.parallel.cost.roofline import Estimate, ParallelConfig, rank_layouts
from reshard.parallel.cost.techniques import shift_room, shift_rows


@dataclass(frozen=True)
class WinnerCheck:
    """The model's view of one :class:`LayoutWinner` row."""

    row: LayoutWinner
    best_static: Estimate
    best_pair: Estimate
    measured_static: Estimate | None  # the model's estimate of the paper's static winner (None: infeasible)
    measured_pair: Estimate | None

    @property
    def static_ratio(self) -> float:
        """Predicted throughput of the measured static winner / the model's best static."""
        return self.measured_static.tokens_per_s / self.best_static.tokens_per_s if self.measured_static else 0.0

    @property
    def pair_ratio(self) -> float:
        return self.measured_pair.tokens_per_s / self.best_pair.tokens_per_s if self.measured_pair else 0.0

    @property
    def speedup(self) -> float:
        """Predicted measured pair / measured static (the paper's bar ratio)."""
        if not (self.measured_static and self.measured_pair):
            return math.nan
        return self.measured_pair.tokens_per_s / self.measured_static.tokens_per_s

    @property
    def loss(self) -> float:
        return log_ratio(1.0, self.static_ratio) + log_ratio(1.0, self.pair_ratio)


def why_behind(got: Estimate | None, best: Estimate) -> str:
    """One line: the phase in which ``got`` loses most per generated token against ``best``."""
    if got is None:
        return "infeasible in the model (does not fit)"
    if got is best:
        return ""
    per = {
        phase: (getattr(got, f"{phase}_s") / got.batch - getattr(best, f"{phase}_s") / best.batch)
        for phase in ("prefill", "decode", "transition")
    }
    phase = max(per, key=per.get)
    return f"{phase} +{per[phase] * 1e3:.1f} ms per sequence (batch {got.batch} vs {best.batch})"


def check_winner(row: LayoutWinner, eff: Efficiency) -> WinnerCheck:
    """Rank every layout of the row's GPUs under ``eff`` and place the measured winners."""
    hw = eff.apply(hardware(row.hardware), engine=row.engine)
    ranked = rank_layouts(model(row.model), hw, row.gpus, workload(row.workload), max_batch=VLLM_MAX_NUM_SEQS)
    by_name = {e.name: e for e in ranked}
    statics = [e for e in ranked if e.prefill == e.decode]
    pairs = [e for e in ranked if e.prefill != e.decode]
    return WinnerCheck(row, statics[0], pairs[0], by_name.get(row.best_static), by_name.get(row.seesaw_pair))


def best_of(
    hw: str, kind: str, model_name: str, workload_name: str, gpus: int, eff: Efficiency, *, engine: str
) -> Estimate:
    """The model's best static layout (``kind="static"``) or Seesaw pair (``"seesaw"``), each
    step paying ``engine``'s overhead."""
    w = workload(workload_name)
    hw_eff = eff.apply(hardware(hw), engine=engine)
    ranked = rank_layouts(model(model_name), hw_eff, gpus, w, max_batch=VLLM_MAX_NUM_SEQS)
    return next(e for e in ranked if (e.prefill == e.decode) == (kind == "static"))


def predict_ratio(row: Ratio, eff: Efficiency) -> float:
    """The model's value of a :class:`Ratio` row: best of the numerator's kind over the denominator's."""
    sides = (row.numerator, row.denominator)
    num, den = (best_of(*side, row.model, row.workload, row.gpus, eff, engine=row.engine) for side in sides)
    return num.tokens_per_s / den.tokens_per_s


# Shift's techniques on n GPUs: (prefill layout, decode layout); Shift prefills in its SP base
# and decodes small batches in its full-TP mode (a second weight copy: see predict_measured)
def technique_layouts(technique: str, n: int) -> tuple[ParallelConfig, ParallelConfig]:
    layouts = {
        "DP": (ParallelConfig(dp=n), ParallelConfig(dp=n)),
        "TP": (ParallelConfig(tp=n), ParallelConfig(tp=n)),
        "SP": (ParallelConfig(sp=n), ParallelConfig(sp=n)),
        "Shift": (ParallelConfig(sp=n), ParallelConfig(tp=n)),
    }
    if technique not in layouts:
        raise ValueError(f"technique must be one of {sorted(layouts)}, got {technique!r}")
    return layouts[technique]


def predict_measured(row: Measured, eff: Efficiency) -> float:
    """The model's value of a :class:`Measured` row: TTFT / TPOT (ms) of one request at a time in
    the technique's prefill / decode layout, or the saturated combined tokens/s (Shift: its SP
    base at saturation, with the KV room its full-TP weight copy takes)."""
    m, hw = model(row.model), eff.apply(hardware(row.hardware), engine=row.engine)
    prefill, decode = technique_layouts(row.technique, row.gpus)
    context = row.input_len + row.output_len / 2
    if row.metric == "ttft_ms":
        return 1e3 * cost.ttft(m, hw, prefill.replica, row.input_len)
    if row.metric == "tpot_ms":
        return 1e3 * cost.tpot(m, hw, decode.replica, 1, context)
    assert row.metric == "throughput", row.metric
    if row.technique == "Shift":
        hw, decode = shift_room(m, hw, decode.tp), prefill  # saturated batches run the SP base
    w = workload("constant", input_len=row.input_len, output_len=row.output_len, requests=100_000)
    e = cost.estimate(m, hw, decode, decode, w)
    return 0.0 if e is None else e.tokens_per_s * (row.input_len + row.output_len) / row.output_len


def row_hardware(row: LayoutWinner | Ratio | Measured) -> str:
    return row.numerator[0] if isinstance(row, Ratio) else row.hardware


def row_loss(row: LayoutWinner | Ratio | Measured, eff: Efficiency) -> float:
    """A winner row: ``-log`` of both ratios (0 when the measured winners are the model's best).
    A ratio or a measured row: ``|log(predicted / published)|``. Grid points that differ only in
    the overhead of an engine the row did not run on reuse one computation (:func:`_row_loss`)."""
    return _row_loss(row, eff.seen_by(row.engine))


@functools.lru_cache(maxsize=4096)
def _row_loss(row: LayoutWinner | Ratio | Measured, eff: Efficiency) -> float:
    """:func:`row_loss`, cached on the row and the factors it reads (frozen dataclasses, equal only
    when every field is). Bounded: the fit's grid varies the overheads fastest (the last factors),
    so repeats lie close together. It cannot see a change to what a row's cost reads besides its
    fields (a profile file edited, ``this_machine`` recalibrated) in the same process."""
    if isinstance(row, LayoutWinner):
        return check_winner(row, eff).loss
    got = predict_ratio(row, eff) if isinstance(row, Ratio) else predict_measured(row, eff)
    return math.inf if got <= 0 else abs(math.log(got / row.value))


def winners_loss(eff: Efficiency, rows: Sequence[LayoutWinner | Ratio]) -> float:
    """Sum of :func:`row_loss` over ``rows``."""
    return sum(row_loss(r, eff) for r in rows)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pairs_within(eff: Efficiency, rows: Sequence[LayoutWinner]) -> int:
    """Rows whose measured Seesaw pair the model puts within 5% of its best pair under ``eff``."""
    return sum(check_winner(r, eff).pair_ratio >= 0.95 for r in rows)


def pairs_missed(eff: Efficiency, rows: Sequence[LayoutWinner]) -> int:
    """Minus :func:`pairs_within`: the loss :func:`pair_ceiling` minimises."""
    return -pairs_within(eff, rows)


def pair_ceiling(
    rows: Sequence[LayoutWinner],
    grid: dict[str, tuple[float, ...]] | None = None,
    *,
    workers: int = 1,
    report: Report = None,
) -> tuple[int, Efficiency]:
    """A diagnostic, not a fit: the most ``rows`` any grid point of the global factors puts
    within 5% (searched on every row at once, so it bounds what fitting could reach without a
    change to the model's structure), and the first point that does; ``workers``, ``report``:
    :func:`fit`'s."""
    read = {overhead_of(r.engine) for r in rows}  # the other engines' overheads stay 0: no row reads them
    names = [n for n in FITTABLE if n in read or n not in OVERHEADS.values()]
    eff, loss = fit(pairs_missed, rows, names, grid=grid, workers=workers, report=report)
    return int(-loss), eff


def fit_half(
    rows: Sequence[LayoutWinner | Ratio | Measured],
    train: Collection[str],
    *,
    loss: Loss = winners_loss,
    grid: dict[str, tuple[float, ...]] | None = None,
    workers: int = 1,
    report: Report = None,
) -> tuple[Efficiency, float]:
    """:func:`parallel.cost.fit.fit` on the rows of the hardware named in ``train`` only (the
    others are the held-out half: the fit never sees them); ``workers``, ``report``: its."""
    have = sorted({row_hardware(r) for r in rows})
    missing = sorted(set(train) - set(have))
    if missing:
        raise ValueError(f"no rows of hardware {missing} to fit on; rows have {have}")
    return fit(loss, [r for r in rows if row_hardware(r) in train], grid=grid, workers=workers, report=report)


def orderings(rows: Sequence[Measured], eff: Efficiency, gap: float = 1.10) -> list[dict]:
    """Per (model, metric): the paper's and the model's techniques best first, and every pair the
    paper separates by more than ``gap`` (a ratio) that the model orders the other way."""
    out = []
    for key in dict.fromkeys((r.model, r.metric) for r in rows):
        group = [r for r in rows if (r.model, r.metric) == key]
        better = 1 if key[1] == "throughput" else -1  # throughput: higher is better; latency: lower
        paper = {r.technique: r.value for r in group}
        mine = {r.technique: predict_measured(r, eff) for r in group}
        flipped = [
            (a, b)
            for a in paper
            for b in paper
            if paper[a] * better > paper[b] * better
            and max(paper[a], paper[b]) / min(paper[a], paper[b]) > gap
            and not mine[a] * better > mine[b] * better
        ]
        order = [sorted(d, key=lambda t, d=d: -better * d[t]) for d in (paper, mine)]
        out.append({"model": key[0], "metric": key[1], "paper": order[0], "model_order": order[1], "flipped": flipped})
    return out


def predict_stream(row: StreamRow) -> tuple[float, float]:
    """``(transfer s, extra s)`` of a :class:`StreamRow` from the model: a prompt stage's KV
    (:func:`technique_models.dejavu_stream_time`, the largest stage's layers) at the nominal bandwidth
    (the paper simulates, so nothing is fitted here), the extra being what outlasts the prompt."""
    net = Hardware("network", 0.0, 0.0, 0.0, "network", row.gbps * 1e9 / 8, 0.0)
    t = models.dejavu_stream_time(model(row.model), net, row.seqs, row.prompt_len, row.prompt_stages)
    return t, max(0.0, t - row.prompt_s)


def predict_trend(row: Trend, eff: Efficiency) -> list[dict]:
    """Per output length of a :class:`Trend`: the model's tokens/s of each static layout and of
    the Seesaw pair (vLLM's batch cap applied), and the best static."""
    m, hw = model(row.model), eff.apply(hardware(row.hardware), engine=row.engine)
    out = []
    for n in row.outputs:
        w = workload("constant", input_len=row.input_len, output_len=n, requests=500)
        rates = {}
        for name in (*row.statics, row.seesaw_pair):
            a, _, b = name.partition("->")
            e = cost.estimate(
                m, hw, cost.parse_notation(a), cost.parse_notation(b or a), w, max_batch=VLLM_MAX_NUM_SEQS
            )
            rates[name] = e.tokens_per_s if e is not None else 0.0
        out.append({"output_len": n, "rates": rates, "best_static": max(row.statics, key=rates.get)})
    return out


def winners_in_order(points: list[dict]) -> list[str]:
    """The best static layouts as the output grows, each run of equal winners once."""
    order: list[str] = []
    for p in points:
        if not order or order[-1] != p["best_static"]:
            order.append(p["best_static"])
    return order


def fig14_rates(row: Ordering, input_len: int, eff: Efficiency) -> dict[str, float]:
    """Peak combined tokens/s (input + output) of DP (``D{n}``), TP (``T{n}``), SP (the paper's
    base) and Shift at saturation on ``row``'s model, as :func:`predict_measured` (Shift: its base,
    with the KV room its full-TP weight copy takes); SP and Shift run the base as the engine does,
    SP x EP with the experts over all ``n`` GPUs (:func:`technique_models.shift_layouts`).
    ``Shift switching``: the planner's Shift row, each phase in the faster of the base and full TP
    (:func:`techniques.shift_rows`)."""
    m, hw, n = model(row.model), eff.apply(hardware(row.hardware), engine=row.engine), row.gpus
    w = workload("constant", input_len=input_len, output_len=row.output_len, requests=100_000)
    base, full = models.shift_layouts(m, cost.parse_notation(row.base).sp, n)
    combined = (input_len + row.output_len) / row.output_len
    layouts = {"DP": ParallelConfig(dp=n), "TP": ParallelConfig(tp=n), "SP": base, "Shift": base}
    out = {}
    for name, cfg in layouts.items():
        e = cost.estimate(m, shift_room(m, hw, n) if name == "Shift" else hw, cfg, cfg, w)
        out[name] = 0.0 if e is None else e.tokens_per_s * combined
    switching = [r for r in shift_rows(m, hw, n, w) if r["layout"] == f"Shift {base.notation}|{full.notation}"]
    out["Shift switching"] = switching[0]["tokens_per_s"] * combined if switching else 0.0
    return out


def fig14_agreement(rows: Sequence[Ordering], eff: Efficiency) -> list[dict]:
    """Per :class:`Ordering` row and input length: the model's rates and whether ``above`` beats
    every technique in ``below`` (``agrees``)."""
    out = []
    for row in rows:
        for n in row.input_lens:
            rates = fig14_rates(row, n, eff)
            agrees = all(rates[row.above] > rates[b] for b in row.below)
            out.append({"claim": row.key, "input_len": n, "rates": rates, "agrees": agrees})
    return out


def check_claim(claim: Claim, eff: Efficiency) -> dict:
    """The model's view of one SiDP :class:`Claim`: the tokens/s it compares and whether it holds."""
    from reshard.parallel.cost.techniques import rank_all

    m, hw = model(claim.model), eff.apply(hardware(claim.hardware), engine=claim.engine)
    w = workload("constant", input_len=claim.input_len, output_len=claim.output_len, requests=100_000)
    rows = rank_all(m, hw, claim.gpus, w, max_batch=None)
    statics = {r["layout"]: r["tokens_per_s"] for r in rows if r["kind"] == "static"}
    sidp = next((r["tokens_per_s"] for r in rows if r["kind"] == "sidp"), 0.0)
    tp_pp = max((v for k, v in statics.items() if re.fullmatch(r"T\d+P\d+", k)), default=0.0)  # vLLM's TP+PP
    dp_tp = max((v for k, v in statics.items() if re.fullmatch(r"D\d+(T\d+)?", k)), default=0.0)  # its DP (+TP)
    values = {
        "tp_pp_below_tp": {"TP x PP": tp_pp, f"T{claim.gpus}": statics.get(f"T{claim.gpus}", 0.0)},
        "sidp_matches_dp": {"SiDP": sidp, "DP x TP": dp_tp},
        "sidp_above_static": {"SiDP": sidp, "best static": max(statics.values(), default=0.0)},
    }[claim.kind]
    a, b = values.values()
    holds = {"tp_pp_below_tp": a < b, "sidp_matches_dp": a >= 0.9 * b, "sidp_above_static": a > b}[claim.kind]
    return {"claim": claim.key, "values": values, "holds": holds}
