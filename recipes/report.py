"""What a generate run writes and prints: ``outputs.jsonl`` / ``finished.jsonl`` lines
(:class:`OutputFormat`), ``summary.json``'s common keys (:func:`run_summary`, for the plain and the
supervised job alike) and the summary lines on the terminal."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from reshard.parallel.engine.metrics import latency_summary
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.model.dims import ParallelDims
from reshard.parallel.vllm_api import in_context, output_text
from reshard.recipes.config import GenerateConfig


@dataclass(frozen=True)
class PhaseSeconds:
    """Where a run's seconds went (the slowest replica's or engine group's)."""

    load: float
    prefill: float
    decode: float  # the decode steps that compiled a graph are in ``compile``, not here
    mixed: float
    compile: float
    generate_total: float


def run_summary(
    cfg: GenerateConfig,
    path,
    completions,
    layouts: dict[str, ParallelDims],
    *,
    stats,
    seconds: PhaseSeconds,
    groups: int,
    compiled: bool,
) -> dict:
    """The summary keys every generate run has: what ran, token counts over all requests, phase
    times, throughput, latency percentiles."""
    prompt_tokens = sum(len(c.prompt_ids) for c in completions)
    generated = sum(len(c.output_ids) for c in completions)
    return {
        "model_path": str(Path(path).resolve()),
        "world_size": dist.get_world_size(),
        "strategy": cfg.parallel.strategy,
        **what_ran(cfg, layouts),
        "requests": len(completions),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        # chunked prefill: prompts are fed in mixed steps (beside decode tokens), counted here
        "prefill_tokens_per_s": prompt_tokens / max(seconds.prefill + seconds.mixed, 1e-9),
        "decode_tokens_per_s": (generated - len(completions)) / max(seconds.decode, 1e-9),
        "mean_decode_batch": stats.mean_decode_batch,
        "engine_groups": groups,
        # a compiled decode step: the calls that compiled a graph (not in decode)
        "phase_seconds": dataclasses.asdict(seconds),
        "mixed_steps": stats.mixed_steps,  # steps that fed prompt chunks beside decode tokens
        "online": any(c.timing is not None and c.timing.arrival > 0 for c in completions),
        "latency": latency_summary(completions, seconds.generate_total),
        "compile": compiled,  # (what ran: the default settles by the device and the layout)
    }


def what_ran(cfg: GenerateConfig, layouts: dict[str, ParallelDims]) -> dict:
    """The summary's keys that say what ran: each layout (degrees and ranks), the layouts in one
    notation, the weights' dtype and the sampling parameters."""
    return {
        "parallel": {name: dims.describe() for name, dims in layouts.items()},
        "layout": run_notation(layouts),
        "dtype": cfg.model.dtype,
        "sampling": dataclasses.asdict(cfg.generation),
    }


def run_notation(layouts: dict[str, ParallelDims]) -> str:
    """Every layout a run used in one string: ``T2P2``; Seesaw's ``P4->T4`` (prefill -> decode);
    otherwise ``prompt T2 / token P2`` (DejaVu's sides, Shift's modes)."""
    if set(layouts) == {"prefill", "decode"}:
        return f"{layouts['prefill'].notation}->{layouts['decode'].notation}"
    if len(layouts) == 1:
        return next(iter(layouts.values())).notation
    return " / ".join(f"{name} {dims.notation}" for name, dims in layouts.items())


def append_finished(path: Path, completions, fmt: OutputFormat | None = None) -> None:
    """Append ``completions`` to a :data:`FINISHED` file, one output line each."""
    fmt = fmt or OutputFormat()
    with open(path, "a") as f:
        f.writelines(fmt.line(c) for c in completions)


def write_outputs(run_dir: Path, completions, summary: dict, strategy, fmt: OutputFormat) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "outputs.jsonl", "w") as f:
        f.writelines(fmt.line(c) for c in completions)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary, strategy)
    if summary["online"]:
        for line in latency_lines(summary["latency"]):
            print("  " + line, flush=True)
        plot_latency(completions, run_dir / "latency.png", f"{summary['strategy']} {summary['layout']}")
    print(f"outputs written to {run_dir.resolve()}", flush=True)


def latency_lines(lat: dict) -> list[str]:
    """An online run's percentiles, one line per figure, with units: ``TTFT  p50 12.3 ms ...``."""
    names = {"ttft": "TTFT", "tpot": "TPOT", "latency": "latency", "queued": "queued"}
    lines = []
    for key, name in names.items():
        unit = "ms/token" if lat["units"][key] == "s/token" else "ms"
        cells = "  ".join(f"{p} {lat[key][p] * 1e3:8.1f} {unit}" for p in ("p50", "p90", "p99"))
        lines.append(f"{name:8s}{cells}")
    return lines


