"""The generate job's requests: prompts from a JSONL file (token ids, text, chat messages, arrival
times) or a seeded synthetic workload, and the checkpoint's tokenizer for text in and out. Every
bad line is a ``ValueError`` naming the file, the line and the value.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from reshard.parallel import Request
from reshard.parallel.engine.request import LATEST_ARRIVAL_S
from reshard.parallel.engine.sampling import resolve_seeds
from reshard.parallel.engine.workload import poisson_arrivals
from reshard.recipes.config import GenerateConfig

# a JSONL object's prompt, by exactly one of these keys: token ids, a text, chat messages (vLLM's
# "prompt_token_ids" and "prompt" too; TRL's "prompt" may be a conversation)
PROMPT_FIELDS = ("prompt_ids", "prompt_token_ids", "text", "prompt", "messages")


def build_requests(cfg: GenerateConfig, model_path: Path, vocab_size: int) -> list[Request]:
    """Requests from ``workload.prompts_file`` or a seeded synthetic workload; arrival times from
    the file's ``"arrival"`` fields or a seeded Poisson process at ``workload.rate`` (else 0)."""
    params = cfg.generation.sampling_params()
    w = cfg.workload
    if w.prompts_file:
        prompts, arrivals = read_prompts(Path(w.prompts_file), model_path)
        if cfg.engine.max_seq_len is not None:  # null: the model's, checked per request by the engine
            _check_lengths(prompts, Path(w.prompts_file), params.max_new_tokens, cfg.engine.max_seq_len)
    else:
        prompts, arrivals = synthetic_prompts(cfg, vocab_size), [0.0] * w.num_requests
    if w.rate is not None:
        if any(a > 0 for a in arrivals):
            raise ValueError(
                f"workload.rate={w.rate} would replace the arrival times of {w.prompts_file}: give one of them"
            )
        arrivals = poisson_arrivals(len(prompts), w.rate, w.seed, w.burst)
    n = cfg.generation.n  # samples per prompt: request ids prompt_index * n + sample (each its own seed)
    requests = [
        Request(i * n + k, p, params, arrival=a) for i, (p, a) in enumerate(zip(prompts, arrivals)) for k in range(n)
    ]
    return resolve_seeds(requests, cfg.generation.seed)  # seeded here: a router in another process places them


def _check_lengths(prompts: list[list[int]], path: Path, new_tokens: int, max_seq_len: int) -> None:
    """``ValueError`` naming the file's line whose prompt + ``new_tokens`` exceeds ``max_seq_len``."""
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    if len(prompts[i]) + new_tokens > max_seq_len:
        raise ValueError(
            f"{path}: the prompt of request {i} ({len(prompts[i])} tokens) + generation.max_new_tokens "
            f"({new_tokens}) = {len(prompts[i]) + new_tokens} exceeds engine.max_seq_len ({max_seq_len})"
        )


