"""Fault tolerance: a rank SIGKILLed mid-decode, torchrun restarts the job, KV comes back from
the ring successors' mirrors and the journal replays the finished steps; the final tokens equal
a failure-free run's (greedy and seeded sampling), at most one step recomputed."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests import dist_harness
from tests.test_recipe import _run_recipe

COMMON = ["progress=false", "workload.num_requests=6", "workload.prompt_len_max=40", "generation.max_new_tokens=12"]


SEESAW = ["parallel=seesaw", "engine.max_batch_size=2"]  # PP2 prefill, TP2 decode, 2 decode slots
SEESAW_DP2 = [*SEESAW, "parallel.decode.dp=2", "parallel.decode.tp=1"]  # decode in 2 replicas


def _launch(tmp_path, name, overrides, restarts=0, world=2):
    env = {**os.environ, "RESHARD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        str(restarts),
        "-m",
        "reshard.recipes.generate",
        f"hydra.run.dir={tmp_path / name}",
        *COMMON,
        *overrides,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)


def _run(tmp_path, name, overrides, restarts=0, world=2):
    proc = _launch(tmp_path, name, overrides, restarts, world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(line)["output_ids"] for line in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
    return outputs, json.loads((tmp_path / name / "summary.json").read_text())


SAMPLED = ["generation.temperature=0.8", "generation.seed=3"]
_REFERENCES: dict = {}


@pytest.fixture
def reference(tmp_path_factory):
    """The failure-free run's tokens for (world, overrides), once per session: the same recipe
    (``run_generate``) in the test harness's process pool, which saves a torchrun job per reference."""

    def get(overrides, world=2):
        key = (world, tuple(overrides))
        if key not in _REFERENCES:
            run_dir = tmp_path_factory.mktemp("ref")
            cache = f"model.cache_dir={run_dir / 'cache'}"
            dist_harness.run(world, _run_recipe, [*COMMON, *overrides, cache], str(run_dir))
            lines = (run_dir / "outputs.jsonl").read_text().splitlines()
            _REFERENCES[key] = [json.loads(line)["output_ids"] for line in lines]
        return _REFERENCES[key]

    return get


def _on(world, **degrees) -> dict:
    """A layout over the whole job, as ``summary.json``'s ``parallel`` reports it."""
    return {"dp": 1, "pp": 1, "sp": 1, "tp": 1, **degrees, "ranks": list(range(world))}


@pytest.mark.parametrize(
    "world,rank,step,sampling,layouts,every",
    [
        # fault.replicate_every=3: steps 0-2 landed at step 3, steps 3-4 lost with the kill at step 5
        (2, 1, 5, [], {"main": _on(2, tp=2)}, 3),
        (2, 0, 6, ["parallel.tp=1"], {"main": _on(2, dp=2)}, 3),
    ]
    + [
        (*case, 1)
        for case in [
            # TP2 sampled, rank 0 killed (greedy, rank 1, whose ring edge wraps: the cases above)
            (2, 0, 7, SAMPLED, {"main": _on(2, tp=2)}),
            # pipeline stages: each stage's KV mirrored on the other
            (2, 0, 6, ["parallel.pp=2"], {"main": _on(2, pp=2)}),
            # Shift: SP prefill, TP decode, one cache
            (2, 1, 4, ["parallel=shift", "parallel.threshold=8"], {"sp": _on(2, sp=2), "tp": _on(2, tp=2)}),
            # Seesaw: at step 16 the second pair decodes (its prompts came from the CPU tier, streamed
            # whole to the mirror) and the third waits in the tier
            (2, 1, 16, SEESAW, {"prefill": _on(2, pp=2), "decode": _on(2, tp=2)}),
            # data-parallel replicas (a rank mirrors another replica's sequences): the DP2
            # replicate_every=3 case above; Seesaw decoding in DP2
            (2, 1, 10, SEESAW_DP2, {"prefill": _on(2, pp=2), "decode": _on(2, dp=2)}),
            # SiDP: every rank a replica, FFNs in the owner pool
            (2, 1, 5, ["parallel=sidp"], {"main": _on(2, dp=2)}),
        ]
    ],
)
def test_killed_rank_recovers_from_its_ring_neighbour(tmp_path, reference, world, rank, step, sampling, layouts, every):
    expected = reference(sampling, world)
    ft = ["fault.replicate=true", f"fault.kill_at=[{rank},{step}]", f"fault.replicate_every={every}"]
    tokens, summary = _run(tmp_path, "ft", [*sampling, *ft], restarts=1, world=world)
    assert tokens == expected
    assert summary["parallel"] == layouts  # every layout the run used
    assert summary["failures"] == 1
    assert 0 < summary["recovered_from_step"] <= step and summary["recomputed_steps"] <= every
    assert every == 1 or summary["recomputed_steps"] > 0  # the kill falls between two messages
    # the first survivor noticed through a collective that failed, torchrun's stop, or a heartbeat
    # declaring the killed rank dead after its checks found it silent (3; a 4th if a check woke early)
    by = summary["detected_by"]
    assert by["how"] in ("collective", "torchrun") or (by["how"] == "heartbeat" and by["silent_checks"] in (3, 4)), by
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("reshard-ft-")]  # cleaned up


