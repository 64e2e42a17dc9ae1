"""Fault tolerance: a rank SIGKILLed mid-decode, torchrun restarts the job, KV comes back from
the ring successors' mirrors and the journal replays the finished steps; the final tokens equal
a failure-free run's (greedy and seeded sampling), at most one step recomputed."""
import json
import os
import subprocess
import sys

import pytest

COMMON = ["progress=false", "workload.num_requests=6", "workload.prompt_len_max=40", "generation.max_new_tokens=12"]


def _run(tmp_path, name, overrides, restarts=0, world=2):
    env = {**os.environ, "RESHARD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # the restarted group needs a fresh store (NOTES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", str(restarts), "-m", "recipes.generate", f"hydra.run.dir={tmp_path / name}",
           *COMMON, *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(line)["output_ids"] for line in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
    return outputs, json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.parametrize("world,rank,step,sampling", [
    (2, 1, 5, []), (2, 0, 7, ["generation.temperature=0.8", "generation.seed=3"]), (4, 2, 6, []),
    (2, 0, 6, ["parallel.pp=2"]),  # pipeline stages: each stage's KV mirrored on the other
    (2, 1, 4, ["parallel=shift", "parallel.threshold=8"]),  # Shift: SP prefill, TP decode, one cache
])
def test_killed_rank_recovers_from_its_ring_neighbour(tmp_path, world, rank, step, sampling):
    expected, _ = _run(tmp_path, "ref", sampling, world=world)
    tokens, summary = _run(tmp_path, "ft", [*sampling, "fault.replicate=true", f"fault.kill_at=[{rank},{step}]"],
                           restarts=1, world=world)
    assert tokens == expected
    assert summary["failures"] == 1
    assert 0 < summary["recovered_from_step"] <= step and summary["recomputed_steps"] <= 1
    assert 0 <= summary["detected_after_s"] < 3.0  # within 3 heartbeats (1 s each), mostly at once
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("reshard-ft-")]  # cleaned up


def test_without_replication_the_job_restarts_from_scratch(tmp_path):
    expected, _ = _run(tmp_path, "ref", [])
    tokens, summary = _run(tmp_path, "scratch", ["fault.kill_at=[1,5]"], restarts=1)
    assert tokens == expected and summary["failures"] == 1 and "recovered_from_step" not in summary


def test_kill_at_is_validated():
    from recipes.config import FaultConfig

    with pytest.raises(ValueError, match=r"fault.kill_at must be \[rank, step\] \(two ints >= 0\) or null, got \[1\]"):
        FaultConfig(kill_at=[1])


def _heartbeat_job(period):
    import time

    import torch.distributed as dist

    from parallel.fault import Heartbeat, job_store

    rank = dist.get_rank()
    tag = [time.time_ns()]  # a fresh key space per call (the worker pool outlives one test)
    dist.broadcast_object_list(tag, src=0)
    store = job_store(tag[0])
    found = []
    beat = Heartbeat(store, rank, dist.get_world_size(), period=period, misses=3,
                     on_dead=lambda r, silent: found.append((r, silent, time.monotonic())))
    time.sleep(4 * period)  # everyone beating: nobody declared
    before = list(found)
    if rank == 1:
        beat.pause()  # rank 1 hangs (stops beating)
    t0 = time.monotonic()
    time.sleep(8 * period)
    beat.stop()
    assert beat.error is None, repr(beat.error)
    return before, [(r, silent, at - t0) for r, silent, at in found]


def test_a_silent_rank_is_declared_dead_within_three_heartbeats():
    from tests import dist_harness

    period = 0.25
    results = dist_harness.run(2, _heartbeat_job, period)
    assert results[0][0] == [] and results[1][0] == []  # no false alarm while both beat
    (rank, silent, after), = results[0][1]
    assert rank == 1 and 3 * period < silent <= 4 * period + 0.2 and after <= 4 * period + 0.3
    assert results[1][1] == []  # rank 1 still hears rank 0
