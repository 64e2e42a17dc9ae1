"""One ranking across techniques: static layouts, Seesaw pairs, Shift, SiDP and DejaVu.

Each row is the offline throughput of one way to serve ``w`` on ``n`` GPUs (a batch that fills the
KV room, prefilled, then decoded for the mean output length; :func:`roofline.estimate`'s setting),
with where the time goes: ``prefill_s``, ``decode_s``, ``transition_s`` (Seesaw's weight moves)
and ``comm_s``, the part of prefill + decode spent in collectives and sends (the same estimate with
free links, subtracted).

- **static / seesaw**: :func:`roofline.rank_layouts` (every D x T x P layout, and every pair that keeps
  ``dp`` as Seesaw does, or any pair with ``change_dp``).
- **shift**: for each Ulysses base ``S{sp}T{n/sp}``, the engine switches per batch to full TP
  ``T{n}`` when that is faster (the token threshold), over one KV cache (Shift's invariance);
  the second, full-TP copy of the weights takes its memory out of the KV room. A MoE model runs
  as SP x EP (:func:`technique_models.shift_layouts`): its routed experts are spread over all
  ``n`` GPUs in one layout both modes use, so the copy leaves them out and a switch moves none of
  them (:func:`transitions.expert_switch_bytes`, in the row's note).
- **sidp**: ``n`` data-parallel replicas with the FFN weights in an owner pool (each GPU holds
  ``1/n`` of every layer's FFN plus a two-layer prefetch buffer); per layer the FFN runs as
  weight-as-a-service or compute-as-a-service, whichever :func:`technique_models.sidp_times` says is faster.
- **dejavu**: prompt / token disaggregation of a ``P{n}`` pipeline (:func:`technique_models.dejavu_plan`):
  the pipeline's throughput scaled by ``I_c / I_dis`` (its baseline over the split's inverse
  throughput); listed only where the split beats the baseline.
"""

from __future__ import annotations

import dataclasses
import math

from reshard.parallel.cost import moe
from reshard.parallel.cost import roofline as cost
from reshard.parallel.cost import technique_models as models
from reshard.parallel.cost.profiles import Hardware, ModelShape, Workload
from reshard.parallel.cost.roofline import ParallelConfig
from reshard.parallel.cost.transitions import expert_switch_bytes


def rank_all(
    m: ModelShape, hw: Hardware, n: int, w: Workload, *, max_batch: int | None = None, change_dp: bool = False
) -> list[dict]:
    """Every feasible row of every technique, best tokens/s first (``change_dp``: :func:`roofline.rank_layouts`'s)."""
    ranked = cost.rank_layouts(m, hw, n, w, max_batch=max_batch, change_dp=change_dp)
    rows = [_static_row(e, m, hw, w, max_batch) for e in ranked]
    rows += shift_rows(m, hw, n, w, max_batch)
    rows += [r for r in (sidp_row(m, hw, n, w, max_batch), dejavu_row(m, hw, n, w)) if r is not None]
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


def _free_links(hw: Hardware) -> Hardware:
    """``hw`` with communication free (infinite bandwidth, no latency)."""
    return dataclasses.replace(hw, link_bw=math.inf, link_latency=0.0, collectives={}, topology=())


def _row(name: str, kind: str, batch: int, prefill: float, decode: float, trans: float, comm: float, w, note=""):
    total = prefill + decode + trans
    return {
        "layout": name,
        "kind": kind,
        "tokens_per_s": batch * w.output_len / total if total > 0 else 0.0,
        "batch": batch,
        "prefill_s": prefill,
        "decode_s": decode,
        "transition_s": trans,
        "comm_s": max(comm, 0.0),
        "note": note,
    }


