"""OpenAI's completions and chat completions, mapped onto the engine's requests.

:func:`parse` turns a request body into :class:`Parsed` (the prompts' token ids and the
engine's :class:`SamplingParams`); every field the engine cannot honour is a
:class:`BadRequest` naming it, never ignored. The response builders return plain dicts in
OpenAI's shapes (``text_completion``, ``chat.completion`` and their ``.chunk`` stream events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from reshard.parallel.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from reshard.parallel.vllm_api import message_text

# fields either endpoint takes: OpenAI's, and vLLM's extras the sampler has
COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty")
COMMON += ("stream", "stream_options", "user", "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty")
COMMON += ("stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")  # vLLM's, as reshard.LLM's
# vLLM's chat template arguments (Qwen3's {"enable_thinking": false} comes in chat_template_kwargs)
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
RESERVED = frozenset(("tokenize", "conversation", "conversations", "messages", "chat_template", "tools"))
COMPLETION_FIELDS = frozenset((*COMMON, "prompt", "logprobs"))
CHAT_FIELDS = frozenset((*COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens", *TEMPLATE_FIELDS))
# fields whose value here means "off": accepted with that value, a 400 naming them with any other
INERT = MappingProxyType(
    {
        "echo": (False,),
        "best_of": (1,),
        "suffix": (None, ""),
        "logit_bias": (None, {}),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "functions": (None, []),
        "parallel_tool_calls": (None,),
        "response_format": (None, {"type": "text"}),
        "store": (None, False),
        "metadata": (None, {}),
        "service_tier": (None, "auto", "default"),
        # vLLM's extras at their defaults
        "spaces_between_special_tokens": (None, True),
    }
)


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` and a message naming the value (``param``:
    the field at fault, as OpenAI's error objects carry)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Limits:
    """What the server checks a request against: the served model's name, context and vocabulary."""

    model: str
    max_seq_len: int
    vocab_size: int
    logprobs: bool = True  # whether log-probabilities can be asked (not across a migration)
    # the checkpoint's generation_config.json sampling values (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens): a request that leaves one out gets it, as vLLM's server
    defaults: Mapping[str, float] = field(default_factory=dict)


@dataclass
class Parsed:
    """A request body as the engine runs it: ``prompts[i]`` sampled ``n`` times with ``sampling``
    (seeds ``seed``, ``seed + 1``, ... where given)."""

    kind: str  # "completions" | "chat"
    prompts: list[list[int]]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top log-probabilities per token (None: none asked)
    stop: tuple[str, ...] = field(default=())


