"""``reshard.LLM``: text in, text out, over any strategy's engine, in a plain process or under torchrun.

The names and types are vLLM's (``LLM``, ``SamplingParams``, ``generate``, ``chat``,
``RequestOutput``, ``Logprob``; :mod:`reshard.parallel.vllm_api` translates), so a vLLM script runs
with its import changed; nothing of vLLM is imported. Every process of the job builds the same
``LLM``. By default (``dp_prompts="shared"``) every process passes the same prompts to each call
(checked: a difference is one ``ValueError`` on every rank) and gets every output; with
``dp_prompts="local"`` each process passes its own and gets its own outputs (TRL's and verl's
shape). In a plain process the ``LLM`` makes a one-rank process group of its own (and ends it in
:meth:`close`); under torchrun it joins the job's. ``tp * pp`` ranks form one engine, the rest of
the world its data-parallel replicas.

A model already in memory (``LLM(model=module)``) is read, never changed: the engine builds its
own layers from the module's config and copies the weights (the caller's parameters, ties,
training mode and optimizer state stay as they are); :meth:`LLM.sync_weights` copies them again
after training steps, :meth:`LLM.load_weights` takes ``(name, tensor)`` pairs under HF names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reshard.mesh import end_groups
from reshard.parallel.engine import Completion, Engine, EngineConfig, Request
from reshard.parallel.engine.sampling import SamplingParams, TokenLogprobs, call_seed
from reshard.parallel.llm_setup import (
    check_memory,
    check_same_arguments,
    check_share,
    configure,
    join_group,
    load_tokenizer,
)
from reshard.parallel.model.checkpoint import resolve_checkpoint
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.sources import experts_transposed
from reshard.parallel.model.weight_sync import model_sync, rollout_tensors, split_fused
from reshard.parallel.vllm_api import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    check_no_lora,
    check_priority,
    check_seed,
    conversations,
    engine_logprobs_mode,
    in_context,
    llm_options,
    logprob_dicts,
    output_text,
    prompt_input,
    prompt_list,
    render_chat,
    stop_reason,
    within_context,
)
from reshard.sync import WeightSync

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]
LOAD_BUCKET_BYTES = 256 << 20  # load_weights: source bytes held at once before they are copied in
DP_PROMPTS = ("shared", "local")  # every rank the same prompts | each rank its own


@dataclass(frozen=True)
class PromptInput:
    """A prompt as the engine takes it: its token ids, and its text where one was given."""

    text: str | None
    ids: list[int]


class LLM:
    """An engine over ``model`` (a checkpoint directory, a hub id, or an HF module in memory).

    ``strategy`` names a registered strategy (``tp``, ``shift``, ``seesaw``, ``sidp``, ``dejavu``,
    or a dotted path); ``tp``, ``pp`` and any other strategy key (e.g. ``threshold`` for Shift)
    configure it (the ``tp`` strategy: ``tp=1`` by default, every process a data-parallel
    replica); engine keys (``max_batch_size``, ``max_seq_len``, ``kv_block_size``, ...) go to
    :class:`EngineConfig`. The ``tp`` strategy's KV cache is paged (blocks of 16, holding what
    contiguous slots would), as vLLM's is, so prefix caching runs: ``n`` samples and a chat's next
    turn compute their prompt once (``kv_block_size=None``: contiguous slots). vLLM's names are
    taken too (``tensor_parallel_size``, ``pipeline_parallel_size``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``,
    ``dtype="auto"``; both names of a pair: ``ValueError``). ``max_seq_len`` / ``max_model_len``
    defaults to the model's ``max_position_embeddings`` (capped at 4096) and may not exceed it.
    ``gpu_memory_utilization``: on CUDA, the share of the device's memory the weights and the KV
    cache may take (checked after the build, ``ValueError`` naming both; the cache is sized by
    ``max_num_seqs`` x ``max_model_len`` or ``kv_tokens``, not by this share); None or on CPU:
    unchecked. ``logprobs_mode``: vLLM's engine-wide mode, ``"raw_logprobs"`` or
    ``"processed_logprobs"``, for every request (None: each request's ``SamplingParams``).
    ``dtype``: the weights' (``"bfloat16"``, ...; default the checkpoint's or the
    module's). ``tokenizer``: for text (a tokenizer or its path; default the checkpoint's, if it
    has one). ``seed``: this LLM's calls without a seed of their own take seeds from it in turn
    (None: fresh ones from the OS). ``dp_prompts``: ``"shared"`` (every process passes the same
    prompts and gets every output) or ``"local"`` (each its own prompts and outputs).
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        *,
        strategy: str = "tp",
        tokenizer=None,
        seed: int | None = None,
        dp_prompts: str = "shared",
        gpu_memory_utilization: float | None = None,
        logprobs_mode: str | None = None,
        **options,
    ) -> None:
        self.logprobs_mode = engine_logprobs_mode(logprobs_mode)  # (vLLM's engine-wide one: every request's)
        if dp_prompts not in DP_PROMPTS:
            raise ValueError(f"LLM: dp_prompts must be one of {DP_PROMPTS}, got {dp_prompts!r}")
        check_share(gpu_memory_utilization)
        check_seed(seed, "LLM: seed")
        self.seed, self.dp_prompts, self._calls, self._step, self._requests = seed, dp_prompts, 0, 0, 0
        self._owns_group = join_group()
        try:
            options = llm_options(options)
            given = {"model": model, "strategy": strategy, "dp_prompts": dp_prompts, "seed": seed, **options}
            check_same_arguments({k: v for k, v in given.items() if k != "tokenizer"})
            self.parallel, config = configure(strategy, options)
            if isinstance(model, nn.Module):
                self.engine, self.tokenizer = self._from_module(model, config), load_tokenizer(tokenizer, None)
            else:
                path = resolve_checkpoint(model)
                self.engine, self.tokenizer = self.parallel.build(path, config), load_tokenizer(tokenizer, path)
            check_memory(gpu_memory_utilization)
        except BaseException:
            self._end_group()
            raise
        self.engine.tokenizer = self.tokenizer  # (stop strings)

    def get_tokenizer(self):
        """The tokenizer (vLLM's ``get_tokenizer``; None where the checkpoint ships none)."""
        return self.tokenizer

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        seed: int | None = None,
        use_tqdm: bool = False,
        lora_request=None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Every prompt's outputs, in order (``dp_prompts="local"``: this process's prompts'). ``prompts``:
        one prompt or a list; a prompt is a text, a list of token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``); a chat goes to
        :meth:`chat`. ``sampling_params``: one for all prompts or one per prompt (default: greedy,
        16 tokens). ``seed``: this call's; a sampled prompt without a seed of its own takes one from
        it and its position in the call (None: the LLM's next, see ``LLM(seed=)``). ``lora_request``:
        vLLM's, None only (one model's weights). ``priority``: vLLM's, an int per prompt, unread:
        requests run first come, first served (vLLM's default scheduling policy)."""
        check_no_lora(lora_request)
        inputs = [self._encode(prompt_input(p, i), i) for i, p in enumerate(prompt_list(prompts))]
        check_priority(priority, len(inputs))
        return self._run(inputs, sampling_params, seed, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        seed: int | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template_content_format: str = "auto",
        lora_request=None,
    ) -> list[RequestOutput]:
        """:meth:`generate` for one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, rendered by the tokenizer's chat template (vLLM's ``chat`` arguments; a
        message's content is text: ``chat_template_content_format`` ``"auto"`` or ``"string"``)."""
        check_no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"LLM.chat: chat_template_content_format={chat_template_content_format!r}: reshard renders "
                'a message\'s content as text ("auto" or "string")'
            )
        template = dict(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({} if tools is None else {"tools": tools}),  # (or in chat_template_kwargs, as before)
            **(chat_template_kwargs or {}),
        )
        inputs = [self._render(chat, i, template) for i, chat in enumerate(conversations(messages))]
        return self._run(inputs, sampling_params, seed, use_tqdm)

    def _run(self, inputs: list[PromptInput], sampling_params, seed: int | None, use_tqdm: bool) -> list[RequestOutput]:
        """The engine's outputs for ``inputs``; under ``dp_prompts="local"`` every process's inputs
        run as one call and each process gets its own back."""
        params, count = [self.sampling(p) for p in _per_prompt(sampling_params, len(inputs))], len(inputs)
        local = self.dp_prompts == "local"
        everyone = _all_gather((inputs, params)) if local else [(inputs, params)]
        first = sum(len(part) for part, _ in everyone[: _rank() if local else 0])  # where this rank's begin
        inputs, params = [x for part, _ in everyone for x in part], [p for _, part in everyone for p in part]
        requests = _requests([x.ids for x in inputs], params, self.engine.max_seq_len)
        warn_repeated_seeds(requests)
        progress = use_tqdm and _rank() == 0
        completions = self.engine.generate(requests, seed=self._call_seed(seed), progress=progress)
        outputs = self._outputs(inputs, params, completions)
        for out, prompt_logprobs in zip(outputs, self._prompt_logprobs([x.ids for x in inputs], params)):
            out.prompt_logprobs = prompt_logprobs
        return outputs[first : first + count]

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` under this LLM's engine-wide ``logprobs_mode`` (vLLM's; ``ValueError`` where
        the request asks for the other mode: reshard's per-request one)."""
        if self.logprobs_mode is None or params.logprobs_mode == self.logprobs_mode:
            return params
        if params.logprobs_mode != "raw":  # (the default: a request that said nothing)
            raise ValueError(
                f"LLM(logprobs_mode={self.logprobs_mode!r}) and a request's logprobs_mode="
                f"{params.logprobs_mode!r}: give one"
            )
        return dataclasses.replace(params, logprobs_mode=self.logprobs_mode)

    def _call_seed(self, seed: int | None) -> int | None:
        """This call's seed: the one given, else the LLM's ``seed``'s next, else None (fresh)."""
        check_seed(seed, "seed")
        self._calls += 1
        if seed is not None or self.seed is None:
            return seed
        return call_seed(self.seed, self._calls - 1)

    def _encode(self, prompt: str | list[int], index: int) -> PromptInput:
        """A text's or token ids' :class:`PromptInput` (``ValueError`` naming a text without a tokenizer)."""
        if isinstance(prompt, list):
            return PromptInput(None, prompt)
        self._need_tokenizer(index, "text")
        return PromptInput(prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]))

    def _render(self, messages: list[dict], index: int, template: dict) -> PromptInput:
        """A conversation's :class:`PromptInput`: its text and ids through the chat template."""
        self._need_tokenizer(index, "a chat")
        if template["chat_template"] is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"conversation {index}: the tokenizer has no chat template (give chat_template=)")
        return PromptInput(*render_chat(self.tokenizer, messages, template))

    def _need_tokenizer(self, index: int, kind: str) -> None:
        if self.tokenizer is None:
            raise ValueError(
                f"prompt {index} is {kind} and this LLM has no tokenizer (its checkpoint ships none): "
                "pass LLM(..., tokenizer=) or token ids"
            )

    def _outputs(self, inputs: list[PromptInput], params, completions: list[Completion]) -> list[RequestOutput]:
        """The completions (``n`` per prompt, in order) as :class:`RequestOutput`, with text."""
        it, outputs = iter(completions), []
        for x, p in zip(inputs, params):
            samples = [next(it) for _ in range(p.n)]
            outs = [self._completion(j, c, p) for j, c in enumerate(samples)]
            cached = samples[0].cached_tokens
            outputs.append(RequestOutput(str(self._requests), x.text, x.ids, None, outs, num_cached_tokens=cached))
            self._requests += 1
        return outputs

    def _completion(self, index: int, c: Completion, p: SamplingParams) -> CompletionOutput:
        """One sample as vLLM's :class:`CompletionOutput`: text cut before its stop string (kept
        with ``include_stop_str_in_output``), the reason it stopped, ``Logprob`` entries."""
        decode = self._decoder(p)
        decode = None if decode is None else in_context(decode, c.prompt_ids)
        text, stop = (
            (None, None) if decode is None else output_text(decode, c.output_ids, c.finish_reason, p, c.stopped_by)
        )
        text = "" if self.tokenizer is not None and not p.detokenize else text  # (vLLM's, without text)
        logprobs = None if c.logprobs is None else logprob_dicts(c.output_ids, c.logprobs, self._piece(p))
        cumulative = None if c.logprobs is None else sum(lp for lp, _ in c.logprobs)
        reason = stop_reason(stop, c.output_ids, c.finish_reason, self._primary_eos())
        return CompletionOutput(index, text, c.output_ids, cumulative, logprobs, c.finish_reason, reason)

    def _prompt_logprobs(self, ids: list[list[int]], params: list[SamplingParams]) -> list[list | None]:
        """Per prompt that asks (``prompt_logprobs``): None for its first token, then each token's
        ``{token id: Logprob}`` under the model given the tokens before it (raw log-softmax)."""
        want = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
        out: list[list | None] = [None] * len(ids)
        for a in range(0, len(want), self.engine.max_batch_size):
            chunk = want[a : a + self.engine.max_batch_size]
            logits = _on_every_rank(self.engine.prompt_logits([ids[i] for i in chunk]))
            for i, x in zip(chunk, logits):
                out[i] = [None, *logprob_dicts(ids[i][1:], _prompt_rows(x, ids[i], params[i]), self._piece(params[i]))]
        return out

    def _primary_eos(self) -> int | None:
        """The EOS id whose stop has no ``stop_reason`` (vLLM's: the tokenizer's, else the model's)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return next(iter(self.engine.eos_ids), None) if eos is None else eos

    def _decoder(self, p: SamplingParams):
        """Token ids -> an output's text (None without a tokenizer or with ``detokenize=False``:
        no text, "" in the latter, as vLLM's)."""
        if self.tokenizer is None or not p.detokenize:
            return None
        return functools.partial(self.tokenizer.decode, skip_special_tokens=p.skip_special_tokens)

    def _piece(self, p: SamplingParams):
        """One token's text for its ``Logprob`` (None: no text)."""
        if self.tokenizer is None or not p.detokenize:
            return None
        return lambda token: self.tokenizer.decode([token])

    # ---- weights -----------------------------------------------------------------------------
    def _from_module(self, module: nn.Module, config: EngineConfig) -> Engine:
        """The engine built from ``module``'s config, its weights copied from ``module``."""
        if not type(self.parallel).single_model():
            raise ValueError(
                f"LLM(model=<module>) builds a strategy of one layout (tp, shift, sidp); strategy "
                f"{self.parallel.name!r} holds several: give it a checkpoint path"
            )
        dtype = config.dtype or str(next(module.parameters()).dtype).removeprefix("torch.")
        config = dataclasses.replace(config, dtype=dtype, load_weights=False)
        with tempfile.TemporaryDirectory(prefix="reshard-config-") as directory:
            module.config.save_pretrained(directory)  # the config alone: nothing is read but it
            model = self.parallel.build_model(directory, self.parallel.dims(dist.get_world_size()), config)
        engine = self.parallel.build_engine(model, config)
        self._sync(model_sync(module, model))
        return engine

    def sync_weights(self, module: nn.Module) -> None:
        """Copy ``module``'s current weights (a plain HF module, DDP's ``.module``, FSDP2 or
        FSDP2 x TP: DTensors move at the lower bound) into the engine, in place. Collective:
        every rank calls it, each with its part of the module."""
        self.engine.ready(("weights",), check=False)  # weights released to host come back first
        self._sync(model_sync(getattr(module, "module", module), self._model()))

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = LOAD_BUCKET_BYTES,
    ) -> int:
        """Copy a state dict or ``(HF name, tensor)`` pairs into the engine in place: full tensors (every rank
        the whole tensor: each copies its slice) or DTensors (moved at the lower bound). Streamed:
        at most ``bucket_bytes`` of source tensors are held before they are copied in (one
        tensor larger than that alone). Collective: every rank gives the same names in the same
        order (``ValueError`` on every rank otherwise). Returns how many tensors were copied."""
        self.engine.ready(("weights",), check=False)  # weights released to host come back first
        model = self._model()
        targets, bucket, size, copied = rollout_tensors(model), {}, 0, 0
        transposed = experts_transposed(model.config)
        for name, tensor in (pair for n, t in _named_tensors(weights) for pair in split_fused(n, t, transposed)):
            bucket[name], size = tensor, size + tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                copied, bucket, size = copied + self._load_bucket(bucket, targets), {}, 0
        return copied + self._load_bucket(bucket, targets, last=True)

    def _load_bucket(self, bucket: dict, targets: dict, last: bool = False) -> int:
        """One bucket of :meth:`load_weights` (every rank agrees it is one, or the last)."""
        everyone = _all_gather((sorted(bucket), last))
        if any(e != everyone[0] for e in everyone):
            raise ValueError(
                f"LLM.load_weights: the ranks gave different tensors (rank 0: {everyone[0][0][:4]}, "
                f"rank {next(r for r, e in enumerate(everyone) if e != everyone[0])}: differs); every rank "
                "gives the same names in the same order"
            )
        if bucket:
            unknown = sorted(set(bucket) - {k.split("@", 1)[0] for k in targets})
            if unknown:
                raise ValueError(
                    f"LLM.load_weights: {len(unknown)} tensors the model has no parameter for: {unknown[:6]}"
                )
            dst = {k: t for k, t in targets.items() if k.split("@", 1)[0] in bucket}
            self._sync(WeightSync(bucket, dst, version=parallel_info(self._model()).weight_version))
        return len(bucket)

    def _sync(self, sync: WeightSync) -> None:
        self._step += 1
        sync.sync(self._step)

    def _model(self) -> nn.Module:
        if not type(self.parallel).single_model():
            raise ValueError(
                f"weights are copied into a strategy of one layout (tp, shift, sidp); "
                f"{self.parallel.name!r} holds several"
            )
        return self.engine.model

    def reset_prefix_cache(self) -> None:
        """Share no prompt KV computed so far with later requests (vLLM's ``reset_prefix_cache``).
        Weights written through :meth:`sync_weights` / :meth:`load_weights` drop it already; call
        it after changing the weights any other way."""
        self.engine.reset_prefix_cache()

    # ---- memory and lifetime -------------------------------------------------------------------
    def release(self, weights: bool = False) -> int:
        """Free the KV cache (e.g. while the same ranks train) and, with ``weights``, move the
        weights to host memory (the same tensors keep their storage objects: syncs and ties hold).
        The next call, sync or :meth:`resume` takes them back. Returns the device bytes freed."""
        return self.engine.release_memory(weights=weights)

    def resume(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Take back now what :meth:`release` freed of ``tags`` (``"weights"``, ``"kv_cache"``;
        verl's names), else the next call does."""
        unknown = sorted(set(tags) - {"weights", "kv_cache"})
        if unknown:
            raise ValueError(f"LLM.resume: tags {unknown} are none of 'weights', 'kv_cache'")
        self.engine.ready(tags)

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode (as TRL and verl call it around a training step): :meth:`release`
        with the weights moved to host. vLLM's level 2 discards the weights, for a sync to write
        them again; here they stay on host as at level 1 (a sync overwrites them all the same).
        Returns the device bytes freed."""
        if level not in (1, 2):
            raise ValueError(f"LLM.sleep: level must be 1 or 2 (vLLM's), got {level!r}")
        return self.release(weights=True)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's ``wake_up``: take back ``tags`` of what :meth:`sleep` freed (None: both)."""
        self.resume(("weights", "kv_cache") if tags is None else tags)

    def close(self) -> None:
        """Release the engine's threads and shared memory, and the process group this LLM made."""
        self.engine.close()
        self._end_group()

    def _end_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            end_groups()
        self._owns_group = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _per_prompt(params, count: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt: ``params`` (None: vLLM's default, 16 tokens), or
    each of a list of ``count``; ``ValueError`` naming anything else."""
    if params is None:
        return [SamplingParams(max_new_tokens=16)] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise ValueError(
            f"sampling_params must be a SamplingParams or a list of them, one per prompt; got "
            f"{type(params).__name__} {str(params)[:60]!r}"
        )
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts (give one, or one per prompt)")
    bad = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params[{bad}] must be a SamplingParams, got {type(params[bad]).__name__}")
    return list(params)


def _requests(ids: list[list[int]], params: list[SamplingParams], max_seq_len: int) -> list[Request]:
    """``n`` requests per prompt, ids their positions in the call; sample ``j`` of a prompt with a
    seed of its own samples with ``seed + j``; each runs up to ``max_seq_len`` at most
    (:func:`~reshard.parallel.vllm_api.within_context`)."""
    requests = []
    for prompt, p in zip(ids, params):
        fitted = within_context(p, len(prompt), max_seq_len)
        for j in range(p.n):
            seed = None if p.seed is None else (p.seed + j) % 2**63
            # (prompt logprobs: reshard.LLM's, not the engine's)
            sampling = dataclasses.replace(fitted, n=1, seed=seed, prompt_logprobs=None)
            requests.append(Request(len(requests), list(prompt), sampling))
    return requests


def _named_tensors(weights) -> Iterator[tuple[str, torch.Tensor]]:
    """``load_weights``' argument as ``(name, tensor)`` pairs; ``TypeError`` naming an item that is none."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    for i, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"LLM.load_weights takes a state dict or (name, tensor) pairs; item {i} is {type(item).__name__} "
                f"{str(item)[:60]!r}"
            )
        if not isinstance(item[1], torch.Tensor):
            raise TypeError(f"LLM.load_weights: {item[0]!r} is a {type(item[1]).__name__}, not a tensor")
        yield item


def warn_repeated_seeds(requests: Sequence[Request]) -> None:
    """Warn (once per call site) where sampled requests share a prompt and a seed: their samples
    will be identical (vLLM's meaning of a seed), e.g. a GRPO group given one seed."""
    seeded = [r for r in requests if not r.sampling.greedy and r.sampling.seed is not None]
    pairs = Counter((tuple(r.prompt_ids), r.sampling.seed) for r in seeded)
    repeated = [(ids, seed, k) for (ids, seed), k in pairs.items() if k > 1]
    if repeated:
        ids, seed, k = repeated[0]
        warnings.warn(
            f"{k} sampled requests have the same prompt ({len(ids)} tokens) and the same seed {seed}: their samples "
            "will be identical; give each its own seed, or none (the call's seed gives each request its own)",
            stacklevel=4,
        )


def _prompt_rows(logits: torch.Tensor, ids: list[int], p: SamplingParams) -> list[TokenLogprobs]:
    """``(T, V)`` logits of a prompt -> each of its tokens after the first as
    :data:`TokenLogprobs` (its log-probability given the ones before it, and the top ones)."""
    lp = torch.log_softmax(logits.float(), -1)[:-1]  # (T - 1, V): position t predicts token t + 1
    top = torch.topk(lp, p.prompt_logprobs, dim=-1)
    picked = lp.gather(1, torch.tensor(ids[1:], device=lp.device)[:, None])[:, 0]
    return [(float(x), tuple(zip(t.tolist(), v.tolist()))) for x, t, v in zip(picked, top.indices, top.values)]


def _all_gather(obj) -> list:
    from reshard.mesh import all_gather_objects

    return all_gather_objects(obj) if dist.get_world_size() > 1 else [obj]


def _on_every_rank(logits: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """:meth:`Engine.prompt_logits`' result on every rank (a pipeline's earlier stages get None:
    the last stage's, gathered)."""
    everyone = _all_gather(logits)
    return logits if logits is not None else next(x for x in everyone if x is not None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
