"""Seeded tiny HF checkpoints built from config (for tests and the main job's built-in default).

These are randomly initialized models, saved with ``save_pretrained`` as safetensors and loaded
back through the real loading path; they are not trained models. The built-in one ships a
tokenizer (byte-level BPE trained offline on seeded made-up text, with a chat template), so text,
chats and stop strings work on the default job.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from reshard.parallel.model.checkpoint import hf_bars_off

FAMILY_DEFAULTS = MappingProxyType(
    {
        "llama": dict(num_key_value_heads=2),
        "qwen2": dict(num_key_value_heads=2),
        "qwen3": dict(num_key_value_heads=2, head_dim=32),
        "mistral": dict(num_key_value_heads=1, sliding_window=24),
        # mixture-of-experts: 8 experts, 2 per token; Qwen3-MoE's first layer dense (mlp_only_layers)
        "qwen3_moe": dict(
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
        "mixtral": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
        "qwen2_moe": dict(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        ),
        # Llama 4 text: top-1 sigmoid router + a shared expert; layer 0 dense, RoPE with chunked
        # attention (chunks of 8) and the L2 q/k norm; layer 1 NoPE with query temperature
        "llama4_text": dict(
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=1,
            intermediate_size=48,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=8,
            floor_scale=4,
        ),
    }
)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "llama4_text")
_COMMON = MappingProxyType(
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
)
BUILTIN = MappingProxyType(
    dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.05,
    )
)
BUILTIN_NAME = "tiny-llama-seed0-v2"  # v2: with a tokenizer
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_config(family: str, **overrides):
    """An HF config of ``family`` (llama | qwen2 | qwen3 | mistral) with tiny dimensions."""
    from transformers import AutoConfig

    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"unknown tiny model family {family!r}; choose from {sorted(FAMILY_DEFAULTS)}")
    kwargs = {**_COMMON, **FAMILY_DEFAULTS[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def make_tiny_checkpoint(
    family: str, path: str | os.PathLike, *, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Build a seeded tiny model and ``save_pretrained`` it (safetensors) into ``path``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with hf_bars_off():
        model.save_pretrained(path, safe_serialization=True, **kwargs)
    return Path(path)


def default_cache_dir() -> Path:
    root = os.environ.get("RESHARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "reshard"
    )
    return Path(root)


def builtin_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The built-in tiny Llama checkpoint, created on first use and reused afterwards."""
    return cached_checkpoint(BUILTIN_NAME, BUILTIN, cache_dir, tokenizer=True)


def cached_checkpoint(
    name: str,
    overrides: Mapping,
    cache_dir: str | os.PathLike | None = None,
    *,
    tokenizer: bool = False,
    family: str = "llama",
) -> Path:
    """A seeded model of ``family`` (``overrides`` of its tiny config) under ``cache_dir/name``, built once.

    Written to a temporary directory and renamed into place, so an interrupted run leaves no
    half-written checkpoint behind.
    """
    target = Path(cache_dir or default_cache_dir()).expanduser() / name  # ("~/models": the home, as a shell)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        make_tiny_checkpoint(family, tmp, seed=0, **overrides)
        if tokenizer:
            save_tokenizer(tmp, overrides.get("vocab_size", _COMMON["vocab_size"]))
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_tokenizer(path: str | os.PathLike, vocab_size: int, *, seed: int = 0) -> None:
    """Save a byte-level BPE tokenizer of exactly ``vocab_size`` ids into ``path``: ``<pad>``,
    ``<s>``, ``</s>``, ``<unk>`` as ids 0-3 (the tiny config's pad, BOS and EOS), trained on
    :func:`synthetic_text` (any text encodes: bytes are its alphabet), and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_text(seed), trainer)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def synthetic_text(seed: int = 0, sentences: int = 7500) -> list[str]:
    """Seeded sentences of made-up words (syllables of a small phonotactics): a corpus with enough
    distinct words for a few thousand BPE merges, made in a fraction of a second."""
    g = random.Random(seed)
    onset = ["", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "st", "tr", "sh"]
    vowel, coda = ["a", "e", "i", "o", "u", "ai", "ou", "ee"], ["", "", "n", "s", "r", "l", "t", "m", "nd", "st"]
    syllable = lambda: g.choice(onset) + g.choice(vowel) + g.choice(coda)  # noqa: E731
    words = ["".join(syllable() for _ in range(g.randint(1, 3))) for _ in range(3000)]
    return [
        " ".join(g.choice(words) for _ in range(g.randint(4, 12))).capitalize() + g.choice(".?!,")
        for _ in range(sentences)
    ]
