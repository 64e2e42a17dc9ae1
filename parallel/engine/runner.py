"""The one model runner: embed -> layers[i:j] -> norm -> head, with listeners at layer edges.

A runner runs one layout of a model: the layer range of this rank's pipeline stage (activations
to and from the neighbouring stages by P2P, micro-batched), how a step's tokens are split (Ulysses
sequence parallelism), and which weight source the layers use. It owns the KV cache of its layer
range (runners may share one, e.g. Shift's two modes). Outside the runner nothing reaches into
``model.model.*``. The engine hands each step the layout's layer listeners
(:class:`reshard.parallel.engine.events.LayerHooks`, or None: no per-layer work at all).

A step is "these sequences, this many tokens each" (:meth:`ModelRunner.run`), and the runner
has two paths. A batch of decode tokens only runs every slot of the cache (idle slots write the
cache's scratch column), so the cache is read as a view, the step's inputs live in persistent
buffers updated in place, and the shapes never change (a compiled decode step is one graph).
Every other step (whole prompts, prompt chunks, prompt tokens beside decode tokens) is one flat
batch of tokens per micro-batch, each sequence attending over its cached KV plus its new tokens.
Host and device synchronize only when the sampled tokens are read.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reshard.kv import AttentionContext, DecodeInputs, KVCache, KVSpec
from reshard.kv.swap import MicrobatchSwap
from reshard.layers.attention import RopeTables
from reshard.layers.moe import feed_forward
from reshard.layers.weights import use_weights
from reshard.mesh import cached_group
from reshard.parallel.engine.channel import GroupLayout
from reshard.parallel.engine.compiled import CompiledBody
from reshard.parallel.engine.config import EngineConfig
from reshard.parallel.engine.events import LayerHooks
from reshard.parallel.engine.request import Sequence, batch_kind
from reshard.parallel.engine.splits import StageLink, TokenSplit, split_ranges
from reshard.parallel.model.dims import ParallelDims, rank_grid
from reshard.parallel.model.info import parallel_info
from reshard.parallel.model.layouts import stage_of_layer

REPLICAS = ("lockstep", "groups")
KV_LEN_BUCKET = 128  # a compiled decode step attends over a multiple of this many positions


@dataclass(frozen=True)
class Replica:
    """This rank's data-parallel replica in a runner's layout."""

    size: int = 1
    rank: int = 0


def replica_groups(dims: ParallelDims, replica: int) -> tuple[dist.ProcessGroup, GroupLayout]:
    """The process group and :class:`GroupLayout` of data-parallel ``replica`` of ``dims`` as an
    engine group (every replica's group is created on every rank, in order: collective)."""
    grid = rank_grid(dims)
    groups = [cached_group(grid[r], purpose="engine-group") for r in range(dims.dp)]
    ranks = tuple(grid[replica].flatten().tolist())
    layout = GroupLayout(replica, dims.dp, ranks, channel=f"groups-{dims.ranks[0]}", job=dims.group())
    return groups[replica], layout


class ModelRunner:
    """Runs steps of ``model`` (an HF causal LM of our layers) in the layout of ``dims``.

    Args:
        config: what the runner takes from :class:`EngineConfig`: ``max_batch_size`` slots of
            ``max_seq_len`` positions per replica, ``num_microbatches`` (default: one per
            pipeline stage), ``compile`` (the decode step's body, one static graph;
            :meth:`EngineConfig.compiles`: by default on CUDA; a step with layer listeners runs eagerly),
            ``kv_block_size``/``kv_tokens`` (a paged KV cache shared by the slots; default:
            contiguous slots), ``kv_swap`` (DejaVu's micro-batch swapping: every slot's KV lives
            in host memory and the device holds two micro-batches' worth; micro-batch ``i + 1``
            is swapped in, and ``i - 1``'s new entries out, while ``i`` computes) and
            ``replicas`` (``"groups"``: each data-parallel replica is an engine group of its own,
            with its own loop, agreement over its ranks only and requests from the router,
            :attr:`engine_group`; ``"lockstep"``: the replicas share every step, the policy
            splits it over them).
        dims: the model's layout (default: its ``parallel_info.dims``, set by ``parallelize``): dp
            replicas split the sequences, ``pp > 1`` makes this a pipeline stage.
        kv: a cache to share with another runner of the same model (default: a new one; the
            config's KV-cache keys then do not apply).
        split: Ulysses token split (Shift's SP mode); layers get ``sequence_parallel=True``.
        weights: the weight source selected for every forward (``None``: own parameters).
        every_slot: decode every slot of the cache (not only the span running sequences occupy),
            where the forward exchanges fixed-size blocks of rows between replicas (SiDP's CaS).
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        *,
        dims: ParallelDims | None = None,
        kv: KVCache | None = None,
        split: TokenSplit | None = None,
        weights: str | None = None,
        every_slot: bool = False,
    ) -> None:
        config = config if config is not None else EngineConfig()
        kv_block_size = config.kv_block_size
        self.model, self.dims = model, dims if dims is not None else parallel_info(model).dims
        self.max_batch_size = _positive("max_batch_size", config.max_batch_size)
        self.max_seq_len = _positive("max_seq_len", config.seq_len(model.config))
        self.num_microbatches = _positive("num_microbatches", config.num_microbatches or self.dims.pp)

        coord = self.dims.world_mesh().get_coordinate()  # (dp, pp, sp, tp)
        if coord is None:
            raise ValueError(
                f"rank {dist.get_rank()} is not one of the layout's ranks {self.dims.ranks}; "
                f"only those ranks run its engine"
            )
        self.group = self.dims.group()  # the layout's ranks agree on each step's tokens
        self.replica = Replica(self.dims.dp, coord[0])
        self.engine_group = None  # lockstep: the layout is one group
        if config.replicas == "groups" and self.dims.dp > 1:
            self.group, self.engine_group = replica_groups(self.dims, coord[0])
            self.replica = Replica()

        self.layer_ids = self._stage_layers(coord[1])
        self.layers = [model.model.layers[i] for i in self.layer_ids]
        self.device = next(self.layers[0].parameters()).to_local().device
        self.link = self._stage_link(coord) if self.dims.pp > 1 else None
        if split is not None and self.link is not None:
            raise ValueError("a token split (sequence parallelism) cannot be combined with pipeline stages")
        self.split = split
        self.weights = weights

        self.compiled = config.compiles(self.device.type, self.num_microbatches)
        self.every_slot = self.compiled or every_slot  # (compiled: fixed shapes)
        self.slots_asked = every_slot
        self.is_source = coord[1] == self.dims.pp - 1 and coord[2] == 0 and coord[3] == 0

        kv_tokens = config.paged_tokens(self.max_seq_len)
        if config.kv_swap and kv is not None:
            raise ValueError(
                "kv_swap needs a KV cache of the runner's own; this one shares its cache with another "
                "layout (Shift's modes, SiDP's replicas)"
            )
        self.kv = kv
        if kv is None:
            self.kv = KVCache(self._kv_spec(kv_block_size, kv_tokens), device=self.device)
        self.swap = self._micro_batch_swap(kv_block_size) if config.kv_swap else None

        self._attach_layers()
        self.decode_inputs = DecodeInputs(self.swap.host if self.swap else self.kv, self.device)
        self._decode_body = self._body
        if self.compiled:  # (a replay's output is overwritten by the next: kept where it outlives it)
            kept = self.num_microbatches > 1 or not self.has_logits  # (a later micro-batch; an async send)
            self._decode_body = CompiledBody(self._body, self.device, self._kv_tensors, clone=kept)
        self.compiled_body = self._decode_body
        self.busy_seconds = 0.0  # wall time in this stage's forward bodies (not in receives or sends)

    def _micro_batch_swap(self, block_size: int | None) -> MicrobatchSwap:
        """Host KV for every slot; the device cache shrinks to two micro-batches of slots."""
        if self.num_microbatches < 2 or block_size is not None or self.compiled:
            raise ValueError(
                f"kv_swap needs num_microbatches >= 2 (got {self.num_microbatches}), a contiguous "
                f"cache (kv_block_size {block_size}) and eager decode (compile {self.compiled})"
            )

        per = -(-self.max_batch_size // self.num_microbatches)
        host = self.kv.spec
        self.kv = KVCache(dataclasses.replace(host, num_slots=2 * per), device=self.device)
        return MicrobatchSwap(KVCache(host, device="cpu"), self.kv, per)

    @property
    def compile_seconds(self) -> float:
        """Wall time of the decode calls that compiled a graph (0 when eager)."""
        return self.compiled_body.seconds if isinstance(self.compiled_body, CompiledBody) else 0.0

    def run_eagerly(self) -> None:
        """Decode eagerly from now on (an engine whose memory moved: its graphs would re-record)."""
        self.compiled, self.every_slot, self._decode_body = False, self.slots_asked, self._body

    def _kv_tensors(self) -> tuple[torch.Tensor, ...]:
        """The cache's K and V tensors, which a step writes in place."""
        return (*self.kv.k, *self.kv.v)

    # ---- layout ---------------------------------------------------------------------------------
    def _stage_layers(self, stage: int) -> list[int]:
        n = len(self.model.model.layers)
        return [i for i in range(n) if stage_of_layer(i, n, self.dims.pp, self.dims.stages) == stage]

    def _stage_link(self, coord: list[int]) -> StageLink:
        grid = rank_grid(self.dims)
        peers = [int(grid[coord[0], p, coord[2], coord[3]]) for p in range(self.dims.pp)]
        dtype = self.model.model.embed_tokens.weight.dtype
        return StageLink(coord[1], peers, self.model.config.hidden_size, dtype, self.device)

    def _kv_spec(self, block_size: int | None, tokens: int | None) -> KVSpec:
        if block_size is not None and not 0 < block_size <= tokens:
            raise ValueError(f"kv_block_size ({block_size}) must be in 1..kv_tokens ({tokens})")
        attn = self.layers[0].self_attn
        return KVSpec(
            num_layers=len(self.layer_ids),
            num_slots=self.max_batch_size,
            num_heads=attn.local_kv_heads,
            max_seq_len=self.max_seq_len,
            head_dim=attn.head_dim,
            dtype=self.model.model.embed_tokens.weight.dtype,
            head_start=attn.kv_head_range[0],
            first_layer=self.layer_ids[0],
            block_size=block_size,
            num_blocks=None if tokens is None else tokens // block_size,
        )

    def _attach_layers(self) -> None:
        """Every attention layer of the range checks the cache holds the KV it reads and writes."""
        for i, layer in zip(self.layer_ids, self.layers):
            self.kv.attach(layer.self_attn.kv_layout, f"model.layers.{i}.self_attn")

    @property
    def mixes(self) -> bool:
        """Whether a step may mix prompt tokens and decode tokens (:meth:`_mixed`): always. A
        Ulysses token split cuts the step's flat batch; pipeline stages pass it on, and micro-batch
        swapping brings it in, one micro-batch slot range at a time (an in-flight step is one
        range)."""
        return True

    @property
    def has_logits(self) -> bool:
        """Whether this rank computes logits (the last pipeline stage)."""
        return self.link is None or self.link.is_last

    # ---- steps ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        seqs: list[Sequence],
        num_tokens: list[int],
        layers: LayerHooks | None = None,
        microbatches: int | None = None,
    ) -> torch.Tensor | None:
        """One step of ``seqs`` (this replica's, at least one): sequence ``i`` computes
        ``num_tokens[i]`` tokens at its positions ``num_computed_tokens ..`` (its whole prompt, a
        chunk of it, or its last output token); ``layers``: listeners called around every layer of
        this stage; ``microbatches``: how many micro-batches the step's sequences are cut into on a
        pipeline (default ``num_microbatches``; an in-flight step is one). Decode tokens only
        (:func:`batch_kind`) take the persistent-buffer decode step; every other step, whole prompts
        included, is one flat batch per micro-batch (:meth:`_mixed`).

        Returns fp32 logits ``(len(seqs), vocab)`` in ``seqs``' order on the last stage (of each
        sequence's last fed token), else None.
        """
        kind = batch_kind(seqs, num_tokens)
        assert kind != "wait", "a runner step has sequences"
        with use_weights(self.weights):
            if kind == "decode":
                return self._decode(seqs, layers)
            return self._mixed(seqs, num_tokens, layers, microbatches or self.num_microbatches)

    @torch.inference_mode()
    def idle(self) -> None:
        """A step this replica has no sequences for: the collectives its layers exchange with the
        other replicas every step (data-parallel attention's MoE dispatch), with nothing to send."""
        with use_weights(self.weights):
            for layer in self.layers:
                if hasattr(feed_forward(layer), "idle"):
                    feed_forward(layer).idle()

    def _mixed(
        self, seqs: list[Sequence], num_tokens: list[int], layers: LayerHooks | None, microbatches: int
    ) -> torch.Tensor | None:
        """Sequence ``i`` feeds its tokens at positions ``c .. c + num_tokens[i] - 1`` (``c``: its
        ``num_computed_tokens``; a whole prompt, a prompt chunk, or its last output token) and
        attends causally over its cached KV and them: one flat ``(sum(num_tokens),)`` batch per
        micro-batch (:meth:`_parts`; pipeline stages overlap them), eager."""
        if self.kv.spec.paged:  # a sequence's first tokens bring its blocks
            for s in seqs:
                if s.num_computed_tokens == 0:
                    assert s.blocks, f"request {s.request.id} reached a paged cache without blocks (policy bug)"
                    self.kv.assign(s.slot, s.blocks)

        parts, ranges = self._parts(seqs, microbatches)
        order = [i for part in parts for i in part]
        assert sorted(order) == list(range(len(seqs))), "a sequence's slot lies outside the cache's (policy bug)"
        rows = [0] * len(parts)  # (swapping: a sequence's cache row less its slot)
        if ranges is not None:
            rows = [self.swap.base(j) - a for j, (a, _) in enumerate(ranges)]
        batches = [
            self._mixed_batch([seqs[i] for i in part], [num_tokens[i] for i in part], row)
            for part, row in zip(parts, rows)
        ]

        edges = None
        if ranges is not None:  # each micro-batch's slots come in, what it wrote goes home
            written = [[(seqs[i].slot, seqs[i].num_computed_tokens, num_tokens[i]) for i in part] for part in parts]
            edges = self.swap.mixed(ranges, written)
        out = self._stages(batches, self._body, edges, layers)

        if out is None or order == sorted(order):
            return out
        back = sorted(range(len(order)), key=order.__getitem__)  # seqs' order, from the parts'
        return out[torch.tensor(back, device=out.device)]

    def _parts(self, seqs: list[Sequence], microbatches: int) -> tuple[list[list[int]], list | None]:
        """A step's micro-batches as indices into ``seqs``, in slot order, and (swapping) the host
        slot range each one's device region holds, else None. Swapping: one micro-batch per slot
        range the sequences occupy; a pipeline: ``microbatches`` near-equal parts; else one."""
        by_slot = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)

        if self.swap is None:
            k = 1 if self.link is None else microbatches
            return [by_slot[a:b] for a, b in split_ranges(len(seqs), k)], None

        ranges = split_ranges(self.max_batch_size, self.num_microbatches)
        parts = [[i for i in by_slot if a <= seqs[i].slot < b] for a, b in ranges]
        kept = [j for j, part in enumerate(parts) if part]
        return [parts[j] for j in kept], [ranges[j] for j in kept]

    def _mixed_batch(self, seqs: list[Sequence], num_tokens: list[int], row: int = 0) -> tuple:
        """(ids ``(N,)``, context, each sequence's last row) of one flat batch of a mixed step;
        ``row``: a sequence's cache row less its slot (swapping: its micro-batch's device region)."""
        starts = [s.num_computed_tokens for s in seqs]
        fed = [(s.request.prompt_ids + s.output)[c : c + n] for s, c, n in zip(seqs, starts, num_tokens)]
        assert [len(f) for f in fed] == num_tokens, "a count runs past the sequence's tokens (policy bug)"

        ids = torch.tensor([t for f in fed for t in f], device=self.device)  # (N,)
        ctx = AttentionContext.build(self.kv, [s.slot + row for s in seqs], starts, num_tokens)
        ends = list(itertools.accumulate(num_tokens))
        rows = torch.tensor(ends, device=self.device) - 1  # each sequence's last token
        return ids, ctx, rows

    def _decode(self, seqs: list[Sequence], layers: LayerHooks | None) -> torch.Tensor | None:
        """The slots in ``num_microbatches`` ranges (each cut to the slots its running sequences
        span, so a step costs what runs; every slot where :attr:`every_slot`); logits of ``seqs``'
        slots."""
        by_slot = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        slots = [seqs[i].slot for i in by_slot]
        positions = [seqs[i].num_computed_tokens for i in by_slot]
        self.decode_inputs.update(slots, [seqs[i].last_token for i in by_slot], positions)

        kv_len = max(positions) + 1
        if self.compiled:  # a few shapes (graphs), not one per step
            kv_len = min(-(-kv_len // KV_LEN_BUCKET) * KV_LEN_BUCKET, self.kv.spec.max_seq_len + 1)

        batches = []  # keep: the rows of the concatenated logits that are seqs' (by slot)
        keep = []
        ranges = []
        for a, b in split_ranges(self.max_batch_size, self.num_microbatches):
            active = [s - a for s in slots if a <= s < b]
            if active and not self.every_slot and self.swap is None:  # the slots running ones span
                a, b, active = a + active[0], a + active[-1] + 1, [s - active[0] for s in active]
            if active:  # a slot range with no running sequence is skipped on every stage
                offset = sum(len(rows) for _, _, rows in batches)
                batches.append(self._decode_batch(a, b, kv_len, active, len(ranges)))
                keep += [offset + i for i in (active if self.compiled else range(len(active)))]
                ranges.append((a, b))

        edges = None
        if self.swap is not None:
            edges = self.swap.decode(ranges, self.decode_inputs.positions, kv_len)
        out = self._stages(
            [(x, ctx, None if isinstance(rows, range) else rows) for x, ctx, rows in batches],
            self._decode_body if layers is None else self._body,  # (listeners run eagerly: no graph holds them)
            edges,
            layers,
        )
        if out is None:
            return None

        in_order = sorted(range(len(by_slot)), key=by_slot.__getitem__)  # seqs' order, from slot order
        picked = [keep[j] for j in in_order]  # (every row, in seqs' order: the logits as they are)
        return out if picked == list(range(len(out))) else out[torch.tensor(picked, device=out.device)]

    def _decode_batch(self, a: int, b: int, kv_len: int, active: list[int], index: int = 0):
        """(ids, context, rows) of slots ``[a, b)``: every row (a ``range``: no gather) when compiled
        (masks built outside the graph) or every slot runs, else the active rows, padded to a
        GEMM-friendly count for the LM head. With swapping, the slots are read and written in the
        device region of micro-batch ``index``."""
        ctx = self.decode_inputs.context(a, b, kv_len)
        if self.swap is not None:
            base = self.swap.base(index)
            ctx.kv, ctx.slots, ctx.rows = self.kv, slice(base, base + b - a), ctx.rows - a + base

        if self.compiled:
            for window in {layer.self_attn.sliding_window for layer in self.layers}:
                ctx.mask(window)

        if self.compiled or len(active) == b - a:
            return self.decode_inputs.ids[a:b], ctx, range(b - a)
        rows = active + active[-1:] * (_row_bucket(len(active), b - a) - len(active))
        return self.decode_inputs.ids[a:b], ctx, torch.tensor(rows, device=self.device)

    def _stages(
        self, batches: list, body: Callable, edges=None, layers: LayerHooks | None = None
    ) -> torch.Tensor | None:
        """Micro-batches through this stage: receive, run, send on (or collect logits).
        ``edges`` (micro-batch swapping) is told before each micro-batch and after the last;
        ``layers``: the step's layer listeners."""
        outs, sends = [], []

        for i, (ids, ctx, rows) in enumerate(batches):
            x = ids if self.link is None or self.link.is_first else self.link.recv(ids.numel())
            if edges is not None:
                edges.before(i)
            t0 = time.perf_counter()
            out = body(x, ctx, rows, layers)
            self.busy_seconds += time.perf_counter() - t0
            if self.has_logits:
                outs.append(out)
            else:
                sends.append(self.link.send(out))

        if edges is not None:
            edges.finish()
        for work in sends:
            work.wait()
        return torch.cat(outs) if outs else None

    def _body(
        self, x: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor | None, layers: LayerHooks | None = None
    ) -> torch.Tensor:
        """Token ids ``(N,)`` (first stage) or hidden ``(1, N, D)`` -> logits of ``rows`` (last
        stage; all rows when None) or hidden ``(1, N, D)`` for the next stage."""
        m, positions = self.model.model, ctx.positions
        if self.link is None or self.link.is_first:
            h = m.embed_tokens((self.split.local(x) if self.split is not None else x)[None])  # (1, N, D)
        else:
            h = x

        pos = (self.split.local(positions) if self.split is not None else positions)[None]
        h = self._layers(h, RopeTables.of(m.rotary_emb(h, pos)), pos, ctx, layers)
        if not self.has_logits:
            return h

        if self.split is not None:
            h = self.split.gather(h, positions.numel())
        h = h if rows is None else h[:, rows]
        return self.model.lm_head(m.norm(h))[0].float()

    def _layers(
        self, h: torch.Tensor, emb, pos: torch.Tensor, ctx: AttentionContext, hooks: LayerHooks | None
    ) -> torch.Tensor:
        kw = dict(position_embeddings=emb, position_ids=pos, attn_context=ctx, token_positions=pos[0])
        if self.split is not None:
            kw["sequence_parallel"] = True

        if hooks is None:  # the fast path: nothing per layer
            for layer in self.layers:
                h = layer(h, **kw)
            return h

        for i, layer in zip(self.layer_ids, self.layers):
            h = hooks.apply(hooks.before, i, h, ctx)
            h = layer(h, **kw)
            h = hooks.apply(hooks.after, i, h, ctx)
        return h

    @torch.inference_mode()
    def prompt_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor] | None:
        """fp32 logits ``(len(p), vocab)`` at every position of each prompt (slots ``0..``); None
        off the last stage. Overwrites those slots: call it between generations."""
        lengths = [len(p) for p in prompts]
        if self.kv.spec.paged:  # between generations every block is free: consecutive ones
            starts = list(itertools.accumulate((self.kv.spec.blocks_for(n) for n in lengths), initial=0))
            if starts[-1] > self.kv.spec.num_blocks:
                raise ValueError(
                    f"prompts of {sum(lengths)} tokens do not fit the paged cache's {self.kv.spec.capacity_tokens}"
                )
            for slot, (a, b) in enumerate(itertools.pairwise(starts)):
                self.kv.assign(slot, list(range(a, b)))

        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        ctx = AttentionContext.build(self.kv, list(range(len(prompts))), [0] * len(prompts), lengths)
        with use_weights(self.weights):
            out = self._stages([(ids, ctx, torch.arange(len(ids), device=self.device))], self._body)
        return None if out is None else list(torch.split(out, lengths))


def runners_device(runners: Mapping[str, object]) -> torch.device | None:
    """This rank's device: the first of ``runners`` that holds one (None: a rank that runs none
    of the layouts, as DéjàVu's absent side)."""
    return next((r.device for r in runners.values() if r.device is not None), None)


def _row_bucket(n: int, cap: int) -> int:
    """Rows the LM head computes for ``n`` wanted: the next power of two (at most ``cap``).

    GEMM kernels are much slower at some odd row counts (on this machine's MKL a 32000 x 768
    head takes ~28 ms at 3, 7 or 11 rows, ~17 ms at 4, 8, 12 or 16), and bucketed counts are what
    captured CUDA graphs want too.
    """
    return min(1 << (n - 1).bit_length(), max(cap, n))


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
