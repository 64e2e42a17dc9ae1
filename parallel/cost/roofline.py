"""An analytic cost model of LLM inference layouts: Seesaw's appendix A roofline, Shift's
communication model (Table 2), SiDP's WaS/CaS threshold ``b*`` and DejaVu's appendix D split.

Per decoder layer and phase, on one GPU of a layout (Seesaw appendix A, Table 3):
``T_layer = max(linear FLOPs / FLOPS, linear bytes / mem_bw) + max(attn FLOPs / FLOPS, attn bytes
/ mem_bw) + T_comm``. Linear bytes are the weights plus the activations read and written; attention
bytes the KV cache read (decode) or Q/K/V written (prefill). Communication:

- TP: 2 all-reduces of the layer's activations per layer, the faster of a ring
  ``2(n-1)/n * bytes / bw + 2(n-1) * lat`` and a tree ``2 * bytes / bw + 2 log2(n) * lat``;
- SP (Ulysses): 2 all-to-alls per layer (fused QKV in, attention output back; Shift's Table 2),
  ``(n-1)/n * bytes / bw + (n-1) * lat``: ``n-1`` pairwise messages, each paying its latency
  (Shift's Fig. 9: SP's TPOT exceeds DP's by ~10 ms over 160 all-to-alls at batch 1);
- PP: one activation send per stage boundary and micro-batch, ``lat + bytes / bw``, plus the
  pipeline fill/drain bubble of prefill;
- DP: nothing.

Memory: weights / (TP * PP) (the first/last stage also holds the embedding / LM head) + KV must fit
in ``(1 - MEMORY_RESERVE)`` of a GPU; the KV room decides the batch, the batch the throughput.
Workload throughput (Seesaw's offline setting): a batch that fills the decode layout's KV is
prefilled, then decoded for the mean output length at the mean context; generated tokens /
seconds. A Seesaw pair prefills in layout A and decodes in layout B on the same GPUs and pays the
weights moved A -> B and B -> A once per such batch: the movement core's lower bound
(:func:`reshard.plan.lower_bound_bytes`) on :class:`reshard.Layout` objects of the model's
parameters, spread over the GPUs' links. KV moves through Seesaw's CPU tier, overlapped (not
charged). Units: seconds, bytes, tokens.

Notation (Seesaw's): ``D`` data, ``T`` tensor, ``P`` pipeline degree, degrees of 1 omitted, a
single GPU is ``T1``; ``S`` is Ulysses SP (Shift), ``A->B`` a Seesaw pair (prefill -> decode).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.parallel.cost.profiles import Hardware, ModelShape, Workload
from reshard.parallel.model.dims import layout_notation

MEMORY_RESERVE = 0.10  # fraction of device memory kept free for activations, workspace, fragmentation
PREFILL_TOKENS = 4096  # assumed tokens per prefill step (vLLM-style chunk), >= one whole prompt
_DTYPES = MappingProxyType({1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32})


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of one layout: ``dp`` replicas of ``pp`` stages of ``sp * tp`` GPUs."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def replica(self) -> ParallelConfig:
        """One data-parallel replica of this layout (a lone request runs on one)."""
        return ParallelConfig(tp=self.tp, pp=self.pp, sp=self.sp)

    @property
    def notation(self) -> str:
        """``D2T2``, ``T4P2``, ``S2T2``; ``T1`` for one GPU."""
        return layout_notation(dp=self.dp, sp=self.sp, tp=self.tp, pp=self.pp)


def parse_notation(text: str) -> ParallelConfig:
    """``"D2P4"`` -> ``ParallelConfig(dp=2, pp=4)``; ``ValueError`` naming ``text`` otherwise."""
    if not re.fullmatch(r"([DSTP]\d+)+", text):
        raise ValueError(f"layout {text!r} is not in Seesaw notation (e.g. D2T2, T4P2, T1)")
    degrees = {k: int(v) for k, v in re.findall(r"([DSTP])(\d+)", text)}
    if len(degrees) != len(re.findall(r"[DSTP]", text)) or min(degrees.values()) < 1:
        raise ValueError(f"layout {text!r} repeats an axis or has a zero degree")
    return ParallelConfig(
        dp=degrees.get("D", 1), tp=degrees.get("T", 1), pp=degrees.get("P", 1), sp=degrees.get("S", 1)
    )


def check_gpus(num_gpus: object) -> int:
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1 or num_gpus & (num_gpus - 1):
        raise ValueError(f"num_gpus must be a power of two >= 1, got {num_gpus!r}")
    return num_gpus


def configs(num_gpus: int) -> list[ParallelConfig]:
    """Every ``D x T x P`` layout of ``num_gpus`` GPUs (powers of two)."""
    n = check_gpus(num_gpus)
    powers = [2**i for i in range(n.bit_length())]
    return [ParallelConfig(dp=d, tp=t, pp=n // (d * t)) for d in powers for t in powers if n % (d * t) == 0]


# ---- sizes ---------------------------------------------------------------------------------------
def layer_params(m: ModelShape) -> int:
    """Parameters of one decoder layer: q, k, v, o, gate, up, down and two norms."""
    attn = m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    return attn + 3 * m.hidden * m.intermediate + 2 * m.hidden


def embedding_params(m: ModelShape) -> int:
    """Embedding + LM head (one matrix when tied) + final norm."""
    return m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.hidden


def model_bytes(m: ModelShape) -> int:
    return (m.layers * layer_params(m) + embedding_params(m)) * m.dtype_bytes


def kv_heads_per_gpu(m: ModelShape, cfg: ParallelConfig) -> float:
    """KV heads a GPU stores: split over ``tp * sp`` (Shift's KV invariance), replicated past ``kv_heads``."""
    return max(m.kv_heads / (cfg.tp * cfg.sp), 1.0)


def kv_bytes_per_token(m: ModelShape, cfg: ParallelConfig) -> float:
    """KV bytes of one token on one GPU: K and V of its stage's layers and its heads."""
    return 2 * math.ceil(m.layers / cfg.pp) * kv_heads_per_gpu(m, cfg) * m.head_dim * m.dtype_bytes


def weight_bytes_per_gpu(m: ModelShape, cfg: ParallelConfig) -> float:
    """Weights of the largest stage on one GPU (TP-split; SP replicas hold the whole stage)."""
    layers = math.ceil(m.layers / cfg.pp) * layer_params(m)
    ends = embedding_params(m) if cfg.pp == 1 else m.vocab * m.hidden + m.hidden
    return (layers + ends) * m.dtype_bytes / cfg.tp


def kv_capacity_tokens(m: ModelShape, hw: Hardware, cfg: ParallelConfig) -> float:
    """Tokens of KV one replica holds (0 when the weights alone do not fit)."""
    free = hw.memory * (1 - MEMORY_RESERVE) - weight_bytes_per_gpu(m, cfg)
    return max(free, 0.0) / kv_bytes_per_token(m, cfg)


def infeasible_reason(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seq_len: float) -> str | None:
    """Why ``cfg`` cannot serve sequences of ``seq_len`` tokens, or ``None`` when it can."""
    if cfg.tp * cfg.sp > m.heads:
        return f"tp*sp ({cfg.tp * cfg.sp}) exceeds the attention heads ({m.heads})"
    if cfg.pp > m.layers:
        return f"pp ({cfg.pp}) exceeds the layers ({m.layers})"
    need = weight_bytes_per_gpu(m, cfg)
    if need > hw.memory * (1 - MEMORY_RESERVE):
        return f"weights {need / 1e9:.1f} GB per GPU exceed {(1 - MEMORY_RESERVE) * hw.memory / 1e9:.1f} GB usable"
    if kv_capacity_tokens(m, hw, cfg) < seq_len:
        return f"KV room for {kv_capacity_tokens(m, hw, cfg):.0f} tokens < one sequence ({seq_len:.0f})"
    return None


# ---- communication ---------------------------------------------------------------------------------
def all_reduce_time(hw: Hardware, nbytes: float, n: int) -> float:
    """All-reduce of ``nbytes`` over ``n`` GPUs: the faster of a ring (``2(n-1)`` latency hops,
    bandwidth-optimal) and a tree / one-shot (``2 log2 n`` hops, the whole message each way), as
    NCCL and vLLM's custom all-reduce pick by message size."""
    if n == 1:
        return 0.0
    lat, bw = hw.comm("all_reduce")
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * lat
    return min(ring, tree)


def all_to_all_time(hw: Hardware, nbytes: float, n: int) -> float:
    """All-to-all of ``nbytes`` per GPU (the ``(n-1)/n`` not kept) over ``n`` GPUs: ``n-1``
    pairwise messages, each paying the link latency."""
    if n == 1:
        return 0.0
    lat, bw = hw.comm("all_to_all")
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def send_time(hw: Hardware, nbytes: float) -> float:
    lat, bw = hw.comm("send")
    return lat + nbytes / bw


# ---- one layer, one stage --------------------------------------------------------------------------
def roofline_time(hw: Hardware, flops: float, nbytes: float) -> float:
    return max(flops / hw.flops, nbytes / hw.mem_bw)


def layer_time(
    m: ModelShape, hw: Hardware, cfg: ParallelConfig, *, tokens: float, attn_flops: float, attn_bytes: float
) -> float:
    """Seconds of one decoder layer on one GPU for ``tokens`` tokens of a replica's micro-batch;
    ``attn_flops`` / ``attn_bytes`` are the whole attention's (split here over ``tp * sp``)."""
    shards, e = cfg.tp * cfg.sp, m.dtype_bytes
    acts = tokens * (4 * m.hidden + m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 3 * m.intermediate) * e
    linear = roofline_time(hw, 2 * layer_params(m) * tokens / shards, layer_params(m) * e / cfg.tp + acts / shards)
    attn = roofline_time(hw, attn_flops / shards, attn_bytes / shards)
    comm = 2 * all_reduce_time(hw, tokens / cfg.sp * m.hidden * e, cfg.tp)
    qkv = tokens / cfg.sp * m.head_dim * (m.heads + 2 * m.kv_heads) / cfg.tp * e
    comm += all_to_all_time(hw, qkv, cfg.sp) + all_to_all_time(
        hw, tokens / cfg.sp * m.head_dim * m.heads / cfg.tp * e, cfg.sp
    )
    return linear + attn + comm


def head_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, rows: float) -> float:
    """The LM head for ``rows`` sampled positions (vocab-split over ``tp``)."""
    params = m.vocab * m.hidden
    return roofline_time(hw, 2 * params * rows / (cfg.tp * cfg.sp), params * m.dtype_bytes / cfg.tp)


