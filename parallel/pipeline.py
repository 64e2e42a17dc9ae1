"""Pipeline-parallel execution: layers split into stages on the ``pp`` axis, micro-batches flowing
through them with point-to-point activations (combinable with dp and tp).

Each stage holds only its layers (parameters of other stages are DTensors with empty local
tensors on this rank) and a KV cache for its layers only. Within a step the sequences are cut
into micro-batches; stage ``s`` receives a micro-batch's hidden states from stage ``s - 1``, runs
its layers and sends them on without waiting, so stages work on different micro-batches at once.
The last stage samples and broadcasts the tokens along the pp axis.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from layers import AttentionContext
from reshard.kv_cache import KVSpec

from .dims import ParallelDims
from .engine import Engine
from .layouts import stage_of_layer
from .parallelize import parallelize
from .plans import tp_plan
from .sampling import sample_tokens, skip_draws


def parallelize_pipeline(path: str | os.PathLike, dims: ParallelDims, *,
                         dtype: torch.dtype | None = None, load_weights: bool = True) -> nn.Module:
    """Load ``path`` with decoder layers split over ``dims.pp`` stages, each TP over ``dims.tp``."""
    layers = _num_layers(path)
    if dims.pp > layers:
        raise ValueError(f"pipeline stages ({dims.pp}) exceed the model's layers ({layers})")
    return parallelize(path, dims, plan=tp_plan(), dtype=dtype, stage_meshes=dims.stage_meshes(),
                       load_weights=load_weights)


def _num_layers(path) -> int:
    from transformers import AutoConfig

    from .checkpoint import resolve_checkpoint

    return AutoConfig.from_pretrained(resolve_checkpoint(path)).num_hidden_layers


class PipelineEngine(Engine):
    """The generation engine over pipeline stages; ``num_microbatches`` per step (at most)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, *, num_microbatches: int = 2,
                 **kwargs) -> None:
        if kwargs.get("compile"):
            raise ValueError("compile=True is not supported with pipeline stages yet")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        coord = dims.world_mesh().get_coordinate()  # (dp, pp, sp, tp)
        self.dims, self.stage, self.num_microbatches = dims, coord[1], num_microbatches
        n = len(model.model.layers)
        self.layer_ids = [i for i in range(n) if stage_of_layer(i, n, dims.pp) == self.stage]
        grid = torch.arange(dims.world_size).view(dims.shape)
        self.peers = [int(grid[coord[0], p, coord[2], coord[3]]) for p in range(dims.pp)]
        self.pp_group = dims.mesh("pp").get_group()
        super().__init__(model, **kwargs)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.dims.pp - 1

    def _device(self) -> torch.device:
        return next(self.model.model.layers[self.layer_ids[0]].parameters()).to_local().device

    def _kv_spec(self) -> KVSpec:
        attn = self.model.model.layers[self.layer_ids[0]].self_attn
        return KVSpec(num_layers=len(self.layer_ids), num_slots=self.max_batch_size,
                      num_heads=attn.local_kv_heads, max_seq_len=self.max_seq_len,
                      head_dim=attn.head_dim, dtype=self.model.model.embed_tokens.weight.dtype,
                      head_start=attn.kv_head_range[0], first_layer=self.layer_ids[0])

    def _logits(self, seqs, ids, starts, lengths) -> torch.Tensor | None:
        """Micro-batched forward through the stages; logits on the last stage, ``None`` elsewhere."""
        bounds = _split(len(seqs), self.num_microbatches)
        offsets = [0] + torch.cumsum(torch.tensor(lengths), 0).tolist()
        outs, sends = [], []
        for a, b in bounds:
            ctx = AttentionContext.build(self.kv, [s.slot for s in seqs[a:b]], starts[a:b], lengths[a:b])
            h = self._stage_input(ids[offsets[a]:offsets[b]], offsets[b] - offsets[a])
            h = self._run_layers(h, ctx)
            if self.is_last:
                last = torch.cumsum(torch.tensor(lengths[a:b], device=self.device), 0) - 1
                outs.append(self.model.lm_head(self.model.model.norm(h[:, last]))[0].float())
            else:
                sends.append(dist.isend(h.contiguous(), self.peers[self.stage + 1]))
        for work in sends:
            work.wait()
        return torch.cat(outs) if self.is_last else None

    def _stage_input(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Stage 0 embeds the tokens; later stages receive ``(1, N, D)`` hidden states."""
        if self.is_first:
            return self.model.model.embed_tokens(ids[None])
        h = torch.empty(1, num_tokens, self.model.config.hidden_size, device=self.device,
                        dtype=self.kv.spec.dtype)
        dist.recv(h, self.peers[self.stage - 1])
        return h

    def _run_layers(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        pos = ctx.positions[None]
        emb = self.model.model.rotary_emb(h, pos)
        for i in self.layer_ids:
            h = self.model.model.layers[i](h, position_embeddings=emb, position_ids=pos, attn_context=ctx)
        return h

    def _select(self, seqs, logits) -> torch.Tensor:
        """The last stage samples; the tokens are broadcast along the pp axis. The other stages
        advance their generators by the same draws, so every rank's generators stay in step (a
        later layout, e.g. Seesaw's decode, may sample on any of them)."""
        params, generators = [s.request.sampling for s in seqs], [s.generator for s in seqs]
        if self.is_last:
            tokens = sample_tokens(logits, params, generators)
        else:
            skip_draws(params, generators, self.vocab_size)
            tokens = torch.empty(len(seqs), dtype=torch.long)
        if self.dims.pp > 1:
            dist.broadcast(tokens, src=self.peers[-1], group=self.pp_group)
        return tokens


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items into at most ``parts`` contiguous, near-equal, non-empty ranges."""
    parts = min(parts, n)
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
