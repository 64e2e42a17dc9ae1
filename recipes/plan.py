"""Plan a deployment we cannot test here, from the cost model (:mod:`parallel.cost`).

    python -m reshard.recipes.plan model=llama3-15b hardware=g5.48xlarge num_gpus=4 workload=arxiv

Single process (no torchrun); ``hardware=this_machine`` first calibrates this machine (2 gloo
processes, cached). Prints one ranking across techniques (every feasible static layout, Seesaw pair
that keeps dp (any pair with ``seesaw_change_dp=true``), Shift, SiDP and DejaVu:
:mod:`parallel.cost.techniques`) and
writes ``plan.json`` and ``plan.png`` into Hydra's run directory. Layouts are in Seesaw's notation
(``D`` data, ``T`` tensor, ``P`` pipeline degree, degrees of 1 omitted, one GPU = ``T1``; ``S``
Ulysses SP; ``E`` expert parallelism of a mixture-of-experts model, ``T8E4`` inside the tp group,
``D8E8`` over data-parallel replicas, ``Shift S2T4E8|T8E8`` Shift's SP x EP, the experts over all 8
GPUs in both modes; ``A->B`` = prefill in A, decode in B).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from reshard.parallel.cost import moe
from reshard.parallel.cost import roofline as cost
from reshard.parallel.cost import technique_models as models
from reshard.parallel.cost.fit import EFFICIENCIES
from reshard.parallel.cost.profiles import HARDWARE, MACHINES, Hardware, ModelShape, hardware, model, workload
from reshard.parallel.cost.techniques import rank_all, with_latency
from reshard.parallel.cost.topology import placement
from reshard.recipes.launch import hydra_main
from reshard.recipes.plan_config import PlanConfig


def _say(line: str) -> None:
    print(line, flush=True)


def make_plan(cfg: PlanConfig) -> dict:
    """Everything the planner predicts for ``cfg`` (the content of ``plan.json``)."""
    m, hw = _model(cfg), EFFICIENCIES[cfg.efficiency].apply(hardware(cfg.hardware, report=_say), engine=cfg.engine)
    w = workload(cfg.workload, input_len=cfg.input_len, output_len=cfg.output_len, requests=cfg.requests)
    ranked = rank_all(m, hw, cfg.num_gpus, w, max_batch=cfg.max_batch, change_dp=cfg.seesaw_change_dp)
    if cfg.rate is not None:
        ranked = with_latency(ranked, m, hw, w, cfg.rate)
    infeasible = {
        c.notation: cost.infeasible_reason(m, hw, c, w.input_len + w.output_len)
        for c in cost.configs(cfg.num_gpus, experts=m.moe)
    }
    if not ranked:
        raise ValueError(f"no layout of {cfg.num_gpus} x {cfg.hardware} fits model {cfg.model!r}: {infeasible}")
    best = {}
    for r in ranked:  # best first (throughput, or completion time at a rate): the first of each kind
        best.setdefault(r["kind"], r)
    static, seesaw = best.get("static"), best.get("seesaw")
    return {
        "model": cfg.model,
        "hardware": hw.name,
        "num_gpus": cfg.num_gpus,
        "workload": {"name": w.name, "input_len": w.input_len, "output_len": w.output_len, "requests": w.requests},
        "rate": cfg.rate,
        "seesaw_change_dp": cfg.seesaw_change_dp,
        "engine": {"kind": cfg.engine, "step_overhead_s": hw.step_overhead},  # the overhead each step pays
        "efficiency": {"name": cfg.efficiency, **EFFICIENCIES[cfg.efficiency].as_dict()},
        "best_static": static["layout"] if static else None,
        "best_seesaw": seesaw["layout"] if seesaw else None,
        "seesaw_speedup": seesaw["tokens_per_s"] / static["tokens_per_s"] if seesaw and static else None,
        "best_by_technique": {kind: r["layout"] for kind, r in best.items()},
        "placement": _placements(hw, static, seesaw),
        "ranked": ranked,
        "phases": _phases(m, hw, cfg.num_gpus, w),
        "infeasible": {k: v for k, v in infeasible.items() if v},
        "shift_threshold": models.shift_threshold(m, hw, cfg.num_gpus),
        "sidp_threshold": models.sidp_threshold(m, hw, cfg.num_gpus),
        "dejavu": models.dejavu_plan(m, hw, cfg.num_gpus, w),
        "moe": moe.describe(m),
        "assumptions": {
            "memory_reserve": cost.MEMORY_RESERVE,
            "prefill_tokens": cost.PREFILL_TOKENS,
        },
    }


def hardware_note(name: str) -> str | None:
    """One line when ``hardware=name`` is a datasheet card without socket topology while a paper's
    machine of the same GPU has one (``a10`` -> ``a10-g5``, the g5.48xlarge); else ``None``."""
    name = MACHINES.get(name, name)
    if name not in HARDWARE or HARDWARE[name].topology:
        return None
    twin = next((k for k, hw in HARDWARE.items() if hw.topology and k.startswith(f"{name}-")), None)
    if twin is None:
        return None
    levels, aws = HARDWARE[twin].topology, {v: k for k, v in MACHINES.items()}.get(twin)
    inner, whole = levels[0].size, levels[-1].size
    machine = f"hardware={aws} (= {twin})" if aws else f"hardware={twin}"
    return (
        f"note: hardware={name} has no socket topology (one flat link between any two GPUs); the Seesaw "
        f"paper's machine is {machine}: {whole} GPUs, {whole // inner} sockets of {inner}"
    )


def _placements(hw: Hardware, *rows: dict | None) -> dict:
    """Where each layout of the best static and Seesaw rows puts its groups on ``hw``'s GPUs
    (:func:`parallel.cost.topology.placement`), by layout."""
    names = [name for r in rows if r for name in r["layout"].split("->")]
    return {name: placement(cost.parse_notation(name), hw) for name in dict.fromkeys(names)}


def _model(cfg: PlanConfig) -> ModelShape:
    """The model's shape, with ``expert_skew`` set on a MoE model (``ValueError`` on a dense one)."""
    m = model(cfg.model)
    if cfg.expert_skew == 1.0:
        return m
    if not m.moe:
        raise ValueError(f"expert_skew ({cfg.expert_skew}) needs a mixture-of-experts model; {cfg.model!r} is dense")
    return dataclasses.replace(m, expert_skew=cfg.expert_skew)