def prefill_stage_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, seq_len: float) -> float:
    """One stage on a prefill micro-batch of ``seqs`` prompts of ``seq_len`` tokens (causal attention:
    ``2 * s^2 * heads * head_dim`` FLOPs per sequence; Q, K, V written once)."""
    tokens = seqs * seq_len
    flops = 2 * seqs * seq_len**2 * m.heads * m.head_dim
    qkv_bytes = tokens * m.head_dim * (m.heads + 2 * m.kv_heads) * m.dtype_bytes
    layer = layer_time(m, hw, cfg, tokens=tokens, attn_flops=flops, attn_bytes=qkv_bytes)
    return _stage(m, hw, cfg, layer, tokens, head_rows=seqs)


def decode_stage_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, context: float) -> float:
    """One stage on a decode micro-batch of ``seqs`` sequences at ``context`` tokens (reads the KV)."""
    flops = 4 * seqs * context * m.heads * m.head_dim
    kv_read = 2 * seqs * context * m.kv_heads * m.head_dim * m.dtype_bytes * max(1.0, cfg.tp * cfg.sp / m.kv_heads)
    layer = layer_time(m, hw, cfg, tokens=seqs, attn_flops=flops, attn_bytes=kv_read)
    return _stage(m, hw, cfg, layer, seqs, head_rows=seqs)


