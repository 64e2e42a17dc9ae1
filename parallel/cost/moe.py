"""Parameter counts of a decoder layer's parts, dense or mixture-of-experts (MoE), and what experts
cost on a layout: HF config reading, total vs active parameters, expert weight reads, expert
parallelism and its all-to-all, load imbalance.

Sizes. A MoE layer holds attention and two norms, a router (``hidden x experts``), an optional
shared expert and ``experts`` routed experts (gate, up, down: ``3 x hidden x expert_intermediate``
each); a dense layer an MLP of width ``intermediate`` instead. *Total* parameters count every
expert (what memory holds); *active* parameters per token count the ``experts_per_token`` routed
experts, the shared expert, the router, attention, the dense layers and the embeddings (what a
token's FLOPs scale with).

Weight reads. A step of ``B`` tokens through a MoE layer reads only the experts some token chose.
With each token choosing ``k`` of ``E`` experts uniformly and independently of the other tokens,
an expert is missed by one token with probability ``1 - k/E``, so the expected number of distinct
experts a step touches is ``E * (1 - (1 - k/E)^B)``: ``k`` at ``B = 1``, ``E`` as ``B`` grows
(:func:`distinct_experts`). Expert weight bytes read per step scale with that, not with ``B``.

Expert parallelism (``ParallelConfig.ep``), as the engine runs it (``parallel.model.dims``):

- inside the TP group (``ep`` divides ``tp``): experts over ``ep`` groups of the tp ranks, each
  expert tensor parallel over ``tp / ep``; attention stays TP, every rank holds the group's tokens
  and the one all-reduce TP already pays sums the partial outputs, so no extra communication;
- data-parallel attention (``ep == dp``, ``tp = pp = sp = 1``): each replica attends over its own
  requests, the replicas' experts are one pool, and each MoE layer sends every token to each
  rank holding one of its experts, once, and a summed row back, by all-to-all
  (:func:`all_to_all_bytes_per_token`: about ``2 * hidden * dtype_bytes`` per other rank reached),
  costed as every all-to-all;
- Shift's SP x EP (``shift_ep``, ``ep = sp * tp``; ``parallel.strategies.shift``): whole experts
  over all ``sp * tp`` GPUs, one layout for both modes (no full-TP copy of them, 0 bytes moved at a
  switch). Each GPU dispatches its ``1/ep`` share of the tokens it holds with its peers by
  all-to-all over all ``ep`` GPUs (the same bytes per dispatched token),
  then the outputs are all-gathered over the GPUs holding the same tokens: the
  ``tp`` ranks of its sp shard in SP mode (``tokens / sp`` rows), all ``ep`` in full TP (all
  ``tokens``). This all-gather replaces the FFN's all-reduce; a shared expert, full TP like a
  dense FFN, keeps its own (:func:`ffn_all_reduces`).

Memory: all experts' weights divided over ``ep`` and, inside each expert, ``tp / ep`` (over ``tp``
in all, or ``ep`` with data-parallel attention or Shift); the rest as for dense layers. Load imbalance:
with ``ep > 1`` the busiest rank gets ``expert_skew`` times the mean share of the routed work (at
most all of it), which multiplies the expert time; ``ep = 1`` splits every expert evenly.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING

from reshard.parallel.cost.collectives import all_gather_time, all_to_all_time, roofline_time
from reshard.parallel.cost.profiles import Hardware, ModelShape

if TYPE_CHECKING:
    from reshard.parallel.cost.roofline import ParallelConfig

# HF config keys that mark a Mixture-of-Experts FFN (Mixtral, Qwen2/3-MoE, Llama 4, DeepSeek, DBRX)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


# ---- HF config.json -> MoE fields of a ModelShape ------------------------------------------------
def _sparse_step_layers(cfg: dict) -> tuple[int, ...]:
    """Qwen2/3-MoE: layer ``i`` is sparse unless in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step`` (HF's defaults: 1 and ``[]``)."""
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _qwen_moe(cfg: dict) -> dict:
    """The hub's configs name the experts ``num_experts``; transformers 5 saves them as
    ``num_local_experts`` (its attribute map)."""
    shared = cfg["shared_expert_intermediate_size"] if cfg.get("model_type") == "qwen2_moe" else 0
    return dict(
        experts=cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate=cfg["moe_intermediate_size"],
        shared_intermediate=shared,
        moe_layers=_sparse_step_layers(cfg),
    )


def _mixtral(cfg: dict) -> dict:
    """Every layer sparse; the experts' width is ``intermediate_size``."""
    return dict(
        experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate=cfg["intermediate_size"],
        moe_layers=tuple(range(cfg["num_hidden_layers"])),
    )


def _llama4(cfg: dict) -> dict:
    """``moe_layers``, else every ``interleave_moe_layer_step``-th layer (HF's rule); experts and
    the shared expert of width ``intermediate_size``, dense layers of ``intermediate_size_mlp``."""
    step = cfg.get("interleave_moe_layer_step") or 1
    layers = cfg.get("moe_layers")
    layers = range(step - 1, cfg["num_hidden_layers"], step) if layers is None else layers
    return dict(
        experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate=cfg["intermediate_size"],
        shared_intermediate=cfg["intermediate_size"],
        moe_layers=tuple(sorted(layers)),
        intermediate=cfg["intermediate_size_mlp"],
    )


FAMILIES: MappingProxyType[str, Callable[[dict], dict]] = MappingProxyType(
    {"qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "mixtral": _mixtral, "llama4_text": _llama4}
)


def moe_fields(cfg: dict, *, name: str) -> dict:
    """The :class:`ModelShape` fields of an HF text config's experts (``{}`` for a dense one; an
    ``intermediate`` entry where dense layers have their own width); ``ValueError`` for a MoE family
    this model cannot read, or a config that lacks a key its family needs."""
    experts = ", ".join(f"{k}={cfg[k]}" for k in EXPERT_KEYS if cfg.get(k))
    if not experts:
        return {}
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"config.json of {name!r} is a Mixture-of-Experts model ({experts}); the cost model has MoE "
            f"profiles for model_type in {sorted(FAMILIES)}, and this config's model_type is {family!r}"
        )
    try:
        return FAMILIES[family](cfg)
    except KeyError as e:
        raise ValueError(f"config.json of {name!r} ({family}) lacks {e.args[0]!r}, which its experts need") from None


# ---- sizes -------------------------------------------------------------------------------------------
def attention_params(m: ModelShape) -> int:
    """q, k, v, o and the layer's two norms."""
    return m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 2 * m.hidden


def dense_ffn_params(m: ModelShape) -> int:
    """gate, up and down of a dense layer's MLP."""
    return 3 * m.hidden * m.intermediate


def expert_params(m: ModelShape) -> int:
    """gate, up and down of one routed expert."""
    return 3 * m.hidden * m.expert_intermediate


def shared_ffn_params(m: ModelShape) -> int:
    """What every token of a MoE layer uses besides attention: the router and the shared expert
    (Qwen2-MoE's one-output shared-expert gate, ``hidden`` weights, is left out)."""
    return m.hidden * m.experts + 3 * m.hidden * m.shared_intermediate


def embedding_params(m: ModelShape) -> int:
    """Embedding + LM head (one matrix when tied) + final norm."""
    return m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.hidden


def layer_params(m: ModelShape, *, sparse: bool, active: bool = False) -> int:
    """Parameters of one dense (``sparse=False``) or MoE layer; ``active``: those one token uses."""
    if not sparse:
        return attention_params(m) + dense_ffn_params(m)
    routed = m.experts_per_token if active else m.experts
    return attention_params(m) + shared_ffn_params(m) + routed * expert_params(m)


def model_params(m: ModelShape, *, active: bool = False) -> int:
    """Total parameters (every expert), or the parameters active per token (``active=True``)."""
    sparse = len(m.moe_layers)
    dense = (m.layers - sparse) * layer_params(m, sparse=False)
    return dense + sparse * layer_params(m, sparse=True, active=active) + embedding_params(m)


# ---- experts on a layout -----------------------------------------------------------------------------
def distinct_experts(experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens touch when each picks ``k`` of ``experts``
    uniformly: ``E * (1 - (1 - k/E)^B)`` (``k`` at ``B = 1``, ``E`` as ``B`` grows; 0 at ``B = 0``)."""
    if not 0 < k <= experts:
        raise ValueError(f"experts_per_token ({k}) must be in 1..experts ({experts})")
    return experts * (1 - (1 - k / experts) ** max(tokens, 0.0))


def all_to_all_bytes_per_token(m: ModelShape, ep: int) -> float:
    """Bytes one token sends over the link per MoE layer with an all-to-all dispatch: its hidden
    vector once to each other rank holding one of its ``k`` experts and one summed row back (the
    engine's ``GroupedExperts.dispatched``). With the ``k`` choices uniform over ``ep`` ranks, a
    token reaches ``ep * (1 - (1 - 1/ep)^k)`` distinct ranks in expectation, ``(ep-1)/ep`` of them
    other ranks: ``k`` rows at ``ep`` much larger than ``k``, at most ``ep - 1``."""
    return 2 * m.hidden * m.dtype_bytes * ranks_reached(m.experts_per_token, ep) * (ep - 1) / ep


def ranks_reached(k: int, ep: int) -> float:
    """Expected distinct ranks of ``ep`` that a token's ``k`` uniform expert choices fall on (the
    rows it is dispatched as): ``ep * (1 - (1 - 1/ep)^k)``."""
    return ep * (1 - (1 - 1 / ep) ** k)


def expert_shards(cfg: ParallelConfig) -> int:
    """GPUs one layer's experts are divided over: ``tp`` (``ep`` groups x ``tp / ep`` inside each
    expert), or ``ep`` with data-parallel attention and under Shift (``sp * tp``)."""
    return cfg.ep if cfg.dispatch else cfg.tp


def layer_weight_bytes(m: ModelShape, cfg: ParallelConfig, *, sparse: bool) -> float:
    """Weight bytes of one dense or MoE layer on one GPU (SP replicas hold the whole TP shard, all
    but Shift's experts, which are spread over the ``sp * tp`` GPUs: :func:`expert_shards`)."""
    e = m.dtype_bytes
    if not sparse:
        return layer_params(m, sparse=False) * e / cfg.tp
    rest = (attention_params(m) + shared_ffn_params(m)) * e / cfg.tp
    return rest + m.experts * expert_params(m) * e / expert_shards(cfg)


def skew_factor(m: ModelShape, cfg: ParallelConfig) -> float:
    """The busiest rank's expert work over the mean: ``expert_skew`` (at most ``ep``: all of it)
    with ``ep > 1``, 1 when every expert is split over all of its GPUs."""
    return min(m.expert_skew, cfg.ep) if cfg.ep > 1 else 1.0


def expert_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, tokens: float) -> float:
    """Seconds of one MoE layer's routed experts on the busiest GPU of a replica stepping ``tokens``
    tokens: the roofline of its FLOPs (``2 * k * expert_params`` per token) and bytes (the distinct
    experts the step touches, :func:`distinct_experts`, plus the rows in and out), times the skew,
    plus the tokens' moves (:func:`dispatch_time`). With data-parallel attention the ``dp``
    replicas step together (their tokens share the experts); under Shift every GPU's experts
    serve the whole step's tokens, ``1/ep`` of the routed rows each."""
    if cfg.dispatch:
        rows, split, etp = tokens * cfg.dp, cfg.ep, 1  # every replica's tokens over the expert pool
    else:
        rows, split, etp = tokens, cfg.tp, cfg.tp // cfg.ep  # the tp group's rows on every GPU
    k, e = m.experts_per_token, m.dtype_bytes
    flops = 2 * k * expert_params(m) * rows / split
    weights = distinct_experts(m.experts, k, rows) * expert_params(m) * e / split
    acts = rows * k / cfg.ep * (2 * m.hidden + 3 * m.expert_intermediate / etp) * e
    compute = skew_factor(m, cfg) * roofline_time(hw, flops, weights + acts)
    return compute + dispatch_time(m, hw, cfg, tokens)


def dispatch_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, tokens: float) -> float:
    """Seconds of one MoE layer's token moves for a replica step of ``tokens`` tokens: the dispatch
    and combine all-to-alls over ``ep`` GPUs (each GPU sends its own tokens with data-parallel
    attention, its ``1/ep`` share of the step under Shift) and, under Shift, the all-gather of the
    outputs over the ``tp`` GPUs holding the same ``tokens / sp`` rows (all of them in full TP);
    0 inside the tp group (TP's all-reduce sums the experts' partial outputs)."""
    if not cfg.dispatch:
        return 0.0
    e, rows = m.dtype_bytes, ranks_reached(m.experts_per_token, cfg.ep)
    sent = tokens / cfg.ep if cfg.shift_ep else tokens  # tokens this GPU dispatches
    a2a = 2 * all_to_all_time(hw, sent * rows * m.hidden * e, cfg.ep, cfg.spans["ep"][1])  # dispatch + combine
    return a2a + (all_gather_time(hw, tokens / cfg.sp * m.hidden * e, cfg.tp) if cfg.shift_ep else 0.0)


