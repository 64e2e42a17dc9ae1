"""The techniques' own models over the roofline (:mod:`parallel.cost.roofline`): Shift's SP/TP token
threshold, SiDP's WaS/CaS batch threshold ``b*`` and DejaVu's prompt/token split (its appendix D,
with ``Y``, ``t`` and the streaming overhead ``m`` taken from the roofline). Units: seconds, bytes,
tokens (DejaVu's ``Y`` and ``t`` in ms, as the paper gives them).
"""

from __future__ import annotations

from reshard.parallel.cost.profiles import Hardware, ModelShape, Workload
from reshard.parallel.cost.roofline import (
    MEMORY_RESERVE,
    ParallelConfig,
    batch_per_replica,
    check_gpus,
    decode_stage_time,
    infeasible_reason,
    kv_bytes_per_token,
    layer_params,
    prefill_stage_time,
    roofline_time,
    send_time,
    ttft,
)


# ---- Shift: the SP/TP token threshold -----------------------------------------------------------------
def step_time(m: ModelShape, hw: Hardware, cfg: ParallelConfig, tokens: float) -> float:
    """One forward of a ``tokens``-token prompt (all stages in turn): Shift's per-step cost."""
    return ttft(m, hw, cfg, tokens)


def shift_full(base: ParallelConfig) -> ParallelConfig:
    """Shift's full-TP mode over ``base``'s GPUs, the experts of a MoE model where ``base`` holds them."""
    return ParallelConfig(tp=base.gpus, ep=base.ep, shift_ep=base.shift_ep)


