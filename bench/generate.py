"""Generation benchmark: our engine against HF ``generate`` (uniform batch, realistic offline workload).

Run from the repo root:

    torchrun --standalone --nproc-per-node 2 bench/generate.py
    torchrun --standalone --nproc-per-node 1 bench/generate.py   # single-rank comparison only
    torchrun --standalone --nproc-per-node 2 bench/generate.py --workload realistic

``--workload uniform`` (default), on the built-in tiny Llama: one batch of ``--batch`` random
prompts (seeded, all ``--prompt-len`` tokens, so no padding), ``--new-tokens`` greedy tokens each.
Both sides always generate exactly that many tokens: ours with no stop tokens, HF with
``min_new_tokens == max_new_tokens`` (which masks EOS in HF).

``--workload realistic``, on a seeded ~100M-parameter Llama (hidden 768, 8 layers, 12 query / 4
KV heads, MLP 2048, vocab 32000, fp32; built once into the cache dir): ``--requests`` seeded
requests, prompt lengths uniform over ``--prompt-lens`` (16..384), output budgets uniform over
``--budgets`` (8..128), greedy, EOS ignored on both sides. For each ``B`` in ``--batches``:

* HF as an offline user runs it: requests in order, batches of ``B``, left padding (pad id from
  the config, attention mask built here), ``max_new_tokens`` = the batch's longest budget,
  ``eos_token_id=None`` (never stops early, EOS not masked), outputs cut to each budget.
* Ours: all requests submitted at once to ``Engine(max_batch_size=B, max_seq_len=longest prompt
  + largest budget)``; continuous batching does the rest. ``--ours`` lists the variants, each an
  admission order (``fifo``: request order, the default; ``longest_first``: largest budget first)
  optionally ``:compiled`` (``torch.compile`` of the decode step; its warm-up run compiles).
* Metric: useful tokens/s = sum of budgets / wall seconds. "equal" counts requests whose tokens
  are identical (left padding may shift HF's numerics slightly; reported, not asserted).
* GEMM share: the model's matrix multiplies alone (every 2-D weight of the decoder layers, this
  rank's local shard, ``F.linear`` on an ``(M, in_features)`` input with ``M = B``: the engine
  computes every KV-cache slot row; plus the LM head with ``M`` = the mean decode batch rounded
  to the engine's power-of-two row bucket), median of ``--gemm-repeats``, divided by our mean decode
  step time (``decode_seconds /
  decode_steps`` over the timed runs).

Both workloads: 1 rank = our ``Engine`` on a 1-rank gloo group vs ``AutoModelForCausalLM``. In a
2-rank job rank 0 runs this part in a subprocess (``--single``, its own 1-rank group) while rank 1
waits at a barrier; then ours with TP=2 vs HF ``from_pretrained(path, tp_plan="auto")``. Each timed
side runs once as warm-up, then ``--repeats`` timed runs; medians. ``--profile`` adds one
``torch.profiler`` run of our ``generate`` on the realistic workload at the largest ``B``.

``--device cuda`` runs the 1-rank part on GPU 0: its 1-rank group is NCCL (so the library places
the model and KV cache on CUDA), HF's model and inputs go to CUDA, and every clock read (the timed
runs, the GEMM passes) follows ``torch.cuda.synchronize()``; ``:compiled`` then captures CUDA
graphs (``mode="reduce-overhead"``). The TP part of a 2-rank job stays on CPU/gloo. ``--dtype``
(``float32`` default, or ``bfloat16``) is the weights' dtype on both sides (and so our KV cache's).
Each realistic row goes to stderr as it finishes (a run cut short keeps what it measured), and the
compiled rows' compile seconds are printed under the table.

    torchrun --standalone --nproc-per-node 1 bench/generate.py --workload realistic --device cuda \
        --ours fifo,longest_first,fifo:compiled --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import parser, rerun_command

from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize
from reshard.parallel.model.tiny_models import builtin_checkpoint, cached_checkpoint, default_cache_dir

REPO = Path(__file__).resolve().parent.parent

Tokens = list[list[int]]
LLAMA_100M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    initializer_range=0.02,
)
LLAMA_100M_NAME = "bench-llama-100m-seed0-v1"
LLAMA_100M_DESC = "Llama hidden 768, 8 layers, 12/4 heads, MLP 2048, vocab 32000, {dtype}, seed 0"
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--workload", choices=("uniform", "realistic"), default="uniform")
    p.add_argument("--batch", type=int, default=8, help="uniform: prompts in the one batch")
    p.add_argument("--prompt-len", type=int, default=128, help="uniform: tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="uniform: generated tokens per prompt")
    p.add_argument("--requests", type=int, default=32, help="realistic: number of requests")
    p.add_argument(
        "--prompt-lens", type=_int_range, default=(16, 384), help="realistic: prompt lengths LO,HI (uniform, inclusive)"
    )
    p.add_argument(
        "--budgets", type=_int_range, default=(8, 128), help="realistic: output budgets LO,HI (uniform, inclusive)"
    )
    p.add_argument(
        "--batches", type=_int_list, default=[8, 16], help="realistic: batch sizes B (HF batch, our max_batch_size)"
    )
    p.add_argument("--gemm-repeats", type=int, default=30, help="realistic: timed GEMM passes")
    p.add_argument(
        "--ours",
        type=_variant_list,
        default=["fifo", "longest_first"],
        help="realistic: our variants, admission[:compiled], e.g. fifo,longest_first:compiled",
    )
    p.add_argument(
        "--profile", action="store_true", help="realistic: print a torch.profiler table of one of our generate calls"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed runs after one warm-up (default: 5 uniform, 3 realistic)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the 1-rank part's device (cuda: NCCL)")
    p.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default="float32", help="weights' dtype, both sides")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank with 2+ ranks")
    p.add_argument("--single-threads", type=int, default=os.cpu_count() or 1, help="torch threads of the 1-rank part")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # internal: 1-rank part
    p.add_argument("--json-out", help=argparse.SUPPRESS)  # internal: where --single writes results
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.workload == "realistic" else 5
    return args


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _variant_list(text: str) -> list[str]:
    """``fifo,longest_first:compiled`` -> variants; each an admission order, optionally compiled."""
    variants = [v for v in text.split(",") if v]
    for v in variants:
        admission, _, mode = v.partition(":")
        if admission not in ("fifo", "longest_first") or mode not in ("", "compiled"):
            raise argparse.ArgumentTypeError(f"variant {v!r}: want fifo|longest_first[:compiled]")
    return variants


def _int_range(text: str) -> tuple[int, int]:
    lo, hi = _int_list(text)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


# ---- shared timing ----------------------------------------------------------------------------
def device(args: argparse.Namespace) -> torch.device:
    """Where the 1-rank part runs (the current CUDA device with ``--device cuda``)."""
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def sync_device() -> None:
    """Wait for queued CUDA work (no-op on CPU), so a host clock read covers it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_runs(
    run: Callable[[], Tokens], repeats: int, sync: bool, after_warmup: Callable[[], None] | None = None
) -> tuple[Tokens, float]:
    """One warm-up call, then ``repeats`` timed calls; returns the tokens and the median seconds."""
    tokens = run()
    if after_warmup is not None:
        after_warmup()
    seconds = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        sync_device()
        t0 = time.perf_counter()
        tokens = run()
        sync_device()
        if sync:
            dist.barrier()
        seconds.append(time.perf_counter() - t0)
    return tokens, statistics.median(seconds)