def ffn_all_reduces(m: ModelShape, cfg: ParallelConfig, *, sparse: bool) -> int:
    """TP all-reduces of a layer's FFN: 1 (a dense MLP's, or the one that sums a MoE layer's
    experts with its shared expert in the tp group); under Shift a MoE layer's routed experts come
    back by all-gather (:func:`dispatch_time`), so only a shared expert's output is all-reduced."""
    return int(m.shared_intermediate > 0) if sparse and cfg.shift_ep else 1


def ep_infeasible_reason(m: ModelShape, cfg: ParallelConfig) -> str | None:
    """Why ``cfg``'s expert parallelism cannot hold ``m`` (``None`` when it can); Ulysses SP runs a
    MoE model only as Shift's SP x EP (``shift_ep``), as the engine does."""
    if m.moe and cfg.sp > 1 and not cfg.shift_ep:
        return f"sp ({cfg.sp}) on MoE model {m.name!r} runs as SP x EP: experts over all sp*tp GPUs (shift_ep)"
    if cfg.ep == 1:
        return None
    if not m.moe:
        return f"ep ({cfg.ep}) needs experts; model {m.name!r} is dense"
    if m.experts % cfg.ep:
        return f"experts ({m.experts}) not divisible by ep ({cfg.ep})"
    etp = 1 if cfg.dispatch else cfg.tp // cfg.ep
    if m.expert_intermediate % etp:
        return f"expert_intermediate ({m.expert_intermediate}) not divisible by tp/ep ({etp})"
    return None


def describe(m: ModelShape) -> dict:
    """What the planner reports of a MoE model (``{}`` for a dense one)."""
    if not m.moe:
        return {}
    return {
        "total_params": model_params(m),
        "active_params": model_params(m, active=True),
        "experts": m.experts,
        "experts_per_token": m.experts_per_token,
        "moe_layers": len(m.moe_layers),
        "shared_expert": m.shared_intermediate > 0,
        "expert_skew": m.expert_skew,
    }