def _stage(m: ModelShape, hw: Hardware, cfg: ParallelConfig, layer: float, tokens: float, head_rows: float) -> float:
    """A stage's layers, the LM head on the last stage (the bottleneck stage), one send and the
    per-step overhead (``hw.step_overhead``: launches and scheduling, paid per micro-batch)."""
    send = send_time(hw, tokens * m.hidden * m.dtype_bytes) if cfg.pp > 1 else 0.0
    return math.ceil(m.layers / cfg.pp) * layer + head_time(m, hw, cfg, head_rows) + send + hw.step_overhead


# ---- phases of one replica -------------------------------------------------------------------------
def prefill_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, seq_len: float) -> float:
    """Seconds for one replica to prefill ``seqs`` prompts: micro-batches of at most
    ``PREFILL_TOKENS`` (and at least ``pp`` of them when there are enough prompts) through ``pp``
    stages, plus the ``pp - 1`` fill/drain bubble."""
    per_mb = max(1.0, min(math.ceil(seqs / cfg.pp), math.floor(PREFILL_TOKENS / seq_len)))
    steps = math.ceil(seqs / per_mb)
    return (steps + cfg.pp - 1) * prefill_stage_time(m, hw, cfg, per_mb, seq_len)


def decode_step_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, context: float) -> float:
    """Seconds for one replica to give each of ``seqs`` sequences one token: ``pp`` micro-batches
    of ``seqs / pp`` in flight, each stage busy with all of them (steady state, no bubble)."""
    micro = max(seqs / cfg.pp, 1e-9)
    return cfg.pp * decode_stage_time(m, hw, cfg, micro, context)


