"""``reshard.LLM``: text in, text out, over any strategy's engine, in a plain process or under torchrun.

The names are vLLM's (``LLM``, ``SamplingParams``, ``generate``, ``chat``, ``RequestOutput``), so a
vLLM user reads the code at once; nothing of vLLM is imported. Every process of the job builds
the same ``LLM`` and passes the same prompts to each call (checked: a difference is one
``ValueError`` on every rank); every process gets every output. In a plain process the ``LLM``
makes a one-rank process group of its own (and ends it in :meth:`close`); under torchrun it joins
the job's. ``tp * pp`` ranks form one engine, the rest of the world its data-parallel replicas.

A model already in memory (``LLM(model=module)``) is read, never changed: the engine builds its
own layers from the module's config and copies the weights (the caller's parameters, ties,
training mode and optimizer state stay as they are); :meth:`LLM.sync_weights` copies them again
after training steps, :meth:`LLM.load_weights` takes ``(name, tensor)`` pairs under HF names.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from reshard.parallel.engine import Completion, Engine, EngineConfig, Request
from reshard.parallel.engine.registry import make_strategy, strategy_class
from reshard.parallel.engine.sampling import SamplingParams, TokenLogprobs, call_seed
from reshard.parallel.model.checkpoint import resolve_checkpoint
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.sources import experts_transposed
from reshard.parallel.model.weight_sync import model_sync, rollout_tensors, split_fused
from reshard.sync import WeightSync

Prompt = str | Sequence[int] | Sequence[dict] | dict  # text, token ids, chat messages, {"prompt_token_ids": ...}
LOAD_BUCKET_BYTES = 256 << 20  # load_weights: source bytes held at once before they are copied in


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``)."""

    index: int  # which of the prompt's ``n`` samples
    text: str | None  # decoded (special tokens skipped); None without a tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprobs] | None  # per token, where asked (SamplingParams.logprobs)


@dataclass
class RequestOutput:
    """One prompt's outputs (vLLM's ``RequestOutput``)."""

    prompt: str | None  # the text given (None: token ids)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # where asked: None for the first token


