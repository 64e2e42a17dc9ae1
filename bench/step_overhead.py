"""Host work per decode step: ms per generated token of our engine (default settings) against HF
``generate`` and a bare HF forward (one token per sequence through a ``DynamicCache``), on a model
whose arithmetic is ~0 (the tiny Llama: hidden 64, 2 layers), 1 process, B sequences at once.

    python bench/step_overhead.py [--batch-sizes 1,8,32,128] [--new-tokens 128] [--prompt-len 16] [--repeats 3]
                                  [--kv-block-size 16] [--async-scheduling] [--compile]
                                  [--temperature 1.0] [--top-p 0.9] [--repetition-penalty 1.1]

Each figure is the median over ``--repeats`` runs, the three interleaved per repeat; per token =
wall time / new tokens (one prefill step included for ours and HF ``generate``, not for the bare
forward). ``--kv-block-size``: our engine on a paged cache of that block size (holding every
sequence whole), else contiguous slots. ``--async-scheduling``: step n+1 scheduled while step n
computes (on this CPU the forward is synchronous: this shows its cost, not its gain).
``--compile``: our decode step compiled on any device (``EngineConfig.compile``, whose default
compiles on CUDA only; the warm-up call compiles). ``--temperature`` / ``--top-p``: every sequence
samples (seeded), ours and HF ``generate`` alike (HF's ``top_k`` off, as ours); the bare forward
stays greedy. ``--repetition-penalty``: every sequence of ours and HF ``generate`` penalized
(HF's processor; ours over the tokens each sequence keeps). Run it in a session of its own (``setsid``) on
a quiet machine: this kernel shares CPU between sessions whatever their nice value.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, fill_sizes, med, parser, rerun_command

DEFAULTS = {"batch_sizes": [1, 8, 32, 128], "new_tokens": 128, "prompt_len": 16, "repeats": 3}
SMALL = {"batch_sizes": [1, 8], "new_tokens": 16, "prompt_len": 8, "repeats": 1}


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def ours(engine, prompts: list[list[int]], new: int, **sampling: float) -> float:
    """Seconds per new token of ``Engine.generate`` (EOS ignored; ``sampling``: SamplingParams'
    temperature, top_p, repetition_penalty; greedy at temperature 0)."""
    from reshard.parallel import Request, SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True, seed=0, **sampling)
    t0 = time.perf_counter()
    engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    return (time.perf_counter() - t0) / new


def hf_generate(
    model,
    prompts: list[list[int]],
    new: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> float:
    """Seconds per new token of HF ``generate`` (no EOS; greedy at temperature 0)."""
    ids = torch.tensor(prompts)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature else dict(do_sample=False)
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        mask = torch.ones_like(ids)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            repetition_penalty=repetition_penalty,
            **sampling,
        )
    return (time.perf_counter() - t0) / new


def bare_forward(model, prompts: list[list[int]], new: int) -> float:
    """Seconds per decode step of the HF model called by hand: one token per sequence, its cache."""
    from transformers import DynamicCache

    ids, cache = torch.tensor(prompts), DynamicCache()
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits
        t0 = time.perf_counter()
        for _ in range(new):
            logits = model(logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
    return (time.perf_counter() - t0) / new


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    p.add_argument("--kv-block-size", type=int, default=None, help="a paged cache of this block size")
    p.add_argument("--async-scheduling", action="store_true", help="schedule step n+1 while step n computes")
    p.add_argument("--compile", action="store_true", help="our decode step compiled (the warm-up pays the compile)")
    p.add_argument("--temperature", type=float, default=0.0, help="every sequence samples at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="every sequence penalized (HF's)")
    args = fill_sizes(p.parse_args(argv), DEFAULTS, SMALL)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    path = make_tiny_checkpoint("llama", Path(tempfile.mkdtemp(prefix="step-overhead-")) / "tiny")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    print(f"# {rerun_command('step_overhead.py', one_thread=False, argv=argv)}")
    print(f"{'B':>5} {'ours ms':>9} {'HF gen ms':>10} {'bare ms':>8} {'ours/HF':>8} {'ours/bare':>10}")
    for batch in args.batch_sizes:
        prompts = _prompts(batch, args.prompt_len, hf.config.vocab_size)
        length = args.prompt_len + args.new_tokens
        paged = {} if args.kv_block_size is None else {"kv_block_size": args.kv_block_size, "kv_tokens": batch * length}
        config = EngineConfig(
            max_batch_size=batch,
            max_seq_len=length,
            async_scheduling=args.async_scheduling or None,
            compile=args.compile or None,  # (None: the default, compiled where the device is CUDA)
            **paged,
        )
        engine = Engine(parallelize(str(path)), config)
        ours(engine, prompts, args.new_tokens if args.compile else 2)  # warm-up (compiled: every shape the runs take)
        times: dict[str, list[float]] = {"ours": [], "hf": [], "bare": []}
        knobs = dict(temperature=args.temperature, top_p=args.top_p, repetition_penalty=args.repetition_penalty)
        for _ in range(args.repeats):
            times["ours"].append(ours(engine, prompts, args.new_tokens, **knobs))
            times["hf"].append(hf_generate(hf, prompts, args.new_tokens, **knobs))
            times["bare"].append(bare_forward(hf, prompts, args.new_tokens))
        o, h, b = (1e3 * med(times[k]) for k in ("ours", "hf", "bare"))
        print(f"{batch:>5} {o:>9.2f} {h:>10.2f} {b:>8.2f} {o / h:>8.2f} {o / b:>10.2f}", flush=True)
        engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
