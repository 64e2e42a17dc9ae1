"""KV streaming benchmark (issue 12): token streaming overhead, coalesced vs per-chunk copies, paged vs
contiguous decode, prompt streaming overlapped with prefill.

Run from the repo root:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/kv_streaming.py
    (options: --sections stream,copies,paged,prefill  --repeats 5  --small for a quick check;
     model: --hidden 512 --intermediate 1408 --layers 8 --heads 8 --kv-heads 8 --vocab 16000)
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 1 bench/kv_streaming.py --sections copies,paged

Model: a seeded Llama checkpoint built once with ``parallel.tiny_models.cached_checkpoint`` (fp32;
default hidden 512, MLP 1408, 8 layers, 8 query / 8 KV heads, vocab 16000: 41.7M parameters),
``parallelize(path)`` (TP = world size). Workload (sections ``stream`` and ``paged``): ``--batch``
seeded random prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens each, no stop
tokens, ``Engine(max_batch_size=batch, max_seq_len=prompt + new)`` (one prefill step, then
``new - 1`` decode steps at a full batch). Decode s/step = ``engine.stats.decode_seconds /
decode_steps`` of one ``generate`` (the loop's per-step time, which includes the runner's
``step_end`` listeners), max over ranks. Every section interleaves its variants per repetition
(round-robin, after one warm-up each), medians.

Sections:

1. ``stream`` (2 ranks, TP2): the same decode workload with no streaming vs ``TokenStream`` (a
   ``step_end`` listener: each step's new KV entries leave while the next step runs, waited for one
   step later) to (a) ``cpu``: a CPU mirror on the same rank (``LocalTransport``), (b) ``peer``:
   the other rank mirrors this rank's heads (P2P on the background group), (c) ``file``: a
   ``FileTransport`` in a temp dir (written and read back into the mirror). The mirrors are
   checked bitwise against the source caches after the warm-up.
2. ``copies``: a prompt's KV (``--copy-seqs`` sequences x ``--copy-tokens`` tokens, every layer of
   this rank's TP heads, paged cache of ``--copy-block`` positions with shuffled block ids)
   moved as ``scatter`` (one packed buffer per peer) + one flush/fetch vs ``chunks`` (one tensor
   per (layer, sequence, K/V) chunk) + one flush/fetch per chunk; also one decode step's entries
   (the same sequences, 1 token each, what ``TokenStream`` sends per step). Transports: ``local``
   (rank 0 alone: flush registers, fetch copies), ``p2p`` and ``shm`` (2 ranks, each sends its
   heads to the other and receives the other's). Time = pack + flush + fetch into fresh receive
   buffers (unpacking not included), barrier before, max over ranks. Bytes equal (asserted) and
   calls are the transports' ``stats``.
3. ``paged``: the decode workload with a contiguous cache vs paged caches of ``--block-sizes``
   with the same token capacity (``kv_tokens = batch x max_seq_len``); outputs compared with the
   contiguous engine's; cache bytes (``KVSpec.bytes``, scratch included) and capacity.
4. ``prefill`` (2 ranks): a prefill of ``--batch`` prompts of ``--prefill-len`` tokens (one step,
   ``max_new_tokens=1``) with no streaming vs per-layer streaming (a ``layer_after`` listener
   ``stream_out(layers=[i])`` / ``stream_in`` of layer i to the other rank while layer i+1
   computes; waited for and unpacked at ``step_end``) vs streaming everything at the end of the
   step (``step_end``). Prefill s = ``engine.stats.prefill_seconds``, max over ranks.

Not measured: microbatch swapping (not built yet), GPU (this machine has none).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import LoadSampler, add_sizes, bench_checkpoint, fill_sizes, med, parser, reduce_scalar, rerun_command

from reshard.kv import KVCache, KVSpec
from reshard.kv.scatter import chunk_bytes, chunk_sizes, chunks, gather, scatter
from reshard.kv.stream import KVStreamer, TokenStream
from reshard.kv.stream_plan import Span, plan_stream, world_layouts
from reshard.kv.transport import (
    FileTransport,
    LocalTransport,
    P2PTransport,
    SharedMemoryTransport,
)
from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

REPO = Path(__file__).resolve().parent.parent

MIB = 2**20
SECTIONS = ("stream", "copies", "paged", "prefill")
DEFAULTS = dict(
    hidden=512,
    intermediate=1408,
    layers=8,
    heads=8,
    kv_heads=8,
    vocab=16000,
    batch=16,
    prompt_len=192,
    new_tokens=64,
    prefill_len=256,
    copy_seqs=16,
    copy_tokens=512,
    copy_block=16,
    block_sizes=[16, 32, 64, 128],
    repeats=5,
)
SMALL = dict(
    hidden=256,
    intermediate=688,
    layers=4,
    heads=8,
    kv_heads=4,
    vocab=4096,
    batch=4,
    prompt_len=32,
    new_tokens=16,
    prefill_len=64,
    copy_seqs=4,
    copy_tokens=64,
    copy_block=16,
    block_sizes=[16, 32],
    repeats=2,
)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    add_sizes(p, DEFAULTS, SMALL)
    args = fill_sizes(p.parse_args(), DEFAULTS, SMALL)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    return args


def checkpoint(args: argparse.Namespace) -> Path:
    return bench_checkpoint(args, "bench-kv")


# ---- measuring -----------------------------------------------------------------------------------
def all_ranks_ok(ok: bool) -> bool:
    return reduce_scalar(float(ok), dist.ReduceOp.MIN) == 1.0


def requests(args, prompt_len: int, new_tokens: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [
        Request(
            i,
            torch.randint(0, args.vocab, (prompt_len,), generator=g).tolist(),
            SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
        )
        for i in range(args.batch)
    ]


def gen(engine: Engine, reqs) -> dict:
    """One ``generate``: decode s/step, prefill s, wall s (max over ranks), outputs."""
    s = engine.stats
    d0 = s.decode_seconds
    n0 = s.decode_steps
    p0 = s.prefill_seconds
    dist.barrier()
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - t0
    steps = s.decode_steps - n0
    return {
        "step": reduce_scalar((s.decode_seconds - d0) / max(steps, 1)),
        "steps": steps,
        "prefill": reduce_scalar(s.prefill_seconds - p0),
        "wall": reduce_scalar(wall),
        "outputs": [c.output_ids for c in out],
    }


def mirror_of(cache: KVCache, head_start: int) -> KVCache:
    return KVCache(dataclasses.replace(cache.spec, head_start=head_start))


def written(cache: KVCache) -> torch.Tensor:
    """Every layer's K and V without the scratch column (contiguous caches)."""
    w = slice(0, cache.spec.max_seq_len)
    return torch.cat([t[:, :, w] for t in cache.k + cache.v])