# ---- uniform workload (built-in tiny Llama, one batch, no padding) ---------------------------
def make_prompts(args: argparse.Namespace, vocab_size: int) -> Tokens:
    """``batch`` prompts of ``prompt_len`` ids in ``[3, vocab)`` (skips pad/bos/eos)."""
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, vocab_size, (args.batch, args.prompt_len), generator=g).tolist()


def bench_ours(path: Path, prompts: Tokens, args: argparse.Namespace) -> tuple[Tokens, float]:
    model = parallelize(path, dtype=dtype(args))
    engine = Engine(
        model, EngineConfig(max_batch_size=len(prompts), max_seq_len=args.prompt_len + args.new_tokens, compile=False)
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    def run() -> Tokens:
        done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
        return [c.output_ids for c in done]

    return time_runs(run, args.repeats, sync=dist.get_world_size() > 1)


def bench_hf(path: Path, prompts: Tokens, args: argparse.Namespace, tp: bool) -> tuple[Tokens, float]:
    model = load_hf(path, tp, args)
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    n = args.new_tokens

    def run() -> Tokens:
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n
            )
        return out[:, ids.shape[1] :].tolist()

    return time_runs(run, args.repeats, sync=tp)


def load_hf(path: Path, tp: bool, args: argparse.Namespace):
    """HF ``from_pretrained`` in ``--dtype``, eval mode; ``tp_plan="auto"`` over the world with
    ``tp`` (CPU), else on ``--device``."""
    from transformers import AutoModelForCausalLM

    if tp:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype(args), tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype(args)).to(device(args)).eval()


