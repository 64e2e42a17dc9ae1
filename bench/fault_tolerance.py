"""Fault tolerance benchmark: one rank SIGKILLed mid-decode under supervision (``fault.migrate``),
its requests going on with their KV, prefilled again, or waiting for the respawn, vs torchrun's
whole-job restart (every request from scratch), vs no failure; and the mirror's cost on a
failure-free job.

    python bench/fault_tolerance.py [--world 2] [--requests 32] [--new-tokens 64] [--batch 8] [--repeats 2]
    python bench/fault_tolerance.py --groups [--world 4] [--prompt-len 64] [--layout dp|dejavu] [--only none] ...

Without ``--groups``: one lockstep engine group of every rank (TP, or ``--override parallel=shift``):
the whole group is respawned in the job and its requests resume there with the KV its ranks'
supervisors kept (``kv``) or prefilled again (``reprefill``).

``--groups``: data-parallel engine groups of one rank each under supervision (``fault.migrate``):
the killed engine is respawned in the job while the others serve, and its requests continue with
their KV on the group that mirrors it (``kv``), prefilled again on any group (``reprefill``) or
on its own respawned group (``none``, whose respawn takes its weights from a live replica, and
again reading the checkpoint); against the same job without failure (with and without
supervision) and against torchrun's whole-job restart (every request from scratch). With
``--layout dejavu``: half the ranks prompt groups, half token groups (of one rank each); the last
rank, a token group's, is killed.

Every variant is a real ``torchrun --max-restarts 1 -m reshard.recipes.generate`` job on the built-in
model (greedy); end-to-end seconds are the whole job's wall time (process start, load, both
attempts), as a user sees it. The kill lands at the middle engine step of the run (requests run
``--batch`` at a time, so the run has about ``ceil(requests / batch) * new_tokens`` steps).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import parser, rerun_command

REPO = Path(__file__).resolve().parents[1]


def run(world: int, args, overrides: list[str], restarts: int, work: Path, name: str) -> tuple[float, dict, list]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        str(restarts),
        "-m",
        "reshard.recipes.generate",
        f"hydra.run.dir={work / name}",
        "progress=false",
        f"workload.num_requests={args.requests}",
        f"workload.prompt_len_min={args.prompt_len // 2}",
        f"workload.prompt_len_max={args.prompt_len}",
        f"engine.max_batch_size={args.batch}",
        *args.override,
        f"generation.max_new_tokens={args.new_tokens}",
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text())
    outputs = [json.loads(line)["output_ids"] for line in (work / name / "outputs.jsonl").read_text().splitlines()]
    return wall, summary, outputs


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="a Hydra override for every variant (e.g. parallel=seesaw); repeatable",
    )
    p.add_argument("--groups", action="store_true", help="supervised engine groups (see the module docstring)")
    p.add_argument("--only", action="append", default=[], help="run the variants whose name contains this; repeatable")
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (the shortest is half)")
    p.add_argument("--layout", choices=("dp", "dejavu"), default="dp", help="--groups: the groups' layout")
    args = p.parse_args()
    variants, kill = group_variants(args) if args.groups else lockstep_variants(args)
    if args.only:  # the failure-free baseline always runs: every ratio is to it
        variants = {v: x for v, x in variants.items() if v == "no failure" or any(o in v for o in args.only)}
    rows: dict[str, list] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.repeats):  # round-robin: drift on a shared machine hits every variant
            for v, (overrides, restarts) in variants.items():
                rows[v].append(run(args.world, args, overrides, restarts, work, f"{rep}-{len(rows[v])}-{abs(hash(v))}"))
    group_report(args, rows, kill)


def lockstep_variants(args) -> tuple[dict, str]:
    """One lockstep group of every rank: respawned with the KV its supervisors kept, or prefilled
    again, vs torchrun's restart from scratch."""
    steps = -(-args.requests // args.batch) * args.new_tokens
    kill = f"fault.kill_at=[{args.world - 1},{steps // 2}]"
    variants = {
        "no failure": ([], 0),
        "no failure, supervised, KV mirrored": (["fault.migrate=kv"], 0),
        "1 failure, migrate=kv": (["fault.migrate=kv", kill], 0),
        "1 failure, migrate=reprefill": (["fault.migrate=reprefill", kill], 0),
        "1 failure, whole-job restart (from scratch)": ([kill], 1),
    }
    return variants, kill


def group_variants(args) -> tuple[dict, str]:
    """Engine groups of one rank (DP, or DejaVu's prompt and token groups): the last rank killed
    at its middle step."""
    decoders = args.world if args.layout == "dp" else args.world // 2  # the groups that decode
    steps = -(-args.requests // (args.batch * decoders)) * args.new_tokens
    kill, dp = f"fault.kill_at=[{args.world - 1},{steps // 2}]", ["parallel.tp=1"]
    if args.layout == "dejavu":
        half = args.world // 2
        dp = ["parallel=dejavu", f"parallel.prompt_ranks={half}", f"parallel.prompt.dp={half}"]
        dp.append(f"parallel.token.dp={args.world - half}")
    variants = {
        "no failure": (dp, 0),
        "no failure, supervised, KV mirrored": ([*dp, "fault.migrate=kv"], 0),
        "1 failure, migrate=kv": ([*dp, "fault.migrate=kv", kill], 0),
        "1 failure, migrate=reprefill": ([*dp, "fault.migrate=reprefill", kill], 0),
        "1 failure, migrate=none": ([*dp, "fault.migrate=none", kill], 0),
        # the requests wait for the respawn: its weights from a live replica (above) or the checkpoint
        "1 failure, migrate=none, respawn reads the checkpoint": (
            [*dp, "fault.migrate=none", "fault.respawn_weights=checkpoint", kill],
            0,
        ),
        "1 failure, whole-job restart (from scratch)": ([*dp, kill], 1),
    }
    return variants, kill


def group_report(args, rows: dict, kill: str) -> None:
    base_wall = statistics.median(w for w, _, _ in rows["no failure"])
    supervised = rows.get("no failure, supervised, KV mirrored") or rows["no failure"]  # (--only may skip it)
    mirrored = statistics.median(w for w, _, _ in supervised)
    base_step = statistics.median(_step(s) for _, s, _ in rows["no failure"])
    reference = rows["no failure"][0][2]
    groups = (
        f"{args.world} engine groups of 1 rank ({args.layout})"
        if args.groups
        else (f"one lockstep group of {args.world} ranks ({' '.join(args.override) or 'TP'})")
    )
    print(
        f"\n{_model(args)}, {groups}, {args.requests} requests x "
        f"{args.new_tokens} new tokens, prompts {args.prompt_len // 2}-{args.prompt_len}, batch {args.batch}, greedy; "
        f"{kill}; median of {args.repeats}, variants round-robin\n"
    )
    print(
        "| variant | end-to-end s | vs no failure | vs supervised no failure | decode ms/step | kill -> first "
        "migrated token s | kill -> respawn serving s | adopted (regenerated tokens) | re-prefilled tokens | "
        "hand-offs adopted | respawn's weights from (build s) | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v, results in rows.items():
        wall = statistics.median(w for w, _, _ in results)
        step = statistics.median(_step(s) for _, s, _ in results)
        death = _death(results[-1][1])
        same = all(out == reference for _, _, out in results)
        print(
            f"| {v} | {wall:.2f} | {wall / base_wall:.2f} | {wall / mirrored:.2f} | {step * 1e3:.2f} "
            f"({step / base_step:.2f}x) | {_after(death, 'first_migrated_token_s')} | {_after(death, 'rejoined_s')} | "
            f"{_adopted(death)} | {death.get('reprefilled_tokens', '-')} | {_hand_offs(results[-1][1])} | "
            f"{_respawn_weights(results, args.world - 1)} | {'yes' if same else 'NO'} |"
        )
    print(f"\ncommand: {rerun_command('fault_tolerance.py', one_thread=False)}")


def _model(args) -> str:
    """The checkpoint the variants ran: the built-in one unless an override names another."""
    paths = [o.split("=", 1)[1] for o in args.override if o.startswith("model.path=")]
    return f"checkpoint {paths[-1]}" if paths else "built-in tiny Llama"


def _death(summary: dict) -> dict:
    deaths = summary.get("fault", {}).get("deaths", [])
    return deaths[0] if deaths else {}


def _after(death: dict, key: str) -> str:
    """Seconds from the kill (its supervisor saw the child end) to ``key``'s time."""
    if death.get(key) is None or death.get("died_s") is None:
        return "-"
    return f"{death[key] - death['died_s']:.2f}"


def _respawn_weights(results: list, rank: int) -> str:
    """Where the killed rank's respawned engine took its weights (``checkpoint`` or a live group)
    and the median seconds its engine took to build with them."""
    sources = [r[1].get("fault", {}).get("weights_from", {}).get(str(rank), {}).get("1") for r in results]
    sources = [s for s in sources if s]
    if not sources:
        return "-"
    where = "replica " + sources[-1][0] if sources[-1][0] != "checkpoint" else "checkpoint"
    return f"{where} ({statistics.median(s[1] for s in sources):.2f})"


def _hand_offs(summary: dict) -> str:
    """DejaVu under supervision: prefilled requests a token group adopted with their KV."""
    if summary.get("fault", {}).get("hand_offs") is None or summary["strategy"] != "dejavu":
        return "-"
    return f"{len(summary['fault']['hand_offs'])} of {summary['requests']}"


def _adopted(death: dict) -> str:
    if "adopted" not in death:
        return "-"
    return f"{len(death['adopted'])} of {len(death['resumed'])} ({sum(a[2] for a in death['adopted'])})"


def _step(summary: dict) -> float:
    ph = summary["phase_seconds"]
    steps = max(summary["generated_tokens"] - summary["requests"], 1) / max(summary["mean_decode_batch"], 1)
    return ph["decode"] / steps


if __name__ == "__main__":
    main()