def test_without_replication_the_job_restarts_from_scratch(tmp_path, reference):
    expected = reference([])
    tokens, summary = _run(tmp_path, "scratch", ["fault.kill_at=[1,5]"], restarts=1)
    assert tokens == expected and summary["failures"] == 1 and "recovered_from_step" not in summary


def test_a_hung_rank_is_declared_dead_by_heartbeats_and_recovered(tmp_path, reference):
    expected = reference([])
    # rank 1 stops at step 5, heartbeats too: rank 0 waits in an all-reduce until its heartbeat
    # thread declares rank 1 dead (3 silent periods of 0.5 s) and leaves; torchrun restarts both
    tokens, summary = _run(
        tmp_path,
        "ft",
        ["fault.replicate=true", "fault.kill_at=[1,5]", "fault.inject=hang", "fault.heartbeat_s=0.5"],
        restarts=1,
    )
    assert tokens == expected and summary["failures"] == 1 and summary["recomputed_steps"] <= 1
    # no collective breaks: the heartbeat declared it dead, after 3 checks that found its counter
    # still (a 4th if a check woke early), not at the first silent check nor never
    assert summary["detected_by"]["how"] == "heartbeat" and summary["detected_by"]["silent_checks"] in (3, 4)


def test_a_second_failure_during_recovery_recovers_again(tmp_path, reference):
    expected = reference([])
    # attempt 0 loses rank 1 at step 8; attempt 1 loses rank 0 at step 4 of its replay
    tokens, summary = _run(tmp_path, "ft", ["fault.replicate=true", "fault.kill_at=[[1,8],[0,4]]"], restarts=2)
    assert tokens == expected and summary["failures"] == 2
    assert summary["recovered_from_step"] == 7 and summary["recomputed_steps"] == 0  # attempt 1 kept the journal


def test_a_failure_after_the_last_restart_ends_the_job_and_keeps_what_finished(tmp_path, reference):
    expected = reference(SEESAW)
    # attempt 1 (the last that --max-restarts 1 allows) loses rank 0 at step 14 of its replay; the
    # first pair of requests finished at step 13
    proc = _launch(tmp_path, "ft", [*SEESAW, "fault.replicate=true", "fault.kill_at=[[1,16],[0,14]]"], restarts=1)
    assert proc.returncode != 0
    finished = tmp_path / "ft" / "finished.jsonl"
    assert (
        f"in attempt 1: it was the last attempt torchrun allows, the job ends. Requests that finished are in {finished}"
    ) in proc.stderr
    kept = [json.loads(line) for line in finished.read_text().splitlines()]
    assert len(kept) == 2 and all(k["output_ids"] == expected[k["id"]] for k in kept)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("reshard-ft-")]


def test_disaggregated_kv_is_refused(tmp_path):
    proc = _launch(tmp_path, "dejavu", ["parallel=dejavu", "fault.replicate=true"])
    assert proc.returncode != 0
    assert (
        "fault tolerance replicates the 'prompt' runner's KV cache; runners ['token'] keep KV of their "
        "own that nothing replicates"
    ) in proc.stderr


def _refused_job(path, run_id):
    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.parallel.fault import FaultTolerance

    engine = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=64, kv_block_size=16, kv_tokens=128))
    with pytest.raises(ValueError) as err:
        FaultTolerance(engine, run_id)
    return str(err.value), os.path.exists(f"/dev/shm/reshard-ft-{run_id}")


def test_a_cache_it_cannot_replicate_is_refused(checkpoints):
    from tests import dist_harness

    for message, left in dist_harness.run(2, _refused_job, checkpoints["llama"], f"refused-{os.getpid()}"):
        assert message == (
            "fault tolerance needs a contiguous KV cache; the 'main' runner's is paged "
            "(kv_block_size=16): drop engine.kv_block_size"
        )
        assert not left