def compare(label: str, ranks: int, threads: int, path: Path, prompts: Tokens, args: argparse.Namespace) -> dict:
    """Ours vs HF on the current process group (1 rank, or TP over all ranks)."""
    ours, ours_s = bench_ours(path, prompts, args)
    hf, hf_s = bench_hf(path, prompts, args, tp=ranks > 1)
    generated = len(prompts) * args.new_tokens
    return dict(
        label=label,
        ranks=ranks,
        threads=threads,
        generated=generated,
        ours_s=ours_s,
        hf_s=hf_s,
        match=ours == hf,
        same_prompts=sum(a == b for a, b in zip(ours, hf)),
        counts_ok=all(len(t) == args.new_tokens for t in ours + hf),
    )


# ---- realistic workload (~100M Llama, mixed lengths) -----------------------------------------
@dataclass
class Workload:
    prompts: Tokens
    budgets: list[int]

    @property
    def useful(self) -> int:
        return sum(self.budgets)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) for p in self.prompts) + max(self.budgets)


def llama_100m_checkpoint() -> Path:
    """The ~100M Llama in the cache dir, built once (like the built-in one)."""
    return cached_checkpoint(LLAMA_100M_NAME, LLAMA_100M)


def checkpoint_params(path: Path) -> int:
    """Number of parameters stored in the checkpoint's safetensors files."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Seeded prompts (lengths uniform over ``--prompt-lens``) and budgets (over ``--budgets``)."""
    g = torch.Generator().manual_seed(args.seed)
    n = args.requests
    lengths = torch.randint(args.prompt_lens[0], args.prompt_lens[1] + 1, (n,), generator=g).tolist()
    budgets = torch.randint(args.budgets[0], args.budgets[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab_size, (m,), generator=g).tolist() for m in lengths]
    return Workload(prompts, budgets)


