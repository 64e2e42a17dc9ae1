"""Offline batch generation — the main job.

    torchrun --standalone --nproc-per-node 2 -m reshard.recipes.generate [hydra overrides]

With no overrides: the built-in tiny Llama checkpoint (created on first use), a seeded synthetic
workload, greedy decoding. Rank 0 writes ``outputs.jsonl`` and ``summary.json`` into Hydra's run
directory and prints its path; other ranks write nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reshard.mesh import device_type
from reshard.parallel import Engine, ParallelDims, Request
from reshard.parallel.engine import WorkloadShape
from reshard.parallel.engine.metrics import latency_summary
from reshard.parallel.engine.workload import poisson_arrivals
from reshard.parallel.fault import restart_count
from reshard.parallel.model.tiny_models import builtin_checkpoint, default_cache_dir
from reshard.recipes.config import GenerateConfig
from reshard.recipes.launch import FINISHED, LAUNCHED_ENV, collective_timeout, hydra_main  # noqa: F401 (collective_timeout: public here too)


def _rank() -> int:
    return dist.get_rank()


# ---- the job ---------------------------------------------------------------------------------
def run_generate(cfg: GenerateConfig, run_dir: Path) -> dict:
    """Load, generate, write outputs (rank 0). Returns the summary dict on every rank.

    The strategy (``cfg.parallel``, looked up by name in :mod:`parallel.engine`'s registry)
    builds the engine; the engine's loop splits the requests over data-parallel replicas itself
    and returns every completion on every rank.
    """
    t0 = time.perf_counter()
    cfg.fault.check_world(dist.get_world_size())  # before anything loads, on every rank alike
    path = _model_path(cfg)
    if cfg.fault.migrate is not None:  # supervised ranks: failures stay in their engine group
        from reshard.recipes.supervised import run_supervised

        return run_supervised(cfg, run_dir, path)
    if cfg.compile:  # Inductor's compiled code outlives /tmp and this run: the second run starts warm
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))
    cfg = replace(cfg, parallel=cfg.parallel.planned(path, dist.get_world_size(), _workload_shape(cfg)))
    layouts = cfg.parallel.layouts(dist.get_world_size())  # validates every layout before loading
    engine = cfg.parallel.build(path, cfg.engine_args())
    engine.tokenizer = stop_tokenizer(cfg, path)
    fmt = OutputFormat(output_tokenizer(path) if _rank() == 0 else None, cfg.generation.n, cfg.generation.stop)
    keep = _keep_finished(engine, run_dir, fmt)
    fault = _fault_tolerance(cfg, engine, keep)
    load_seconds = time.perf_counter() - t0
    requests = build_requests(cfg, path, engine.model.config.vocab_size)
    if cfg.compile and _rank() == 0:
        print(compile_notice(), flush=True)
    t1 = time.perf_counter()
    with engine:
        try:
            completions = engine.generate(requests, progress=cfg.progress and _rank() == 0)
        except RuntimeError:  # a peer died mid-collective (the error itself follows in the traceback)
            if fault is not None:
                fault["ft"].on_failure(f"a collective failed on rank {_rank()}")
                if LAUNCHED_ENV in os.environ:  # its line says what comes next; the launcher tells the rest
                    raise SystemExit(1) from None
            raise
        except KeyboardInterrupt:  # Ctrl-C or a launcher's SIGTERM: nothing will recover from the mirrors
            if fault is not None:
                fault["ft"].abandon()
            raise
    summary = _summary(cfg, path, engine, layouts, completions, load_seconds, time.perf_counter() - t1)
    summary["failures"] = restart_count()
    if fault is not None:
        summary.update(fault.pop("summary")(), recovery_seconds=fault["recovery_seconds"])
        fault["ft"].close()
    if _rank() == 0:
        _write_outputs(run_dir, completions, summary, cfg.parallel, fmt)
        keep.unlink(missing_ok=True)  # outputs.jsonl holds them all
    return summary


def compile_notice() -> str:
    """What ``compile=true`` is about to do, said before the first (slow) compiled step."""
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "Inductor's default cache")
    return (
        "compiling the decode step at its first calls (a first run on this machine can take minutes; "
        f"compiled code is cached in {where}, so later runs start faster)"
    )


def _workload_shape(cfg: GenerateConfig) -> WorkloadShape:
    """What a strategy's planner knows of the requests before they are built (the synthetic
    workload's mean prompt length)."""
    w = cfg.workload
    return WorkloadShape(
        prompt_len=(w.prompt_len_min + w.prompt_len_max) / 2,
        new_tokens=cfg.generation.max_new_tokens,
        batch=cfg.engine.max_batch_size,
    )


def append_finished(path: Path, completions, fmt: OutputFormat | None = None) -> None:
    """Append ``completions`` to a :data:`FINISHED` file, one output line each."""
    fmt = fmt or OutputFormat()
    with open(path, "a") as f:
        f.writelines(fmt.line(c) for c in completions)


def _keep_finished(engine: Engine, run_dir: Path, fmt: OutputFormat) -> Path:
    """Rank 0 appends each request to ``run_dir/finished.jsonl`` the step it finishes, so a job
    that dies keeps what it completed (a restarted attempt rewrites the file as it replays)."""
    path = run_dir / FINISHED
    if _rank() != 0:
        return path
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("")

    def hook(index: int, step, tokens) -> None:
        done = [s.completion() for s in step.seqs if s.finish_reason is not None]
        if done:
            append_finished(path, done, fmt)

    engine.events.on("step_agreed", hook)
    return path


def _fault_tolerance(cfg: GenerateConfig, engine: Engine, finished: Path) -> dict | None:
    """Ring replication and a journal when ``fault.replicate``; on a restarted attempt, recover
    first (restore KV from the successors' mirrors, replay the journal)."""
    from reshard.parallel.fault import FaultTolerance, inject_kill

    kills, attempt = cfg.fault.kills(), restart_count()
    kill = kills[attempt] if attempt < len(kills) else None
    if not cfg.fault.replicate:  # the baseline: a kill restarts every request from scratch
        if kill is not None:
            engine.events.on("step_ready", inject_kill(kill))
        return None

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ft = FaultTolerance(
        engine,
        run_id,
        kill_at=kill,
        hang=cfg.fault.inject == "hang",
        attempt=attempt,
        heartbeat_s=cfg.fault.heartbeat_s,
        replicate_every=cfg.fault.replicate_every,
        max_restarts=int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        on_last_failure=f"Requests that finished are in {finished.resolve()}",
    )
    t0, killed = time.time(), ft.killed_at()
    if attempt > 0:
        ft.recover()

    def summary() -> dict:
        detected = ft.detected_after()
        return {
            "failures": attempt,
            "restart_after_s": None if killed is None else t0 - killed,
            "detected_after_s": detected,
            "recovered_from_step": ft.recovered_from,
            "detected_after_heartbeats": None if detected is None else detected / cfg.fault.heartbeat_s,
            "recomputed_steps": ft.recomputed_steps,
        }

    return {"ft": ft, "summary": summary, "recovery_seconds": time.time() - t0}


def _model_path(cfg: GenerateConfig) -> Path:
    """The configured checkpoint; the built-in one is created by rank 0 while the others wait."""
    if cfg.model.path is not None:
        from reshard.parallel import resolve_checkpoint

        return resolve_checkpoint(cfg.model.path)
    if _rank() == 0:
        builtin_checkpoint(cfg.model.cache_dir)
    dist.barrier()
    return builtin_checkpoint(cfg.model.cache_dir)


def build_requests(cfg: GenerateConfig, model_path: Path, vocab_size: int) -> list[Request]:
    """Requests from ``workload.prompts_file`` or a seeded synthetic workload; arrival times from
    the file's ``"arrival"`` fields or a seeded Poisson process at ``workload.rate`` (else 0)."""
    params = cfg.generation.sampling_params()
    w = cfg.workload
    if w.prompts_file:
        prompts, arrivals = read_prompts(Path(w.prompts_file), model_path)
        _check_lengths(prompts, Path(w.prompts_file), params.max_new_tokens, cfg.engine.max_seq_len)
    else:
        prompts, arrivals = synthetic_prompts(cfg, vocab_size), [0.0] * w.num_requests
    if w.rate is not None:
        if any(a > 0 for a in arrivals):
            raise ValueError(
                f"workload.rate={w.rate} would replace the arrival times of {w.prompts_file}: give one of them"
            )
        arrivals = poisson_arrivals(len(prompts), w.rate, w.seed, w.burst)
    n = cfg.generation.n  # samples per prompt: request ids prompt_index * n + sample (each its own seed)
    return [
        Request(i * n + k, p, params, arrival=a) for i, (p, a) in enumerate(zip(prompts, arrivals)) for k in range(n)
    ]


def _check_lengths(prompts: list[list[int]], path: Path, new_tokens: int, max_seq_len: int) -> None:
    """``ValueError`` naming the file's line whose prompt + ``new_tokens`` exceeds ``max_seq_len``."""
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    if len(prompts[i]) + new_tokens > max_seq_len:
        raise ValueError(
            f"{path}: the prompt of request {i} ({len(prompts[i])} tokens) + generation.max_new_tokens "
            f"({new_tokens}) = {len(prompts[i]) + new_tokens} exceeds engine.max_seq_len ({max_seq_len})"
        )


def synthetic_prompts(cfg: GenerateConfig, vocab_size: int) -> list[list[int]]:
    w = cfg.workload
    gen = torch.Generator().manual_seed(w.seed)
    lengths = torch.randint(w.prompt_len_min, w.prompt_len_max + 1, (w.num_requests,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def read_prompts(path: Path, model_path: Path) -> tuple[list[list[int]], list[float]]:
    """JSONL lines: a token-id list, ``{"prompt_ids": [...]}``, a string or ``{"text": ...}``; a
    mapping may give ``"arrival"`` (seconds after the start, >= 0; default 0). Returns the prompts
    and their arrival times."""
    if not path.exists():
        raise ValueError(f"workload.prompts_file {str(path)!r} does not exist")
    prompts, arrivals = [], []
    tokenizer = functools.cache(lambda: _tokenizer(model_path, path))  # loaded at the first text prompt
    for lineno, line in enumerate(_prompt_lines(path), 1):
        if not line.strip():
            raise ValueError(f"{path}:{lineno}: blank line (one prompt per line; only the end may be blank)")
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        arrivals.append(_arrival(item, path, lineno))
        prompts.append(_prompt_ids(item, f"{path}:{lineno}", tokenizer))
    if not prompts:
        raise ValueError(f"workload.prompts_file {str(path)!r} has no prompts")
    return prompts, arrivals


def _prompt_ids(item, where: str, tokenizer: Callable[[], Any]) -> list[int]:
    """A prompts-file line's token ids: a token-id list (or ``{"prompt_ids": ...}``) as given, a text
    (or ``{"text": ...}``) tokenized, ``{"messages": [...]}`` rendered by the tokenizer's chat
    template with the assistant's turn opened."""
    if isinstance(item, dict):
        if "messages" in item:
            return _chat_ids(item["messages"], tokenizer(), where)
        item = item.get("prompt_ids", item.get("text"))
    if isinstance(item, str):
        item = tokenizer()(item)["input_ids"]
    if not (isinstance(item, list) and item and all(type(t) is int for t in item)):  # no bools
        raise ValueError(f"{where}: expected a non-empty token-id list, a text or chat messages")
    return item


def _chat_ids(messages, tokenizer, where: str) -> list[int]:
    ok = isinstance(messages, list) and messages
    if not (ok and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}')
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat messages need a chat template; the checkpoint's tokenizer has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def output_tokenizer(model_path: Path):
    """The checkpoint's tokenizer for decoding outputs, or ``None`` when it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((Path(model_path) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # files that do not load: outputs stay token ids, as without a tokenizer
        return None


def stop_tokenizer(cfg: GenerateConfig, path: Path):
    """The checkpoint's tokenizer when the job has stop strings (matched in decoded text), else
    None; ``ValueError`` naming the checkpoint when it has none."""
    if not cfg.generation.stop:
        return None
    tokenizer = output_tokenizer(path)
    if tokenizer is None:
        raise ValueError(
            f"generation.stop={list(cfg.generation.stop)} is matched in decoded text, and the checkpoint {path} "
            "has no tokenizer (tokenizer.json / tokenizer_config.json); use generation.stop_token_ids"
        )
    return tokenizer


def _prompt_lines(path: Path) -> list[str]:
    """The file's lines, blank ones at the end dropped; a file that is not UTF-8 is a ``ValueError``
    naming it and the byte."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"workload.prompts_file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _arrival(item, path: Path, lineno: int) -> float:
    value = item.get("arrival", 0.0) if isinstance(item, dict) else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{path}:{lineno}: arrival must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _tokenizer(model_path: Path, prompts_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # no tokenizer files in the checkpoint
        raise ValueError(
            f"{prompts_path} has text or chat prompts but the checkpoint at {model_path} has no "
            f"usable tokenizer ({type(e).__name__}); give token-id lists"
        ) from e


def _summary(
    cfg, path, engine: Engine, layouts: dict[str, ParallelDims], completions, load_s: float, gen_s: float
) -> dict:
    """Token counts over all requests; phase times of the slowest replica (or engine group);
    latency percentiles and end-to-end throughput; every layout the run used."""
    s = _job_stats(engine)
    compile_s = sum(getattr(r, "compile_seconds", 0.0) for r in engine.runners.values())
    seconds = [s.prefill_seconds, s.decode_seconds, s.mixed_seconds, gen_s, compile_s]
    phase = torch.tensor(seconds, dtype=torch.float64, device=device_type())
    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
    prefill_s, decode_s, mixed_s, gen_s, compile_s = phase.tolist()
    decode_s = max(decode_s - compile_s, 0.0)  # the decode steps that compiled are reported apart
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
        "prefill_tokens_per_s": prompt_tokens / max(prefill_s + mixed_s, 1e-9),
        "decode_tokens_per_s": (generated - len(completions)) / max(decode_s, 1e-9),
        "mean_decode_batch": s.mean_decode_batch,
        "engine_groups": max(len(engine.group_stats), 1),
        "phase_seconds": {
            "load": load_s,
            "prefill": prefill_s,
            "decode": decode_s,
            "mixed": mixed_s,
            "compile": compile_s,  # compile=true: the decode calls that compiled a graph (not in decode)
            "generate_total": gen_s,
        },
        "mixed_steps": s.mixed_steps,  # chunked prefill's steps (engine.prefill_chunk)
        "online": any(c.timing is not None and c.timing.arrival > 0 for c in completions),
        "latency": latency_summary(completions, gen_s),
        "compile": cfg.compile,
        "kv": _kv_summary(engine),
        **cfg.parallel.summary(engine),
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


def _job_stats(engine: Engine):
    """The engine's counters over all its groups (one group: its own)."""
    return type(engine.stats).total(engine.group_stats) if engine.group_stats else engine.stats


def _kv_summary(engine: Engine) -> dict:
    """The KV cache's capacity (tokens per replica) and, paged, its block counts."""
    kv = next((r.kv for r in engine.runners.values() if r.kv is not None), None)
    if kv is None:
        return {}
    spec, s = kv.spec, _job_stats(engine)
    out = {"paged": spec.paged, "capacity_tokens": spec.capacity_tokens}
    if spec.paged:
        out.update(
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            blocks_allocated=s.kv_blocks_allocated,
            blocks_freed=s.kv_blocks_freed,
            blocks_peak=s.kv_blocks_peak,
        )
    return out


def _write_outputs(run_dir: Path, completions, summary: dict, strategy, fmt: OutputFormat) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "outputs.jsonl", "w") as f:
        f.writelines(fmt.line(c) for c in completions)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, strategy)
    print(f"outputs written to {run_dir.resolve()}", flush=True)


@dataclass(frozen=True)
class OutputFormat:
    """How a completion becomes an ``outputs.jsonl`` / ``finished.jsonl`` line: ids and finish reason;
    with a tokenizer also the prompt as fed and the output decoded (special tokens skipped); with
    ``n`` samples per prompt (request id ``prompt_index * n + sample``) which prompt and sample."""

    tokenizer: Any = None
    n: int = 1
    stop: Sequence[str] | None = None  # stop strings: the decoded output ends before the first (as vLLM's)

    def line(self, c) -> str:
        out = {"id": c.id, "prompt_ids": c.prompt_ids, "output_ids": c.output_ids, "finish_reason": c.finish_reason}
        if self.n > 1:
            out.update(prompt_index=c.id // self.n, sample=c.id % self.n)
        if self.tokenizer is not None:
            out["prompt"] = self.tokenizer.decode(c.prompt_ids)
            out["output"] = self._cut(self.tokenizer.decode(c.output_ids, skip_special_tokens=True), c.finish_reason)
        if c.logprobs is not None:  # per output token: [its logprob, [[id, logprob] of the top ones]]
            out["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in c.logprobs]
        return json.dumps(out) + "\n"

    def _cut(self, text: str, reason: str) -> str:
        """``text`` up to the first stop string in it (a request a stop string ended)."""
        found = [i for i in (text.find(s) for s in self.stop or ()) if i >= 0] if reason == "stop" else []
        return text[: min(found)] if found else text


def _print_summary(s: dict, strategy) -> None:
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


def main() -> None:
    hydra_main("generate", run_generate)


if __name__ == "__main__":
    main()