def synthetic_prompts(cfg: GenerateConfig, vocab_size: int) -> list[list[int]]:
    w = cfg.workload
    gen = torch.Generator().manual_seed(w.seed)
    lengths = torch.randint(w.prompt_len_min, w.prompt_len_max + 1, (w.num_requests,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def read_prompts(path: Path, model_path: Path) -> tuple[list[list[int]], list[float]]:
    """JSONL lines: a token-id list, ``{"prompt_ids": [...]}``, a string or ``{"text": ...}``; a
    mapping may give ``"arrival"`` (seconds after the start, >= 0; default 0). Returns the prompts
    and their arrival times."""
    arrival = functools.partial(_arrival, path=path)  # each line's, checked before its prompt is read
    items = read_items(path, model_path, "workload.prompts_file", arrival)
    return [ids for ids, _ in items], [arrival(item, lineno=k) for k, (_, item) in enumerate(items, 1)]


def read_items(
    path: Path, model_path: Path, key: str, check: Callable[..., Any] | None = None
) -> list[tuple[list[int], Any]]:
    """Each line of the JSONL file at ``path`` (the config key ``key``) as its prompt's token ids
    (:func:`_prompt_ids`) and the parsed line; ``ValueError`` naming the line otherwise.
    ``check(item, lineno=)`` runs on each parsed line before its prompt is read."""
    if not path.exists():
        raise ValueError(f"{key} {str(path)!r} does not exist")
    items = []
    for lineno, line in enumerate(_prompt_lines(path), 1):
        if not line.strip():
            raise ValueError(f"{path}:{lineno}: blank line (one prompt per line; only the end may be blank)")
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if check is not None:
            check(item, lineno=lineno)
        items.append(item)
    if not items:
        raise ValueError(f"{key} {str(path)!r} has no prompts")
    return items_ids(items, model_path, str(path), lambda k: f"{path}:{k + 1}")


def items_ids(items: list, model_path: Path, source: str, where: Callable[[int], str]) -> list[tuple[list[int], Any]]:
    """Each item (a prompts-file line's or a dataset row's forms, see :func:`_prompt_ids`) with its
    token ids; ``where(k)`` names item ``k`` in errors, ``source`` the items' origin."""
    tokenizer = functools.cache(lambda: _tokenizer(model_path, source))  # loaded at the first text prompt
    return [(_prompt_ids(item, where(k), tokenizer), item) for k, item in enumerate(items)]


def _prompt_ids(item, where: str, tokenizer: Callable[[], Any]) -> list[int]:
    """A prompts-file line's token ids: a token-id list (or ``{"prompt_ids": ...}``) as given, a text
    (or ``{"text": ...}``) tokenized, ``{"messages": [...]}`` rendered by the tokenizer's chat
    template with the assistant's turn opened; an object names its prompt by one key of
    :data:`PROMPT_FIELDS`."""
    if isinstance(item, dict):
        key = _prompt_key(item, where)
        item = item[key]
        if key == "messages" or (key == "prompt" and isinstance(item, list) and item and isinstance(item[0], dict)):
            return _chat_ids(item, tokenizer(), where)  # (TRL's conversational "prompt" too)
    if isinstance(item, str):
        item = tokenizer()(item)["input_ids"]
    if not (isinstance(item, list) and item and all(type(t) is int for t in item)):  # no bools
        raise ValueError(f"{where}: expected a non-empty token-id list, a text or chat messages")
    return item


def _prompt_key(item: dict, where: str) -> str:
    """The one key of :data:`PROMPT_FIELDS` that ``item`` names its prompt by (a line that named
    two had one of them ignored, silently)."""
    keys = [k for k in PROMPT_FIELDS if k in item]
    if len(keys) != 1:
        fields = list(PROMPT_FIELDS)
        raise ValueError(f"{where}: an object names its prompt by one of {fields}; got keys {sorted(item)}")
    return keys[0]


def _chat_ids(messages, tokenizer, where: str) -> list[int]:
    ok = isinstance(messages, list) and messages
    if not (ok and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}')
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat messages need a chat template; the checkpoint's tokenizer has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def output_tokenizer(model_path: Path):
    """The checkpoint's tokenizer for decoding outputs, or ``None`` when it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((Path(model_path) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # files that do not load: outputs stay token ids, as without a tokenizer
        return None


def stop_tokenizer(cfg: GenerateConfig, path: Path):
    """The checkpoint's tokenizer when the job has stop strings (matched in decoded text), else
    None; ``ValueError`` naming the checkpoint when it has none."""
    if not cfg.generation.stop:
        return None
    tokenizer = output_tokenizer(path)
    if tokenizer is None:
        raise ValueError(
            f"generation.stop={list(cfg.generation.stop)} is matched in decoded text, and the checkpoint {path} "
            "has no tokenizer (tokenizer.json / tokenizer_config.json); use generation.stop_token_ids"
        )
    return tokenizer


def _prompt_lines(path: Path) -> list[str]:
    """The file's lines, blank ones at the end dropped; a file that is not UTF-8 is a ``ValueError``
    naming it and the byte."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"workload.prompts_file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _arrival(item, *, path: Path, lineno: int) -> float:
    value = item.get("arrival", 0.0) if isinstance(item, dict) else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{path}:{lineno}: arrival must be a number of seconds >= 0, got {value!r}")
    if value >= LATEST_ARRIVAL_S:
        raise ValueError(f"{path}:{lineno}: arrival is seconds after the start, got {value!r} (a wall-clock time?)")
    return float(value)


def _tokenizer(model_path: Path, prompts_path: Path | str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # no tokenizer files in the checkpoint
        raise ValueError(
            f"{prompts_path} has text or chat prompts but the checkpoint at {model_path} has no "
            f"usable tokenizer ({type(e).__name__}); give token-id lists"
        ) from e