def hf_batches(work: Workload, batch: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Requests in order, ``batch`` at a time: left-padded ``(ids, attention_mask, budgets)``."""
    out = []
    for i in range(0, len(work.prompts), batch):
        prompts, budgets = work.prompts[i : i + batch], work.budgets[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out.append((ids, mask, budgets))
    return out


def hf_padding(work: Workload, batch: int) -> tuple[int, int]:
    """(prompt positions HF prefills incl. padding, decode positions incl. tokens past budgets)."""
    prefill = decode = 0
    for i in range(0, len(work.prompts), batch):
        prompts, budgets = work.prompts[i : i + batch], work.budgets[i : i + batch]
        prefill += len(prompts) * max(len(p) for p in prompts)
        decode += len(prompts) * max(budgets)
    return prefill, decode


def bench_hf_realistic(
    model, work: Workload, batch: int, pad_id: int, args: argparse.Namespace, tp: bool
) -> tuple[Tokens, float]:
    """HF ``generate`` over the requests in order, ``batch`` at a time, left padded, greedy."""
    dev = next(model.parameters()).device
    batches = [(ids.to(dev), mask.to(dev), budgets) for ids, mask, budgets in hf_batches(work, batch, pad_id)]

    def run() -> Tokens:
        outputs = []
        for ids, mask, budgets in batches:
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max(budgets),
                    eos_token_id=None,
                    pad_token_id=pad_id,
                )
            outputs += [row[:b] for row, b in zip(out[:, ids.shape[1] :].tolist(), budgets)]
        return outputs

    return time_runs(run, args.repeats, sync=tp)


STAT_FIELDS = ("decode_seconds", "decode_steps", "decode_batch_sum", "prefill_seconds")


def _stats(engine: Engine) -> dict[str, float]:
    return {k: getattr(engine.stats, k) for k in STAT_FIELDS}


def bench_ours_realistic(
    model, work: Workload, batch: int, variant: str, args: argparse.Namespace
) -> tuple[Tokens, float, Engine, dict[str, float]]:
    """All requests at once into one engine of ``batch`` slots (``variant``: admission order
    [``:compiled``]); returns the stats of the timed runs."""
    admission, _, mode = variant.partition(":")
    engine = Engine(
        model,
        EngineConfig(
            max_batch_size=batch, max_seq_len=work.max_seq_len, compile=mode == "compiled", admission=admission
        ),
    )
    requests = [
        Request(i, p, SamplingParams(max_new_tokens=b, ignore_eos=True))
        for i, (p, b) in enumerate(zip(work.prompts, work.budgets))
    ]
    start: dict[str, float] = {}

    def run() -> Tokens:
        return [c.output_ids for c in engine.generate(requests)]

    tokens, seconds = time_runs(
        run, args.repeats, sync=dist.get_world_size() > 1, after_warmup=lambda: start.update(_stats(engine))
    )
    timed = {k: v - start[k] for k, v in _stats(engine).items()}
    return tokens, seconds, engine, timed


def gemm_weights(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's local 2-D weights of every decoder layer (q, k, v, o, gate, up, down), LM head."""
    layers = [_local(p) for p in model.model.layers.parameters() if p.ndim == 2]
    return layers, _local(model.lm_head.weight)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


@torch.inference_mode()
def time_gemms(weights: list[tuple[torch.Tensor, int]], repeats: int, sync: bool) -> float:
    """Median seconds of one pass of ``F.linear(x, w)`` for each ``(w, M)``, ``x`` random ``(M, in)``."""
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(m, w.shape[1], generator=g, dtype=w.dtype).to(w.device), w) for w, m in weights]

    def one_pass() -> float:
        if sync:
            dist.barrier()
        sync_device()
        t0 = time.perf_counter()
        for x, w in inputs:
            F.linear(x, w)
        sync_device()
        return time.perf_counter() - t0

    one_pass()
    return statistics.median(one_pass() for _ in range(repeats))


def gemm_share(model, engine: Engine, timed: dict[str, float], args: argparse.Namespace, sync: bool) -> dict:
    """GEMM seconds (layers at M = max_batch_size, LM head at the bucket of the mean decode batch)
    per decode step."""
    steps = max(timed["decode_steps"], 1)
    step_s = timed["decode_seconds"] / steps
    mean_batch = timed["decode_batch_sum"] / steps
    layer_ws, head_w = gemm_weights(model)
    m_layers = engine.max_batch_size  # decode computes every KV slot's row in the layers
    # the LM head: the active rows, padded to the engine's power-of-two bucket
    m_head = min(1 << (max(1, round(mean_batch)) - 1).bit_length(), m_layers)
    gemm_s = time_gemms([(w, m_layers) for w in layer_ws] + [(head_w, m_head)], args.gemm_repeats, sync)
    return dict(
        step_s=step_s,
        mean_batch=mean_batch,
        gemm_s=gemm_s,
        m_layers=m_layers,
        m_head=m_head,
        prefill_s=timed["prefill_seconds"] / args.repeats,
        decode_s=timed["decode_seconds"] / args.repeats,
    )