def neighbour_written(cache: KVCache) -> torch.Tensor:
    """The previous rank's ``written(cache)`` (ring), by an all-gather of equal shapes."""
    mine = written(cache).contiguous()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return everyone[(dist.get_rank() - 1) % dist.get_world_size()]


# ---- 1. token streaming overhead ---------------------------------------------------------------------
def section_stream(path: Path, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "section stream runs on 2 ranks (TP2)"
    engine = Engine(
        parallelize(path), EngineConfig(max_batch_size=args.batch, max_seq_len=args.prompt_len + args.new_tokens)
    )
    reqs = requests(args, args.prompt_len, args.new_tokens)
    src = world_layouts(engine.kv)
    tmp = Path(tempfile.mkdtemp(prefix=f"kvbench-r{rank}-"))
    streamers, mirrors = {}, {}
    # (a) cpu: a mirror on this rank (the plan is all local copies)
    streamers["cpu"] = KVStreamer(plan_stream(src, dict(src)), transport=lambda peer: LocalTransport())
    mirrors["cpu"] = mirror_of(engine.kv, src[rank].head_start)
    # (b) peer: rank r mirrors rank r - 1's heads (P2P)
    ring = {r: src[(r - 1) % world] for r in range(world)}
    streamers["peer"] = KVStreamer(plan_stream(src, ring))
    mirrors["peer"] = mirror_of(engine.kv, ring[rank].head_start)
    # (c) file: written to and read back from files in a per-rank temp dir
    streamers["file"] = KVStreamer(plan_stream(src, dict(src)), transport=lambda peer: LocalTransport())
    (tmp / "files").mkdir()
    replaced = streamers["file"].transports[rank]
    streamers["file"].transports[rank] = FileTransport(tmp / "files")
    mirrors["file"] = mirror_of(engine.kv, src[rank].head_start)

    variants = ["none", "cpu", "peer", "file"]
    rows = {v: {"step": [], "prefill": [], "wall": [], "bytes": 0, "steps": 0} for v in variants}

    def run(variant: str, warm: bool) -> None:
        stream, remove = None, None
        if variant != "none":
            stream = TokenStream(streamers[variant], engine.kv, mirrors[variant])
            remove = engine.events.on("step_end", lambda step, seqs: stream.step_end(step.kind, seqs))
        r = gen(engine, reqs)
        if stream is not None:
            stream.drain()
            remove()
            rows[variant]["bytes"] = reduce_scalar(stream.bytes_out, dist.ReduceOp.SUM)
            rows[variant]["steps"] = stream.steps
        if variant == "file":  # keep the disk from filling: the files of this run are read already
            shutil.rmtree(tmp / "files")
            (tmp / "files").mkdir()
        if warm:
            rows[variant]["outputs"] = r["outputs"]
            if variant != "none":
                expect = neighbour_written(engine.kv) if variant == "peer" else written(engine.kv)
                rows[variant]["equal"] = all_ranks_ok(torch.equal(written(mirrors[variant]), expect))
            return
        for k in ("step", "prefill", "wall"):
            rows[variant][k].append(r[k])

    for v in variants:
        run(v, warm=True)
    for _ in range(args.repeats):
        for v in variants:
            run(v, warm=False)
    for s in streamers.values():
        s.close()
    replaced.close()
    shutil.rmtree(tmp, ignore_errors=True)
    base = rows["none"]
    for v in variants:
        r = rows[v]
        r["same_tokens"] = r["outputs"] == base["outputs"]
        # paired overhead: this variant vs the baseline of the same round
        r["paired"] = [a / b - 1 for a, b in zip(r["step"], base["step"])]
    dist.barrier()
    return {"rows": rows, "kv_heads_per_rank": engine.kv.spec.num_heads, "cache_mib": engine.kv.spec.bytes / MIB}


def format_stream(res: dict, args) -> list[str]:
    rows, base = res["rows"], res["rows"]["none"]
    b = med(base["step"])
    lines = [
        "| streaming to | decode ms/step (median) | min-max ms | overhead vs none (medians) "
        "| overhead, median of paired rounds | prefill ms (incl. prompt streaming) | MiB streamed per run "
        "| steps streamed | mirror bitwise equal | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "none": "none (baseline)",
        "cpu": "(a) CPU copy, same rank (local)",
        "peer": "(b) other rank (P2P)",
        "file": "(c) files (FileTransport)",
    }
    for v, r in rows.items():
        s = med(r["step"])
        none = v == "none"
        over = "-" if none else f"{100 * (s / b - 1):+.1f}%"
        paired = "-" if none else f"{100 * med(r['paired']):+.1f}%"
        mib = "-" if none else f"{r['bytes'] / MIB:.1f}"
        equal = "-" if none else ("yes" if r["equal"] else "NO")
        lines.append(
            f"| {names[v]} | {1e3 * s:.2f} | {1e3 * min(r['step']):.2f}-{1e3 * max(r['step']):.2f} "
            f"| {over} | {paired} | {1e3 * med(r['prefill']):.1f} | {mib} "
            f"| {'-' if none else r['steps']} | {equal} | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return lines


# ---- 2. coalesced vs per-chunk copies ----------------------------------------------------------------
def copy_cache(args, rank: int, num_heads: int, head_dim: int, layers: int) -> KVCache:
    per_seq = -(-args.copy_tokens // args.copy_block)
    spec = KVSpec(
        num_layers=layers,
        num_slots=args.copy_seqs,
        num_heads=num_heads,
        max_seq_len=args.copy_tokens,
        head_dim=head_dim,
        head_start=rank * num_heads,
        block_size=args.copy_block,
        num_blocks=args.copy_seqs * per_seq,
    )
    cache = KVCache(spec)
    g = torch.Generator().manual_seed(rank)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    order = torch.randperm(spec.num_blocks, generator=g).tolist()  # scattered blocks
    for slot in range(args.copy_seqs):
        cache.assign(slot, order[slot * per_seq : (slot + 1) * per_seq])
    return cache


def section_copies(path: Path | None, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = world
    kv_heads, head_dim = args.kv_heads // tp, args.hidden // args.heads
    cache = copy_cache(args, rank, kv_heads, head_dim, args.layers)
    src = world_layouts(cache)
    n = args.copy_tokens
    workloads = {
        f"prompt ({args.copy_seqs} seqs x {n} tokens)": [Span(i, i, 0, n) for i in range(args.copy_seqs)],
        f"decode step ({args.copy_seqs} seqs x 1 token)": [Span(i, i, n - 1, n) for i in range(args.copy_seqs)],
    }
    results = []
    transports = ["local"] + (["p2p", "shm"] if world == 2 else [])
    step = [0]

    for tname in transports:
        if tname == "local":
            pieces_out = plan_stream(src, dict(src)).sends(rank).get(rank, [])
            active = rank == 0
            tr = LocalTransport() if active else None
            send_tr = recv_tr = tr
            pieces_in = pieces_out
        else:
            ring = {r: src[(r - 1) % world] for r in range(world)}
            plan = plan_stream(src, ring)
            peer = (rank + 1) % world
            pieces_out, pieces_in = plan.sends(rank)[peer], plan.receives(rank)[(rank - 1) % world]
            active = True
            if tname == "p2p":
                send_tr = recv_tr = P2PTransport(peer)
            else:
                run_id = f"kvbench{os.getppid()}"
                send_tr = recv_tr = SharedMemoryTransport(run_id)

        def key(method: str, i: int, src_rank: int):
            return ("bench", method, step[0], src_rank, i)

        def coalesced(spans):
            buf = scatter(cache, pieces_out, spans)
            jobs = [send_tr.flush(buf, key("c", 0, rank))]
            src_rank = rank if tname == "local" else (rank - 1) % world
            out = torch.empty(sum(chunk_bytes(cache, pieces_in, spans)), dtype=torch.uint8)
            jobs.append(recv_tr.fetch(key("c", 0, src_rank), out))
            for j in jobs:
                j.wait(120)

        def per_chunk(spans):
            cs = chunks(cache, pieces_out, spans)
            jobs = [send_tr.flush(c, key("n", i, rank)) for i, c in enumerate(cs)]
            src_rank = rank if tname == "local" else (rank - 1) % world
            jobs += [
                recv_tr.fetch(key("n", i, src_rank), torch.empty(nb, dtype=torch.uint8))
                for i, nb in enumerate(chunk_sizes(cache, pieces_in, spans))
            ]
            for j in jobs:
                j.wait(120)

        methods = {"coalesced (scatter, 1 flush)": coalesced, "per-chunk (chunks, 1 flush each)": per_chunk}
        for wname, spans in workloads.items():
            row = {m: {"times": [], "calls": 0, "bytes": 0} for m in methods}
            for rep in range(args.repeats + 1):  # rep 0: warm-up
                for m, fn in methods.items():
                    step[0] += 1
                    before = (send_tr.stats.flush_calls, send_tr.stats.flush_bytes) if active else (0, 0)
                    dist.barrier()
                    t0 = time.perf_counter()
                    if active:
                        fn(spans)
                    dt = reduce_scalar(time.perf_counter() - t0)
                    dist.barrier()  # every fetch done before the next round (shm regions, keys)
                    calls = send_tr.stats.flush_calls - before[0] if active else 0
                    nbytes = send_tr.stats.flush_bytes - before[1] if active else 0
                    calls, nbytes = reduce_scalar(calls, dist.ReduceOp.SUM), reduce_scalar(nbytes, dist.ReduceOp.SUM)
                    if rep == 0:
                        row[m]["calls"], row[m]["bytes"] = calls, nbytes
                    else:
                        assert (calls, nbytes) == (row[m]["calls"], row[m]["bytes"])
                        row[m]["times"].append(dt)
            names = list(methods)
            assert row[names[0]]["bytes"] == row[names[1]]["bytes"], row  # the same bytes either way
            results.append(
                {
                    "transport": tname,
                    "workload": wname,
                    "row": row,
                    "ranks": "rank 0 alone" if tname == "local" else "2 ranks, both directions",
                }
            )
        if active:
            send_tr.close()
        dist.barrier()
    breakdown = []  # rank 0: packing and unpacking alone (no transport), the coalesced path's two halves
    if rank == 0:
        mirror = copy_cache(args, rank, kv_heads, head_dim, args.layers)
        pieces = plan_stream(src, dict(src)).sends(rank)[rank]
        for wname, spans in workloads.items():
            buf = scatter(cache, pieces, spans)
            nchunks = len(chunk_sizes(cache, pieces, spans))
            times = {"scatter": [], "gather": []}
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                scatter(cache, pieces, spans)
                t1 = time.perf_counter()
                gather(mirror, pieces, spans, buf)
                times["scatter"].append(t1 - t0)
                times["gather"].append(time.perf_counter() - t1)
            breakdown.append((wname, nchunks, buf.numel(), med(times["scatter"][1:]), med(times["gather"][1:])))
    dist.barrier()
    return {
        "breakdown": breakdown,
        "results": results,
        "block": args.copy_block,
        "heads": kv_heads,
        "head_dim": head_dim,
        "cache_mib": cache.spec.bytes / MIB,
    }


def format_copies(res: dict) -> list[str]:
    lines = [
        "| transport | ranks | workload | MiB moved (all ranks) | coalesced flushes | per-chunk flushes "
        "| coalesced ms | per-chunk ms | per-chunk / coalesced time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        c, n = r["row"].values()
        tc, tn = med(c["times"]), med(n["times"])
        lines.append(
            f"| {r['transport']} | {r['ranks']} | {r['workload']} | {c['bytes'] / MIB:.2f} "
            f"| {c['calls']:.0f} | {n['calls']:.0f} | {1e3 * tc:.2f} | {1e3 * tn:.2f} | {tn / tc:.2f}x |"
        )
    lines += [
        "",
        "Packing and unpacking alone (rank 0, no transport):",
        "",
        "| workload | chunks | bytes | scatter ms | gather (unpack) ms | us per chunk (scatter) |",
        "|---|---|---|---|---|---|",
    ]
    for wname, nchunks, nbytes, ts, tg in res["breakdown"]:
        lines.append(f"| {wname} | {nchunks} | {nbytes} | {1e3 * ts:.2f} | {1e3 * tg:.2f} | {1e6 * ts / nchunks:.1f} |")
    return lines


# ---- 3. paged vs contiguous ----------------------------------------------------------------------------
def section_paged(path: Path, args) -> dict:
    model = parallelize(path)
    seq_len = args.prompt_len + args.new_tokens
    capacity = args.batch * seq_len
    engines = {"contiguous": Engine(model, EngineConfig(max_batch_size=args.batch, max_seq_len=seq_len))}
    for bs in args.block_sizes:
        engines[f"paged, block {bs}"] = Engine(
            model, EngineConfig(max_batch_size=args.batch, max_seq_len=seq_len, kv_block_size=bs, kv_tokens=capacity)
        )
    reqs = requests(args, args.prompt_len, args.new_tokens)
    rows = {k: {"step": [], "prefill": []} for k in engines}
    for k, e in engines.items():  # warm-up
        r = gen(e, reqs)
        rows[k]["outputs"], rows[k]["steps"] = r["outputs"], r["steps"]
    for _ in range(args.repeats):
        for k, e in engines.items():
            r = gen(e, reqs)
            rows[k]["step"].append(r["step"])
            rows[k]["prefill"].append(r["prefill"])
    for k, e in engines.items():
        spec = e.kv.spec
        rows[k].update(
            bytes=spec.bytes,
            capacity=spec.capacity_tokens,
            peak=e.stats.kv_blocks_peak,
            block=spec.block_size,
            same=rows[k]["outputs"] == rows["contiguous"]["outputs"],
            batch=e.stats.mean_decode_batch,
        )
    dist.barrier()
    return {"rows": rows, "capacity": capacity}


def format_paged(res: dict) -> list[str]:
    rows = res["rows"]
    c = med(rows["contiguous"]["step"])
    lines = [
        "| cache | decode ms/step | min-max ms | paged / contiguous step | prefill ms | decode steps "
        "| mean batch | token capacity | cache MiB (per rank, scratch incl.) | peak tokens held "
        "| same tokens as contiguous |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in rows.items():
        s = med(r["step"])
        held = "-" if r["block"] is None else f"{r['peak'] * r['block']}"
        lines.append(
            f"| {k} | {1e3 * s:.2f} | {1e3 * min(r['step']):.2f}-{1e3 * max(r['step']):.2f} "
            f"| {s / c:.2f} | {1e3 * med(r['prefill']):.1f} | {r['steps']} | {r['batch']:.1f} "
            f"| {r['capacity']} | {r['bytes'] / MIB:.1f} | {held} | {'yes' if r['same'] else 'NO'} |"
        )
    return lines


# ---- 4. prompt streaming overlapped with prefill ---------------------------------------------------------
class PromptStream:
    """``mode`` ``layer``: each layer's KV leaves in ``layer_after``; ``end``: all of it at ``step_end``.
    Both wait for (and unpack) everything at ``step_end``, inside the prefill step."""

    def __init__(self, streamer: KVStreamer, cache: KVCache, mirror: KVCache, mode: str, tag: int) -> None:
        self.streamer = streamer
        self.cache = cache
        self.mirror = mirror
        self.mode = mode
        self.tag = tag
        self.spans = []
        self.jobs = []
        self.ins = []

    def step_begin(self, step, seqs) -> None:
        self.spans = [Span(s.request.id, s.slot, 0, s.prompt_len) for s in seqs] if step.kind == "prefill" else []

    def after_layer(self, index, hidden, ctx) -> None:
        if self.mode == "layer" and self.spans:
            self._send([index])

    def _send(self, layers) -> None:
        self.jobs += self.streamer.stream_out(self.cache, self.spans, layers=layers, tag=self.tag)
        self.ins.append(self.streamer.stream_in(self.mirror, self.spans, layers=layers, tag=self.tag))

    def step_end(self, step, seqs) -> None:
        if not self.spans:
            return
        if self.mode == "end":
            self._send(None)
        for j in self.jobs:
            j.wait(120)
        for i in self.ins:
            i.wait(120)
        self.jobs = []
        self.ins = []
        self.spans = []


def section_prefill(path: Path, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "section prefill runs on 2 ranks (TP2)"
    engine = Engine(
        parallelize(path),
        EngineConfig(
            max_batch_size=args.batch,
            max_seq_len=args.prefill_len + 1,
            max_prefill_tokens=args.batch * args.prefill_len,
        ),
    )
    reqs = requests(args, args.prefill_len, 1)
    src = world_layouts(engine.kv)
    ring = {r: src[(r - 1) % world] for r in range(world)}
    streamer = KVStreamer(plan_stream(src, ring))
    mirror = mirror_of(engine.kv, ring[rank].head_start)
    variants = ["none", "layer", "end"]
    rows = {v: {"prefill": [], "wall": []} for v in variants}
    tag = [0]

    def run(v: str, warm: bool) -> None:
        removers = []
        if v != "none":
            tag[0] += 1
            ps = PromptStream(streamer, engine.kv, mirror, v, tag[0])
            removers = [
                engine.events.on("step_begin", ps.step_begin),
                engine.events.on("layer_after", ps.after_layer),
                engine.events.on("step_end", ps.step_end),
            ]
        r = gen(engine, reqs)
        for rm in removers:
            rm()
        if warm:
            if v != "none":
                w = slice(0, args.prefill_len)
                got = torch.cat([t[:, :, w] for t in mirror.k + mirror.v])
                mine = torch.cat([t[:, :, w] for t in engine.kv.k + engine.kv.v]).contiguous()
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                rows[v]["equal"] = all_ranks_ok(torch.equal(got, everyone[(rank - 1) % world]))
            return
        rows[v]["prefill"].append(r["prefill"])
        rows[v]["wall"].append(r["wall"])

    for v in variants:
        run(v, warm=True)
    for _ in range(args.repeats):
        for v in variants:
            run(v, warm=False)
    streamer.close()
    kv_bytes = (
        2 * args.layers * (args.kv_heads // world) * args.batch * args.prefill_len * (args.hidden // args.heads) * 4
    )
    for v in variants:
        rows[v]["paired"] = [a / b - 1 for a, b in zip(rows[v]["prefill"], rows["none"]["prefill"])]
    dist.barrier()
    return {"rows": rows, "mib_per_rank": kv_bytes / MIB}


def format_prefill(res: dict) -> list[str]:
    rows = res["rows"]
    b = med(rows["none"]["prefill"])
    names = {
        "none": "prefill, no streaming",
        "layer": "per-layer stream_out in after_layer (overlapped)",
        "end": "prefill, then stream everything at step_end",
    }
    lines = [
        "| variant | prefill s (median) | min-max s | vs no streaming (medians) | median of paired rounds "
        "| mirror bitwise equal |",
        "|---|---|---|---|---|---|",
    ]
    for v, r in rows.items():
        s = med(r["prefill"])
        none = v == "none"
        over = "-" if none else f"{100 * (s / b - 1):+.1f}%"
        paired = "-" if none else f"{100 * med(r['paired']):+.1f}%"
        equal = "-" if none else ("yes" if r["equal"] else "NO")
        lines.append(
            f"| {names[v]} | {s:.3f} | {min(r['prefill']):.3f}-{max(r['prefill']):.3f} | {over} | {paired} | {equal} |"
        )
    return lines


# ---- main ------------------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pids = [None] * world
    dist.all_gather_object(pids, (os.getpid(), os.getppid()))
    sampler = LoadSampler({p for pair in pids for p in pair}) if rank == 0 else None
    t_start, started = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
    path = checkpoint(args)
    out = {}
    for section in args.sections:
        if section in ("stream", "prefill") and world != 2:
            if rank == 0:
                print(f"[skip] section {section} needs 2 ranks", flush=True)
            continue
        fn = {"stream": section_stream, "copies": section_copies, "paged": section_paged, "prefill": section_prefill}[
            section
        ]
        out[section] = fn(path, args)
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:.0f}s] {section} done", flush=True)
    if rank == 0:
        numel = _numel(path)
        hd = args.hidden // args.heads
        print(
            f"\n{started:%Y-%m-%d %H:%M} UTC; Llama hidden {args.hidden}, MLP {args.intermediate}, {args.layers} "
            f"layers, {args.heads}/{args.kv_heads} heads x {hd}, vocab {args.vocab}: {numel / 1e6:.1f}M fp32 "
            f"parameters; TP{world} ({args.kv_heads // world} KV heads per rank); torch {torch.__version__}, "
            f"{world} gloo ranks, 1 thread each; warm-up 1 + median of {args.repeats}, variants round-robin"
        )
        if "stream" in out:
            print(
                f"\n1. Token streaming: {args.batch} seqs x {args.prompt_len} prompt tokens, {args.new_tokens} "
                f"greedy tokens ({args.new_tokens - 1} decode steps), max_seq_len "
                f"{args.prompt_len + args.new_tokens}, contiguous cache "
                f"{out['stream']['cache_mib']:.1f} MiB/rank\n"
            )
            print("\n".join(format_stream(out["stream"], args)))
        if "copies" in out:
            r = out["copies"]
            print(
                f"\n2. Coalesced vs per-chunk copies: paged cache, block {r['block']}, shuffled block ids, "
                f"{args.layers} layers x {r['heads']} KV heads x {r['head_dim']} per rank, fp32 "
                f"({r['cache_mib']:.0f} MiB/rank); time = pack + flush + fetch, max over ranks\n"
            )
            print("\n".join(format_copies(r)))
        if "paged" in out:
            print(
                f"\n3. Paged vs contiguous: {args.batch} seqs x {args.prompt_len} prompt, {args.new_tokens} new "
                f"tokens; same token capacity {out['paged']['capacity']} (contiguous: {args.batch} slots x "
                f"{args.prompt_len + args.new_tokens})\n"
            )
            print("\n".join(format_paged(out["paged"])))
        if "prefill" in out:
            print(
                f"\n4. Prompt streaming: prefill of {args.batch} x {args.prefill_len} tokens (one step), "
                f"{out['prefill']['mib_per_rank']:.1f} MiB of KV per rank to the other rank (P2P)\n"
            )
            print("\n".join(format_prefill(out["prefill"])))
        print(f"\nmachine: {sampler.summary()}")
        print(f"command: {rerun_command('kv_streaming.py', world)}")
        print(f"total {time.perf_counter() - t_start:.0f}s")
    dist.barrier()
    dist.destroy_process_group()


def _numel(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118
                n = 1
                for s in h.get_slice(k).get_shape():
                    n *= s
                total += n
    return total


if __name__ == "__main__":
    main()
