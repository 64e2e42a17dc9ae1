"""What the rollout loop learns from: its prompts and its reward.

The default is the toy task (seeded prompts of ordinary tokens, new each iteration; the reward is
the fraction of even tokens in the answer). ``train.prompts_file`` (JSONL: token ids, a text or
chat messages per line, as ``workload.prompts_file``, with any other fields, e.g. an ``"answer"``)
or ``train.prompts_dataset`` (a ``datasets`` dataset read offline: a ``save_to_disk`` directory or
a cached name; TRL's ``"prompt"`` column, a text or a conversation, and any other columns) and
``train.reward`` (``package.module:function``) make it a real one. The reward is called as
TRL calls its reward functions, once per iteration for the whole batch::

    reward(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float]

``prompts`` and ``completions`` are texts where the policy has a tokenizer (its special tokens
skipped), else token-id lists; each other field of the lines is a keyword argument, one value per
completion. Each iteration takes the file's next ``train.prompts`` lines (from the top again at
its end).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.recipes.prompts import PROMPT_FIELDS, items_ids, output_tokenizer, read_items
from reshard.recipes.rollout_config import TrainConfig

SPECIAL_TOKENS = 3  # ids 0..2: pad, bos, eos
PROMPT_KEYS = (*PROMPT_FIELDS, "arrival")  # a line's fields that are not reward columns


@dataclass(frozen=True)
class Prompt:
    """One prompt of an iteration: its token ids and its line's other fields."""

    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


class Task:
    """The prompts of each iteration and the rewards of their completions (see the module)."""

    def __init__(self, cfg: TrainConfig, policy_path: Path, vocab_size: int) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.lines = _lines(Path(cfg.prompts_file), policy_path) if cfg.prompts_file else None
        if cfg.prompts_dataset:
            self.lines = _rows(cfg.prompts_dataset, cfg.prompts_split, policy_path)
        self.reward = load_reward(cfg.reward) if cfg.reward else None
        self.tokenizer = output_tokenizer(policy_path) if cfg.reward else None

    @property
    def max_prompt_len(self) -> int:
        return self.cfg.prompt_len if self.lines is None else max(len(p.ids) for p in self.lines)

    def prompts(self, iteration: int) -> list[Prompt]:
        """``train.prompts`` prompts of ``iteration``."""
        n = self.cfg.prompts
        if self.lines is None:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + iteration)
            ids = torch.randint(SPECIAL_TOKENS, self.vocab_size, (n, self.cfg.prompt_len), generator=gen).tolist()
            return [Prompt(p) for p in ids]
        return [self.lines[(iteration * n + k) % len(self.lines)] for k in range(n)]

    def rewards(self, prompts: list[Prompt], completions: list[list[int]]) -> list[float]:
        """One reward per completion (``prompts[i]``'s)."""
        if self.reward is None:
            return [even_reward(c, self.cfg.max_new_tokens) for c in completions]
        columns = {k: [p.columns.get(k) for p in prompts] for k in sorted({k for p in prompts for k in p.columns})}
        text = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else list
        out = self.reward(
            prompts=[text(p.ids) for p in prompts],
            completions=[text(c) for c in completions],
            completion_ids=[list(c) for c in completions],
            **columns,
        )
        return _checked(out, len(completions), self.cfg.reward)


def even_reward(completion: list[int], max_new_tokens: int) -> float:
    """Fraction of the answer's ``max_new_tokens`` positions holding an even ordinary token."""
    return sum(1 for t in completion if t >= SPECIAL_TOKENS and t % 2 == 0) / max_new_tokens


def load_reward(spec: str) -> Callable[..., list[float]]:
    """The function ``package.module:function`` names; ``ValueError`` naming ``train.reward``
    where it is not importable or not callable."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"train.reward must be package.module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"train.reward {spec!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"train.reward {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _lines(path: Path, policy_path: Path) -> list[Prompt]:
    items = read_items(path, policy_path, "train.prompts_file")
    return [Prompt(ids, {k: v for k, v in item.items() if k not in PROMPT_KEYS} if isinstance(item, dict) else {})
            for ids, item in items]  # fmt: skip


def _rows(name: str, split: str, policy_path: Path) -> list[Prompt]:
    """The ``split`` of the ``datasets`` dataset ``name`` (a ``save_to_disk`` directory, or a name
    in the local Hugging Face cache: read offline) as prompts. A row's prompt is TRL's ``"prompt"``
    column (a text or a conversation) or a prompts-file line's fields; its other columns go to the
    reward."""
    rows = [_as_line(row) for row in load_rows(name, split)]
    items = items_ids(rows, policy_path, f"train.prompts_dataset {name!r}", lambda k: f"{name}[{split}][{k}]")
    return [Prompt(ids, {k: v for k, v in row.items() if k not in PROMPT_KEYS}) for ids, row in items]


def load_rows(name: str, split: str) -> list[dict]:
    """``ValueError`` naming ``train.prompts_dataset`` where ``datasets`` is missing, the dataset
    is not found offline or has no such split."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"train.prompts_dataset={name} needs the `datasets` package (pip install datasets)") from None
    try:
        if Path(name).is_dir():
            loaded = datasets.load_from_disk(name)
        else:  # from the hub's local cache only: nothing is downloaded at run time
            from huggingface_hub import snapshot_download

            loaded = datasets.load_dataset(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except Exception as e:  # not saved there, not in the cache
        raise ValueError(f"train.prompts_dataset {name!r} was not found offline ({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"train.prompts_split {split!r} is not a split of {name!r}: {sorted(loaded)}")
        loaded = loaded[split]
    if len(loaded) == 0:
        raise ValueError(f"train.prompts_dataset {name!r} ({split}) has no rows")
    return list(loaded)


def _as_line(row: dict) -> dict:
    """A dataset row in a prompts-file line's form: TRL's ``"prompt"`` as ``"text"`` or ``"messages"``."""
    row = dict(row)
    if "prompt" in row:
        prompt = row.pop("prompt")
        row["text" if isinstance(prompt, str) else "messages"] = prompt
    return row


def _checked(out, count: int, spec: str) -> list[float]:
    values = list(out) if isinstance(out, (list, tuple)) else None
    if (
        values is None
        or len(values) != count
        or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    ):
        raise ValueError(
            f"train.reward {spec!r} must return {count} finite numbers (one per completion), got {str(out)[:80]}"
        )
    return [float(v) for v in values]
