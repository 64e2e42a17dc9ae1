"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt or a chat to the token ids the
server would run, and token ids to their text, checked as the completions are (one line naming
the field for a bad value)."""

import functools
from typing import Any

from reshard.parallel.serve.protocol import TEMPLATE_FIELDS, BadRequest, Limits, check_model, messages_ids
from reshard.parallel.serve.text import Text

TOKENIZE_FIELDS = frozenset(
    ("model", "prompt", "messages", "add_special_tokens", "return_token_strs", *TEMPLATE_FIELDS)
)
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))


def tokenize(body: Any, limits: Limits, text: Text) -> dict:
    """``{"prompt": text}`` (``add_special_tokens``, default true) or ``{"messages": [...]}`` (the
    chat template and its arguments, as a chat completion's; ``add_special_tokens`` default false) ->
    ``{"count", "max_model_len", "tokens", "token_strs"}`` (the last null unless ``return_token_strs``)."""
    _check(body, TOKENIZE_FIELDS, limits)
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give a prompt or messages, one of them", "prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt must be a string, got {prompt!r}"[:200], "prompt")
        ids = text.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        special = _flag(body, "add_special_tokens", False)
        ids = messages_ids(body, functools.partial(text.chat, special_tokens=special))  # (chat(messages, template))
    strs = text.tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": limits.max_seq_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, limits: Limits, text: Text) -> dict:
    """``{"tokens": [ids]}`` -> ``{"prompt": their text}`` (special tokens kept, as vLLM's)."""
    _check(body, DETOKENIZE_FIELDS, limits)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise BadRequest(f"tokens must be a list of token ids, got {ids!r}"[:200], "tokens")
    vocab = min(limits.vocab_size, len(text.tokenizer))  # (a model's padded vocabulary has ids no text has)
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise BadRequest(f"token id {outside[0]} is outside the vocabulary of {vocab} tokens", "tokens")
    return {"prompt": text.decode(ids, skip_special_tokens=False)}


def _check(body: Any, fields: frozenset[str], limits: Limits) -> None:
    """A JSON object of ``fields`` only, naming the served model or none."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unsupported field {unknown[0]!r} (this endpoint takes {sorted(fields)})", unknown[0])
    check_model(body, limits)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:  # (left out or null: the default, as vLLM's optional fields)
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}", name)
    return value