def _phases(m, hw, num_gpus: int, w) -> dict:
    """Prompt tokens/s and generated tokens/s of each static layout in its phase alone."""
    out = {}
    for c in cost.configs(num_gpus, experts=m.moe):
        pre, dec = (cost.phase_throughput(m, hw, c, w, phase) for phase in ("prefill", "decode"))
        if pre > 0:
            out[c.notation] = {"prefill_tokens_per_s": pre, "decode_tokens_per_s": dec}
    return out


def table(plan: dict, top: int) -> str:
    """The ranked rows of every technique as a fixed-width table (the first ``top`` rows); with a
    rate, TTFT and TPOT at it (``-`` for offline-only techniques, ``overloaded`` past capacity)."""
    online = plan["rate"] is not None
    head = f"{'rank':>4}  {'layout':<24}{'kind':<8}{'tokens/s':>10}{'% best':>7}{'batch':>7}{'prefill s':>11}"
    head += f"{'decode s':>10}{'comm s':>8}{'trans s':>9}" + (f"{'TTFT ms':>11}{'TPOT ms':>9}" if online else "")
    rows = [head]
    for i, e in enumerate(plan["ranked"][:top], 1):
        line = (
            f"{i:>4}  {e['layout']:<24}{e['kind']:<8}{e['tokens_per_s']:>10.1f}"
            f"{100 * e['tokens_per_s'] / plan['ranked'][0]['tokens_per_s']:>7.0f}{e['batch']:>7}"
            f"{e['prefill_s']:>11.2f}{e['decode_s']:>10.2f}{e['comm_s']:>8.2f}{e['transition_s']:>9.3f}"
        )
        rows.append(line + (_latency_cells(e) if online else ""))
    shown = len(plan["ranked"][:top])
    if shown < len(plan["ranked"]):
        rows.append(f"({shown} of {len(plan['ranked'])} feasible rows; plan.json has all; top=N shows more)")
    rows.append(f"each step pays {plan['engine']['step_overhead_s'] * 1e3:.0f} ms ({plan['engine']['kind']} engine)")
    if online:
        rows.append(f"ranked by TTFT + {plan['workload']['output_len']:.0f} x TPOT at {plan['rate']} requests/s")
    return "\n".join(rows)


def _latency_cells(e: dict) -> str:
    if e["ttft_s"] is None:
        return f"{'-':>11}{'-':>9}"
    if e["ttft_s"] == float("inf"):
        return f"{'overloaded':>11}{'':>9}"
    return f"{e['ttft_s'] * 1e3:>11.1f}{e['tpot_s'] * 1e3:>9.2f}"


