"""Offline batch generation — the main job.

    torchrun --standalone --nproc-per-node 2 -m reshard.recipes.generate [hydra overrides]

With no overrides: the built-in tiny Llama checkpoint (created on first use), a seeded synthetic
workload, greedy decoding. Rank 0 writes ``outputs.jsonl`` and ``summary.json`` into Hydra's run
directory and prints its path; other ranks write nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from reshard.mesh import device_type
from reshard.parallel import Engine, ParallelDims
from reshard.parallel.engine import WorkloadShape
from reshard.parallel.fault import restart_count
from reshard.parallel.model.tiny_models import builtin_checkpoint, default_cache_dir
from reshard.recipes.config import GenerateConfig
from reshard.recipes.launch import FINISHED, collective_timeout, hydra_main  # noqa: F401 (collective_timeout: public here too)
from reshard.recipes.prompts import build_requests, output_tokenizer, stop_tokenizer
from reshard.recipes.report import OutputFormat, PhaseSeconds, append_finished, run_summary, write_outputs


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
    keep_compiled_code(cfg)
    if cfg.fault.migrate is not None:  # supervised ranks: failures stay in their engine group
        from reshard.recipes.supervised import run_supervised

        return run_supervised(cfg, run_dir, path)
    cfg = replace(cfg, parallel=cfg.parallel.planned(path, dist.get_world_size(), _workload_shape(cfg)))
    layouts = cfg.parallel.layouts(dist.get_world_size())  # validates every layout before loading
    engine = cfg.parallel.build(path, cfg.engine_config())
    engine.tokenizer = stop_tokenizer(cfg, path) or output_tokenizer(path)  # (its EOS ends requests too)
    fmt = OutputFormat(
        output_tokenizer(path) if _rank() == 0 else None, cfg.generation.n, cfg.generation.sampling_params()
    )
    keep = _keep_finished(engine, run_dir, fmt)
    _inject_failure(cfg, engine)
    load_seconds = time.perf_counter() - t0
    requests = build_requests(cfg, path, engine.model.config.vocab_size)
    t1 = time.perf_counter()
    with engine:
        completions = engine.generate(requests, progress=cfg.progress and _rank() == 0)
    summary = _summary(cfg, path, engine, layouts, completions, load_seconds, time.perf_counter() - t1)
    summary["failures"] = restart_count()  # whole-job restarts (torchrun's): each started from scratch
    if _rank() == 0:
        write_outputs(run_dir, completions, summary, cfg.parallel, fmt)
        keep.unlink(missing_ok=True)  # outputs.jsonl holds them all
    return summary


def _workload_shape(cfg: GenerateConfig) -> WorkloadShape:
    """What a strategy's planner knows of the requests before they are built (the synthetic
    workload's mean prompt length)."""
    w = cfg.workload
    return WorkloadShape(
        prompt_len=(w.prompt_len_min + w.prompt_len_max) / 2,
        new_tokens=cfg.generation.max_new_tokens,
        batch=cfg.engine.max_batch_size,
    )


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


def _inject_failure(cfg: GenerateConfig, engine: Engine) -> None:
    """``fault.kill_at`` without supervision: this attempt's kill, after which torchrun's restart
    (``--max-restarts``) runs the job again from scratch (the requests that finished are kept)."""
    from reshard.parallel.fault import inject_kill

    kills, attempt = cfg.fault.kills(), restart_count()
    if attempt < len(kills):
        engine.events.on("step_ready", inject_kill(kills[attempt]))


def _model_path(cfg: GenerateConfig) -> Path:
    """The configured checkpoint; the built-in one is created by rank 0 while the others wait."""
    if cfg.model.path is not None:
        from reshard.parallel import resolve_checkpoint

        return resolve_checkpoint(cfg.model.path)
    if _rank() == 0:
        builtin_checkpoint(cfg.model.cache_dir)
    dist.barrier()
    return builtin_checkpoint(cfg.model.cache_dir)


def keep_compiled_code(cfg: GenerateConfig) -> None:
    """Where the job compiles its decode step, Inductor's code is kept past ``/tmp`` and this run
    (``~/.cache/reshard/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` says): a second run starts warm."""
    if cfg.engine_config().compiles(device_type()):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))


def _summary(
    cfg, path, engine: Engine, layouts: dict[str, ParallelDims], completions, load_s: float, gen_s: float
) -> dict:
    """:func:`run_summary` with the phase times of the slowest replica (or engine group), the KV
    cache and the strategy's own keys."""
    s = _job_stats(engine)
    compile_s = sum(r.compile_seconds for r in engine.runners.values())
    seconds = [s.prefill_seconds, s.decode_seconds, s.mixed_seconds, gen_s, compile_s]
    phase = torch.tensor(seconds, dtype=torch.float64, device=device_type())
    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
    prefill_s, decode_s, mixed_s, gen_s, compile_s = phase.tolist()
    decode_s = max(decode_s - compile_s, 0.0)  # the decode steps that compiled are reported apart
    phases = PhaseSeconds(load_s, prefill_s, decode_s, mixed_s, compile_s, gen_s)
    groups = max(len(engine.group_stats), 1)
    compiled = any(r.compiled for r in engine.runners.values())  # (the compiled decode, where it ran)
    summary = run_summary(cfg, path, completions, layouts, stats=s, seconds=phases, groups=groups, compiled=compiled)
    return {**summary, "kv": _kv_summary(engine), **cfg.parallel.summary(engine)}


def _job_stats(engine: Engine):
    """The engine's counters over all its groups (one group: its own)."""
    return type(engine.stats).total(engine.group_stats) if engine.group_stats else engine.stats


def _kv_summary(engine: Engine) -> dict:
    """The KV cache's capacity (tokens per replica), paged, its block counts, and the prefix
    cache's figures where prompts were looked up."""
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
            preemptions=s.preemptions,
            prompt_tokens_computed=s.prompt_tokens_computed,
        )
    if spec.paged or s.prefix_cache_queries:  # (contiguous caches' prompts shared whole: Seesaw's, DejaVu's)
        out.update(prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)
    return out


def main() -> None:
    hydra_main("generate", run_generate)


if __name__ == "__main__":
    main()
