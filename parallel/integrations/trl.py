"""TRL's ``rollout_func`` over :class:`reshard.LLM`: ``GRPOTrainer(..., rollout_func=RolloutFunc())``.

TRL calls ``rollout_func(prompts, trainer)`` on every process with that process's prompts (each
already repeated ``num_generations`` times by its sampler) and expects, per prompt, its token ids,
one completion's token ids and the log-probability of each completion token under the
distribution it was drawn from. :class:`RolloutFunc` builds one ``LLM`` from ``trainer.model`` at
its first call (the trainer's processes form it: ``tp`` of them per engine, the rest data-parallel
replicas), copies the weights in again whenever the trainer has stepped since (``sync_weights``:
DDP, FSDP2 and plain modules) and generates each process's own prompts (``dp_prompts="local"``:
one engine call over every process's prompts, each process handed back its own rows). Prompts
are tokenized as TRL's own generation does (its chat template and ``chat_template_kwargs`` for
conversations); sampling follows ``trainer.args`` (temperature,
top-k / top-p / min-p, repetition penalty, ``max_completion_length``, ``generation_kwargs`` under
vLLM's names); log-probabilities are ``processed`` (what TRL's vLLM path asks for), so TRL's
importance-sampling correction compares like with like.
"""

from __future__ import annotations

from typing import Any

from reshard.integrations import vllm_sampling
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.llm import LLM


class RolloutFunc:
    """A ``rollout_func`` for TRL's ``GRPOTrainer``. ``tp``: processes per engine (1: every process
    a replica of its own); other keys go to :class:`LLM` (``strategy``, ``max_seq_len``,
    ``max_batch_size``, ``seed`` (default ``trainer.args.seed``), ...). :meth:`close` (or the
    end of the process) ends the engine."""

    def __init__(self, *, tp: int = 1, **llm_options: Any) -> None:
        self.options = {"tp": tp, **llm_options}
        self.llm: LLM | None = None
        self.synced_step: int | None = None  # the trainer's global step whose weights the engine holds

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        """Per prompt: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one float per token)."""
        self._sync(trainer)
        ids = [_prompt_ids(trainer, p) for p in prompts]
        mine = [o.outputs[0] for o in self.llm.generate(ids, _sampling(trainer.args))]  # (each process its own)
        return {
            "prompt_ids": ids,
            "completion_ids": [list(o.token_ids) for o in mine],
            "logprobs": [[entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs)] for o in mine],
        }

    def _sync(self, trainer) -> None:
        """The engine with ``trainer.model``'s current weights (built at the first call)."""
        model, step = trainer.accelerator.unwrap_model(trainer.model), trainer.state.global_step
        if self.llm is None:
            options = {"seed": trainer.args.seed, **self.options, "dp_prompts": "local"}
            self.llm = LLM(model, tokenizer=trainer.processing_class, **options)
        elif step != self.synced_step:
            self.llm.sync_weights(model)
        self.synced_step = step

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def _sampling(args) -> SamplingParams:
    """``GRPOConfig``'s sampling keys as :class:`SamplingParams` (processed log-probabilities)."""
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "max_tokens": args.max_completion_length,
        "logprobs": 0,
        "logprobs_mode": "processed",
        **(args.generation_kwargs or {}),
    }
    return vllm_sampling(given, "GRPOConfig")


def _prompt_ids(trainer, prompt) -> list[int]:
    """``prompt``'s token ids as TRL's own generation makes them (a text, or a conversation through
    the trainer's chat template with a generation prompt)."""
    tokenizer = trainer.processing_class
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    return list(
        tokenizer.apply_chat_template(
            conversation=prompt,
            chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )["input_ids"]
    )