def plot_latency(completions, path: Path, title: str) -> None:
    """Each request's time to first token and end-to-end latency against its arrival (left) and
    their distributions (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = sorted((c.timing for c in completions if c.timing is not None), key=lambda t: t.arrival)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot([t.arrival for t in timed], [t.ttft * 1e3 for t in timed], ".", label="time to first token")
    a.plot([t.arrival for t in timed], [t.latency * 1e3 for t in timed], ".", label="end to end")
    a.set(xlabel="arrival (s)", ylabel="ms", title="per request")
    a.legend()
    for values, label in (([t.ttft for t in timed], "TTFT"), ([t.latency for t in timed], "latency")):
        data = sorted(v * 1e3 for v in values)
        b.plot(data, [(i + 1) / len(data) for i in range(len(data))], label=label)
    b.set(xlabel="ms", ylabel="fraction of requests", title="distribution")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass(frozen=True)
class OutputFormat:
    """How a completion becomes an ``outputs.jsonl`` / ``finished.jsonl`` line: ids and finish reason;
    with a tokenizer also the prompt as fed and the output decoded (special tokens skipped); with
    ``n`` samples per prompt (request id ``prompt_index * n + sample``) which prompt and sample."""

    tokenizer: Any = None
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the job's: the output's text ends as vLLM's

    def line(self, c) -> str:
        out = {"id": c.id, "prompt_ids": c.prompt_ids, "output_ids": c.output_ids, "finish_reason": c.finish_reason}
        if self.n > 1:
            out.update(prompt_index=c.id // self.n, sample=c.id % self.n)
        if self.tokenizer is not None:
            out["prompt"] = self.tokenizer.decode(c.prompt_ids)
            decode = in_context(functools.partial(self.tokenizer.decode, skip_special_tokens=True), c.prompt_ids)
            out["output"] = output_text(decode, c.output_ids, c.finish_reason, self.sampling)[0]
        if c.logprobs is not None:  # per output token: [its logprob, [[id, logprob] of the top ones]]
            out["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in c.logprobs]
        return json.dumps(out) + "\n"


def print_summary(s: dict, strategy) -> None:
    ph, lat = s["phase_seconds"], s["latency"]
    print(
        f"\n{s['strategy']} {s['layout']} on {s['world_size']} rank(s), {s['dtype']}, {_sampling_line(s['sampling'])}: "
        f"{s['requests']} requests, {s['prompt_tokens']} prompt / {s['generated_tokens']} generated tokens\n"
        f"  end to end {lat['output_tokens_per_s']:10.1f} output tok/s, {lat['requests_per_s']:.2f} requests/s "
        f"({ph['generate_total']:.3f} s; load {ph['load']:.3f} s before it)\n"
        f"  prefill {s['prefill_tokens_per_s']:10.1f} tok/s  ({ph['prefill']:.3f} s)\n"
        f"  decode  {s['decode_tokens_per_s']:10.1f} tok/s  ({ph['decode']:.3f} s, "
        f"mean batch {s['mean_decode_batch']:.1f})\n"
        f"  layouts {_layouts_line(s['parallel'])}",
        flush=True,
    )
    if ph.get("compile"):
        print(f"  compile {ph['compile']:.1f} s (first decode calls; not counted as decode)", flush=True)
    kv = s.get("kv", {})
    if kv.get("prefix_cache_queries"):
        hits, queries = kv["prefix_cache_hits"], kv["prefix_cache_queries"]
        print(f"  prefix cache {hits / queries:.1%} of {queries} prompt tokens hit (computed once)", flush=True)
    for line in strategy.report(s) if strategy is not None else ():
        print("  " + line, flush=True)


def _sampling_line(g: dict) -> str:
    """``greedy, 32 new tokens`` or ``temperature 0.8 top_k 50 top_p 0.9 seed 0, 32 new tokens``."""
    if g["temperature"] == 0:
        how = "greedy"
    else:
        how = f"temperature {g['temperature']} top_k {g['top_k']} top_p {g['top_p']} seed {g['seed']}"
    return f"{how}, up to {g['max_new_tokens']} new tokens"


def _layouts_line(layouts: dict) -> str:
    """``prefill dp1 pp2 sp1 tp1 (ranks 0-1), decode ...``: each layout the run used."""

    def ranks(r: list[int]) -> str:
        return f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}"

    return ", ".join(
        f"{name} dp{d['dp']} pp{d['pp']} sp{d['sp']} tp{d['tp']} ({ranks(d['ranks'])})" for name, d in layouts.items()
    )