def _static_row(e: cost.Estimate, m: ModelShape, hw: Hardware, w: Workload, max_batch: int | None) -> dict:
    free = cost.estimate(m, _free_links(hw), e.prefill, e.decode, w, max_batch=e.batch // e.decode.dp or 1)
    comm = e.prefill_s + e.decode_s - (free.prefill_s + free.decode_s) if free is not None else 0.0
    kind = "static" if e.prefill == e.decode else "seesaw"
    return _row(e.name, kind, e.batch, e.prefill_s, e.decode_s, e.transition_s, comm, w)


# ---- Shift --------------------------------------------------------------------------------------------
def shift_rows(m: ModelShape, hw: Hardware, n: int, w: Workload, max_batch: int | None = None) -> list[dict]:
    """One row per Ulysses base ``S{sp}T{n/sp}`` that fits beside its full-TP weight copy."""
    rows, room = [], shift_room(m, hw, n)
    for sp in (2**i for i in range(1, n.bit_length())):
        base, full = models.shift_layouts(m, sp, n)
        if cost.infeasible_reason(m, room, base, w.input_len + w.output_len):
            continue
        times = [_shift_times(m, h, base, full, w, max_batch, room) for h in (hw, _free_links(hw))]
        (b, pre, dec), (_, pre0, dec0) = times
        if b > 0:
            name = f"Shift {base.notation}|{full.notation}"
            rows.append(_row(name, "shift", b, pre, dec, 0.0, pre + dec - pre0 - dec0, w, _shift_note(m, base, full)))
    return rows


def _shift_note(m: ModelShape, base: ParallelConfig, full: ParallelConfig) -> str:
    """What the row counts of memory, and (MoE) the expert bytes a switch moves (the lower bound)."""
    if not m.moe:
        return "second weight copy counted"
    moved = expert_switch_bytes(m, base, full)
    return f"second copy of all but the experts counted; experts over all {base.gpus} GPUs, {moved} bytes at a switch"


def shift_copy_bytes(m: ModelShape, n: int) -> float:
    """Per GPU, Shift's full-TP weight copy over ``n`` GPUs: the full-TP layout's weights less a
    MoE model's routed experts, which both modes share (SP x EP)."""
    full = models.shift_layouts(m, 1, n)[1]
    experts = len(m.moe_layers) * m.experts * moe.expert_params(m) * m.dtype_bytes / moe.expert_shards(full)
    return cost.weight_bytes_per_gpu(m, full) - experts


def shift_room(m: ModelShape, hw: Hardware, n: int) -> Hardware:
    """``hw`` with the memory of Shift's full-TP weight copy over ``n`` GPUs taken out."""
    return dataclasses.replace(hw, memory=hw.memory - shift_copy_bytes(m, n) / (1 - cost.MEMORY_RESERVE))


def _shift_times(m, hw, base, full, w, max_batch, room_hw) -> tuple[int, float, float]:
    """(batch, prefill s, decode s): each step in the faster of the base and full TP."""
    b = cost.batch_per_replica(m, room_hw, base, w, max_batch)
    pre = min(cost.prefill_time(m, hw, c, b, w.input_len) for c in (base, full))
    ctx = w.input_len + w.output_len / 2
    dec = w.output_len * min(cost.decode_step_time(m, hw, c, b, ctx) for c in (base, full))
    return b, pre, dec


# ---- SiDP ---------------------------------------------------------------------------------------------
def sidp_weight_bytes(m: ModelShape, n: int) -> float:
    """Per GPU: attention, norms and the ends whole; ``1/n`` of every layer's FFN (the owner pool);
    two layers' FFN as the prefetch buffer."""
    ffn = 3 * m.hidden * m.intermediate
    rest = m.layers * (cost.layer_params(m) - ffn) + cost.embedding_params(m)
    return (rest + m.layers * ffn / n + 2 * ffn) * m.dtype_bytes


def sidp_row(m: ModelShape, hw: Hardware, n: int, w: Workload, max_batch: int | None = None) -> dict | None:
    """``n`` replicas sharing an FFN owner pool (``None`` on one GPU, when it does not fit, or for a
    MoE model: an owner pool of experts is not modelled)."""
    if n < 2 or m.moe:
        return None
    room = hw.memory * (1 - cost.MEMORY_RESERVE) - sidp_weight_bytes(m, n)
    one = ParallelConfig()
    fits = math.floor(max(room, 0.0) / cost.kv_bytes_per_token(m, one) / (w.input_len + w.output_len))
    b = max(0, min(fits if max_batch is None else min(fits, max_batch), math.ceil(w.requests / n)))
    if b == 0:
        return None
    times = [_sidp_times(m, h, n, b, w) for h in (hw, _free_links(hw))]
    (pre, dec), (pre0, dec0) = times
    return _row(
        f"SiDP D{n}", "sidp", b * n, pre, dec, 0.0, pre + dec - pre0 - dec0, w, "FFN owner pool, WaS/CaS per step"
    )


def _sidp_times(m: ModelShape, hw: Hardware, n: int, b: int, w: Workload) -> tuple[float, float]:
    """(prefill s, decode s) of one replica: attention as one GPU; the FFN by WaS or CaS."""
    attn = dataclasses.replace(m, intermediate=0)  # the layer without its FFN
    one = ParallelConfig()
    chunk = max(1.0, min(b, math.floor(cost.PREFILL_TOKENS / w.input_len)))  # prompts per prefill step
    pre_layer = cost.prefill_stage_time(attn, hw, one, chunk, w.input_len) / m.layers
    pre = math.ceil(b / chunk) * (pre_layer + min(models.sidp_times(m, hw, n, chunk * w.input_len))) * m.layers
    ctx = w.input_len + w.output_len / 2
    dec_layer = cost.decode_stage_time(attn, hw, one, b, ctx) / m.layers + min(models.sidp_times(m, hw, n, b))
    return pre, w.output_len * dec_layer * m.layers


# ---- DejaVu -------------------------------------------------------------------------------------------
def dejavu_row(m: ModelShape, hw: Hardware, n: int, w: Workload) -> dict | None:
    """The prompt / token split of a ``P{n}`` pipeline where it beats the pipeline (else ``None``)."""
    plan = models.dejavu_plan(m, hw, n, w)
    pipe = cost.estimate(m, hw, ParallelConfig(pp=n), ParallelConfig(pp=n), w)
    if plan.get("D_p") is None or pipe is None or pipe.batch == 0 or not plan["plan_pays"]:
        return None
    gain = plan["I_c"] / plan["I_dis"]
    name = f"DejaVu P{plan['D_p']}|P{plan['D_t']}"
    note = f"P{n} x {gain:.2f} (I_c / I_dis); KV streaming inside m={plan['m']:.2f}, not in comm"
    return _row(name, "dejavu", pipe.batch, pipe.prefill_s / gain, pipe.decode_s / gain, 0.0, 0.0, w, note)


# ---- online: latency at an arrival rate ---------------------------------------------------------------
def online_latency(
    m: ModelShape, hw: Hardware, prefill: ParallelConfig, decode: ParallelConfig, w: Workload, rate: float
) -> dict:
    """TTFT and TPOT (s) of requests arriving at ``rate`` per second, spread over the replicas:
    the decode batch ``B`` per replica follows Little's law (``B = rate/dp * output_len * TPOT``),
    each decode step also yields to the prefill work arriving meanwhile (its share ``f`` of the
    time), and a request waits for the prefill queue like an M/M/1 server (``TTFT = t_p / (1 -
    f)``). ``utilization``: the prefill share plus the decode share at full batches; >= 1, the
    layouts cannot keep up (latencies ``inf``)."""
    per_replica = rate / decode.dp
    t_prefill = cost.ttft(m, hw, prefill.replica, w.input_len)
    f = rate / prefill.dp * t_prefill  # fraction of a replica's time spent prefilling
    ctx = w.input_len + w.output_len / 2
    cap = cost.batch_per_replica(m, hw, decode, w)
    full = cost.decode_step_time(m, hw, decode.replica, cap, ctx) if cap else math.inf
    util = f + (per_replica * w.output_len * full / cap if cap else math.inf)  # prefill + decode time shares
    if util >= 1:  # even full decode batches cannot keep up beside the prefill work
        return {"ttft_s": math.inf, "tpot_s": math.inf, "utilization": util}
    batch, tpot = 1.0, math.inf
    for _ in range(50):  # fixed point of Little's law (stable: it converges in a few rounds)
        tpot = cost.decode_step_time(m, hw, decode.replica, batch, ctx) / (1 - f)
        batch = min(float(cap), max(1.0, per_replica * w.output_len * tpot))
    return {"ttft_s": t_prefill / (1 - f), "tpot_s": tpot, "utilization": util}


def with_latency(rows: list[dict], m: ModelShape, hw: Hardware, w: Workload, rate: float) -> list[dict]:
    """``rows`` with ``ttft_s``, ``tpot_s`` and ``utilization`` at ``rate`` requests/s where the
    technique serves online (static layouts; Shift: its base prefills, full TP decodes), ranked by
    mean completion time (``TTFT + output_len * TPOT``); rows that cannot keep up, and the
    offline-only techniques (Seesaw, SiDP, DejaVu: batch-oriented), follow by throughput."""
    out = []
    for r in rows:
        layouts = _online_layouts(r)
        room = shift_room(m, hw, layouts[1].tp) if r["kind"] == "shift" else hw  # its copy's memory
        lat = online_latency(m, room, *layouts, w, rate) if layouts else {"ttft_s": None, "tpot_s": None}
        out.append({**r, **lat})
    return sorted(out, key=lambda r: (_completion(r, w), -r["tokens_per_s"]))


def _online_layouts(row: dict) -> tuple[ParallelConfig, ParallelConfig] | None:
    if row["kind"] == "static":
        cfg = cost.parse_notation(row["layout"])
        return cfg, cfg
    if row["kind"] == "shift":  # "Shift S2T2|T4", "Shift S2T4E8|T8E8"
        base = cost.parse_notation(row["layout"].split()[1].split("|")[0])
        return base, models.shift_full(base)
    return None


def _completion(row: dict, w: Workload) -> float:
    if row.get("ttft_s") is None:
        return math.inf
    return row["ttft_s"] + w.output_len * row["tpot_s"]