def ttft(m: ModelShape, hw: Hardware, cfg: ParallelConfig, input_len: float) -> float:
    """Time to first token of one lone request (all stages in turn)."""
    return cfg.pp * prefill_stage_time(m, hw, cfg, 1, input_len)


def tpot(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, context: float) -> float:
    """Per-token latency of ``seqs`` concurrent sequences on one replica (all stages in turn)."""
    return cfg.pp * decode_stage_time(m, hw, cfg, seqs / cfg.pp, context)


# ---- workload throughput -----------------------------------------------------------------------------
def batch_per_replica(
    m: ModelShape, hw: Hardware, cfg: ParallelConfig, w: Workload, max_batch: int | None = None
) -> int:
    """Sequences of ``input_len + output_len`` tokens one decode replica holds (KV-bound, or
    ``max_batch``), at most its share of the requests."""
    fits = math.floor(kv_capacity_tokens(m, hw, cfg) / (w.input_len + w.output_len))
    cap = fits if max_batch is None else min(fits, max_batch)
    return max(0, min(cap, math.ceil(w.requests / cfg.dp)))


@dataclass(frozen=True)
class Estimate:
    """A prefill -> decode pair (equal for a static layout) and its predicted seconds per batch."""

    prefill: ParallelConfig
    decode: ParallelConfig
    batch: int  # sequences in flight over all replicas of the decode layout
    prefill_s: float
    decode_s: float
    transition_s: float  # weights moved A -> B and B -> A, once per batch
    tokens_per_s: float  # generated tokens / second

    @property
    def name(self) -> str:
        a, b = self.prefill.notation, self.decode.notation
        return a if a == b else f"{a}->{b}"

    def as_dict(self) -> dict:
        return {
            "layout": self.name,
            "kind": "static" if self.prefill == self.decode else "seesaw",
            "tokens_per_s": self.tokens_per_s,
            "batch": self.batch,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "transition_s": self.transition_s,
        }


def estimate(
    m: ModelShape,
    hw: Hardware,
    prefill: ParallelConfig,
    decode: ParallelConfig,
    w: Workload,
    *,
    max_batch: int | None = None,
) -> Estimate | None:
    """Throughput of prefilling in ``prefill`` and decoding in ``decode``; ``None`` if either does
    not fit (the prefill layout needs room for one prompt: Seesaw keeps the rest in its CPU tier)."""
    if infeasible_reason(m, hw, decode, w.input_len + w.output_len) or infeasible_reason(m, hw, prefill, w.input_len):
        return None
    b = batch_per_replica(m, hw, decode, w, max_batch)
    total = b * decode.dp
    pre = prefill_time(m, hw, prefill, total / prefill.dp, w.input_len)
    dec = w.output_len * decode_step_time(m, hw, decode, b, w.input_len + w.output_len / 2)
    trans = (
        0.0 if prefill == decode else transition_time(m, hw, prefill, decode) + transition_time(m, hw, decode, prefill)
    )
    return Estimate(prefill, decode, total, pre, dec, trans, total * w.output_len / (pre + dec + trans))


def prefill_throughput(m: ModelShape, hw: Hardware, cfg: ParallelConfig, w: Workload) -> float:
    """Prompt tokens / second of ``cfg`` over a KV-filling batch (0 when it does not fit)."""
    e = estimate(m, hw, cfg, cfg, w)
    return 0.0 if e is None or e.batch == 0 else e.batch * w.input_len / e.prefill_s