def test_directories_of_jobs_whose_agent_is_gone_are_removed(tmp_path):
    from reshard.parallel.fault import remove_orphans

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for name, owner in [("dead", ended.stdout.strip()), ("alive", str(os.getpid())), ("starting", None)]:
        (tmp_path / f"reshard-ft-{name}").mkdir()
        if owner is not None:
            (tmp_path / f"reshard-ft-{name}" / "owner").write_text(owner)
    assert remove_orphans(tmp_path) == [tmp_path / "reshard-ft-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reshard-ft-alive", "reshard-ft-starting"]


def test_kill_at_is_validated():
    from reshard.recipes.config import FaultConfig

    for bad in ([1], [[1, 2], [3]], [1, -2], []):
        with pytest.raises(
            ValueError,
            match=r"fault.kill_at must be \[rank, step\] \(two ints >= 0\), a list "
            r"of them \(one per attempt\) or null, got ",
        ):
            FaultConfig(kill_at=bad)
    assert FaultConfig(kill_at=[[1, 16], [0, 14]]).kills() == [(1, 16), (0, 14)]
    assert FaultConfig(kill_at=[2, 5]).kills() == [(2, 5)]
    with pytest.raises(ValueError, match=re.escape("fault.inject must be kill or hang, got 'freeze'")):
        FaultConfig(inject="freeze")
    with pytest.raises(ValueError, match=re.escape("fault.inject=hang needs fault.replicate=true")):
        FaultConfig(kill_at=[1, 5], inject="hang")


def _heartbeat_job(period, misses):
    """Both ranks beat until each has heard the other beat ``misses + 1`` times; then rank 1 stops
    beating (it hangs, still watching) and rank 0 waits for its monitor to declare rank 1 dead.
    Returns the monitor's events, how many of them came before rank 1 stopped beating, and the
    last beat this rank published."""
    import time

    import torch.distributed as dist

    from reshard.parallel.fault import Heartbeat, job_store

    rank = dist.get_rank()
    peer = 1 - rank
    tag = [time.time_ns()]  # a fresh key space per call (the worker pool outlives one test)
    dist.broadcast_object_list(tag, src=0)
    store = job_store(tag[0])
    beat = Heartbeat(store, rank, 2, period=period, misses=misses, on_dead=lambda r, silent: None)

    def until(done, what: str) -> None:  # a guard against a hang, not a measurement
        deadline = time.monotonic() + 100 * period
        while not done():
            assert time.monotonic() < deadline, f"rank {rank}: never {what}: {list(beat.events)}"
            time.sleep(period / 10)

    until(lambda: [e[:2] for e in beat.events.copy()].count(("beat", peer)) > misses, f"heard rank {peer} beat")
    dist.barrier()  # both have heard the other beat
    stopped_at = len(beat.events)
    if rank == 1:
        beat.pause()  # rank 1 hangs (stops beating)
    else:
        until(lambda: beat.detected, "declared rank 1 dead")
    dist.barrier()
    beat.stop()
    assert beat.error is None, repr(beat.error)
    return list(beat.events), stopped_at, int(store.get(f"hb/{rank}"))


def test_a_silent_rank_is_declared_dead_within_three_heartbeats():
    """What each rank's monitor saw of the other, in order: rank 0 heard rank 1 beat (no false
    alarm), heard its last beat, missed it at the next checks and declared it dead at the third;
    rank 1, silent itself, kept hearing rank 0 and declared nothing."""
    from tests import dist_harness

    misses = 3
    (seen_by_0, stopped_at_0, _), (seen_by_1, stopped_at_1, last_beat_1) = dist_harness.run(
        2, _heartbeat_job, 0.25, misses
    )
    assert {r for _, r, _ in seen_by_0} == {1} and {r for _, r, _ in seen_by_1} == {0}
    heard = [(event, n) for event, _, n in seen_by_0]
    assert "dead" not in [event for event, _ in heard[:stopped_at_0]]  # no false alarm while rank 1 beat
    last = max(i for i, (event, _) in enumerate(heard) if event == "beat")
    assert heard[last] == ("beat", last_beat_1)  # rank 0 heard rank 1's last beat, then only silence:
    assert heard[last + 1 :] == [("miss", last_beat_1)] * (misses - 1) + [("dead", last_beat_1)], heard
    heard_by_1 = [event for event, _, _ in seen_by_1]
    assert "dead" not in heard_by_1 and "beat" in heard_by_1[stopped_at_1:]  # rank 1 still hears rank 0