def shift_layouts(m: ModelShape, sp: int, num_gpus: int) -> tuple[ParallelConfig, ParallelConfig]:
    """Shift's base ``S{sp}T{n/sp}`` and full TP ``T{n}`` over ``n = num_gpus`` GPUs, as the engine
    runs them: on a MoE model as SP x EP, the experts over all ``n`` GPUs in both modes
    (``S{sp}T{n/sp}E{n}`` and ``T{n}E{n}``, ``shift_ep``)."""
    base = ParallelConfig(sp=sp, tp=num_gpus // sp, ep=num_gpus if m.moe else 1, shift_ep=m.moe)
    return base, shift_full(base)


def shift_base(m: ModelShape, hw: Hardware, num_gpus: int) -> ParallelConfig | None:
    """Shift's base layout (:func:`shift_layouts`): the largest SP degree (x TP for the rest) whose
    weights fit, replicated over SP (a MoE model's experts: spread over all GPUs)."""
    for sp in sorted((2**i for i in range(1, num_gpus.bit_length())), reverse=True):
        cfg = shift_layouts(m, sp, num_gpus)[0]
        if infeasible_reason(m, hw, cfg, 1) is None:
            return cfg
    return None


def shift_threshold(m: ModelShape, hw: Hardware, num_gpus: int, *, limit: int = 1 << 20) -> dict:
    """The smallest token count per step where the SP base beats full TP (``threshold`` None when
    SP never wins below ``limit`` tokens or no SP layout fits)."""
    base, full = shift_base(m, hw, check_gpus(num_gpus)), shift_layouts(m, 1, num_gpus)[1]
    if base is None:
        return {"threshold": None, "base": None, "shift": full.notation, "reason": "no SP layout fits"}

    def sp_wins(n: int) -> bool:
        return step_time(m, hw, base, n) < step_time(m, hw, full, n)

    hi = next((n for n in (2**i for i in range(limit.bit_length())) if sp_wins(n)), None)
    if hi is None:
        return {
            "threshold": None,
            "base": base.notation,
            "shift": full.notation,
            "reason": f"TP wins up to {limit} tokens",
        }
    lo = hi // 2  # sp_wins(lo) is False (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sp_wins(mid) else (mid, hi)
    return {"threshold": hi, "base": base.notation, "shift": full.notation, "reason": None}


# ---- SiDP: b* --------------------------------------------------------------------------------------------
def sidp_times(m: ModelShape, hw: Hardware, replicas: int, batch: float) -> tuple[float, float]:
    """Per-layer FFN seconds ``(WaS, CaS)`` at ``batch`` rows per replica: WaS fetches the layer's
    FFN weights over the link, overlapped with the local GEMM; CaS ships ``2 x b x hidden``
    activation bytes (there and back) and the owner runs one fused GEMM over all replicas' rows."""
    ffn = 3 * m.hidden * m.intermediate
    local = roofline_time(hw, 2 * ffn * batch, ffn * m.dtype_bytes)
    was = max(send_time(hw, ffn * m.dtype_bytes, replicas), local)  # from an owner among all replicas
    ship = 2 * send_time(hw, batch * m.hidden * m.dtype_bytes, replicas)
    cas = ship + roofline_time(hw, 2 * ffn * batch * replicas, ffn * m.dtype_bytes)
    return was, cas


def sidp_threshold(m: ModelShape, hw: Hardware, replicas: int, *, limit: int = 1 << 20) -> float | None:
    """``b*``: the smallest batch per replica where CaS stops beating WaS (``None`` below ``limit``,
    and for a MoE model, whose expert owner pool is not modelled)."""
    if m.moe:
        return None

    def cas_slower(b: int) -> bool:
        was, cas = sidp_times(m, hw, replicas, b)
        return cas >= was

    hi = next((b for b in (2**i for i in range(limit.bit_length())) if cas_slower(b)), None)
    if hi is None:
        return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cas_slower(mid) else (mid, hi)
    return float(hi)


# ---- DejaVu: D_p / D_t -------------------------------------------------------------------------------------
def dejavu_stream_time(m: ModelShape, hw: Hardware, seqs: float, prompt_len: float, stages: int) -> float:
    """Seconds for one of ``stages`` prompt stages to stream its layers' KV of a micro-batch of
    ``seqs`` prompts to the token machines (each stage over its own link, concurrently)."""
    return send_time(hw, kv_bytes_per_token(m, ParallelConfig(pp=stages)) * seqs * prompt_len)


def dejavu_overhead(m: ModelShape, hw: Hardware, seqs: float, prompt_len: float, stages: int, Y: float) -> float:
    """DejaVu's ``m`` from the link, as its section 5.4 defines it (``m = cache transfer time /
    prompt time``, line 598; Table 6: extra time = max(0, transfer - prompt time)): a stage's KV
    stream of a micro-batch against the micro-batch's prompt time ``Y``; at least 1."""
    return max(1.0, dejavu_stream_time(m, hw, seqs, prompt_len, stages) / Y)


def dejavu_plan(m: ModelShape, hw: Hardware, num_gpus: int, w: Workload, *, overhead: float | None = None) -> dict:
    """DejaVu's split of ``num_gpus`` pipeline stages into prompt and token machines, with ``Y`` and
    ``t`` (ms) of one micro-batch on the ``P{num_gpus}`` pipeline from this model, the streaming
    overhead ``m`` from the link (:func:`dejavu_overhead`; ``overhead`` overrides it) and the memory
    limits (2), (3) from its shapes (dropped, and said so, when they cannot be met)."""
    from reshard.parallel.cost.dejavu_planner import plan_disaggregation

    pipe = ParallelConfig(pp=num_gpus)
    if num_gpus < 2 or infeasible_reason(m, hw, pipe, w.input_len + w.output_len):
        return {"D_p": None, "D_t": None, "reason": f"needs a feasible P{num_gpus} pipeline of >= 2 GPUs"}
    micro = max(1, batch_per_replica(m, hw, pipe, w) // num_gpus)
    Y = num_gpus * prefill_stage_time(m, hw, pipe, micro, w.input_len) * 1e3
    t = num_gpus * decode_stage_time(m, hw, pipe, micro, w.input_len + w.output_len / 2) * 1e3
    if overhead is None:
        overhead = dejavu_overhead(m, hw, micro, w.input_len, num_gpus, Y / 1e3)
    kv_layer = 2 * m.kv_heads * m.head_dim * m.dtype_bytes * micro / 1e9  # GB per token per layer
    mem = dict(
        L=m.layers,
        M=hw.memory * (1 - MEMORY_RESERVE) / 1e9,
        W0=layer_params(m) * m.dtype_bytes / 1e9,
        C0=kv_layer * w.input_len,
        K0=kv_layer * w.output_len,
    )
    try:
        plan, note = plan_disaggregation(num_gpus, Y, t, w.output_len, overhead, **mem), None
    except ValueError as e:
        plan, note = plan_disaggregation(num_gpus, Y, t, w.output_len, overhead), f"memory limits dropped: {e}"
    return {**plan.as_dict(), "Y_ms": Y, "t_ms": t, "m": overhead, "micro_batch": micro, "reason": note}
