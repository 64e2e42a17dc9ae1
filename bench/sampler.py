"""The sampler alone: ms to draw one token for each of B rows of logits over a real vocabulary,
ours (``sample_tokens``: each row's own seeded generator, the warpers once per group of rows
sharing a value) against HF ``generate``'s (its warpers over the batch, then ``softmax`` and
``torch.multinomial`` from the global generator).

    python bench/sampler.py [--batch-sizes 8,32] [--vocab-sizes 32000,151936] [--repeats 5] [--device cuda]

Each figure is the median over ``--repeats`` calls, ours and HF's interleaved; every row
samples, at temperature 1.0 (vLLM's and TRL's default) and at temperature 0.7 with top-p 0.9.
``--device``: the logits there, and our generators with them (an engine's, on its device); each
call ends with its tokens on the host.
Run it in a session of its own (``setsid``) on a quiet machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, fill_sizes, med, parser, rerun_command

DEFAULTS = {"batch_sizes": [8, 32], "vocab_sizes": [32000, 151936], "repeats": 5}
SMALL = {"batch_sizes": [8], "vocab_sizes": [1000], "repeats": 1}
KNOBS = {"t=1.0": dict(temperature=1.0), "t=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9)}


def ours(logits: torch.Tensor, knobs: dict) -> float:
    """Seconds for :func:`sample_tokens` over ``logits`` ``(B, V)``, every row seeded."""
    from reshard.parallel.engine.sampling import SamplingParams, make_generator, sample_tokens

    params = [SamplingParams(seed=i, **knobs) for i in range(len(logits))]
    generators = [make_generator(p, logits.device) for p in params]
    t0 = time.perf_counter()
    sample_tokens(logits, params, generators)
    return time.perf_counter() - t0


def hf(logits: torch.Tensor, knobs: dict) -> float:
    """Seconds for HF ``generate``'s sampling step: its warpers, softmax, one multinomial draw."""
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(knobs["temperature"])])
    if "top_p" in knobs:
        warpers.append(TopPLogitsWarper(knobs["top_p"]))
    ids = torch.zeros(len(logits), 1, dtype=torch.long, device=logits.device)
    t0 = time.perf_counter()
    scores = warpers(ids, logits)
    torch.multinomial(torch.softmax(scores, -1), num_samples=1).cpu()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    p.add_argument("--device", default="cpu", help="where the logits (and our generators) are")
    args = fill_sizes(p.parse_args(argv), DEFAULTS, SMALL)
    torch.set_num_threads(2)
    print(f"# {rerun_command('sampler.py', one_thread=False, argv=argv)}")
    print(f"{'B':>4} {'V':>7} {'sampling':>16} {'ours ms':>9} {'HF ms':>8} {'ours/HF':>8}")
    for vocab in args.vocab_sizes:
        for batch in args.batch_sizes:
            logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(args.device)
            for name, knobs in KNOBS.items():
                ours(logits, knobs), hf(logits, knobs)  # (warm-up)
                runs = [(ours(logits, knobs), hf(logits, knobs)) for _ in range(args.repeats)]
                o, h = (1e3 * med([r[i] for r in runs]) for i in (0, 1))
                print(f"{batch:>4} {vocab:>7} {name:>16} {o:>9.2f} {h:>8.2f} {o / h:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
