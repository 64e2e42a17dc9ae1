"""``reshard.LLM`` (the front door) against HF ``generate`` and our ``Engine`` called directly (timed in turns), on
``bench/generate.py``'s realistic offline workload, one process (no torchrun: the ``LLM`` makes its
own one-rank group).

Run from the repo root:

    python bench/llm.py                       # 32 requests, batch 8, 3 timed runs each, medians
    python bench/llm.py --batches 8 16

Each side generates exactly each request's budget (greedy, EOS ignored). HF: requests in order,
``B`` at a time, left padded (``bench/generate.py``'s ``bench_hf_realistic``). ``Engine``: all
requests at once into ``Engine(max_batch_size=B)``. ``LLM``: ``LLM(path, max_batch_size=B)`` and
one ``generate`` of token-id prompts, a ``SamplingParams`` per prompt: the front door's own cost
(prompt parsing, request expansion, the seed agreement, the outputs) is the gap to ``Engine``.
Prints useful tokens/s and the ratios; tokens of the three sides are compared (reported).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import (  # bench/ is not a package
    bench_hf_realistic,
    llama_100m_checkpoint,
    make_workload,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    args.prompt_lens, args.budgets = (16, 384), (8, 128)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from reshard import LLM, SamplingParams
    from reshard.parallel import Request

    path = llama_100m_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    work = make_workload(args, hf.config.vocab_size)
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in work.budgets]
    for batch in args.batches:
        hf_tokens, hf_s = bench_hf_realistic(hf, work, batch, hf.config.pad_token_id or 0, args, tp=False)
        with LLM(path, max_batch_size=batch, max_seq_len=work.max_seq_len) as llm:
            requests = [Request(i, q, s) for i, (q, s) in enumerate(zip(work.prompts, params))]
            (eng_tokens, eng_s), (llm_tokens, llm_s) = _interleaved(llm, requests, work.prompts, params, args.repeats)
        useful = work.useful
        print(
            f"B={batch:3d}  HF {useful / hf_s:8.1f} tok/s  Engine {useful / eng_s:8.1f} tok/s "
            f"({hf_s / eng_s:4.2f}x HF)  LLM {useful / llm_s:8.1f} tok/s ({hf_s / llm_s:4.2f}x HF, "
            f"{llm_s / eng_s - 1:+.1%} vs Engine)  equal to HF {sum(a == b for a, b in zip(llm_tokens, hf_tokens))}"
            f"/{len(hf_tokens)}, LLM == Engine: {llm_tokens == eng_tokens}",
            flush=True,
        )


def _interleaved(llm, requests, prompts, params, repeats: int) -> tuple[tuple[list, float], tuple[list, float]]:
    """``Engine.generate`` and ``LLM.generate`` timed in turns (a warm-up of each, then
    ``repeats`` rounds of both): each one's tokens and median seconds."""
    import statistics
    import time

    sides = {
        "engine": lambda: [c.output_ids for c in llm.engine.generate(requests)],
        "llm": lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
    }
    tokens = {k: run() for k, run in sides.items()}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for k, run in sides.items():
            t0 = time.perf_counter()
            tokens[k] = run()
            seconds[k].append(time.perf_counter() - t0)
    return tuple((tokens[k], statistics.median(seconds[k])) for k in sides)


if __name__ == "__main__":
    main()
