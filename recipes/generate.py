"""Offline batch generation — the main job.

    torchrun --standalone --nproc-per-node 2 -m recipes.generate [hydra overrides]

With no overrides: the built-in tiny Llama checkpoint (created on first use), a seeded synthetic
workload, greedy decoding. Rank 0 writes ``outputs.jsonl`` and ``summary.json`` into Hydra's run
directory and prints its path; other ranks write nothing.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel import Engine, ParallelDims, Request
from parallel.tiny_models import builtin_checkpoint

from .config import GenerateConfig

TIMEOUT_ENV = "RESHARD_COLLECTIVE_TIMEOUT"  # seconds any collective may wait (default 600)


# ---- the job ---------------------------------------------------------------------------------
def run_generate(cfg: GenerateConfig, run_dir: Path) -> dict:
    """Load, generate, write outputs (rank 0). Returns the summary dict on every rank.

    The strategy (``cfg.parallel``, looked up by name in :mod:`parallel.engine`'s registry)
    builds the engine; the engine's loop splits the requests over data-parallel replicas itself
    and returns every completion on every rank.
    """
    t0 = time.perf_counter()
    path = _model_path(cfg)
    dims = cfg.parallel.dims(dist.get_world_size())  # validates the layout before loading
    args = cfg.engine.args(compile=cfg.compile, dtype=cfg.model.dtype, allow_unused=cfg.model.allow_unused_weights)
    engine = cfg.parallel.build(path, args)
    load_seconds = time.perf_counter() - t0
    requests = build_requests(cfg, path, engine.model.config.vocab_size)
    t1 = time.perf_counter()
    with engine:
        completions = engine.generate(requests, progress=cfg.progress and _rank() == 0)
    summary = _summary(cfg, path, engine, dims, completions, load_seconds, time.perf_counter() - t1)
    if _rank() == 0:
        _write_outputs(run_dir, completions, summary, cfg.parallel)
    return summary


def _model_path(cfg: GenerateConfig) -> Path:
    """The configured checkpoint; the built-in one is created by rank 0 while the others wait."""
    if cfg.model.path is not None:
        from parallel import resolve_checkpoint

        return resolve_checkpoint(cfg.model.path)
    if _rank() == 0:
        builtin_checkpoint(cfg.model.cache_dir)
    dist.barrier()
    return builtin_checkpoint(cfg.model.cache_dir)


def build_requests(cfg: GenerateConfig, model_path: Path, vocab_size: int) -> list[Request]:
    """Requests from ``workload.prompts_file`` or a seeded synthetic workload."""
    params = cfg.generation.sampling_params()
    if cfg.workload.prompts_file:
        prompts = read_prompts(Path(cfg.workload.prompts_file), model_path)
    else:
        prompts = synthetic_prompts(cfg, vocab_size)
    return [Request(i, p, params) for i, p in enumerate(prompts)]


def synthetic_prompts(cfg: GenerateConfig, vocab_size: int) -> list[list[int]]:
    w = cfg.workload
    gen = torch.Generator().manual_seed(w.seed)
    lengths = torch.randint(w.prompt_len_min, w.prompt_len_max + 1, (w.num_requests,), generator=gen)
    return [torch.randint(0, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]


def read_prompts(path: Path, model_path: Path) -> list[list[int]]:
    """JSONL lines: a token-id list, ``{"prompt_ids": [...]}``, a string or ``{"text": ...}``."""
    if not path.exists():
        raise ValueError(f"workload.prompts_file {str(path)!r} does not exist")
    prompts, tokenizer = [], None
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if isinstance(item, dict):
            item = item.get("prompt_ids", item.get("text"))
        if isinstance(item, str):
            tokenizer = tokenizer or _tokenizer(model_path, path)
            item = tokenizer(item)["input_ids"]
        if not (isinstance(item, list) and item and all(type(t) is int for t in item)):  # no bools
            raise ValueError(f"{path}:{lineno}: expected a non-empty token-id list or a text")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"workload.prompts_file {str(path)!r} has no prompts")
    return prompts


def _tokenizer(model_path: Path, prompts_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # no tokenizer files in the checkpoint
        raise ValueError(f"{prompts_path} has text prompts but the checkpoint at {model_path} has no "
                         f"usable tokenizer ({type(e).__name__}); give token-id lists") from e


def _summary(cfg, path, engine: Engine, dims: ParallelDims, completions, load_s: float,
             gen_s: float) -> dict:
    """Token counts over all requests; phase times of the slowest replica."""
    s = engine.stats
    phase = torch.tensor([s.prefill_seconds, s.decode_seconds, gen_s], dtype=torch.float64)
    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
    prefill_s, decode_s, gen_s = phase.tolist()
    prompt_tokens = sum(len(c.prompt_ids) for c in completions)
    generated = sum(len(c.output_ids) for c in completions)
    return {
        "model_path": str(Path(path).resolve()),
        "world_size": dist.get_world_size(),
        "strategy": cfg.parallel.strategy,
        "parallel": {"dp": dims.dp, "sp": dims.sp, "tp": dims.tp},
        "requests": len(completions),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "prefill_tokens_per_s": prompt_tokens / max(prefill_s, 1e-9),
        "decode_tokens_per_s": (generated - len(completions)) / max(decode_s, 1e-9),
        "mean_decode_batch": s.mean_decode_batch,
        "phase_seconds": {"load": load_s, "prefill": prefill_s, "decode": decode_s,
                          "generate_total": gen_s},
        "compile": cfg.compile,
        **cfg.parallel.summary(engine),
    }


def _write_outputs(run_dir: Path, completions, summary: dict, strategy) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "outputs.jsonl", "w") as f:
        for c in completions:
            f.write(json.dumps({"id": c.id, "prompt_ids": c.prompt_ids, "output_ids": c.output_ids,
                                "finish_reason": c.finish_reason}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, strategy)
    print(f"outputs written to {run_dir.resolve()}", flush=True)


def _print_summary(s: dict, strategy) -> None:
    ph = s["phase_seconds"]
    print(f"\n{s['strategy']} on {s['world_size']} rank(s): {s['requests']} requests, "
          f"{s['prompt_tokens']} prompt / {s['generated_tokens']} generated tokens\n"
          f"  prefill {s['prefill_tokens_per_s']:10.1f} tok/s  ({ph['prefill']:.3f} s)\n"
          f"  decode  {s['decode_tokens_per_s']:10.1f} tok/s  ({ph['decode']:.3f} s, "
          f"mean batch {s['mean_decode_batch']:.1f})\n"
          f"  load {ph['load']:.3f} s, generate {ph['generate_total']:.3f} s", flush=True)
    for line in strategy.report(s):
        print("  " + line, flush=True)


# ---- process group and Hydra plumbing -------------------------------------------------------
def _rank() -> int:
    return dist.get_rank()


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait before the job fails (``$RESHARD_COLLECTIVE_TIMEOUT`` s,
    default 600) instead of gloo's 30 minutes; set before the process group exists."""
    raw = os.environ.get(TIMEOUT_ENV, "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_distributed() -> None:
    """Join torchrun's process group (NCCL with CUDA, else gloo); alone, a 1-rank group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=collective_timeout())
    if dist.get_world_size() > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))


def hydra_rank_overrides(argv: list[str]) -> list[str]:
    """All ranks share rank 0's run dir; only rank 0 lets Hydra write files or logs."""
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        stamp = [datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")]
        dist.broadcast_object_list(stamp, src=0)
        extra.append(f"hydra.run.dir={stamp[0]}")
    if _rank() != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                  "hydra/hydra_logging=disabled"]
    return extra


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(version_base=None, config_path="../conf", config_name="generate")
    def _main(cfg: DictConfig) -> None:
        try:
            config = GenerateConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
            run_generate(config, Path(HydraConfig.get().runtime.output_dir))
        except ValueError as e:  # a user error: one line, not a traceback per rank
            report_once(f"error: {e}")
            raise SystemExit(2) from None

    _main()


def report_once(message: str) -> None:
    """Print ``message`` on stderr from the first rank of the job that gets here; the other ranks,
    which usually found the same error, stay quiet. Counted in the process group's store, so
    nothing is left on disk."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank shares
        if store.add("reshard/user-error", 1) > 1:
            return
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    init_distributed()
    sys.argv += hydra_rank_overrides(sys.argv[1:])
    try:
        _hydra_entry()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
