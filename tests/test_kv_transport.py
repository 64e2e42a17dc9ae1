"""Flush/fetch transports: bitwise round trips, P2P beside collectives, timeouts, errors, cleanup."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from reshard.kv.jobs import Job
from reshard.kv.transport import FileTransport, LocalTransport, Medium, SharedMemoryTransport, choose_transport
from tests import dist_harness

DTYPES = [torch.float32, torch.bfloat16]
WAIT = 10.0


def _chunk(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _regions(run_id: str) -> list[str]:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return [f for f in os.listdir(root) if run_id in f] if root else []


def _run_id() -> str:
    return f"test{uuid.uuid4().hex[:12]}"


def _round_trip(flusher, fetcher, dtype: torch.dtype, *, view_as_bytes: bool) -> None:
    src = _chunk(dtype)
    out = torch.empty_like(src)
    chunk, dst = (_as_bytes(src), _as_bytes(out)) if view_as_bytes else (src, out)
    flusher.flush(chunk, ("req7", 3, 12)).wait(WAIT)
    fetcher.fetch(("req7", 3, 12), dst).wait(WAIT)
    assert torch.equal(_as_bytes(out), _as_bytes(src))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view_as_bytes", [True, False])
def test_local_round_trip_is_bitwise(dtype, view_as_bytes):
    with LocalTransport() as t:
        _round_trip(t, t, dtype, view_as_bytes=view_as_bytes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_round_trip_is_bitwise_and_leaves_no_region(dtype):
    run_id = _run_id()
    flusher, fetcher = SharedMemoryTransport(run_id), SharedMemoryTransport(run_id)
    _round_trip(flusher, fetcher, dtype, view_as_bytes=True)
    assert _regions(run_id) == []  # a fetched region is removed by the fetch
    flusher.close()
    fetcher.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_file_round_trip_is_bitwise_and_atomic(tmp_path, dtype):
    with FileTransport(tmp_path) as t:
        _round_trip(t, t, dtype, view_as_bytes=False)
        assert [p.name for p in tmp_path.iterdir()] == [t.path(("req7", 3, 12)).name]  # no temp file


def test_zero_byte_chunks_move_on_every_local_transport(tmp_path):
    for t in (LocalTransport(), SharedMemoryTransport(_run_id()), FileTransport(tmp_path)):
        t.flush(torch.empty(0), "empty").wait(WAIT)
        t.fetch("empty", torch.empty(0)).wait(WAIT)
        t.close()


def test_stats_count_bytes_and_calls_per_transport():
    """Eight per-chunk flushes vs one coalesced flush of the same bytes."""
    chunks = [_chunk(torch.float32, 256, seed=i) for i in range(8)]
    with LocalTransport() as per_chunk, LocalTransport() as coalesced:
        jobs = [per_chunk.flush(c, ("r", i)) for i, c in enumerate(chunks)]
        outs = [torch.empty_like(c) for c in chunks]
        jobs += [per_chunk.fetch(("r", i), o) for i, o in enumerate(outs)]
        whole = torch.cat(chunks)
        jobs += [coalesced.flush(whole, "all"), coalesced.fetch("all", torch.empty_like(whole))]
        for job in jobs:
            job.wait(WAIT)
        assert [j.id for j in jobs] == sorted(j.id for j in jobs)  # ids are monotonic
        s, c = per_chunk.stats, coalesced.stats
        assert (s.flush_calls, s.fetch_calls, s.calls) == (8, 8, 16)
        assert s.flush_bytes == s.fetch_bytes == c.flush_bytes == c.fetch_bytes == 8 * 256 * 4
        assert (c.calls, c.bytes) == (2, 2 * 8 * 256 * 4)
        assert all(torch.equal(o, ch) for o, ch in zip(outs, chunks))


def test_a_fetch_nobody_flushes_times_out_naming_the_job():
    t = SharedMemoryTransport(_run_id())
    job = t.fetch(("req9", 0, 1), torch.empty(16, dtype=torch.uint8))
    with pytest.raises(TimeoutError, match=rf"job {job.id} \(shm fetch of key \('req9', 0, 1\)"):
        job.wait(0.2)
    assert not job.done()
    t.close(timeout=0.2)  # gives up on the waiting fetch
    with pytest.raises(RuntimeError, match="closed"):
        job.wait(WAIT)


def test_background_errors_reach_the_caller(tmp_path):
    directory = tmp_path / "gone"
    directory.mkdir()
    t = FileTransport(directory)
    directory.rmdir()
    job = t.flush(_chunk(torch.float32), "k")
    with pytest.raises(Exception, match="No such file") as info:  # safetensors' own error type
        job.wait(WAIT)
    assert any(f"job {job.id}" in note for note in info.value.__notes__)
    t.close()

    with LocalTransport() as local:
        local.flush(_chunk(torch.float32, 10), "k").wait(WAIT)
        with pytest.raises(ValueError, match=r"key 'k' has 40 bytes but the fetch buffer has 20"):
            local.fetch("k", torch.empty(5)).wait(WAIT)
        with pytest.raises(KeyError, match="no chunk was flushed under key 'other'"):
            local.fetch("other", torch.empty(10)).wait(WAIT)
        local.fetch("k", torch.empty(10)).wait(WAIT)  # the chunk is still there for the right buffer
        local.flush(torch.ones(2), "twice")
        with pytest.raises(ValueError, match="key 'twice' was flushed already"):
            local.flush(torch.ones(2), "twice").wait(WAIT)


def test_shm_leaves_nothing_after_failures_or_close():
    run_id = _run_id()
    a, b = SharedMemoryTransport(run_id), SharedMemoryTransport(run_id)
    a.flush(_chunk(torch.float32, 100), "x").wait(WAIT)
    with pytest.raises(FileExistsError):  # a second flush of an unfetched key fails, leaks nothing
        a.flush(_chunk(torch.float32, 100), "x").wait(WAIT)
    with pytest.raises(ValueError, match="400 bytes but the fetch buffer has 4"):
        b.fetch("x", torch.empty(1)).wait(WAIT)
    a.flush(_chunk(torch.float32, 100), "never fetched").wait(WAIT)
    assert len(_regions(run_id)) == 2
    b.close()
    a.close()  # removes what it flushed and nobody fetched
    assert _regions(run_id) == []


def test_bad_input_is_named():
    with LocalTransport() as t:
        with pytest.raises(ValueError, match=r"must be contiguous; got shape \(4, 4\)"):
            t.flush(torch.zeros(4, 4).t(), "k")
        with pytest.raises(ValueError, match="a key is a string or a non-empty tuple"):
            t.flush(torch.zeros(4), ("r", 1.5))
    with pytest.raises(ValueError, match="run_id must be"):
        SharedMemoryTransport("a/b")
    with pytest.raises(ValueError, match="does not exist"):
        FileTransport("/nonexistent/kv")
    with pytest.raises(ValueError, match="got kind='gpu'"):
        Medium("gpu", 0)


def test_choose_transport():
    gpu0 = Medium("device", 0)
    cpu0 = Medium("cpu", 0)
    cpu1 = Medium("cpu", 1)
    disk1 = Medium("disk", 1)
    assert choose_transport(gpu0, cpu0) == "local"
    assert choose_transport(cpu0, cpu1) == "shm"
    assert choose_transport(cpu0, Medium("cpu", 2, node=1)) == "p2p"
    assert choose_transport(gpu0, Medium("device", 1)) == "p2p"
    assert choose_transport(cpu1, disk1) == choose_transport(disk1, gpu0) == "file"


# ---- two ranks --------------------------------------------------------------------------------
def _p2p_beside_collectives(run_id: str):
    import torch.distributed as dist

    from reshard.kv.transport import open_transport

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    t = open_transport(Medium("device", rank), Medium("device", peer))  # -> p2p, background group
    chunks = {(i, str(dtype)): _chunk(dtype, 50_000, seed=i) for i in range(4) for dtype in DTYPES}
    mine = {k: v for k, v in chunks.items() if k[0] % 2 == rank}
    theirs = {k: v for k, v in chunks.items() if k[0] % 2 == peer}
    outs = {k: torch.empty_like(v) for k, v in theirs.items()}
    # 1. rank 1's fetches wait in the background while both main threads run collectives on the
    #    default group; rank 0 flushes only after round 4's all_reduce, so they cannot finish sooner
    early = [t.fetch(k, outs[k]) for k in theirs] if rank == 1 else []
    total, pending_at_round_3 = 0.0, None
    for i in range(10):
        if i == 3 and rank == 1:
            pending_at_round_3 = not any(job.done() for job in early)
        if i == 5 and rank == 0:
            early = [t.flush(_as_bytes(v), k) for k, v in mine.items()]
        x = torch.full((1000,), float(i + rank))
        dist.all_reduce(x)
        total += float(x[0])
    # 2. both ranks flush to each other before fetching: sends must not hold up receives
    jobs = [t.flush(_as_bytes(v), k) for k, v in mine.items() if rank == 1]
    jobs += [t.fetch(k, outs[k]) for k in theirs if rank == 0]
    jobs += [t.flush(_as_bytes(v), ("again",) + k) for k, v in mine.items()]
    again = {k: torch.empty_like(v) for k, v in theirs.items()}
    jobs += [t.fetch(("again",) + k, again[k]) for k in theirs]
    for job in early + jobs:
        job.wait(WAIT)
    ok = all(
        torch.equal(_as_bytes(outs[k]), _as_bytes(v)) and torch.equal(_as_bytes(again[k]), _as_bytes(v))
        for k, v in theirs.items()
    )
    # 3. a fetch of the wrong size fails on the receiver (no abort) and the stream stays usable
    mismatch = ""
    if rank == 0:
        t.flush(torch.arange(10, dtype=torch.float32), "m").wait(WAIT)
        t.flush(torch.arange(3, dtype=torch.float32), "n").wait(WAIT)
    else:
        try:
            t.fetch("m", torch.empty(5)).wait(WAIT)
        except ValueError as e:
            mismatch = str(e)
        after = torch.empty(3)
        t.fetch("n", after).wait(WAIT)
        ok = ok and torch.equal(after, torch.arange(3, dtype=torch.float32))
    stats = (t.stats.flush_calls, t.stats.fetch_calls, t.stats.flush_bytes, t.stats.fetch_bytes)
    t.close()
    # 4. shared memory between the two processes
    s = open_transport(Medium("cpu", 0), Medium("cpu", 1), run_id=run_id)
    src = _chunk(torch.bfloat16, 4096, seed=9)
    if rank == 0:
        s.flush(src, "kv").wait(WAIT)
    dist.barrier()
    if rank == 1:
        out = torch.empty_like(src)
        s.fetch("kv", out).wait(WAIT)
        ok = ok and torch.equal(_as_bytes(out), _as_bytes(src))
    dist.barrier()
    s.close()
    return ok, total, pending_at_round_3, mismatch, stats, type(t).__name__, type(s).__name__


def test_p2p_round_trip_beside_default_group_collectives():
    run_id = _run_id()
    results = dist_harness.run(2, _p2p_beside_collectives, run_id, timeout=60)
    chunk_bytes = 50_000 * (4 + 2) * 2  # two indices per rank, fp32 + bf16 each
    for rank, (ok, total, pending, mismatch, stats, p2p, shm) in enumerate(results):
        assert ok and (p2p, shm) == ("P2PTransport", "SharedMemoryTransport")
        assert total == sum(2 * i + 1 for i in range(10))  # the collectives were right
        if rank == 0:
            assert stats == (2 * 4 + 2, 2 * 4, 2 * chunk_bytes + 52, 2 * chunk_bytes)
        else:
            assert pending is True  # its fetches were still waiting during the collectives
            assert "key 'm' has 40 bytes but the fetch buffer has 20" in mismatch
            assert stats == (2 * 4, 2 * 4 + 1, 2 * chunk_bytes, 2 * chunk_bytes + 12)
    assert _regions(run_id) == []


def test_open_transport_without_ranks(tmp_path):
    from reshard.kv.transport import open_transport

    assert isinstance(open_transport(Medium("device", 0), Medium("cpu", 0)), LocalTransport)
    t = open_transport(Medium("cpu", 0), Medium("disk", 0), directory=tmp_path)
    assert isinstance(t, FileTransport)
    for transport in (t, open_transport(Medium("device", 0), Medium("cpu", 0))):
        transport.close()
    with pytest.raises(ValueError, match="pass directory="):
        open_transport(Medium("cpu", 0), Medium("disk", 0))


def test_job_wait_without_timeout_returns_when_done():
    with LocalTransport() as t:
        job = t.flush(torch.ones(3), "k")
        assert isinstance(job, Job)
        job.wait()
        assert job.done()