def parse(kind: str, body: Any, limits: Limits, tokenize: Callable[[str], list[int]], chat) -> Parsed:
    """``body`` (the decoded JSON) of a ``kind`` request, checked; ``tokenize(text)`` and
    ``chat(messages)`` give token ids."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_fields(kind, body)
    check_model(body, limits)
    prompts = _prompts(body, tokenize) if kind == "completions" else [messages_ids(body, chat)]
    for ids in prompts:
        _check_prompt(ids, limits)
    n = _int(body, "n", 1, 1, None)  # (as vLLM: no cap but the server's serve.max_waiting, Front.accept)
    logprobs = _logprobs(kind, body)
    if logprobs is not None and not limits.logprobs:
        raise BadRequest(
            "logprobs are not kept across a failure (a migration carries tokens): not served with fault.migrate",
            "logprobs",
        )
    stop = _stop(body.get("stop"))
    longest = max(map(len, prompts))
    room = limits.max_seq_len - longest
    # OpenAI's 16 for completions, unless null is given (vLLM's: the rest of the context, as a chat's)
    default = 16 if kind == "completions" and body.get("max_tokens", 16) is not None else room
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, default, 1, None)
    if max_tokens > room:
        raise BadRequest(
            f"{key}={max_tokens} with a prompt of {longest} tokens exceeds the model's context of "
            f"{limits.max_seq_len} tokens (at most {room} new tokens)",
            key,
        )
    max_tokens = min(max_tokens, limits.defaults.get("max_new_tokens", max_tokens))  # (the checkpoint's cap: vLLM's)
    sampling = _sampling(body, max_tokens, logprobs, stop, _stop_ids(body, limits.vocab_size), limits.defaults)
    stream, options = _bool(body, "stream"), body.get("stream_options")
    taken = {"include_usage", "continuous_usage_stats"}  # (the latter off only: vLLM's extra)
    bad = options is not None and not isinstance(options, dict)
    if bad or set(options or {}) - taken or (options or {}).get("continuous_usage_stats"):
        raise BadRequest(f"stream_options must be {{'include_usage': bool}}, got {options!r}", "stream_options")
    if options and not stream:
        raise BadRequest("stream_options can only be given with stream=true", "stream_options")
    usage = options is not None and options.get("include_usage", True) is True  # (vLLM's default: True)
    return Parsed(kind, prompts, sampling, n, stream, usage, logprobs, stop)


def check_model(body: dict, limits: Limits) -> None:
    """A 404 naming the served model where ``body`` names another (none named: the served one, as vLLM)."""
    if body.get("model") not in (limits.model, None, ""):
        raise BadRequest(
            f"model {body.get('model')!r} does not exist; this server serves {limits.model!r}", "model", 404
        )


def _check_fields(kind: str, body: dict) -> None:
    for name, value in body.items():
        if name in (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS):
            continue
        if name in INERT and value in INERT[name]:
            continue
        what = f"with {value!r}" if name in INERT else "here"
        raise BadRequest(f"unsupported field {name!r}: reshard serve cannot honour it {what}", name)


def _prompts(body: dict, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
    """A prompt: a string, a list of strings, a token-id list or a list of them."""
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)):
        p = [p]
    if not (isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p)):
        raise BadRequest(f"prompt must be a string, a token-id list or a list of either, got {p!r}"[:200], "prompt")
    out = [tokenize(x) if isinstance(x, str) else x for x in p]
    if any(not ids or not all(type(t) is int for t in ids) for ids in out):
        raise BadRequest("prompt must not be empty and its token ids must be ints", "prompt")
    return out


def template_options(body: dict) -> dict:
    """``body``'s chat template arguments, checked (vLLM's: ``add_generation_prompt`` default true,
    ``continue_final_message`` default false, not both; ``chat_template_kwargs`` for the template)."""
    generation, final = (body.get(k) for k in ("add_generation_prompt", "continue_final_message"))
    generation, final = generation if generation is not None else True, final if final is not None else False
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs  # (null: none, as vLLM)
    for name, value in (("add_generation_prompt", generation), ("continue_final_message", final)):
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false, got {value!r}", name)
    if generation and final:
        raise BadRequest(
            "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
        )
    if not isinstance(kwargs, dict) or set(kwargs) & RESERVED:
        raise BadRequest(
            f"chat_template_kwargs must be an object of the template's variables (none of {sorted(RESERVED)}), "
            f"got {kwargs!r}"[:200],
            "chat_template_kwargs",
        )
    return {"add_generation_prompt": generation, "continue_final_message": final, **kwargs}


def messages_ids(body: dict, chat) -> list[int]:
    """``body``'s ``messages``, checked, as ``chat(messages, template_options(body))`` gives their ids."""
    m = body.get("messages")
    ok = isinstance(m, list) and m and all(isinstance(x, dict) for x in m)
    if not ok or not all(x.get("role") in ("system", "user", "assistant", "developer") for x in m):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': <text>}", "messages")
    from jinja2 import TemplateError

    try:  # (text parts joined, as vLLM's string content format)
        return chat([_message(x, j) for j, x in enumerate(m)], template_options(body))
    except (ValueError, TypeError) as e:  # (TypeError: a template argument of the wrong kind, as vLLM's 400)
        raise BadRequest(str(e).replace("conversation 0, message", "messages"), "messages") from None
    except TemplateError as e:  # (the template's own refusal, raise_exception: the request's fault, as vLLM)
        raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None


def _message(m: dict, j: int) -> dict:
    """Message ``j`` as the chat template gets it: its role, its content as text, its ``name``."""
    out = {"role": m["role"], "content": message_text(m.get("content"), 0, j)}
    return {**out, "name": m["name"]} if isinstance(m.get("name"), str) else out  # (vLLM's: a string only)


def _check_prompt(ids: list[int], limits: Limits) -> None:
    if len(ids) >= limits.max_seq_len:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens; the model's context is {limits.max_seq_len} tokens "
            "(a prompt must leave room for one new token)",
            "prompt",
        )
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary of {limits.vocab_size}", "prompt")


