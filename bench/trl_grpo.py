"""A GRPO step in TRL with reshard's rollout (``RolloutFunc``: data-parallel, or TP over the
processes) against TRL's own generation (transformers ``generate`` on the training model).

Run from the repo root:

    OMP_NUM_THREADS=2 python bench/trl_grpo.py                            # 1 process: TRL vs reshard
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/trl_grpo.py   # 2: TRL vs reshard DP2 vs TP2
    OMP_NUM_THREADS=2 python bench/trl_grpo.py --sides trl,reshard-dp,reshard-paged,reshard-cached
                                              # the prefix cache: a paged cache with it off and on

A seeded Llama (hidden 768, 8 layers, 12/4 heads, MLP 2048, vocab 4096: 69.2M parameters, fp32) with
the built-in byte-level BPE tokenizer and chat template; chat prompts of made-up words; per process
``--batch`` completions per step (``--batch`` / ``--generations`` prompts), ``--new`` tokens at most,
temperature 1.0; ``--steps`` optimizer steps per side (the first is warm-up: not counted), each side
from the same checkpoint in the same processes, in turn. Per step (medians over the counted steps,
the slowest rank): the step's seconds, generation (TRL's ``_generate``: for reshard the rollout
function, sync included), the weight sync alone, and completion tokens per second of generation.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import med, parser, rerun_command  # bench/ is not a package
from generate import LLAMA_100M

MODEL = {**LLAMA_100M, "vocab_size": 4096}  # bench/generate.py's Llama with the built-in tokenizer's vocab
MODEL_NAME = "bench-llama-69m-bpe-seed0-v1"
# reshard's rollout on a paged cache (16-token blocks, 1024 tokens a slot), the prefix cache off and on
PAGED = {
    "reshard-paged": {"kv_block_size": 16, "kv_tokens": 64 * 1024, "prefix_caching": False},
    "reshard-cached": {"kv_block_size": 16, "kv_tokens": 64 * 1024, "prefix_caching": True},
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--sides", default="trl,reshard-dp,reshard-tp")
    args = p.parse_args()
    from reshard.parallel.model.tiny_models import cached_checkpoint

    path = str(cached_checkpoint(MODEL_NAME, MODEL, tokenizer=True))  # (ranks race to one atomic rename)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sides = [s for s in args.sides.split(",") if s != "reshard-tp" or world > 1]
    results = {side: _side(path, side, world, args) for side in sides}
    if int(os.environ.get("RANK", "0")) == 0:
        _report(results, world, args)


def _side(path: str, side: str, world: int, args) -> dict:
    """One side's GRPO run; per counted step its seconds (the slowest rank's)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reshard.integrations.trl import RolloutFunc
    from reshard.parallel.model.tiny_models import synthetic_text

    class Timed(RolloutFunc):
        def _sync(self, trainer) -> None:
            start = time.perf_counter()
            super()._sync(trainer)
            times["sync"].append(time.perf_counter() - start)

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times["begin"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - times["begin"])

    times = {"step": [], "generate": [], "sync": [], "tokens": []}
    options = {"tp": 2 if side == "reshard-tp" else 1, "max_batch_size": 64, **PAGED.get(side, {})}
    rollout = None if side == "trl" else Timed(**options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    sentences = synthetic_text(1, sentences=64)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": s}] for s in sentences]})
    config = GRPOConfig(
        output_dir=f"/tmp/reshard-bench-trl-{side}", max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.generations, max_completion_length=args.new, temperature=1.0, learning_rate=1e-6,
        beta=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        disable_tqdm=True, gradient_checkpointing=False,
    )  # fmt: skip
    reward = lambda completion_ids, **kw: [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]  # noqa: E731
    reward.__name__ = "even_tokens"
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        rollout_func=rollout, callbacks=[Steps()],
    )  # fmt: skip
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        times["generate"].append(time.perf_counter() - start)
        times["tokens"].append(sum(len(ids) for ids in out[1]))
        return out

    trainer._generate = timed_generate
    trainer.train()
    if rollout is not None:
        rollout.close()
    # step 0 is warm-up; seconds: the slowest rank's; tokens: every rank's
    return {k: [_over_ranks(x, k == "tokens") for x in v[1:]] for k, v in times.items() if k != "begin"}


def _over_ranks(x: float, total: bool) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if total else dist.ReduceOp.MAX)
    return t.item()


def _report(results: dict, world: int, args) -> None:
    print(f"\nGRPO step, {world} process(es), {args.batch} completions per process, <= {args.new} tokens:")
    print(f"{'side':<14} {'step s':>8} {'generate s':>11} {'sync s':>8} {'gen tok/s':>10} {'step vs trl':>12}")
    base = med(results["trl"]["step"]) if "trl" in results else float("nan")
    for side, r in results.items():
        sync = med(r["sync"]) if r["sync"] else 0.0
        rate = sum(r["tokens"]) / sum(r["generate"]) if r["generate"] else float("nan")
        step = med(r["step"])
        print(f"{side:<14} {step:>8.3f} {med(r['generate']):>11.3f} {sync:>8.3f} {rate:>10.1f} {base / step:>11.2f}x")
    print(f"command: {rerun_command('trl_grpo.py', world if world > 1 else None, one_thread=world > 1)}")


if __name__ == "__main__":
    main()
