"""DejaVu's streaming library: KV between every pair of layouts {TP 1, 2, 4} x {pipeline 1, 2}
on 4 ranks, bitwise; coalesced vs per-chunk copies; incompatible readers refused.

Oracle: a global KV tensor per request, computed identically on every rank from a seed; each
rank's cache holds (and must end up holding) the slice its layout names.
"""

import itertools

import pytest
import torch

from tests import dist_harness

L = 4
H = 4
HD = 8
MAXLEN = 16
LAYOUTS = [(tp, pp) for pp in (1, 2) for tp in (1, 2, 4) if tp * pp <= 4]  # 5 layouts on 4 ranks...
LAYOUTS.append((4, 1))  # ... TP4 (x PP1) once; with PP2, TP4 needs 8 ranks: TP2 x PP2 is the 4-rank case
SPANS = [(10, 11), (11, 5)]  # (request id, tokens)


def _layout(rank, tp, pp, world=4):
    """KVLayout of ``rank`` in TP ``tp`` x PP ``pp`` (the rest data-parallel replicas)."""
    from reshard.kv import KVLayout

    t, stage = rank % tp, (rank // tp) % pp
    nl, nh = L // pp, H // tp
    return KVLayout(stage * nl, nl, t * nh, nh, HD, torch.float32)


def _cache(layout, paged, seed):
    from reshard.kv import KVCache, KVSpec

    kw = dict(block_size=4, num_blocks=12) if paged else {}
    cache = KVCache(
        KVSpec(
            num_layers=layout.num_layers,
            num_slots=3,
            num_heads=layout.num_heads,
            max_seq_len=MAXLEN,
            head_dim=HD,
            head_start=layout.head_start,
            first_layer=layout.first_layer,
            **kw,
        )
    )
    if paged:  # scattered blocks, different on every rank
        order = torch.randperm(12, generator=torch.Generator().manual_seed(seed)).tolist()
        for slot in range(3):
            cache.assign(slot, order[4 * slot : 4 * slot + 4])
    return cache


def _truth(key):
    g = torch.Generator().manual_seed(key)
    return torch.randn(L, 2, H, MAXLEN, HD, generator=g)  # (layer, k/v, head, token, hd)


def _fill(cache, slots):
    lay = cache.layout
    for (key, n), slot in zip(SPANS, slots):
        t = _truth(key)
        for layer in range(lay.first_layer, lay.first_layer + lay.num_layers):
            h = slice(lay.head_start, lay.head_start + lay.num_heads)
            cache.write_slot(layer, slot, t[layer, 0, h, :n], t[layer, 1, h, :n])


def _wrong(cache, slots):
    """Chunks of ``cache`` that differ from the truth (empty when streamed right)."""
    lay, bad = cache.layout, []
    for (key, n), slot in zip(SPANS, slots):
        t = _truth(key)
        for layer in range(lay.first_layer, lay.first_layer + lay.num_layers):
            k, v = cache.read_slot(layer, slot, n)
            h = slice(lay.head_start, lay.head_start + lay.num_heads)
            if not (torch.equal(k, t[layer, 0, h, :n]) and torch.equal(v, t[layer, 1, h, :n])):
                bad.append((key, layer))
    return bad


def _pairs_job(pairs):
    import torch.distributed as dist

    from reshard.kv.stream import KVStreamer
    from reshard.kv.stream_plan import Span, plan_stream

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = {}
    for i, (src, dst) in enumerate(pairs):
        src_l = {r: _layout(r, *src) for r in range(world)}
        dst_l = {r: _layout(r, *dst) for r in range(world)}
        plan = plan_stream(src_l, dst_l)
        src_cache, dst_cache = _cache(src_l[rank], i % 2 == 0, rank), _cache(dst_l[rank], i % 2 == 1, rank + 7)
        src_slots, dst_slots = [0, 2], [1, 0]
        _fill(src_cache, src_slots)
        streamer = KVStreamer(plan, timeout=30)
        out = streamer.stream_out(src_cache, [Span(k, s, 0, n) for (k, n), s in zip(SPANS, src_slots)], tag=i)
        streamer.stream_in(dst_cache, [Span(k, s, 0, n) for (k, n), s in zip(SPANS, dst_slots)], tag=i).wait()
        for job in out:
            job.wait(30)
        streamer.close()
        bad = _wrong(dst_cache, dst_slots)
        if bad:
            failures[f"{src}->{dst}"] = bad
    return failures


def test_streaming_between_every_pair_of_layouts_is_bitwise():
    pairs = list(itertools.product(LAYOUTS, LAYOUTS))
    assert len(pairs) == 36
    for failures in dist_harness.run(4, _pairs_job, pairs, timeout=240):
        assert failures == {}


def test_plan_splits_at_the_source_and_merges_at_the_destination():
    """TP4 -> TP2 x PP2: every destination merges two source head ranges; replicas (TP1 x 4)
    spread the sending over all holders."""
    from reshard.kv.stream_plan import plan_stream

    plan = plan_stream({r: _layout(r, 4, 1) for r in range(4)}, {r: _layout(r, 2, 2) for r in range(4)})
    assert {d: len(p) for d, p in ((r, plan.receives(r)) for r in range(4))} == {0: 2, 1: 2, 2: 2, 3: 2}
    assert plan.receives(0)[0][0].box == ((0, 2), (0, 1)) and plan.receives(0)[1][0].box == ((0, 2), (1, 2))
    fan = plan_stream({r: _layout(r, 1, 1) for r in range(4)}, {r: _layout(r, 4, 1) for r in range(4)})
    assert all(p.src == p.dst for p in fan.pieces)  # replicas hold everything: all local copies
    spread = plan_stream({r: _layout(r, 1, 1) for r in range(2)}, {r: _layout(r, 4, 1) for r in range(2, 6)})
    assert sorted(p.src for p in spread.pieces) == [0, 0, 1, 1]


def test_an_incompatible_reader_is_refused_with_both_layouts_named():
    from reshard.kv import KVLayout
    from reshard.kv.stream_plan import plan_stream

    src = {r: _layout(r, 2, 1) for r in range(2)}
    wide = {0: KVLayout(0, 4, 0, 2, 16, torch.float32)}
    with pytest.raises(
        ValueError,
        match=r"rank 0 reads KV layout KVLayout\(first_layer=0, num_layers=4, head_start=0, "
        r"num_heads=2, head_dim=16, .*which the source layouts do not hold "
        r"\(\{0: KVLayout\(first_layer=0, num_layers=4, head_start=0, num_heads=2, "
        r"head_dim=8",
    ):
        plan_stream(src, wide)
    deep = {1: KVLayout(2, 4, 0, 2, HD, torch.float32)}  # layers 2..5 of a 4-layer source
    with pytest.raises(ValueError, match=r"rank 1 reads KV layout KVLayout\(first_layer=2, num_layers=4"):
        plan_stream(src, deep)


def test_coalesced_and_per_chunk_copies_move_the_same_bytes():
    from reshard.kv.scatter import chunks, gather, scatter
    from reshard.kv.stream_plan import Span, plan_stream
    from reshard.kv.transport import LocalTransport

    src = {0: _layout(0, 1, 1)}
    dst = {0: _layout(0, 2, 2)}
    plan = plan_stream(src, dst)
    cache = _cache(src[0], True, 0)
    _fill(cache, [0, 2])
    spans = [Span(k, s, 0, n) for (k, n), s in zip(SPANS, [0, 2])]
    pieces = plan.sends(0)[0]
    coalesced, naive = LocalTransport(), LocalTransport()
    buf = scatter(cache, pieces, spans)
    coalesced.flush(buf, "all").wait(10)
    for i, c in enumerate(chunks(cache, pieces, spans)):
        naive.flush(c, i).wait(10)
    assert coalesced.stats.bytes == naive.stats.bytes == buf.numel()
    assert coalesced.stats.calls == 1 and naive.stats.calls == 2 * 2 * 2  # (2 layers x 2 spans x K, V)
    coalesced.close(), naive.close()
    target = _cache(dst[0], False, 5)  # the coalesced buffer unpacks into another layout bitwise
    gather(target, plan.receives(0)[0], [Span(k, s, 0, n) for (k, n), s in zip(SPANS, [1, 0])], buf)
    assert _wrong(target, [1, 0]) == []


def _token_stream_job(path, where, tmp):
    """TP2 decode; every step's new KV entries stream to a mirror (the other rank's heads, a CPU
    copy on this rank, or files) while the next step runs; the mirror ends up equal to the cache."""
    import dataclasses

    import torch.distributed as dist

    from reshard.kv import KVCache
    from reshard.kv.stream import KVStreamer, TokenStream
    from reshard.kv.stream_plan import plan_stream, world_layouts
    from reshard.kv.transport import FileTransport, LocalTransport
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    rank, world = dist.get_rank(), dist.get_world_size()
    # whole-prompt steps and decode steps: the phases a token stream mirrors (DejaVu's steps)
    engine = Engine(parallelize(path), EngineConfig(max_batch_size=3, max_seq_len=48, chunked_prefill=False))
    src = world_layouts(engine.kv)
    if where == "peer":  # rank r mirrors rank r - 1's heads (the ring of DejaVu's replication)
        dst = {r: src[(r - 1) % world] for r in range(world)}
        transport = None
    else:
        dst = dict(src)
        if where == "cpu":
            transport = lambda peer: LocalTransport()  # noqa: E731
        else:  # one directory per rank: the keys name the step, not the rank
            import os

            os.makedirs(f"{tmp}/rank{rank}", exist_ok=True)
            transport = lambda peer: FileTransport(f"{tmp}/rank{rank}")  # noqa: E731
    mirror = KVCache(dataclasses.replace(engine.kv.spec, head_start=dst[rank].head_start))
    streamer = KVStreamer(plan_stream(src, dst), transport=transport)
    stream = TokenStream(streamer, engine.kv, mirror)
    engine.events.on("step_end", lambda step, seqs: stream.step_end(step.kind, seqs))
    reqs = [Request(i, list(range(3 + i, 12 + 2 * i)), SamplingParams(max_new_tokens=6 + i)) for i in range(5)]
    engine.generate(reqs)
    stream.drain()
    streamer.close()
    written = slice(0, engine.kv.spec.max_seq_len)  # the scratch column is never streamed
    mine = [torch.cat([k[:, :, written] for k in engine.kv.k + engine.kv.v])]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine[0])
    expected = everyone[(rank - 1) % world] if where == "peer" else mine[0]
    got = torch.cat([k[:, :, written] for k in mirror.k + mirror.v])
    return torch.equal(got, expected), stream.steps, stream.bytes_out


