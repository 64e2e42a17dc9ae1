"""vLLM's offline API in reshard's terms: one translation for every front end (``reshard.LLM``,
``reshard serve``, the generate recipe, the TRL and verl adapters).

- **Prompts**: a text, token ids, ``{"prompt": text}`` (vLLM's ``TextPrompt``) or
  ``{"prompt_token_ids": ids}`` (``TokensPrompt``), alone or in a list; anything else is one
  ``ValueError`` naming the prompt's index and what it got (:func:`prompt_input`), never read as
  something else. Chats go through ``LLM.chat``.
- **Names**: vLLM's engine arguments (``tensor_parallel_size``, ``max_model_len``, ...) as ours
  (:func:`llm_options`); vLLM-named sampling dicts as :class:`SamplingParams` (:func:`vllm_sampling`).
- **Outputs**: :class:`RequestOutput`, :class:`CompletionOutput` and :class:`Logprob` as vLLM's;
  an output's text is cut before the stop string that ended it, and leaves out the stop token
  that ended it (:func:`output_text`, unless ``include_stop_str_in_output``), alike in ``LLM``,
  the recipe's ``outputs.jsonl`` and the server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypedDict

import torch

from reshard.parallel.engine.request import new_text_start, prompt_suffix
from reshard.parallel.engine.sampling import SamplingParams, TokenLogprobs


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: a text the tokenizer encodes."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: token ids as given."""

    prompt_token_ids: list[int]


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` is its 1-based place in the
    distribution where it is among the top ones reported (None where it is not: the sampled
    token outside the top ``logprobs``); ``decoded_token`` its text (None without detokenizing)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``)."""

    index: int  # which of the prompt's ``n`` samples
    text: str | None  # decoded, cut before its stop string; "" with detokenize=False; None without a tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the sampled tokens' log-probabilities (where asked)
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled one and the top ones (where asked)
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS)

    def finished(self) -> bool:
        """Whether it ended (vLLM's: always, offline)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's outputs (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None  # the text given, or a chat as rendered (None: token ids)
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # where asked: None for the first token
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int | None = None  # prompt tokens found cached (the first sample's; None: not looked up)


# ---- prompts ---------------------------------------------------------------------------------
PROMPT_FORMS = "a text, a list of token ids, {'prompt': text} or {'prompt_token_ids': [ids]}"


def prompt_list(prompts) -> list:
    """``prompts`` as a list (one prompt alone: a list of one); ``ValueError`` for none."""
    if isinstance(prompts, (str, bytes, bytearray, Mapping)) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {str(prompts)[:60]!r}")
    return list(prompts)


def prompt_input(prompt, index: int) -> str | list[int]:
    """Prompt ``index`` as its text or its token ids; ``ValueError`` naming the index and what it
    got for anything but :data:`PROMPT_FORMS` (a chat message: ``LLM.chat``), or an empty one."""
    if isinstance(prompt, Mapping):
        prompt = _from_dict(prompt, index)
    if isinstance(prompt, Sequence) and len(prompt) == 0:
        raise ValueError(f"prompt {index} is empty: a prompt needs at least one token")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt if isinstance(prompt, str) else list(prompt)
    raise ValueError(
        f"prompt {index} must be {PROMPT_FORMS}; got {type(prompt).__name__} {str(prompt)[:60]!r}{_hint(prompt)}"
    )


def _hint(prompt) -> str:
    """What a prompt of none of :data:`PROMPT_FORMS` was likely meant as."""
    if isinstance(prompt, (bytes, bytearray)):
        return " (bytes: decode them to a text; their values are not token ids)"
    if hasattr(prompt, "tolist"):  # (a tensor or an array of ids)
        return " (an array: give its ids as a list, .tolist())"
    chat = isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)
    return " (a chat: give it to LLM.chat)" if chat else ""


def _from_dict(prompt: Mapping, index: int) -> str | list[int]:
    """A ``TextPrompt`` or ``TokensPrompt``'s one value; ``ValueError`` for other keys."""
    keys = sorted(prompt)
    if keys == ["prompt"] and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == ["prompt_token_ids"]:
        ids = prompt["prompt_token_ids"]
        if _is_token_ids(ids):
            return ids
        raise ValueError(
            f"prompt {index}'s prompt_token_ids must be a list of ints; got {type(ids).__name__} "
            f"{str(ids)[:60]!r}{_hint(ids)}"
        )
    role = " (a chat message: give the chat to LLM.chat)" if "role" in prompt else ""
    raise ValueError(
        f"prompt {index} is a dict with keys {keys}{role}: a dict prompt is {{'prompt': text}} or "
        f"{{'prompt_token_ids': [ids]}}; got {str(dict(prompt))[:60]!r}"
    )


def _is_token_ids(x) -> bool:
    """A non-empty list (or tuple) of ints; bytes are not (their values are a text's bytes)."""
    text = isinstance(x, (str, bytes, bytearray))
    return isinstance(x, Sequence) and not text and all(type(t) is int for t in x) and len(x) > 0


def conversations(messages) -> list[list[dict]]:
    """``LLM.chat``'s argument (one conversation, a list of messages, or a list of them) as a list
    of conversations; ``ValueError`` naming the index of one that is not a list of messages."""
    if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
        messages = [messages]
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"chat takes a conversation or a list of them, got {str(messages)[:60]!r}")
    for i, chat in enumerate(messages):
        ok = isinstance(chat, Sequence) and chat and all(isinstance(m, Mapping) and "role" in m for m in chat)
        if not ok:
            raise ValueError(
                f"conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} messages, "
                f"got {str(chat)[:60]!r}"
            )
    return [
        [{**m, "content": message_text(m.get("content"), i, j)} for j, m in enumerate(chat)]
        for i, chat in enumerate(messages)
    ]


def check_priority(priority, count: int) -> None:
    """vLLM's ``priority`` argument: None, or an int per prompt, which first-come-first-served
    scheduling does not read (vLLM's default policy does not either); ``ValueError`` otherwise."""
    if priority is None:
        return
    if not isinstance(priority, Sequence) or len(priority) != count or any(type(p) is not int for p in priority):
        raise ValueError(f"priority must be an int per prompt ({count}), got {priority!r:.60}")


def check_seed(seed, name: str) -> None:
    """``ValueError`` naming ``name`` for a seed that is neither None nor an int >= 0."""
    if seed is not None and not (type(seed) is int and seed >= 0):
        raise ValueError(f"{name} must be an int >= 0 or None, got {seed!r}")


def check_no_lora(lora_request) -> None:
    """``ValueError`` for a vLLM ``lora_request`` other than None (reshard serves one model's weights)."""
    if lora_request is not None:
        raise ValueError(f"lora_request={lora_request!r}: reshard serves one model's weights (no LoRA adapters)")


def render_chat(tokenizer, messages: list[dict], template: Mapping, special_tokens: bool = False) -> tuple[str, list]:
    """A conversation's text through ``tokenizer``'s chat template with ``template`` (its
    arguments) and its ids: that text tokenized as HF's ``tokenize=True`` tokenizes it, without
    special tokens (the template holds them; ``special_tokens``: the tokenizer's own too), as vLLM
    renders: one rendering, and a tokenizing argument among ``template`` changes nothing."""
    text = tokenizer.apply_chat_template(messages, **{**template, "tokenize": False})
    return text, list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def message_text(content, conversation: int, message: int) -> str:
    """A chat message's content as text, as vLLM's "string" content format renders it: a string as
    it is, a list of ``{"type": "text", "text": ...}`` parts joined by newlines; ``ValueError``
    naming the message for anything else (reshard runs text models: no image parts)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    if parts and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
    ):
        return "\n".join(p["text"] for p in parts)
    raise ValueError(
        f"conversation {conversation}, message {message}: content must be a text or a list of "
        f"{{'type': 'text', 'text': ...}} parts, got {str(content)[:60]!r}"
    )


# ---- names -----------------------------------------------------------------------------------
# vLLM's engine arguments -> ours (LLM's keyword arguments and EngineConfig's keys)
LLM_NAMES = MappingProxyType(
    {
        "tensor_parallel_size": "tp",
        "pipeline_parallel_size": "pp",
        "max_model_len": "max_seq_len",
        "max_num_seqs": "max_batch_size",
        "max_num_batched_tokens": "max_prefill_tokens",
        "enable_prefix_caching": "prefix_caching",
        "enable_chunked_prefill": "chunked_prefill",
        "block_size": "kv_block_size",
    }
)
# vLLM's engine arguments with nothing to do here (as TRL's and verl's colocated loops pass them):
# the values taken (None: any)
LLM_NOOPS = MappingProxyType(
    {
        "trust_remote_code": None,  # (reshard builds the model families it knows)
        "generation_config": ("auto",),  # (the checkpoint's file, always)
        "disable_log_stats": None,
        "distributed_executor_backend": (None, "external_launcher", "uni", "mp"),  # (torchrun's processes)
        "enable_sleep_mode": None,  # (LLM.sleep / wake_up always work)
        "model_impl": ("auto", "vllm", "transformers"),  # (TRL's default: "vllm")
        "skip_tokenizer_init": (None, False),
        "swap_space": None,  # (a preempted request is computed again, or swapped to a strategy's CPU tier)
        "disable_custom_all_reduce": None,
        "max_logprobs": None,
        "tokenizer_mode": ("auto",),
        "load_format": ("auto", "safetensors", "dummy"),  # (verl's "dummy": weights unread, synced in)
        "quantization": (None,),
        "kv_cache_dtype": ("auto",),
        "revision": (None,),
        "tokenizer_revision": (None,),
        "download_dir": (None,),
        "hf_overrides": (None, {}),
        "enable_lora": (None, False),
        "cpu_offload_gb": (None, 0),
        "compilation_config": (None, {}),
        "scheduling_policy": ("fcfs",),  # (requests run first come, first served: a request's priority is unread)
    }
)


# vLLM's engine-wide ``logprobs_mode`` names -> ``SamplingParams.logprobs_mode`` (its logits modes: none here)
LOGPROBS_MODE_NAMES = MappingProxyType({"raw_logprobs": "raw", "processed_logprobs": "processed"})


def engine_logprobs_mode(name: str | None) -> str | None:
    """``LLM(logprobs_mode=)``'s vLLM name as the mode every request's log-probabilities take
    (None: each request's own); ``ValueError`` naming it for any other."""
    if name is None or name in LOGPROBS_MODE_NAMES.values():
        return name
    if name not in LOGPROBS_MODE_NAMES:
        raise ValueError(
            f"LLM: logprobs_mode={name!r} is not one reshard returns (one of {list(LOGPROBS_MODE_NAMES)}; "
            "logits modes are not kept)"
        )
    return LOGPROBS_MODE_NAMES[name]


def llm_options(given: Mapping) -> dict:
    """``LLM``'s keyword arguments with vLLM's names as ours (``ValueError`` where both of a pair
    are given); ``dtype="auto"`` is the checkpoint's (None), a torch dtype its name; ``enforce_eager=True`` no compiled
    step; the names of :data:`LLM_NOOPS` do nothing, at the values it takes (``ValueError`` naming
    any other)."""
    out = {k: v for k, v in given.items() if k not in LLM_NAMES and k not in LLM_NOOPS and k != "enforce_eager"}
    for name, taken in LLM_NOOPS.items():
        if name in given and taken is not None and given[name] not in taken:
            only = " or ".join(map(repr, taken))
            raise ValueError(f"LLM: {name}={given[name]!r} is not one reshard honours (only {only})")
    if given.get("enforce_eager") and given.get("compile"):
        raise ValueError("LLM got enforce_eager=True and compile=True: give one")
    if given.get("enforce_eager"):  # (vLLM's eager-only: no compiled step)
        out["compile"] = False
    if given.get("enable_sleep_mode") and given.get("compile") is None:  # (a loop that sleeps releases its
        out["compile"] = False  # memory every iteration: graphs compiled before the first sleep are thrown away)
    if given.get("load_format") == "dummy":  # (vLLM's: weights left unread, for a sync to write)
        out["load_weights"] = False
    for theirs, ours in LLM_NAMES.items():
        if given.get(theirs) is None:
            continue
        if given.get(ours) is not None:
            raise ValueError(
                f"LLM got {theirs}={given[theirs]!r} and {ours}={given[ours]!r}: they are one setting "
                "(vLLM's name and reshard's), give one"
            )
        out[ours] = given[theirs]
    if out.get("dtype") == "auto":
        out["dtype"] = None
    if isinstance(out.get("dtype"), torch.dtype):  # (vLLM takes torch's dtypes too: torch.bfloat16)
        out["dtype"] = str(out["dtype"]).removeprefix("torch.")
    return out


_SAMPLING = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"max_tokens"}


def vllm_sampling(given: Mapping, where: str) -> SamplingParams:
    """vLLM-named sampling keys (``max_tokens``, ``temperature``, ``top_k`` with -1 or None for
    off, ``logprobs`` as a bool or a count, ``stop`` as a string or a list, ...) as
    :class:`SamplingParams`; a key the engine cannot honour is a ``ValueError`` naming it and
    ``where`` it came from (a request, a config)."""
    unknown = sorted(set(given) - _SAMPLING)
    if unknown:
        raise ValueError(f"{where}: sampling parameter {unknown[0]!r} is not one reshard honours")
    kw = dict(given)
    if isinstance(kw.get("logprobs"), bool):
        kw["logprobs"] = 0 if kw["logprobs"] else None
    if "top_k" in kw and kw["top_k"] is None:  # TRL's "off"
        kw["top_k"] = 0
    if "min_p" in kw and kw["min_p"] is None:
        kw["min_p"] = 0.0
    return SamplingParams(**kw)


def within_context(params: SamplingParams, prompt_len: int, max_seq_len: int) -> SamplingParams:
    """``params`` for a prompt of ``prompt_len`` tokens: ``max_tokens`` up to the end of the
    context at most, where the request ends with ``"length"`` (vLLM's cap; ``max_tokens=None``: that
    far), ``min_tokens`` within it. A prompt that leaves no room keeps its own (the engine's error)."""
    room = max_seq_len - prompt_len
    most = (params.max_new_tokens or 1) if room < 1 else min(params.max_new_tokens or room, room)
    return dataclasses.replace(params, max_new_tokens=most, min_tokens=min(params.min_tokens, most))


# ---- outputs ---------------------------------------------------------------------------------
def output_text(
    decode: Callable[[list[int]], str],
    ids: Sequence[int],
    finish_reason: str | None,
    params: SamplingParams,
    stopped_by: int | str | None = None,
) -> tuple[str, str | None]:
    """vLLM's text of an output's token ``ids`` and the stop string that ended it (None: none did).
    ``stopped_by``: what the engine says ended it (a token id or a stop string; None: found here
    from the text). The text is cut before that string (kept with ``include_stop_str_in_output``).
    An output a stop token ended (EOS, ``stop_token_ids``) leaves that token's text out unless
    ``include_stop_str_in_output``, and no stop string is looked for, as vLLM's detokenizer does."""
    if finish_reason != "stop" or not ids:
        return decode(list(ids)), None
    if isinstance(stopped_by, int):
        return decode(list(ids if params.include_stop_str_in_output else ids[:-1])), None
    stops = params.stop if stopped_by is None else (stopped_by,)
    found = ended_by_string(decode, ids, stops, params.min_tokens)
    if found is None:
        if stopped_by is not None:  # (the engine's string, whose place this decoding does not show)
            return decode(list(ids)), stopped_by
        return decode(list(ids if params.include_stop_str_in_output else ids[:-1])), None  # a stop token
    stop, at = found
    text = decode(list(ids))
    return (text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]), stop


def in_context(decode: Callable[[list[int]], str], prompt: Sequence[int]) -> Callable[[list[int]], str]:
    """``decode`` of output ids as the text they add after the prompt's last tokens, as vLLM's
    detokenizer primes itself with them: a tokenizer that drops a word's leading space at the start
    of a text (SentencePiece's: Llama 2's, Mistral's) keeps the output's first space."""
    suffix = prompt_suffix(decode, prompt)
    if not suffix:
        return decode
    base = decode(suffix)

    def after(ids: list[int]) -> str:
        whole = decode([*suffix, *ids])
        return whole[len(base) :] if whole.startswith(base) else decode(ids)

    return after


def ended_by_string(
    decode: Callable[[list[int]], str], ids: Sequence[int], stops: Sequence[str], min_tokens: int
) -> tuple[str, int] | None:
    """The stop string the last of ``ids`` completed and where it begins in ``decode(ids)``, or
    None. As vLLM checks them: only past ``min_tokens`` tokens, only a string that ends in the text
    the last token added, the first of ``stops`` that does."""
    if not stops or len(ids) <= min_tokens:
        return None
    text, before = decode(list(ids)), decode(list(ids[:-1]))
    start = new_text_start(text, before)
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0:
            return stop, at
    return None


def stop_reason(stop: str | None, token_ids: Sequence[int], finish_reason: str, eos: int | None):
    """What ended a request (vLLM's ``stop_reason``): its stop string (``stop``, from
    :func:`output_text`), else the stop token that ended it (a ``stop_token_ids`` entry, an EOS id
    of the generation config's); None for the tokenizer's EOS (``eos``) and for a request that
    did not stop."""
    if finish_reason != "stop":
        return None
    if stop is not None:
        return stop
    return token_ids[-1] if token_ids and token_ids[-1] != eos else None


def logprob_dicts(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], piece: Callable[[int], str] | None
) -> list[dict[int, Logprob]]:
    """Per token, vLLM's ``{token id: Logprob}``: the sampled token first, then the top ones
    (``piece(id)``: a token's text; None: no text)."""
    out = []
    for token, (lp, top) in zip(token_ids, logprobs):
        ranks = {t: r for r, (t, _) in enumerate(top, start=1)}
        entry = {token: _logprob(lp, ranks.get(token), token, piece)}
        for rank, (t, value) in enumerate(top, start=1):
            entry.setdefault(t, _logprob(value, rank, t, piece))
        out.append(entry)
    return out


def _logprob(value: float, rank: int | None, token: int, piece: Callable[[int], str] | None) -> Logprob:
    return Logprob(value, rank, None if piece is None else piece(token))
