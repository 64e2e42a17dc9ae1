"""Generation benchmark: our engine against HF ``generate`` on the built-in tiny Llama.

Run from the repo root:

    torchrun --standalone --nproc-per-node 2 bench/generate.py
    torchrun --standalone --nproc-per-node 1 bench/generate.py   # single-rank comparison only

One batch of ``--batch`` random prompts (seeded, all ``--prompt-len`` tokens, so no padding),
``--new-tokens`` greedy tokens each. Both sides always generate exactly that many tokens: ours
with no stop tokens, HF with ``min_new_tokens == max_new_tokens`` (which masks EOS in HF).

* 1 rank: our ``Engine`` on a 1-rank gloo group vs ``AutoModelForCausalLM.generate``. In a
  2-rank job rank 0 runs this part in a subprocess (``--single``, its own 1-rank group) while
  rank 1 waits at a barrier.
* 2 ranks: our ``Engine`` with TP=2 vs HF ``from_pretrained(path, tp_plan="auto")``.

Each timed run is preceded by one warm-up run; tokens/s = generated tokens / wall seconds
(median over ``--repeats``). Prints a table, whether our greedy tokens equal HF's, and the command.
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
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel import Engine, Request, SamplingParams, parallelize  # noqa: E402
from parallel.tiny_models import builtin_checkpoint  # noqa: E402

Tokens = list[list[int]]
COMMAND = "torchrun --standalone --nproc-per-node {n} bench/generate.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank with 2+ ranks")
    p.add_argument("--single-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the 1-rank part")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # internal: 1-rank part
    p.add_argument("--json-out", help=argparse.SUPPRESS)  # internal: where --single writes results
    return p.parse_args(argv)


# ---- workload -------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace, vocab_size: int) -> Tokens:
    """``batch`` prompts of ``prompt_len`` ids in ``[3, vocab)`` (skips pad/bos/eos)."""
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, vocab_size, (args.batch, args.prompt_len), generator=g).tolist()


def time_runs(run: Callable[[], Tokens], repeats: int, sync: bool) -> tuple[Tokens, float]:
    """One warm-up call, then ``repeats`` timed calls; returns the tokens and the median seconds."""
    tokens = run()
    seconds = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        t0 = time.perf_counter()
        tokens = run()
        if sync:
            dist.barrier()
        seconds.append(time.perf_counter() - t0)
    return tokens, statistics.median(seconds)


def bench_ours(path: Path, prompts: Tokens, args: argparse.Namespace) -> tuple[Tokens, float]:
    model = parallelize(path)
    engine = Engine(model, max_batch_size=len(prompts),
                    max_seq_len=args.prompt_len + args.new_tokens, compile=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=())

    def run() -> Tokens:
        done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
        return [c.output_ids for c in done]

    return time_runs(run, args.repeats, sync=dist.get_world_size() > 1)


def bench_hf(path: Path, prompts: Tokens, args: argparse.Namespace, tp: bool) -> tuple[Tokens, float]:
    from transformers import AutoModelForCausalLM

    kwargs = {"tp_plan": "auto"} if tp else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    ids = torch.tensor(prompts)
    n = args.new_tokens

    def run() -> Tokens:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)
        return out[:, ids.shape[1]:].tolist()

    return time_runs(run, args.repeats, sync=tp)


def compare(label: str, ranks: int, threads: int, path: Path, prompts: Tokens,
            args: argparse.Namespace) -> dict:
    """Ours vs HF on the current process group (1 rank, or TP over all ranks)."""
    ours, ours_s = bench_ours(path, prompts, args)
    hf, hf_s = bench_hf(path, prompts, args, tp=ranks > 1)
    generated = len(prompts) * args.new_tokens
    return dict(label=label, ranks=ranks, threads=threads, generated=generated,
                ours_s=ours_s, hf_s=hf_s, match=ours == hf,
                same_prompts=sum(a == b for a, b in zip(ours, hf)),
                counts_ok=all(len(t) == args.new_tokens for t in ours + hf))


# ---- process groups -------------------------------------------------------------------------
def run_single(args: argparse.Namespace) -> dict:
    """The 1-rank comparison on the current 1-rank process group."""
    torch.set_num_threads(args.single_threads)
    path = builtin_checkpoint()
    prompts = make_prompts(args, _vocab_size(path))
    return compare("1 rank", 1, torch.get_num_threads(), path, prompts, args)


def single_main(args: argparse.Namespace) -> None:
    """``--single``: the 1-rank part on a private 1-rank gloo group (in-memory store, no ports)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        Path(args.json_out).write_text(json.dumps(run_single(args)))
    finally:
        dist.destroy_process_group()


def single_in_subprocess(args: argparse.Namespace) -> dict:
    """Rank 0 of a multi-rank job: run ``--single`` in a fresh process without torchrun's env."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_WORLD_SIZE"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "single.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *_size_flags(args),
               "--single-threads", str(args.single_threads), "--single", "--json-out", str(out)]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def _size_flags(args: argparse.Namespace) -> list[str]:
    return ["--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
            "--seed", str(args.seed)]


def _vocab_size(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


# ---- report ---------------------------------------------------------------------------------
def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"batch={args.batch} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
            f"greedy, warm-up 1 + median of {args.repeats}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPU cores, gloo")
    lines = [head, "",
             "| setup  | threads/rank | ours tok/s | HF tok/s | ours/HF | ours s | HF s   | tokens equal |",
             "|--------|--------------|------------|----------|---------|--------|--------|--------------|"]
    for r in rows:
        ours, hf = r["generated"] / r["ours_s"], r["generated"] / r["hf_s"]
        equal = "yes" if r["match"] else f"no ({r['same_prompts']}/{args.batch} prompts)"
        if not r["counts_ok"]:
            equal += ", wrong token count"
        lines.append(f"| {r['label']:<6} | {r['threads']:>12} | {ours:>10.1f} | {hf:>8.1f} | "
                     f"{ours / hf:>7.2f} | {r['ours_s']:>6.3f} | {r['hf_s']:>6.3f} | {equal:<12} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.single:
        return single_main(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        builtin_checkpoint()
    dist.barrier()
    if world == 1:
        rows = [run_single(args)]
    else:
        rows = [single_in_subprocess(args)] if rank == 0 else []
        dist.barrier()  # other ranks wait while rank 0's subprocess runs the 1-rank part
        torch.set_num_threads(args.threads)
        path = builtin_checkpoint()
        prompts = make_prompts(args, _vocab_size(path))
        rows.append(compare(f"{world} rank", world, torch.get_num_threads(), path, prompts, args))
    dist.destroy_process_group()
    if rank == 0:
        print("\n" + table(rows, args))
        print("\ncommand: " + " ".join([COMMAND.format(n=world), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
