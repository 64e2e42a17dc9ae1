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
- DP: nothing;
- EP (mixture-of-experts layers, :mod:`parallel.cost.moe`): inside the TP group nothing beyond
  TP's all-reduces; over data-parallel replicas a dispatch and a combine all-to-all per MoE layer;
  Shift's SP x EP, in both modes, the two all-to-alls over all ``sp * tp`` GPUs and an all-gather of
  the outputs over the GPUs that hold the same tokens, in place of the FFN's all-reduce (a shared
  expert, full TP, keeps its all-reduce).

Memory: weights / (TP * PP) (the first/last stage also holds the embedding / LM head) + KV must fit
in ``(1 - MEMORY_RESERVE)`` of a GPU; the KV room decides the batch, the batch the throughput.
Workload throughput (Seesaw's offline setting): a batch that fills the decode layout's KV is
prefilled, then decoded for the mean output length at the mean context; generated tokens / seconds.
A Seesaw pair prefills in layout A a CPU tier's worth of such batches in one run, decodes them in
layout B, and moves the weights A -> B -> A once per tier at the movement core's lower bound
(:mod:`parallel.cost.transitions`); KV moves through the tier, overlapped. Units: s, bytes, tokens.

Notation (Seesaw's): ``D`` data, ``T`` tensor, ``P`` pipeline degree, degrees of 1 omitted, a
single GPU is ``T1``; ``S`` is Ulysses SP (Shift), ``E`` expert parallelism (``T8E4``: experts over
4 groups of the 8 tp ranks; ``D8E8``: over 8 data-parallel replicas; in a Shift row, ``S2T4E8|T8E8``,
over all 8 GPUs in both modes, tokens by all-to-all), ``A->B`` a Seesaw pair (prefill -> decode).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cache

from reshard.parallel.cost import moe
from reshard.parallel.cost.collectives import all_reduce_time, all_to_all_time, roofline_time, send_time
from reshard.parallel.cost.moe import embedding_params
from reshard.parallel.cost.profiles import Hardware, ModelShape, Workload
from reshard.parallel.cost.transitions import transition_bytes as transition_bytes  # re-exported
from reshard.parallel.cost.transitions import transition_time
from reshard.parallel.model.dims import layout_notation

MEMORY_RESERVE = 0.10  # fraction of device memory kept free for activations, workspace, fragmentation
PREFILL_TOKENS = 4096  # assumed tokens per prefill step (vLLM-style chunk), >= one whole prompt
CPU_KV_PER_GPU = 80 * 2**30  # Seesaw section 6.1: "we allocate 80 GiB of CPU memory per GPU" (its KV tier)


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of one layout: ``dp`` replicas of ``pp`` stages of ``sp * tp`` GPUs; ``ep``: the
    experts of MoE layers over ``ep`` groups of the tp ranks, or, with ``tp = pp = sp = 1``, over
    the replicas (data-parallel attention, :attr:`dispatch`); ``shift_ep``: Shift's SP x EP, the
    experts over all ``ep = sp * tp`` GPUs of one replica in both of its modes (the base
    ``S{sp}T{tp}E{ep}`` and full TP ``T{ep}E{ep}``), tokens by all-to-all (:mod:`parallel.cost.moe`)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    shift_ep: bool = False

    def __post_init__(self) -> None:
        if self.shift_ep:
            if self.ep != self.sp * self.tp or self.dp != 1 or self.pp != 1:
                raise ValueError(
                    f"Shift's SP x EP spreads the experts over all sp*tp GPUs of one replica: ep ({self.ep}) "
                    f"must equal sp*tp ({self.sp * self.tp}) with dp and pp 1, in {self}"
                )
        elif self.ep > 1 and self.sp > 1:
            raise ValueError(
                f"sp ({self.sp}) x ep ({self.ep}): with SP the experts span all sp*tp ({self.sp * self.tp}) "
                f"GPUs (Shift's SP x EP: S{self.sp}T{self.tp}E{self.sp * self.tp}, shift_ep=True), in {self}"
            )
        elif self.ep < 1 or (self.ep > 1 and self.tp % self.ep and not self.tp == self.sp == self.pp == 1):
            raise ValueError(
                f"ep ({self.ep}) must divide tp ({self.tp}) (experts in the tp group), or span the "
                f"replicas with tp, pp and sp 1 (data-parallel attention), in {self}"
            )

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def dispatch(self) -> bool:
        """Tokens reach the experts by all-to-all: experts over data-parallel replicas, or Shift's
        SP x EP (:attr:`shift_ep`)."""
        return self.ep > 1 and (self.tp == 1 or self.shift_ep)

    @property
    def spans(self) -> dict[str, tuple[int, int]]:
        """Per kind of traffic, ``(group size, GPUs its aligned block spans)`` on the ascending (dp, pp,
        sp, tp) grid; the experts' all-to-all spans the replicas (:attr:`dispatch`) or one replica."""
        ep_span = self.gpus if self.tp == self.sp == self.pp == 1 else self.sp * self.tp
        return {
            "tp": (self.tp, self.tp),
            "sp": (self.sp, self.sp * self.tp),
            "pp": (self.pp, self.pp * self.sp * self.tp),
            "ep": (self.ep, ep_span),
        }

    @property
    def replica(self) -> ParallelConfig:
        """One data-parallel replica of this layout (a lone request runs on one; with
        :attr:`dispatch` its experts stay spread over ``ep`` GPUs)."""
        return ParallelConfig(tp=self.tp, pp=self.pp, sp=self.sp, ep=self.ep, shift_ep=self.shift_ep)

    @property
    def notation(self) -> str:
        """``D2T2``, ``T4P2``, ``S2T2``, ``T8E4``, ``D8E8``, ``S2T4E8``; ``T1`` for one GPU."""
        ep = f"E{self.ep}" if self.ep > 1 else ""
        return layout_notation(dp=self.dp, sp=self.sp, tp=self.tp, pp=self.pp) + ep


def parse_notation(text: str) -> ParallelConfig:
    """``"D2P4"`` -> ``ParallelConfig(dp=2, pp=4)``, ``"T8E4"`` -> ``ParallelConfig(tp=8, ep=4)``,
    ``"S2T4E8"`` -> Shift's SP x EP base (``shift_ep``); ``ValueError`` naming ``text`` otherwise."""
    if not re.fullmatch(r"([DSTPE]\d+)+", text):
        raise ValueError(f"layout {text!r} is not in Seesaw notation (e.g. D2T2, T4P2, T8E4, T1)")
    degrees = {k: int(v) for k, v in re.findall(r"([DSTPE])(\d+)", text)}
    if len(degrees) != len(re.findall(r"[DSTPE]", text)) or min(degrees.values()) < 1:
        raise ValueError(f"layout {text!r} repeats an axis or has a zero degree")
    get = degrees.get
    shift = get("S", 1) > 1 and get("E", 1) > 1
    cfg = ParallelConfig(dp=get("D", 1), tp=get("T", 1), pp=get("P", 1), sp=get("S", 1), ep=get("E", 1), shift_ep=shift)
    if cfg.dispatch and not shift and cfg.ep != cfg.dp:
        raise ValueError(f"layout {text!r}: experts over the replicas need ep ({cfg.ep}) == dp ({cfg.dp})")
    return cfg


def check_gpus(num_gpus: object) -> int:
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1 or num_gpus & (num_gpus - 1):
        raise ValueError(f"num_gpus must be a power of two >= 1, got {num_gpus!r}")
    return num_gpus


def configs(num_gpus: int, *, experts: bool = False) -> list[ParallelConfig]:
    """Every ``D x T x P`` layout of ``num_gpus`` GPUs (powers of two); with ``experts`` also each
    one's expert-parallel variants (``ep`` of 2..tp inside the tp group, and ``D{n}E{n}``)."""
    n = check_gpus(num_gpus)
    powers = [2**i for i in range(n.bit_length())]
    out = [ParallelConfig(dp=d, tp=t, pp=n // (d * t)) for d in powers for t in powers if n % (d * t) == 0]
    if not experts:
        return out
    ep = [dataclasses.replace(c, ep=e) for c in out for e in powers if 1 < e <= c.tp]
    return out + ep + ([ParallelConfig(dp=n, ep=n)] if n > 1 else [])


# ---- sizes ---------------------------------------------------------------------------------------
def layer_params(m: ModelShape) -> int:
    """Parameters of one decoder layer (q, k, v, o, the FFN and two norms); of a MoE model the
    mean over its layers, every expert counted (:func:`moe.model_params` has total and active)."""
    return (moe.model_params(m) - embedding_params(m)) // m.layers


def model_bytes(m: ModelShape) -> int:
    """All weights (every expert)."""
    return moe.model_params(m) * m.dtype_bytes


@cache
def stage_mix(m: ModelShape, pp: int) -> tuple[tuple[int, int], ...]:
    """``(dense, sparse)`` decoder layers of each of ``pp`` stages (near-equal contiguous blocks,
    as :func:`parallel.model.layouts.stage_of_layer` places them)."""
    from reshard.parallel.model.layouts import stage_of_layer

    mix = [[0, 0] for _ in range(pp)]
    sparse = set(m.moe_layers)
    for layer in range(m.layers):
        mix[stage_of_layer(layer, m.layers, pp)][layer in sparse] += 1
    return tuple(map(tuple, mix))


def kv_heads_per_gpu(m: ModelShape, cfg: ParallelConfig) -> float:
    """KV heads a GPU stores: split over ``tp * sp`` (Shift's KV invariance), replicated past ``kv_heads``."""
    return max(m.kv_heads / (cfg.tp * cfg.sp), 1.0)


def kv_bytes_per_token(m: ModelShape, cfg: ParallelConfig) -> float:
    """KV bytes of one token on one GPU: K and V of its stage's layers and its heads."""
    return 2 * math.ceil(m.layers / cfg.pp) * kv_heads_per_gpu(m, cfg) * m.head_dim * m.dtype_bytes


def weight_bytes_per_gpu(m: ModelShape, cfg: ParallelConfig) -> float:
    """Weights of the largest stage on one GPU (TP-split, experts over :func:`moe.expert_shards`;
    SP replicas hold the whole stage but Shift's experts)."""
    dense, sparse = (moe.layer_weight_bytes(m, cfg, sparse=s) for s in (False, True))
    layers = max(d * dense + s * sparse for d, s in stage_mix(m, cfg.pp))
    ends = embedding_params(m) if cfg.pp == 1 else m.vocab * m.hidden + m.hidden
    return layers + ends * m.dtype_bytes / cfg.tp


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
    if moe.ep_infeasible_reason(m, cfg):
        return moe.ep_infeasible_reason(m, cfg)
    need = weight_bytes_per_gpu(m, cfg)
    if need > hw.memory * (1 - MEMORY_RESERVE):
        return f"weights {need / 1e9:.1f} GB per GPU exceed {(1 - MEMORY_RESERVE) * hw.memory / 1e9:.1f} GB usable"
    if kv_capacity_tokens(m, hw, cfg) < seq_len:
        return f"KV room for {kv_capacity_tokens(m, hw, cfg):.0f} tokens < one sequence ({seq_len:.0f})"
    return None


# ---- one layer, one stage --------------------------------------------------------------------------
def layer_time(
    m: ModelShape,
    hw: Hardware,
    cfg: ParallelConfig,
    *,
    tokens: float,
    attn_flops: float,
    attn_bytes: float,
    sparse: bool = False,
) -> float:
    """Seconds of one decoder layer on one GPU for ``tokens`` tokens of a replica's micro-batch;
    ``attn_flops`` / ``attn_bytes`` are the whole attention's (split here over ``tp * sp``). A MoE
    layer (``sparse``): attention, router and shared expert as a dense layer's linears, plus the
    routed experts (:func:`moe.expert_time`: distinct experts read, skew, all-to-all, all-gather)
    and the FFN's all-reduces as the layout does them (:func:`moe.ffn_all_reduces`)."""
    shards, e = cfg.tp * cfg.sp, m.dtype_bytes
    params = moe.layer_params(m, sparse=sparse) - (m.experts * moe.expert_params(m) if sparse else 0)
    width = m.shared_intermediate if sparse else m.intermediate  # the FFN every token runs
    acts = tokens * (4 * m.hidden + m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 3 * width) * e
    linear = roofline_time(hw, 2 * params * tokens / shards, params * e / cfg.tp + acts / shards)
    attn = roofline_time(hw, attn_flops / shards, attn_bytes / shards)
    reduces = 1 + moe.ffn_all_reduces(m, cfg, sparse=sparse)  # attention's, the FFN's
    comm = reduces * all_reduce_time(hw, tokens / cfg.sp * m.hidden * e, cfg.tp)
    qkv = tokens / cfg.sp * m.head_dim * (m.heads + 2 * m.kv_heads) / cfg.tp * e
    span = cfg.spans["sp"][1]
    comm += all_to_all_time(hw, qkv, cfg.sp, span) + all_to_all_time(
        hw, tokens / cfg.sp * m.head_dim * m.heads / cfg.tp * e, cfg.sp, span
    )
    return linear + attn + comm + (moe.expert_time(m, hw, cfg, tokens) if sparse else 0.0)


def stage_layers_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, **layer: float) -> float:
    """Seconds of the slowest stage's decoder layers (dense and MoE layers as the stage holds
    them, :func:`stage_mix`); ``layer``: :func:`layer_time`'s keywords."""
    dense = layer_time(m, hw, cfg, **layer)
    sparse = layer_time(m, hw, cfg, **layer, sparse=True) if m.moe else 0.0
    return max(d * dense + s * sparse for d, s in stage_mix(m, cfg.pp))


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
    layers = stage_layers_time(m, hw, cfg, tokens=tokens, attn_flops=flops, attn_bytes=qkv_bytes)
    return _stage(m, hw, cfg, layers, tokens, head_rows=seqs)


def decode_stage_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, seqs: float, context: float) -> float:
    """One stage on a decode micro-batch of ``seqs`` sequences at ``context`` tokens (reads the KV)."""
    flops = 4 * seqs * context * m.heads * m.head_dim
    kv_read = 2 * seqs * context * m.kv_heads * m.head_dim * m.dtype_bytes * max(1.0, cfg.tp * cfg.sp / m.kv_heads)
    layers = stage_layers_time(m, hw, cfg, tokens=seqs, attn_flops=flops, attn_bytes=kv_read)
    return _stage(m, hw, cfg, layers, seqs, head_rows=seqs)


def _stage(m: ModelShape, hw: Hardware, cfg: ParallelConfig, layers: float, tokens: float, head_rows: float) -> float:
    """A stage's ``layers`` seconds, the LM head on the last stage (the bottleneck stage), one send
    (over the slowest stage boundary: the stages of a replica span ``pp * sp * tp`` GPUs) and the
    per-step overhead (``hw.step_overhead``: launches and scheduling, paid per micro-batch)."""
    send = send_time(hw, tokens * m.hidden * m.dtype_bytes, cfg.spans["pp"][1]) if cfg.pp > 1 else 0.0
    return layers + head_time(m, hw, cfg, head_rows) + send + hw.step_overhead


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
    not fit (the prefill layout needs room for one prompt: Seesaw keeps the rest in its CPU tier).
    ``max_batch`` caps a static layout's replicas (a serving engine's ``max_num_seqs``: vLLM's
    256 in the papers' baselines); a Seesaw pair decodes with the GPU KV full, its CPU tier feeding
    it (Seesaw section 4.3, "keeping GPU KV cache fully utilized"), so its batch is the decode
    layout's KV room."""
    if infeasible_reason(m, hw, decode, w.input_len + w.output_len) or infeasible_reason(m, hw, prefill, w.input_len):
        return None
    b = batch_per_replica(m, hw, decode, w, batch_cap(prefill, decode, max_batch))
    return _estimate(m, hw, prefill, decode, w, b, decode_time(m, hw, decode, w, b))


def batch_cap(prefill: ParallelConfig, decode: ParallelConfig, max_batch: int | None) -> int | None:
    """``max_batch`` for a static layout (``max_num_seqs``), none for a pair (GPU KV full, fed by its CPU tier)."""
    return max_batch if prefill == decode else None


def decode_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, w: Workload, batch: int) -> float:
    """Seconds for a replica of ``cfg`` to give ``batch`` sequences ``w.output_len`` tokens (mean context)."""
    return w.output_len * decode_step_time(m, hw, cfg, batch, w.input_len + w.output_len / 2)


def _estimate(
    m: ModelShape, hw: Hardware, prefill: ParallelConfig, decode: ParallelConfig, w: Workload, b: int, dec: float
) -> Estimate:
    """:func:`estimate` of a pair whose decode replicas hold ``b`` sequences each, decoded in ``dec``
    seconds; a Seesaw pair prefills a CPU tier's worth in one run (one pipeline fill and drain) and
    moves its weights A -> B -> A once per tier, each batch paying its share (section 4.3)."""
    total = b * decode.dp
    seesaw = prefill != decode and total > 0
    tier = max(total, cpu_tier_sequences(m, w, decode.gpus)) if seesaw else total
    share = total / tier if seesaw else 1.0  # this batch's share of a tier's prefill run and round trip
    pre = prefill_time(m, hw, prefill, tier / prefill.dp, w.input_len) * share
    trip = transition_time(m, hw, prefill, decode) + transition_time(m, hw, decode, prefill) if seesaw else 0.0
    trans = trip * share
    return Estimate(prefill, decode, total, pre, dec, trans, total * w.output_len / (pre + dec + trans))


def cpu_tier_sequences(m: ModelShape, w: Workload, gpus: int) -> int:
    """Sequences between two Seesaw transitions: its tiered KV buffer prefills until the CPU tier
    (:data:`CPU_KV_PER_GPU` per GPU) is full, then decodes them all (section 4.3), at most the job's."""
    per_seq = kv_bytes_per_token(m, ParallelConfig()) * (w.input_len + w.output_len)
    return min(w.requests, math.floor(CPU_KV_PER_GPU * gpus / per_seq))


def phase_throughput(m: ModelShape, hw: Hardware, cfg: ParallelConfig, w: Workload, phase: str) -> float:
    """Prompt (``phase="prefill"``) or generated (``"decode"``) tokens / second of ``cfg`` in that
    phase alone, over a KV-filling batch (0 when it does not fit)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    e, tokens = estimate(m, hw, cfg, cfg, w), {"prefill": w.input_len, "decode": w.output_len}[phase]
    return 0.0 if e is None or e.batch == 0 else e.batch * tokens / getattr(e, f"{phase}_s")


def rank_layouts(
    m: ModelShape, hw: Hardware, num_gpus: int, w: Workload, *, max_batch: int | None = None, change_dp: bool = False
) -> list[Estimate]:
    """Every feasible static layout and Seesaw pair of ``num_gpus`` GPUs, best first. A pair keeps
    its replicas (``dp``), as Seesaw does (section 4.1: "we only dynamically adjust tensor and
    pipeline parallelism"); ``change_dp`` adds the pairs that change ``dp`` (``D2P2->T4``: reshard
    runs them, no paper measured them)."""
    cands = configs(num_gpus, experts=m.moe)
    prefills = [a for a in cands if not infeasible_reason(m, hw, a, w.input_len)]
    decodes = [b for b in cands if not infeasible_reason(m, hw, b, w.input_len + w.output_len)]

    decoded = {}  # (decode layout, cap) -> (batch per replica, decode seconds), each computed once
    out = []
    for a in prefills:
        for b in (d for d in decodes if change_dp or d.dp == a.dp):
            cap = batch_cap(a, b, max_batch)
            if (b, cap) not in decoded:
                n = batch_per_replica(m, hw, b, w, cap)
                decoded[b, cap] = n, decode_time(m, hw, b, w, n)
            batch, seconds = decoded[b, cap]
            if batch > 0:
                out.append(_estimate(m, hw, a, b, w, batch, seconds))
    return sorted(out, key=lambda e: -e.tokens_per_s)
