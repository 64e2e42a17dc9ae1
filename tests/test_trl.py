"""TRL's ``GRPOTrainer`` with ``rollout_func=reshard.integrations.trl.RolloutFunc()`` (TRL as pinned
in the test extras): a tiny seeded Llama with an offline tokenizer and chat template, a few steps
on one process and on two (data-parallel and tensor-parallel). Each step the trainer scores
reshard's completions, the engine's weights equal the policy's bitwise, and the log-probabilities
TRL receives equal the policy's own at the sampling temperature."""

from __future__ import annotations

import pytest
import torch

from tests import dist_harness
from tests.test_text_io import _with_tokenizer

STEPS, TEMPERATURE = 3, 0.7


@pytest.fixture(scope="module")
def tokenized(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "llama"
    _with_tokenizer(checkpoints["llama"], path)
    return str(path)


def _logprob_gap(policy, out: dict) -> float:
    """The largest difference between ``out``'s log-probabilities and the policy's own (log-softmax
    of its logits over the temperature) of the same completion tokens."""
    gap = 0.0
    with torch.no_grad():
        for prompt, completion, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            logits = policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]  # (C, V)
            own = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(1, torch.tensor(completion)[:, None])
            gap = max(gap, (own[:, 0] - torch.tensor(logprobs)).abs().max().item())
    return gap


def _grpo(path: str, tp: int, out_dir: str) -> dict:
    """``STEPS`` GRPO steps with reshard's rollout; per step what the reward function saw."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from reshard.integrations.trl import RolloutFunc
    from tests.test_weight_sync import _sliced_equal

    torch.manual_seed(0)
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        AutoTokenizer.from_pretrained(path),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rollout, returned, steps = RolloutFunc(tp=tp, max_seq_len=64, max_batch_size=8), [], []

    def rollout_func(prompts, trainer):
        returned.append(rollout(prompts, trainer))
        return returned[-1]

    def reward(prompts, completions, completion_ids, **kwargs):
        policy = trainer.accelerator.unwrap_model(trainer.model)
        own = {n: p.detach() for n, p in policy.named_parameters()}
        steps.append({
            "step": trainer.state.global_step,
            "from_reshard": completion_ids == returned[-1]["completion_ids"],
            "unsynced": _sliced_equal(rollout.llm.engine.model, own),
            "logprob_gap": _logprob_gap(policy, returned[-1]),
        })  # fmt: skip
        return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]  # even tokens are good

    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"w{5 + i} w{9 + i} w{11 + i}"}] for i in range(4)]}
    )
    config = GRPOConfig(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, temperature=TEMPERATURE, learning_rate=0.05, beta=0.0, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True,  # (fp32: no autocast)
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        rollout_func=rollout_func,
    )  # fmt: skip
    trainer.train()
    rollout.close()
    moved = any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return {
        "global_step": trainer.state.global_step,
        "steps": steps,
        "moved": moved,
        "synced": rollout.synced_step,
        "prompts": [p for out in returned for p in out["prompt_ids"]],
    }


def _grpo_runs(path: str, tps: list[int], out_dir: str) -> list[dict]:
    return [_grpo(path, tp, f"{out_dir}/tp{tp}") for tp in tps]


@pytest.mark.parametrize("world, tps", [(1, [1]), (2, [1, 2])], ids=["one-process", "dp2-then-tp2"])
def test_grpo_with_reshard_rollouts_runs_to_max_steps_synced_every_step(tokenized, tmp_path, world, tps):
    """One process; two processes data-parallel (an engine each), then tensor-parallel (one over both)."""
    try:
        per_rank = dist_harness.run(world, _grpo_runs, tokenized, tps, str(tmp_path))
    finally:
        dist_harness.retire(world)  # TRL and accelerate leave singletons and seeds behind
    for result in (r for runs in per_rank for r in runs):
        assert result["global_step"] == STEPS and result["moved"]  # ran to max_steps, and trained
        assert [s["step"] for s in result["steps"]] == list(range(STEPS)) and result["synced"] == STEPS - 1
        assert all(len(p) == 7 for p in result["prompts"])  # "user : wA wB wC assistant :", TRL's tokenization
        for step in result["steps"]:
            assert step["from_reshard"] and step["unsynced"] == [], step
            assert step["logprob_gap"] < 1e-4, step