@pytest.mark.parametrize("where", ["peer", "cpu", "file"])
def test_token_streaming_mirrors_every_step(checkpoints, tmp_path, where):
    for same, steps, nbytes in dist_harness.run(2, _token_stream_job, checkpoints["llama"], where, str(tmp_path)):
        assert same and steps > 5 and nbytes > 0


def test_disk_tier_reshards_between_layouts(tmp_path):
    """Written by a TP2 x PP2 layout (four caches), read back by TP1 and TP4 caches (paged and not)."""
    from reshard.kv.disk import DiskKVTier

    tier = DiskKVTier(tmp_path)
    writers = [_cache(_layout(r, 2, 2), r % 2 == 0, r) for r in range(4)]
    for cache in writers:
        _fill(cache, [0, 2])
        for (key, n), slot in zip(SPANS, [0, 2]):
            tier.swap_out(cache, slot, key, n)
    for tp, paged in ((1, True), (4, False)):
        for r in range(tp):
            reader = _cache(_layout(r, tp, 1), paged, 9)
            for (key, n), slot in zip(SPANS, [1, 0]):
                assert tier.swap_in(reader, slot, key) == n
            assert _wrong(reader, [1, 0]) == []
    tier.free(10)
    assert not list(tmp_path.glob("req10-*")) and list(tmp_path.glob("req11-*"))
    with pytest.raises(ValueError, match=r"request 10: the disk tier at .* holds no KV for layer 0 heads \[0, 4\)"):
        tier.swap_in(_cache(_layout(0, 1, 1), False, 0), 0, 10)