def summary_lines(plan: dict) -> str:
    s, d, x = plan["shift_threshold"], plan["dejavu"], plan["moe"]
    best = ", ".join(f"{kind} {name}" for kind, name in plan["best_by_technique"].items())
    experts = (
        f"MoE: {x['total_params'] / 1e9:.1f}B parameters, {x['active_params'] / 1e9:.1f}B active per token; "
        f"{x['experts']} experts, top-{x['experts_per_token']}{', a shared expert' if x['shared_expert'] else ''}, "
        f"{x['moe_layers']} MoE layers; expert_skew {x['expert_skew']} (E: expert parallelism, Shift's SP x EP "
        "included; SiDP not modelled)\n"
        if x
        else ""
    )
    where = "; ".join(f"{name}: {_where(p)}" for name, p in plan["placement"].items())
    return (
        f"{experts}best per technique: {best}\n"
        f"placed on {plan['hardware']}: {where}\n"
        f"best static {plan['best_static']}, best Seesaw {plan['best_seesaw']} "
        f"(x{plan['seesaw_speedup'] or float('nan'):.2f}{_pair_space(plan)}); "
        f"Shift threshold {s['threshold']} tokens "
        f"({s['base']} vs {s['shift']}); SiDP b* {plan['sidp_threshold']}; "
        f"DejaVu {d.get('D_p')} prompt + {d.get('D_t')} token GPUs "
        f"({'beats' if d.get('plan_pays') else 'does not beat'} the same GPUs without disaggregation)"
    )


def _pair_space(plan: dict) -> str:
    """The summary's note on which Seesaw pairs were ranked."""
    return "" if plan["seesaw_change_dp"] else ", of the pairs that keep dp"


def _where(p: dict) -> str:
    """``tp groups 0-3 | 4-7 (tp in-socket, pp cross-socket)``: a layout's tp groups and the outermost
    level each kind of its traffic crosses."""
    crossed = ", ".join(f"{axis} {level}" for axis, level in p["crosses"].items() if level)
    if len(p["tp_groups"][0]) == 1:
        return crossed or "one GPU per replica"
    groups = " | ".join(f"{g[0]}-{g[-1]}" for g in p["tp_groups"])
    return f"tp groups {groups}" + (f" ({crossed})" if crossed else "")


PHASES = (("prefill", "tab:blue"), ("decode", "tab:green"), ("comm", "tab:red"), ("transition", "tab:orange"))


def plot(plan: dict, path: Path, top: int) -> None:
    """Where the time of the best ``top`` rows goes, as a PNG: one stacked bar per row of seconds per
    1000 generated tokens (prefill and decode compute, communication, Seesaw's transition), its
    tokens/s written beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan["ranked"][:top][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 2))
    labels = [f"{r['layout']} ({r['kind']})" for r in rows]
    left = [0.0] * len(rows)
    for phase, color in PHASES:
        widths = [_per_kilotoken(r, phase, plan) for r in rows]
        ax.barh(labels, widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    best = plan["ranked"][0]["tokens_per_s"]
    for y, (r, x) in enumerate(zip(rows, left)):
        ax.text(x, y, f" {r['tokens_per_s']:,.0f} tok/s ({100 * r['tokens_per_s'] / best:.0f}% of best)", va="center",
                fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(left) * 1.25)
    below = 0.6 / (0.35 * len(rows) + 0.2)  # the legend 0.6 in under the axes, whatever their height
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -below), ncol=4, fontsize=8)
    w = plan["workload"]
    model = plan["model"] if len(plan["model"]) <= 40 else "..." + plan["model"][-37:]  # a long path, its end
    ax.set_xlabel("seconds per 1000 generated tokens (shorter is better)")
    ax.set_title(
        f"{model} on {plan['num_gpus']} x {plan['hardware']}, {w['name']} ({w['input_len']:.0f} in / "
        f"{w['output_len']:.0f} out)\ntop {len(rows)} of {len(plan['ranked'])} feasible layouts, "
        f"{plan['efficiency']['name']} efficiencies, {plan['engine']['kind']} engine "
        f"({plan['engine']['step_overhead_s'] * 1e3:.0f} ms a step)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _per_kilotoken(row: dict, phase: str, plan: dict) -> float:
    """Seconds of ``phase`` per 1000 generated tokens (compute phases without their communication,
    split in proportion)."""
    tokens = row["batch"] * plan["workload"]["output_len"] / 1000
    if phase in ("comm", "transition"):
        return row[f"{phase}_s"] / tokens
    compute = row["prefill_s"] + row["decode_s"]
    share = row[f"{phase}_s"] / compute if compute else 0.0
    return share * (compute - row["comm_s"]) / tokens


def run_plan(cfg: PlanConfig, run_dir: Path) -> dict:
    """Plan, print the table, write ``plan.json`` and ``plan.png`` into ``run_dir``."""
    plan = make_plan(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    plot(plan, run_dir / "plan.png", cfg.top)
    note = hardware_note(cfg.hardware)
    lines = [table(plan, cfg.top), summary_lines(plan), *([note] if note else [])]
    print(*lines, f"outputs written to {run_dir.resolve()}", sep="\n", flush=True)
    return plan


def main() -> None:
    hydra_main("plan", run_plan)


if __name__ == "__main__":
    main()