def decode_throughput(m: ModelShape, hw: Hardware, cfg: ParallelConfig, w: Workload) -> float:
    """Generated tokens / second of ``cfg`` in the decode phase alone (0 when it does not fit)."""
    e = estimate(m, hw, cfg, cfg, w)
    return 0.0 if e is None or e.batch == 0 else e.batch * w.output_len / e.decode_s


# ---- Seesaw transitions through the movement core -----------------------------------------------------
def _param_kinds(m: ModelShape) -> list[tuple[tuple[int, ...], int | None, int]]:
    """(shape, TP shard dim or None, count) of each decoder-layer parameter kind (TP as layers/ shards it)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return [
        ((q, m.hidden), 0, 1),
        ((kv, m.hidden), 0, 2),
        ((m.hidden, q), 1, 1),
        ((m.intermediate, m.hidden), 0, 2),
        ((m.hidden, m.intermediate), 1, 1),
        ((m.hidden,), None, 2),
    ]


def _layout(cfg: ParallelConfig, stage: int, shape: tuple[int, ...], dim: int | None, dtype: torch.dtype):
    """The :class:`reshard.Layout` of a parameter of ``stage`` under ``cfg``: a (dp, tp) mesh of
    the ascending (dp, pp, tp) grid, replicated over dp, ``Shard(dim)`` (or replicated) over tp."""
    from reshard import Layout

    grid = torch.arange(cfg.gpus).view(cfg.dp, cfg.pp, cfg.tp)[:, stage, :].tolist()  # (dp, tp) ranks
    placements = (Replicate(), Shard(dim) if dim is not None else Replicate())
    return Layout(tuple(tuple(r) for r in grid), placements, shape, dtype)


@cache
def _lower_bound(
    a: ParallelConfig, sa: int, b: ParallelConfig, sb: int, shape: tuple[int, ...], dim: int | None, dtype: torch.dtype
) -> int:
    from reshard.plan import lower_bound_bytes

    return lower_bound_bytes(_layout(a, sa, shape, dim, dtype), _layout(b, sb, shape, dim, dtype))


@cache
def transition_bytes(m: ModelShape, a: ParallelConfig, b: ParallelConfig) -> int:
    """Bytes the movement core must move to re-shard the weights from ``a`` to ``b`` (its lower
    bound, summed over receiving GPUs); layers grouped by their (stage in a, stage in b)."""
    from reshard.parallel.model.layouts import stage_of_layer

    if a.gpus != b.gpus or a.sp > 1 or b.sp > 1:
        raise ValueError(
            f"Seesaw transitions need two D/T/P layouts of the same GPUs, got {a.notation} -> {b.notation}"
        )
    dtype = _DTYPES[m.dtype_bytes]
    groups: dict[tuple[int, int], int] = {}
    for layer in range(m.layers):
        key = (stage_of_layer(layer, m.layers, a.pp), stage_of_layer(layer, m.layers, b.pp))
        groups[key] = groups.get(key, 0) + 1
    total = sum(
        n * count * _lower_bound(a, sa, b, sb, shape, dim, dtype)
        for (sa, sb), n in groups.items()
        for shape, dim, count in _param_kinds(m)
    )
    ends = [(0, 0), (a.pp - 1, b.pp - 1)]  # embedding with the first stage, LM head with the last
    return total + sum(_lower_bound(a, sa, b, sb, (m.vocab, m.hidden), 0, dtype) for sa, sb in ends)


def transition_time(m: ModelShape, hw: Hardware, a: ParallelConfig, b: ParallelConfig) -> float:
    """Seconds to move :func:`transition_bytes`, spread evenly over every GPU's link (assumed)."""
    nbytes = transition_bytes(m, a, b)
    return 0.0 if nbytes == 0 else send_time(hw, nbytes / a.gpus)


def rank_layouts(
    m: ModelShape, hw: Hardware, num_gpus: int, w: Workload, *, max_batch: int | None = None
) -> list[Estimate]:
    """Every feasible static layout and Seesaw pair of ``num_gpus`` GPUs, best first."""
    cands = configs(num_gpus)
    out = [estimate(m, hw, a, b, w, max_batch=max_batch) for a in cands for b in cands]
    return sorted((e for e in out if e is not None and e.batch > 0), key=lambda e: -e.tokens_per_s)