def _sampling(
    body: dict,
    max_tokens: int,
    logprobs: int | None,
    stop: tuple[str, ...],
    stop_ids: tuple[int, ...] | None,
    defaults: Mapping[str, float],
) -> SamplingParams:
    d = defaults  # (the checkpoint's generation config, else OpenAI's: sampled at 1.0)
    values = dict(
        temperature=_num(body, "temperature", d.get("temperature", 1.0), 0, None),
        top_p=_num(body, "top_p", d.get("top_p", 1.0), 0, 1),
        top_k=max(0, _int(body, "top_k", d.get("top_k", 0), -1, None)),  # (-1: off, vLLM's; 0 here)
        min_p=_num(body, "min_p", d.get("min_p", 0.0), 0, 1),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=_num(body, "repetition_penalty", d.get("repetition_penalty", 1.0), 0, None),
        min_tokens=_int(body, "min_tokens", 0, 0, max_tokens),
        ignore_eos=_bool(body, "ignore_eos"),
        seed=_int(body, "seed", None, 0, 2**63 - 1),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=body.get("skip_special_tokens") is None or _bool(body, "skip_special_tokens"),
    )
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=stop, stop_token_ids=stop_ids, **values)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _stop_ids(body: dict, vocab_size: int) -> tuple[int, ...] | None:
    """vLLM's ``stop_token_ids``: token ids that end a choice besides EOS (None: none given)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise BadRequest(
            f"stop_token_ids must be a list of token ids in 0..{vocab_size - 1}, got {ids!r}"[:200], "stop_token_ids"
        )
    return tuple(ids)


def _logprobs(kind: str, body: dict) -> int | None:
    if kind == "completions":
        return _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top is not None:
            raise BadRequest(f"top_logprobs={top} needs logprobs=true", "top_logprobs")
        return None
    return top or 0


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else None
    # (as many as given: vLLM's, not OpenAI's 4; an object is none: its keys were once taken for them)
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a string or a list of non-empty strings, got {value!r}", "stop")
    return stops


def _int(body: dict, name: str, default, low: int, high: int | None):
    v = body.get(name)
    if v is None:
        return default
    if type(v) is not int or v < low or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        raise BadRequest(f"{name} must be an integer {rng}, got {v!r}", name)
    return v


def _num(body: dict, name: str, default: float, low: float, high: float | None) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= low and (high is None or v <= high)):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be a number {rng}, got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}", name)
    return bool(v)


# ---- responses ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def envelope(kind: str, rid: str, model: str, choices: list[dict], chunk: bool) -> dict:
    """The object around ``choices``: a whole response or one stream event."""
    obj = ("chat.completion" if kind == "chat" else "text_completion") + (".chunk" if chunk and kind == "chat" else "")
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}


def choice(
    kind: str, index: int, text: str, finish: str | None, logprobs: dict | None, delta: bool, stop_reason=None
) -> dict:
    """One choice: a completion's ``text`` or a chat ``message`` (a stream's ``delta``); vLLM's
    ``stop_reason``: the stop string or stop token that ended it (None: EOS, or not ended)."""
    out: dict[str, Any] = {"index": index}
    if kind == "chat":
        out["delta" if delta else "message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    out["logprobs"], out["finish_reason"] = logprobs, finish  # "abort": cancelled (a drain's grace ran out), as vLLM
    out["stop_reason"] = stop_reason
    return out


def logprobs_of(kind: str, tokens: Sequence[int], lps: Sequence[TokenLogprobs], piece, offset: int = 0) -> dict:
    """OpenAI's log-probability object of ``tokens`` (``piece(id)``: a token's text)."""
    if kind == "chat":
        content = []
        for t, (lp, top) in zip(tokens, lps):
            tops = [_entry(piece(i), p) for i, p in top]
            content.append({**_entry(piece(t), lp), "top_logprobs": tops})
        return {"content": content}
    pieces = [piece(t) for t in tokens]
    offsets = [offset + sum(map(len, pieces[:k])) for k in range(len(pieces))]
    return {
        "tokens": pieces,
        "token_logprobs": [lp for lp, _ in lps],
        # (the sampled token's first, then the top ones: up to logprobs + 1 entries, as vLLM's and OpenAI's)
        "top_logprobs": [dict([(piece(t), lp), *((piece(i), p) for i, p in top)]) for t, (lp, top) in zip(tokens, lps)],
        "text_offset": offsets,
    }


def _entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}
