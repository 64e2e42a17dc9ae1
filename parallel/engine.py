"""Generation engine: batched prefill, decode over a preallocated KV cache, continuous batching.

The engine drives a model prepared by :func:`parallel.parallelize` (HF module tree with our layers):
it calls the HF decoder layers directly, flattening the step's tokens into ``(1, N, D)`` and passing
an :class:`layers.AttentionContext` through to the attention layers. Strategies (Shift, Seesaw, ...)
reuse the step functions and add their own scheduling.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from layers import AttentionContext
from reshard import KVCache
from reshard.kv_cache import KVSpec

from .sampling import SamplingParams, make_generator, sample_tokens


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch_sum: int = 0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_sum / max(self.decode_steps, 1)


@dataclass
class _Sequence:
    request: Request
    slot: int
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None

    @property
    def last_token(self) -> int:
        return self.output[-1]

    def append(self, token: int) -> None:
        self.output.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.request.sampling.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        r = self.request
        return Completion(r.id, list(r.prompt_ids), list(self.output), self.finish_reason)


class Engine:
    """Continuous-batching generation over ``max_batch_size`` KV-cache slots.

    Args:
        model: an HF causal LM whose modules are our layers (see :func:`parallel.parallelize`).
        max_seq_len: longest prompt + generation a slot holds (default: the model's
            ``max_position_embeddings``, capped at 4096).
        max_prefill_tokens: prompt tokens admitted into one prefill step (at least one request).
        compile: ``torch.compile`` the decode step (static shapes: all slots, full cache length).
    """

    def __init__(self, model: nn.Module, *, max_batch_size: int = 8, max_seq_len: int | None = None,
                 max_prefill_tokens: int = 4096, compile: bool = False) -> None:
        cfg = model.config
        self.model = model
        self.max_batch_size = _positive("max_batch_size", max_batch_size)
        self.max_seq_len = _positive("max_seq_len", max_seq_len or min(cfg.max_position_embeddings, 4096))
        self.max_prefill_tokens = _positive("max_prefill_tokens", max_prefill_tokens)
        self.vocab_size = cfg.vocab_size
        self.eos_ids = _as_ids(cfg.eos_token_id)
        self.device = self._device()
        self.kv = KVCache(self._kv_spec(), device=self.device)
        self.stats = EngineStats()
        self.compiled = compile
        self._decode_forward = torch.compile(self._forward) if compile else self._forward

    def _device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.to_local().device

    def _kv_spec(self) -> KVSpec:
        attn = self.model.model.layers[0].self_attn
        dtype = self.model.model.embed_tokens.weight.dtype
        return KVSpec(num_layers=len(self.model.model.layers), num_slots=self.max_batch_size,
                      num_heads=attn.local_kv_heads, max_seq_len=self.max_seq_len,
                      head_dim=attn.head_dim, dtype=dtype, head_start=attn.kv_head_range[0])

    # ---- public API -------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], *, progress: bool = False) -> list[Completion]:
        """Run all ``requests`` to completion; returns completions in request order."""
        self.validate(requests)
        queue, running, done = deque(requests), {}, {}
        free = list(range(self.max_batch_size - 1, -1, -1))
        with tqdm(total=len(requests), disable=not progress, desc="generate", unit="req") as bar:
            while queue or running:
                admitted = self._admit(queue, free, running)
                if admitted:
                    self.prefill(admitted)
                active = [s for s in running.values() if s.finish_reason is None]
                if active:
                    self.decode(active)
                for slot in [k for k, s in running.items() if s.finish_reason is not None]:
                    seq = running.pop(slot)
                    done[seq.request.id] = seq.completion()
                    free.append(slot)
                    bar.update(1)
        return [done[r.id] for r in requests]

    @torch.inference_mode()
    def prompt_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """fp32 logits ``(len(p), vocab)`` at every position of each prompt, replicated on all ranks.

        Runs one prefill step through the cache (slots ``0..len(prompts)-1``); call it between
        ``generate`` calls, not during one.
        """
        if not 0 < len(prompts) <= self.max_batch_size:
            raise ValueError(f"prompt_logits takes 1..{self.max_batch_size} prompts, got {len(prompts)}")
        self.validate([Request(i, list(p), SamplingParams(max_new_tokens=1)) for i, p in enumerate(prompts)])
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        ctx = AttentionContext.build(self.kv, list(range(len(prompts))), [0] * len(prompts), lengths)
        logits = self._forward(ids, ctx.positions, ctx, torch.arange(len(ids), device=self.device))
        return list(torch.split(logits, lengths))

    def validate(self, requests: Sequence[Request]) -> None:
        """``ValueError`` naming the request for empty, too long or out-of-vocabulary prompts."""
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for r in requests:
            n, m = len(r.prompt_ids), r.sampling.max_new_tokens
            if n == 0:
                raise ValueError(f"request {r.id}: empty prompt")
            if n + m > self.max_seq_len:
                raise ValueError(f"request {r.id}: prompt length ({n}) + max_new_tokens ({m}) = "
                                 f"{n + m} exceeds max_seq_len ({self.max_seq_len})")
            bad = [t for t in r.prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"request {r.id}: token ids {bad[:5]} outside vocab [0, {self.vocab_size})")

    # ---- steps --------------------------------------------------------------------------------
    def _admit(self, queue: deque, free: list[int], running: dict) -> list[_Sequence]:
        admitted, budget = [], self.max_prefill_tokens
        while queue and free and (not admitted or len(queue[0].prompt_ids) <= budget):
            request = queue.popleft()
            budget -= len(request.prompt_ids)
            seq = self.new_sequence(request, free.pop())
            running[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def new_sequence(self, request: Request, slot: int) -> _Sequence:
        stop = request.sampling.stop_token_ids
        return _Sequence(request, slot, make_generator(request.sampling, request.id),
                         frozenset(self.eos_ids if stop is None else stop))

    def prefill(self, seqs: list[_Sequence]) -> None:
        """One step over the whole prompts of ``seqs``; samples each one's first token."""
        t0 = time.perf_counter()
        lengths = [len(s.request.prompt_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.request.prompt_ids], device=self.device)
        logits = self._logits(seqs, ids, [0] * len(seqs), lengths)
        self._append(seqs, logits, lengths)
        self.stats.prefill_tokens += sum(lengths)
        self.stats.prefill_steps += 1
        self.stats.prefill_seconds += time.perf_counter() - t0

    def decode(self, seqs: list[_Sequence]) -> None:
        """One token for each of ``seqs``."""
        t0 = time.perf_counter()
        if self.compiled:
            logits = self._static_decode_logits(seqs)
        else:
            ids = torch.tensor([s.last_token for s in seqs], device=self.device)
            logits = self._logits(seqs, ids, [s.cached for s in seqs], [1] * len(seqs))
        self._append(seqs, logits, [1] * len(seqs))
        self.stats.decode_tokens += len(seqs)
        self.stats.decode_steps += 1
        self.stats.decode_batch_sum += len(seqs)
        self.stats.decode_seconds += time.perf_counter() - t0

    def _logits(self, seqs: list[_Sequence], ids: torch.Tensor, starts: list[int],
                lengths: list[int]) -> torch.Tensor:
        """fp32 logits ``(len(seqs), vocab)`` at each sequence's last new token."""
        ctx = AttentionContext.build(self.kv, [s.slot for s in seqs], starts, lengths)
        last = torch.cumsum(torch.tensor(lengths, device=self.device), 0) - 1
        return self._forward(ids, ctx.positions, ctx, last)

    def _static_decode_logits(self, seqs: list[_Sequence]) -> torch.Tensor:
        """Decode over every slot with a full-length cache, so the compiled graph never changes."""
        n = self.max_batch_size
        ids, starts = torch.zeros(n, dtype=torch.long, device=self.device), [0] * n
        for s in seqs:
            ids[s.slot], starts[s.slot] = s.last_token, s.cached
        ctx = AttentionContext.build(self.kv, list(range(n)), starts, [1] * n, kv_len=self.max_seq_len)
        for w in self._windows():
            ctx.mask(w)
        logits = self._decode_forward(ids, ctx.positions, ctx, torch.arange(n, device=self.device))
        return logits[torch.tensor([s.slot for s in seqs], device=self.device)]

    def _windows(self) -> set:
        return {layer.self_attn.sliding_window for layer in self.model.model.layers}

    def _append(self, seqs: list[_Sequence], logits: torch.Tensor | None, lengths: list[int]) -> None:
        for seq, token, n in zip(seqs, self._select(seqs, logits).tolist(), lengths):
            seq.cached += n
            seq.append(token)

    def _select(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The next token of each sequence, the same on every rank."""
        return self._agree(sample_tokens(logits, [s.request.sampling for s in seqs],
                                         [s.generator for s in seqs]))

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """All ranks of the model's mesh continue with the tokens of mesh coordinate (0, ..., 0)."""
        mesh = self.model.model.embed_tokens.weight.device_mesh
        coord = list(mesh.get_coordinate())
        for axis in reversed(range(mesh.ndim)):  # innermost axis first, then outward
            if mesh.size(axis) > 1:
                src = int(mesh.mesh[tuple(coord[:axis] + [0] + coord[axis + 1:])])
                dist.broadcast(tokens, src=src, group=mesh.get_group(axis))
        return tokens

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                 last: torch.Tensor) -> torch.Tensor:
        """``(N,)`` token ids at ``(N,)`` positions -> fp32 logits ``(len(last), vocab)``."""
        m = self.model.model
        h = m.embed_tokens(ids[None])  # (1, N, D)
        pos = positions[None]
        emb = m.rotary_emb(h, pos)
        for layer in m.layers:
            h = layer(h, position_embeddings=emb, position_ids=pos, attn_context=ctx)
        h = m.norm(h[:, last])  # (1, B, D)
        return self.model.lm_head(h)[0].float()


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _as_ids(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