def profile_generate(engine: Engine, work: Workload) -> None:
    """One ``generate`` of the workload under ``torch.profiler`` (CPU); rank 0 prints the top ops,
    then the ops inside the prefill and the decode steps."""
    from torch.profiler import ProfilerActivity, profile

    requests = [
        Request(i, p, SamplingParams(max_new_tokens=b, ignore_eos=True))
        for i, (p, b) in enumerate(zip(work.prompts, work.budgets))
    ]
    undo = _label_steps(engine)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(requests)
    finally:
        undo()
    if dist.get_rank() == 0:
        print(
            f"\nprofile: our generate, realistic workload, max_batch_size={engine.max_batch_size}, "
            f"world {dist.get_world_size()}, {torch.get_num_threads()} threads (self CPU time)"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        events = prof.events()
        print("\n".join(region_table(events, f"engine.{phase}") for phase in ("prefill", "decode")))


def _label_steps(engine: Engine) -> Callable[[], None]:
    """Wrap each engine step (``Engine._run(step)``) in ``record_function("engine.<kind>")``;
    returns the undo."""
    from torch.profiler import record_function

    run = engine._run

    def labelled(step, *a, **kw):
        with record_function(f"engine.{step.kind}"):
            return run(step, *a, **kw)

    engine._run = labelled
    return lambda: delattr(engine, "_run")  # back to the class method


def region_table(events, region: str, rows: int = 20) -> str:
    """Self CPU time by op name of the events inside ``region`` (a ``record_function`` label)."""
    total = 0.0
    count = 0
    per_op = {}
    for e in events:
        if e.name == region:
            total, count = total + e.cpu_time_total, count + 1
        elif _inside(e, region):
            n, t = per_op.get(e.name, (0, 0.0))
            per_op[e.name] = (n + 1, t + e.self_cpu_time_total)
    if not count:
        return f"\n{region}: no labelled steps in the profile"
    lines = [
        f"\n{region}: {count} calls, {total / 1e3:.0f} ms CPU total, "
        f"{total / 1e3 / max(count, 1):.1f} ms per call; self CPU time by op inside it:",
        "| op | calls | self ms | ms per call of region | share |",
        "|---|---|---|---|---|",
    ]
    inner = sum(t for _, t in per_op.values())
    for name, (n, t) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(
            f"| {name} | {n} | {t / 1e3:.0f} | {t / 1e3 / max(count, 1):.2f} | {100 * t / max(total, 1e-9):.1f}% |"
        )
    own = total - inner
    lines.append(
        f"| (region's own Python, outside ops) | | {own / 1e3:.0f} | "
        f"{own / 1e3 / count:.2f} | {100 * own / max(total, 1e-9):.1f}% |"
    )
    return "\n".join(lines)


def _inside(event, region: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == region:
            return True
        parent = parent.cpu_parent
    return False


def compare_realistic(label: str, ranks: int, threads: int, path: Path, args: argparse.Namespace) -> list[dict]:
    """Ours vs HF on the realistic workload for every ``B`` in ``--batches``."""
    config = json.loads((path / "config.json").read_text())
    work = make_workload(args, config["vocab_size"])
    pad_id = config.get("pad_token_id") or 0
    tp = ranks > 1
    ours_model, hf_model = parallelize(path, dtype=dtype(args)), load_hf(path, tp, args)
    rows = []
    for batch in args.batches:
        hf, hf_s = bench_hf_realistic(hf_model, work, batch, pad_id, args, tp)
        for variant in args.ours:
            ours, ours_s, engine, timed = bench_ours_realistic(ours_model, work, batch, variant, args)
            share = gemm_share(ours_model, engine, timed, args, sync=tp)
            if args.profile and batch == max(args.batches) and variant == args.ours[0]:
                profile_generate(engine, work)
            rows.append(
                dict(
                    label=label,
                    ranks=ranks,
                    threads=threads,
                    batch=batch,
                    variant=variant,
                    useful=work.useful,
                    ours_s=ours_s,
                    hf_s=hf_s,
                    equal=sum(a == b for a, b in zip(ours, hf)),
                    prefix=sum(_common_prefix(a, b) for a, b in zip(ours, hf)),
                    counts_ok=[len(t) for t in ours] == work.budgets == [len(t) for t in hf],
                    compile_s=sum(getattr(r, "compile_seconds", 0.0) for r in engine.runners.values()),
                    **share,
                )
            )
            _progress(rows[-1])
    return rows


def _progress(row: dict) -> None:
    """One line on stderr per finished row, so a run cut short still shows what it measured."""
    print(
        f"[generate] {row['label']} B={row['batch']} {row['variant']}: ours {row['ours_s']:.2f} s, "
        f"HF {row['hf_s']:.2f} s, equal {row['equal']}, step {1e3 * row['step_s']:.2f} ms, "
        f"GEMM {1e3 * row['gemm_s']:.2f} ms, compile {row['compile_s']:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- process groups -------------------------------------------------------------------------
def run_single(args: argparse.Namespace) -> list[dict]:
    """The 1-rank comparison on the current 1-rank process group."""
    torch.set_num_threads(args.single_threads)
    threads = torch.get_num_threads()
    if args.workload == "realistic":
        return compare_realistic("1 rank", 1, threads, llama_100m_checkpoint(), args)
    path = builtin_checkpoint()
    prompts = make_prompts(args, _vocab_size(path))
    return [compare("1 rank", 1, threads, path, prompts, args)]


def run_multi(args: argparse.Namespace, world: int) -> list[dict]:
    """The TP comparison over all ranks of the default group."""
    torch.set_num_threads(args.threads)
    threads, label = torch.get_num_threads(), f"{world} rank"
    if args.workload == "realistic":
        return compare_realistic(label, world, threads, llama_100m_checkpoint(), args)
    path = builtin_checkpoint()
    prompts = make_prompts(args, _vocab_size(path))
    return [compare(label, world, threads, path, prompts, args)]


def backend(args: argparse.Namespace) -> str:
    """The 1-rank part's process-group backend: NCCL on GPU 0 with ``--device cuda`` (made the
    current device first), else gloo."""
    if args.device != "cuda":
        return "gloo"
    torch.cuda.set_device(0)
    return "nccl"


def single_main(args: argparse.Namespace) -> None:
    """``--single``: the 1-rank part on a private 1-rank group (in-memory store, no ports)."""
    dist.init_process_group(backend(args), store=dist.HashStore(), rank=0, world_size=1)
    try:
        Path(args.json_out).write_text(json.dumps(run_single(args)))
    finally:
        dist.destroy_process_group()


def single_in_subprocess(args: argparse.Namespace) -> list[dict]:
    """Rank 0 of a multi-rank job: run ``--single`` in a fresh process without torchrun's env."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_WORLD_SIZE"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "single.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *_size_flags(args),
            "--single-threads",
            str(args.single_threads),
            "--single",
            "--json-out",
            str(out),
        ]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def _size_flags(args: argparse.Namespace) -> list[str]:
    """The workload flags, for the ``--single`` subprocess."""
    flags = [
        "--workload",
        args.workload,
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--requests",
        str(args.requests),
        "--prompt-lens",
        "{},{}".format(*args.prompt_lens),
        "--budgets",
        "{},{}".format(*args.budgets),
        "--batches",
        ",".join(map(str, args.batches)),
        "--gemm-repeats",
        str(args.gemm_repeats),
        "--repeats",
        str(args.repeats),
        "--ours",
        ",".join(args.ours),
        "--seed",
        str(args.seed),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    return flags + (["--profile"] if args.profile else [])


def _vocab_size(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


# ---- report ---------------------------------------------------------------------------------
def where(args: argparse.Namespace) -> str:
    """The machine of the 1-rank part: CPU cores and gloo, or the GPU and NCCL."""
    if args.device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, NCCL, {DTYPE_NAMES[args.dtype]}"
    return f"{os.cpu_count()} CPU cores, gloo" + ("" if args.dtype == "float32" else f", {DTYPE_NAMES[args.dtype]}")


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"batch={args.batch} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
        f"greedy, warm-up 1 + median of {args.repeats}, torch {torch.__version__}, {where(args)}"
    )
    lines = [
        head,
        "",
        "| setup  | threads/rank | ours tok/s | HF tok/s | ours/HF | ours s | HF s   | tokens equal |",
        "|--------|--------------|------------|----------|---------|--------|--------|--------------|",
    ]
    for r in rows:
        ours, hf = r["generated"] / r["ours_s"], r["generated"] / r["hf_s"]
        equal = "yes" if r["match"] else f"no ({r['same_prompts']}/{args.batch} prompts)"
        if not r["counts_ok"]:
            equal += ", wrong token count"
        lines.append(
            f"| {r['label']:<6} | {r['threads']:>12} | {ours:>10.1f} | {hf:>8.1f} | "
            f"{ours / hf:>7.2f} | {r['ours_s']:>6.3f} | {r['hf_s']:>6.3f} | {equal:<12} |"
        )
    return "\n".join(lines)


def realistic_table(rows: list[dict], args: argparse.Namespace) -> str:
    path = default_cache_dir() / LLAMA_100M_NAME
    work = make_workload(args, _vocab_size(path))
    prompt_tokens = sum(len(p) for p in work.prompts)
    pads = ", ".join(
        f"B={b}: prefill {p} / decode {d} positions" for b in args.batches for p, d in [hf_padding(work, b)]
    )
    lines = [
        f"model: {LLAMA_100M_DESC.format(dtype=DTYPE_NAMES[args.dtype])}, "
        f"{checkpoint_params(path) / 1e6:.1f}M parameters",
        f"workload: {args.requests} requests (seed {args.seed}), prompt lengths uniform "
        f"{args.prompt_lens[0]}..{args.prompt_lens[1]} (sum {prompt_tokens}), budgets uniform "
        f"{args.budgets[0]}..{args.budgets[1]} (sum {work.useful} = useful tokens), greedy, EOS ignored",
        f"HF padded work: {pads} (real: {prompt_tokens} / {work.useful})",
        f"warm-up 1 + median of {args.repeats}, torch {torch.__version__}, {where(args)}",
        "GEMM share = GEMMs alone (GEMM M = rows of the layers / of the LM head: B / mean decode "
        "batch; rank 0) / our mean decode step; prefill s, decode s: ours, per timed run",
        "",
        "| setup  | B  | ours (admission) | thr/rank | ours tok/s | HF tok/s | ours/HF | ours s  | HF s    "
        "| equal requests | equal tokens | prefill s | decode s | steps/run | mean batch | step ms | GEMM M "
        "| GEMM ms | GEMM share |",
        "|--------|----|------------------|----------|------------|----------|---------|---------|---------"
        "|----------------|--------------|-----------|----------|-----------|------------|---------|--------"
        "|---------|------------|",
    ]
    for r in rows:
        ours, hf = r["useful"] / r["ours_s"], r["useful"] / r["hf_s"]
        equal = f"{r['equal']}/{args.requests}" + ("" if r["counts_ok"] else " BAD COUNT")
        steps = r["decode_s"] / r["step_s"] if r["step_s"] else 0.0
        lines.append(
            f"| {r['label']:<6} | {r['batch']:>2} | {r['variant']:<16} | {r['threads']:>8} | {ours:>10.1f} | "
            f"{hf:>8.1f} | "
            f"{ours / hf:>7.2f} | {r['ours_s']:>7.2f} | {r['hf_s']:>7.2f} | {equal:>14} | "
            f"{100 * r['prefix'] / r['useful']:>11.1f}% | {r['prefill_s']:>9.2f} | {r['decode_s']:>8.2f} | "
            f"{steps:>9.0f} | {r['mean_batch']:>10.2f} | {1e3 * r['step_s']:>7.1f} | "
            f"{r['m_layers']:>2}/{r['m_head']:<3} | {1e3 * r['gemm_s']:>7.1f} | "
            f"{100 * r['gemm_s'] / r['step_s']:>9.1f}% |"
        )
    lines.append("\nequal tokens = tokens before each request's first difference / useful tokens")
    compiled = [r for r in rows if r["variant"].endswith(":compiled")]
    if compiled:
        lines.append(
            "compile s (decode calls that compiled a graph, warm-up included): "
            + ", ".join(f"{r['label']} B={r['batch']} {r['variant']} {r['compile_s']:.1f}" for r in compiled)
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.single:
        return single_main(args)
    # 1 rank: its own default group runs the 1-rank part (NCCL with --device cuda); 2+: gloo (TP on CPU)
    single_rank = int(os.environ.get("WORLD_SIZE", "1")) == 1
    dist.init_process_group(backend(args) if single_rank else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        llama_100m_checkpoint() if args.workload == "realistic" else builtin_checkpoint()
    dist.barrier()
    if world == 1:
        rows = run_single(args)
    else:
        rows = single_in_subprocess(args) if rank == 0 else []
        dist.barrier()  # other ranks wait while rank 0's subprocess runs the 1-rank part
        rows += run_multi(args, world)
    dist.destroy_process_group()
    if rank == 0:
        render = realistic_table if args.workload == "realistic" else table
        print("\n" + render(rows, args))
        print("\ncommand: " + rerun_command("generate.py", world, one_thread=False))


if __name__ == "__main__":
    main()