class LLM:
    """An engine over ``model`` (a checkpoint directory, a hub id, or an HF module in memory).

    ``strategy`` names a registered strategy (``tp``, ``shift``, ``seesaw``, ``sidp``, ``dejavu``,
    or a dotted path); ``tp``, ``pp`` and any other strategy key (e.g. ``threshold`` for Shift)
    configure it (the ``tp`` strategy: ``tp=1`` by default, every process a data-parallel
    replica); engine keys (``max_batch_size``, ``max_seq_len``, ``kv_block_size``, ...) go to
    :class:`EngineConfig`. ``dtype``: the weights' (``"bfloat16"``, ...; default the
    checkpoint's or the module's). ``tokenizer``: for text (default the checkpoint's, if it has
    one). ``seed``: this LLM's calls without a seed of their own take seeds from it in turn (None:
    fresh ones from the OS).
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        *,
        strategy: str = "tp",
        tp: int | None = None,
        pp: int | None = None,
        tokenizer=None,
        dtype: str | None = None,
        seed: int | None = None,
        **options,
    ) -> None:
        self.seed, self._calls, self._step = seed, 0, 0
        self._owns_group = _join_group()
        try:
            degrees = {"tp": 1 if tp is None and strategy == "tp" else tp, "pp": pp}  # tp strategy: DP over processes
            degrees = {k: v for k, v in degrees.items() if v is not None}
            engine_keys, strategy_keys = _split_options(strategy, {**degrees, **options})
            self.parallel = make_strategy({"strategy": strategy, **strategy_keys})
            self.parallel.layouts(dist.get_world_size())  # ValueError naming the keys before anything loads
            config = EngineConfig(dtype=dtype, **engine_keys)
            if isinstance(model, nn.Module):
                self.engine, self.tokenizer = self._from_module(model, config), tokenizer
            else:
                path = resolve_checkpoint(model)
                self.engine, self.tokenizer = self.parallel.build(path, config), tokenizer or _tokenizer_of(path)
        except BaseException:
            self._end_group()
            raise
        self.engine.tokenizer = self.tokenizer  # (stop strings)

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        seed: int | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Every prompt's outputs, in order, on every rank. ``prompts``: one prompt or a list; a
        prompt is a text, a list of token ids, a chat (a list of ``{"role", "content"}``
        messages, rendered by the tokenizer's chat template) or ``{"prompt_token_ids": ids}``.
        ``sampling_params``: one for all prompts or one per prompt (default: greedy, 16 tokens).
        ``seed``: this call's; a sampled prompt without a seed of its own takes one from it and
        its position in the call (None: the LLM's next, see ``LLM(seed=)``)."""
        batch = _as_batch(prompts)
        ids = [self._encode(p, i) for i, p in enumerate(batch)]
        params = _per_prompt(sampling_params, len(batch))
        requests = _requests(ids, params)
        completions = self.engine.generate(requests, seed=self._call_seed(seed), progress=use_tqdm and _rank() == 0)
        outputs = self._outputs(batch, ids, params, completions)
        for out, prompt_logprobs in zip(outputs, self._prompt_logprobs(ids, params)):
            out.prompt_logprobs = prompt_logprobs
        return outputs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """:meth:`generate` for one conversation (a list of messages) or a list of them."""
        one = bool(messages) and isinstance(messages[0], dict)
        return self.generate([list(messages)] if one else [list(m) for m in messages], sampling_params, **kwargs)

    def _call_seed(self, seed: int | None) -> int | None:
        """This call's seed: the one given, else the LLM's ``seed``'s next, else None (fresh)."""
        self._calls += 1
        if seed is not None or self.seed is None:
            return seed
        return call_seed(self.seed, self._calls - 1)

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        """A prompt's token ids (``ValueError`` naming it where it is none of the forms)."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        if isinstance(prompt, str) or _is_chat(prompt):
            if self.tokenizer is None:
                kind = "text" if isinstance(prompt, str) else "a chat"
                raise ValueError(
                    f"prompt {index} is {kind} and this LLM has no tokenizer (its checkpoint ships none): "
                    "pass LLM(..., tokenizer=) or token ids"
                )
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            return list(_chat_ids(self.tokenizer, prompt, index))
        if isinstance(prompt, Sequence) and all(type(t) is int for t in prompt):
            return list(prompt)
        raise ValueError(
            f"prompt {index} must be a text, a list of token ids, a list of chat messages or "
            f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__} {str(prompt)[:60]!r}"
        )

    def _outputs(self, batch, ids, params, completions: list[Completion]) -> list[RequestOutput]:
        """The completions (``n`` per prompt, in order) as :class:`RequestOutput`, with text."""
        it, outputs = iter(completions), []
        for prompt, prompt_ids, p in zip(batch, ids, params):
            samples = [next(it) for _ in range(p.n)]
            outs = [
                CompletionOutput(j, self._decode(c.output_ids), c.output_ids, c.finish_reason, c.logprobs)
                for j, c in enumerate(samples)
            ]
            outputs.append(RequestOutput(prompt if isinstance(prompt, str) else None, prompt_ids, outs))
        return outputs

    def _prompt_logprobs(self, ids: list[list[int]], params: list[SamplingParams]) -> list[list | None]:
        """Per prompt that asks (``prompt_logprobs``): None for its first token, then each token's
        :data:`TokenLogprobs` under the model given the tokens before it (raw log-softmax)."""
        want = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
        out: list[list | None] = [None] * len(ids)
        for a in range(0, len(want), self.engine.max_batch_size):
            chunk = want[a : a + self.engine.max_batch_size]
            logits = _on_every_rank(self.engine.prompt_logits([ids[i] for i in chunk]))
            for i, x in zip(chunk, logits):
                lp = torch.log_softmax(x.float(), -1)[:-1]  # (T - 1, V): position t predicts token t + 1
                top = torch.topk(lp, params[i].prompt_logprobs, dim=-1)
                picked = lp.gather(1, torch.tensor(ids[i][1:], device=lp.device)[:, None])[:, 0]
                out[i] = [None] + [
                    (float(p), tuple(zip(t.tolist(), v.tolist()))) for p, t, v in zip(picked, top.indices, top.values)
                ]
        return out

    def _decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

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
        self, weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = LOAD_BUCKET_BYTES
    ) -> int:
        """Copy ``(HF name, tensor)`` pairs into the engine in place: full tensors (every rank
        the whole tensor: each copies its slice) or DTensors (moved at the lower bound). Streamed:
        at most ``bucket_bytes`` of source tensors are held before they are copied in (one
        tensor larger than that alone). Collective: every rank gives the same names in the same
        order (``ValueError`` on every rank otherwise). Returns how many tensors were copied."""
        self.engine.ready(("weights",), check=False)  # weights released to host come back first
        model = self._model()
        targets, bucket, size, copied = rollout_tensors(model), {}, 0, 0
        transposed = experts_transposed(model.config)
        for name, tensor in (pair for n, t in weights for pair in split_fused(n, t, transposed)):
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

    def close(self) -> None:
        """Release the engine's threads and shared memory, and the process group this LLM made."""
        self.engine.close()
        self._end_group()

    def _end_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _join_group() -> bool:
    """Join torchrun's process group, or make a one-rank one in a plain process; whether this
    call made it (its maker ends it)."""
    if dist.is_initialized():
        return False
    from reshard.recipes.launch import collective_timeout

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, accelerate: env:// rendezvous
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=collective_timeout())
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _split_options(strategy: str, options: dict) -> tuple[dict, dict]:
    """``options`` as (engine keys, strategy keys); ``ValueError`` naming an unknown key (and the
    nearest known one)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"dtype", "load_weights"}
    strategy_fields = {f.name for f in dataclasses.fields(strategy_class(strategy))}
    unknown = sorted(set(options) - engine_fields - strategy_fields)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(engine_fields | strategy_fields), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"LLM got {unknown[0]!r}{hint}: neither an engine key nor a key of strategy {strategy!r} "
            f"({sorted(strategy_fields)})"
        )
    engine = {k: v for k, v in options.items() if k in engine_fields}
    return engine, {k: v for k, v in options.items() if k not in engine_fields}


def _as_batch(prompts) -> list:
    """``prompts`` as a list of prompts (one prompt alone: a list of one)."""
    if isinstance(prompts, (str, dict)) or _is_chat(prompts):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(type(t) is int for t in prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {str(prompts)[:60]!r}")
    return list(prompts)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)


def _chat_ids(tokenizer, messages: Sequence[dict], index: int) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"prompt {index} is a chat and the tokenizer has no chat template")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(max_new_tokens=16)] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts (give one, or one per prompt)")
    return list(params)


def _requests(ids: list[list[int]], params: list[SamplingParams]) -> list[Request]:
    """``n`` requests per prompt, ids their positions in the call; sample ``j`` of a prompt with a
    seed of its own samples with ``seed + j``."""
    requests = []
    for prompt, p in zip(ids, params):
        for j in range(p.n):
            seed = None if p.seed is None else (p.seed + j) % 2**63
            sampling = dataclasses.replace(p, n=1, seed=seed, prompt_logprobs=None)  # (prompt logprobs: ours)
            requests.append(Request(len(requests), list(prompt), sampling))
    return requests


def _tokenizer_of(path: Path):
    """The checkpoint's tokenizer, or None where it ships none."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


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
