"""Failures stay in their engine group (``fault.migrate``): every rank's engine runs as a child of
the process torchrun watches, a dead engine is respawned inside the job while the other groups
keep serving, and its requests go on elsewhere (re-prefilled) or wait for its next generation;
tokens equal a failure-free run's, torchrun never restarts the job."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import dist_harness
from tests.test_recipe import _run_recipe

COMMON = ["progress=false", "workload.prompt_len_max=40", "engine.max_batch_size=2"]
# a warm spare is one more process per supervisor (forked from its fork server: its imports are
# done, but it holds memory). The tests of spares (a respawn taken by one; Ctrl-C stops them) and
# the each-rank-killed tests (their respawns must serve before the job ends) keep them on
BASE = [*COMMON, "fault.warm_spare=false"]
DP4 = [*COMMON, "parallel.tp=1", "workload.num_requests=32", "generation.max_new_tokens=32"]
# with migrate=kv the dead groups' requests leave at once: more work keeps the job on while respawns load
DP4_LONG = [*COMMON, "parallel.tp=1", "workload.num_requests=64", "generation.max_new_tokens=32"]
TP2x2 = [*BASE, "parallel.tp=2", "workload.num_requests=8", "generation.max_new_tokens=16"]
SAMPLED = ["generation.temperature=0.8", "generation.seed=3"]
DEJAVU = [  # prompt groups 0 and 1 (ranks 0, 1), token groups 2 and 3 (ranks 2, 3)
    *BASE, "parallel=dejavu", "parallel.prompt_ranks=2", "parallel.prompt.dp=2", "parallel.token.dp=2",
    "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED,
]  # fmt: skip
_REFERENCES: dict = {}
LIVES = ("started", "ready", "hung")  # a supervisor's events of its children's lives


@pytest.fixture
def reference(tmp_path_factory):
    """The failure-free, unsupervised run's tokens (the same recipe in the harness's process pool)."""

    def get(overrides, world):
        key = (world, tuple(overrides))
        if key not in _REFERENCES:
            run_dir = tmp_path_factory.mktemp("ref")
            dist_harness.run(world, _run_recipe, overrides, str(run_dir))
            lines = (run_dir / "outputs.jsonl").read_text().splitlines()
            _REFERENCES[key] = [json.loads(line)["output_ids"] for line in lines]
        return _REFERENCES[key]

    return get


def _command(tmp_path, overrides, world, restarts=0):
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        "--max-restarts", str(restarts), "-m", "reshard.recipes.generate", f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]  # fmt: skip


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(tmp_path, overrides, world, restarts=0):
    """A supervised job; its tokens, summary and supervisors' events. ``--max-restarts 0`` (by
    default): a failure that reached torchrun would end the job."""
    proc = subprocess.run(
        _command(tmp_path, overrides, world, restarts), cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=220,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    outputs = [json.loads(line)["output_ids"] for line in (run / "outputs.jsonl").read_text().splitlines()]
    return outputs, json.loads((run / "summary.json").read_text()), _events(run)


def _events(run):
    return [json.loads(line) for line in (run / "supervision.jsonl").read_text().splitlines()]


def _gone(events) -> bool:
    """Whether every child and spare the supervisors started has exited."""
    pids = {e["pid"] for e in events} | {e["spare"] for e in events if "spare" in e}
    return not [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _checkpoint_digest(path):
    """The weights digest of the checkpoint loaded on one rank (the layout of a DP group of one)."""
    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.recipes.supervised import weights_digest

    return weights_digest(Engine(parallelize(path), EngineConfig(max_batch_size=1, max_seq_len=64)))


def _never_waited(deaths) -> int:
    """Checks that nobody waited for a dead group, from the steps each other group journaled
    between the router's seeing a death and its seeing the group's next generation ready (or the
    end), in order, no seconds: one of the groups that served through that whole outage stepped
    on in it (the others may have had nothing left to run); returns for how many deaths some
    other group stepped on during the outage. Stepped on: more than once (a step under way when
    the death was seen ends in the outage even for a group that then waits)."""
    shown = 0
    for d in deaths:
        stepped = d["others_kept_stepping"]
        throughout = {e: stepped[e] for e in d["served_throughout"]}
        assert not throughout or max(throughout.values()) > 1, (d["endpoint"], throughout, deaths)
        shown += max(stepped.values(), default=0) > 1
    return shown


def test_each_rank_killed_in_turn_its_requests_move_with_their_kv(tmp_path, reference):
    expected = reference(DP4_LONG, 4)
    shm = _shm()
    # four engine groups of one rank; each rank's engine is SIGKILLed at a decode step, in turn
    kills = "fault.kill_at=[[0,3],[1,40],[2,80],[3,120]]"
    # contiguous slots, as the kill steps were placed for: the outages then span several steps of
    # the other groups (a paged group's steps are slower; its migrations are the paged test's below)
    contiguous = "engine.kv_block_size=null"
    tokens, summary, events = _run(tmp_path, [*DP4_LONG, contiguous, "fault.migrate=kv", kills], 4)
    assert _gone(events) and _shm() <= shm  # every process of the job ended, nothing left in /dev/shm
    assert tokens == expected
    assert summary["failures"] == 0  # torchrun never restarted the job
    deaths = summary["fault"]["deaths"]  # in the order the router saw them
    assert sorted(d["rank"] for d in deaths) == [0, 1, 2, 3] and all(d["exitcode"] == -signal.SIGKILL for d in deaths)
    assert sorted(d["endpoint"] for d in deaths) == ["0.0", "1.0", "2.0", "3.0"]
    assert _never_waited(deaths) >= 2  # nobody waited for a dead group
    # a dead group's requests moved with their KV to the next group, which mirrored it (when
    # that one was down too, they were prefilled again): at most replicate_every (1) position per
    # sequence computed again
    served_by = summary["fault"]["served_by"]
    _moved_with_kv(deaths, served_by, every=1, groups=4)
    # groups respawned in the job served again afterwards
    assert any(eps[-1].endswith(".1") for eps in served_by.values()), served_by
    # each respawned engine holds the checkpoint's weights, bit for bit, taken from a live replica
    # (through a link of their own) where one served, else read from the checkpoint
    (digest,) = dist_harness.run(1, _checkpoint_digest, _builtin())
    digests = summary["fault"]["weights_digest"]  # a respawn the job no longer needed may not have loaded
    assert sum("1" in digests[str(r)] for r in range(4)) >= 2, digests
    assert {d for per_rank in digests.values() for d in per_rank.values()} == {digest}
    sources = summary["fault"]["weights_from"]
    assert all(sources[r]["0"][0] == "checkpoint" for r in sources)
    assert any(k != "0" and src[0].split(".")[0] != r for r in sources for k, src in sources[r].items()), sources


def _moved_with_kv(deaths, served_by, every: int, groups: int) -> None:
    """Checks, for every death whose next group was up and lived on until it had stepped each of
    the dead one's requests (it never died, or its journal holds a token of each from after the
    death), that its requests went there and resumed with their KV (the mirror connector's) with
    at most ``every`` positions computed again; where that group is a first generation (it
    mirrored the dead one from the start), the others had no KV in the mirror yet (their last
    ``every`` steps included their prompt's). A respawned group holds what the dead one resent
    it whole when it came up, which a death soon after may cut short."""
    died = {d["endpoint"] for d in deaths}
    checked, moved = 0, set()  # moved: requests an earlier death moved (their KV may be lost twice)
    for d in deaths:
        first_move, moved = set(d["resumed"]) - moved, moved | set(d["resumed"])
        lived = d["adopted_by"] not in died or set(d["resumed"]) <= set(d["stepped_by_adopter"])
        if d["adopted_by"] is None or not lived:
            continue
        adopted = {rid for rid, _, _ in d["adopted"]}
        assert adopted <= set(d["resumed"]) and d["reprefilled_tokens"] == 0, d
        assert all(kept > 0 and again <= every for _, kept, again in d["adopted"]), d
        assert int(d["adopted_by"].split(".")[0]) == (int(d["endpoint"].split(".")[0]) + 1) % groups
        assert all(d["adopted_by"] in served_by[str(rid)] for rid in d["resumed"]), (d, served_by)
        if not d["adopted_by"].endswith(".0"):
            continue  # a respawned adopter: it holds what the dead one resent it whole when it came up
        checked += 1
        assert all(d["tokens_so_far"][str(rid)] <= every for rid in first_move - adopted), d
    assert checked, deaths


def _builtin() -> str:
    """The built-in checkpoint the jobs read from the session's ``RESHARD_CACHE``."""
    from reshard.parallel.model.tiny_models import builtin_checkpoint

    return str(builtin_checkpoint())


def test_a_tensor_parallel_group_restarts_together_its_requests_adopted_shard_by_shard(tmp_path, reference):
    expected = reference([*TP2x2, *SAMPLED], 4)
    # two groups of TP2 (seeded sampling); rank 3 dies, rank 2 (its group's other shard) is replaced with it
    tokens, summary, events = _run(tmp_path, [*TP2x2, *SAMPLED, "fault.migrate=kv", "fault.kill_at=[3,5]"], 4)
    assert tokens == expected and summary["failures"] == 0
    (death,) = summary["fault"]["deaths"]
    assert death["endpoint"] == "1.0" and death["rank"] == 3 and death["resumed"]
    assert [e["rank"] for e in events if e["event"] == "replaced"] == [2]
    served_by = summary["fault"]["served_by"]
    assert all(served_by[str(rid)] == ["1.0", "0.0"] for rid in death["resumed"]), served_by
    # group 0 mirrored both shards (rank 2's on rank 0, rank 3's on rank 1) and adopted them
    _moved_with_kv([death], served_by, every=1, groups=2)
    assert death["adopted"]
    digests = summary["fault"]["weights_digest"]  # generation 1 loaded unless the job ended first
    assert all(len(set(digests[r].values())) == 1 for r in "0123") and digests["2"]["0"] != digests["3"]["0"]
    assert _gone(events)


def test_pipeline_groups_lose_a_later_stage_and_a_first_stage_and_serve_on(tmp_path, reference):
    overrides = [*BASE, "parallel.tp=1", "parallel.pp=2", "workload.num_requests=8", "generation.max_new_tokens=16"]
    expected = reference([*overrides, *SAMPLED], 4)
    # DP2 x PP2: group 1's later stage (rank 3) dies, then group 0's first stage (rank 0, the
    # router's rank): both groups are down at once, their requests wait for a respawned group
    kills = ["fault.migrate=reprefill", "fault.kill_at=[[3,5],[0,12]]"]
    tokens, summary, events = _run(tmp_path, [*overrides, *SAMPLED, *kills], 4)
    assert tokens == expected and summary["failures"] == 0
    deaths = {d["endpoint"]: d for d in summary["fault"]["deaths"]}
    assert {e: d["rank"] for e, d in deaths.items()} == {"0.0": 0, "1.0": 3}, deaths
    assert sorted(e["rank"] for e in events if e["event"] == "replaced") == [1, 2]  # each stage's peer with it
    served_by = summary["fault"]["served_by"]
    moved = [rid for d in deaths.values() for rid in d["resumed"]]
    assert moved and all(len(served_by[str(rid)]) > 1 for rid in moved), (moved, served_by)
    assert sum(d["reprefilled_tokens"] for d in deaths.values()) == sum(
        n for d in deaths.values() for n in d["tokens_so_far"].values()
    )
    assert _gone(events)


def _prefilled_then_decoded(served_by, prompt_groups=(0, 1)) -> bool:
    """Whether every request was prefilled by a prompt group and decoded on by a token group last."""
    group = lambda e: int(e.split(".")[0])  # noqa: E731
    return all(group(eps[0]) in prompt_groups and group(eps[-1]) not in prompt_groups for eps in served_by.values())


def test_dejavu_token_rank_killed_its_requests_move_with_their_kv_to_the_other_token_group(tmp_path, reference):
    expected = reference(DEJAVU, 4)  # unsupervised DejaVu: prompt and token groups, KV streamed
    # a hand-off awaits its KV up to fault.handoff_wait_s: long enough for a machine under any load
    waits = "fault.handoff_wait_s=60"
    tokens, summary, events = _run(tmp_path, [*DEJAVU, "fault.migrate=kv", "fault.kill_at=[3,6]", waits], 4)
    assert tokens == expected and summary["failures"] == 0
    fault = summary["fault"]
    assert _prefilled_then_decoded(fault["served_by"]), fault["served_by"]
    # hand-offs are migrations from a live source: the prompt group's KV was adopted, nothing prefilled again
    assert len(fault["hand_offs"]) >= 4 and all(kept == 1 and again == 0 for _, _, kept, again in fault["hand_offs"])
    (death,) = fault["deaths"]
    assert death["endpoint"] == "3.0" and death["rank"] == 3 and death["adopted_by"] == "2.0"
    # its decoding requests went on in token group 2 with the KV group 2 mirrored: at most a token
    # again. The guarantee of replicate_every=1 (as _moved_with_kv's): a request that decoded more
    # than one step there (more than 1 + 1 tokens with its first) had its KV's first message out;
    # one that decoded one step may have lost its only message with the death (prefilled again)
    decoding = {rid for rid in death["resumed"] if death["tokens_so_far"][str(rid)] > 2}
    assert decoding and decoding <= {rid for rid, _, _ in death["adopted"]}, death
    assert all(again <= 1 for _, _, again in death["adopted"]) and death["reprefilled_tokens"] == 0
    assert _gone(events)


def test_dejavu_prompt_rank_killed_its_prompts_are_prefilled_again_into_a_paged_cache(tmp_path, reference):
    expected = reference(DEJAVU, 4)
    paged = ["engine.kv_block_size=4", "engine.kv_tokens=160"]
    tokens, summary, events = _run(tmp_path, [*DEJAVU, *paged, "fault.migrate=reprefill", "fault.kill_at=[1,1]"], 4)
    assert tokens == expected and summary["failures"] == 0
    fault = summary["fault"]
    (death,) = fault["deaths"]
    assert death["endpoint"] == "1.0" and death["rank"] == 1
    # what it had not prefilled yet was prefilled by the other prompt group (or its own next generation)
    assert death["restarted"] and not death["resumed"]
    assert all(fault["served_by"][str(rid)][:2] in (["1.0", "0.0"], ["1.0", "1.1"]) for rid in death["restarted"])
    assert _prefilled_then_decoded(fault["served_by"])
    assert fault["hand_offs"]  # into the token groups' paged caches
    assert _gone(events)


@pytest.mark.parametrize("strategy", ["seesaw", "sidp"])
def test_a_strategy_of_one_group_restarts_whole_in_the_job(tmp_path, reference, strategy):
    """Seesaw and SiDP run one engine group of every rank: a rank's death respawns the group in
    the job (no torchrun restart), its requests resume there with their tokens so far."""
    overrides = [*BASE, f"parallel={strategy}", "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED]
    expected = reference(overrides, 2)
    tokens, summary, events = _run(tmp_path, [*overrides, "fault.migrate=reprefill", "fault.kill_at=[1,6]"], 2)
    assert tokens == expected and summary["failures"] == 0
    (death,) = summary["fault"]["deaths"]
    assert death["endpoint"] == "0.0" and death["rank"] == 1 and death["resumed"] and death["rejoined_s"] is not None
    assert [e["rank"] for e in events if e["event"] == "replaced"] == [0]  # the whole group, in the job
    assert all(summary["fault"]["served_by"][str(rid)] == ["0.0", "0.1"] for rid in death["resumed"])
    assert _gone(events)


# Seesaw's first 4 steps prefill (8 prompts, 2 slots) into its CPU tier and step 4 changes its caches
# over: its decode cache, the one its supervisors keep, first holds KV at step 5, and the kill comes
# as many decode steps later as Shift's
@pytest.mark.parametrize("strategy,kill_step", [("shift", 6), ("seesaw", 11)])
def test_a_lockstep_group_respawned_resumes_with_the_kv_its_supervisors_kept(tmp_path, reference, strategy, kill_step):
    """Shift and Seesaw (one group of every rank) under ``fault.migrate=kv``: each rank's KV
    streams to its ring successor's supervisor (Seesaw's decode cache, whose prompts come from
    the CPU tier through its connector), which replays it to the group's next generation; the dead
    generation's requests resume there through the mirror connector (the same one migrations and
    hand-offs use) with at most replicate_every (1) position per sequence computed again."""
    overrides = [*BASE, f"parallel={strategy}", "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED]
    expected = reference(overrides, 2)
    shm = _shm()
    tokens, summary, events = _run(tmp_path, [*overrides, "fault.migrate=kv", f"fault.kill_at=[1,{kill_step}]"], 2)
    assert tokens == expected and summary["failures"] == 0
    (death,) = summary["fault"]["deaths"]
    assert death["endpoint"] == "0.0" and death["adopted_by"] == "0.1"
    assert [e["rank"] for e in events if e["event"] == "replaced"] == [0]  # the whole group, in the job
    adopted = {rid for rid, _, _ in death["adopted"]}
    assert adopted and adopted <= set(death["resumed"]), death
    assert all(kept > 0 and again <= 1 for _, kept, again in death["adopted"]), death
    # a resumed request not adopted had no more than replicate_every tokens: its prompt's KV was in flight
    assert all(death["tokens_so_far"][str(rid)] <= 1 for rid in set(death["resumed"]) - adopted), death
    assert all(summary["fault"]["served_by"][str(rid)] == ["0.0", "0.1"] for rid in death["resumed"])
    assert _gone(events) and _shm() <= shm


def test_kv_sent_every_three_steps_into_a_paged_cache_regenerates_at_most_three_tokens(tmp_path, reference):
    overrides = [*BASE, "parallel.tp=1", "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED]
    expected = reference(overrides, 2)  # contiguous KV, unsupervised
    kv = ["fault.migrate=kv", "fault.replicate_every=3", "fault.kill_at=[0,8]"]  # the router's rank's engine
    paged = ["engine.kv_block_size=4", "engine.kv_tokens=160"]  # blocks scattered over the pool by then
    tokens, summary, events = _run(tmp_path, [*overrides, *kv, *paged], 2)
    assert tokens == expected and summary["failures"] == 0
    (death,) = summary["fault"]["deaths"]
    assert death["endpoint"] == "0.0" and death["adopted_by"] == "1.0" and death["adopted"]
    _moved_with_kv([death], summary["fault"]["served_by"], every=3, groups=2)
    assert _gone(events)


def test_each_rank_killed_in_turn_without_kv_its_requests_are_prefilled_again_elsewhere(tmp_path, reference):
    expected = reference(DP4, 4)
    kills = "fault.kill_at=[[0,3],[1,40],[2,80],[3,120]]"
    tokens, summary, events = _run(tmp_path, [*DP4, "fault.migrate=reprefill", kills], 4)
    assert tokens == expected and summary["failures"] == 0
    deaths = summary["fault"]["deaths"]
    assert sorted(d["rank"] for d in deaths) == [0, 1, 2, 3]
    assert _never_waited(deaths) >= 2
    served_by = summary["fault"]["served_by"]
    for d in deaths:
        assert d["adopted"] == [] and d["adopted_by"] is None
        # prompt + every token so far prefilled again on a live group
        assert d["reprefilled_tokens"] == sum(d["tokens_so_far"].values())
        assert all(served_by[str(rid)][-1] != d["endpoint"] for rid in d["resumed"]), (d, served_by)
    assert sum(len(d["resumed"]) for d in deaths) > 0
    assert _gone(events)


def test_a_hung_group_is_killed_and_with_migrate_none_its_requests_wait_for_its_respawn(tmp_path, reference):
    overrides = [*COMMON, "parallel.tp=1", "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED]
    expected = reference(overrides, 2)
    hang = ["fault.migrate=none", "fault.kill_at=[1,5]", "fault.inject=hang", "fault.hung_after_s=4"]
    tokens, summary, events = _run(tmp_path, [*overrides, *hang], 2)
    assert tokens == expected and summary["failures"] == 0
    (death,) = summary["fault"]["deaths"]
    assert death["endpoint"] == "1.0" and death["hung"] and death["exitcode"] == -signal.SIGKILL
    (hung,) = [e for e in events if e["event"] == "hung"]  # SIGSTOPped: silent past fault.hung_after_s
    # (silent_s is the silence its supervisor compared with fault.hung_after_s: never below it)
    assert hung["rank"] == 1 and hung["endpoint"] == "1.0" and hung["silent_s"] >= 4, hung
    # rank 1's supervisor, in order: the child served, was killed as hung, and the respawn started
    lives = [(e["event"], e["endpoint"]) for e in events if e["rank"] == 1 and e["event"] in LIVES]
    assert lives[:4] == [("started", "1.0"), ("ready", "1.0"), ("hung", "1.0"), ("started", "1.1")], lives
    # its requests waited for the group's next generation, which served them
    waited, served_by = death["resumed"] + death["restarted"], summary["fault"]["served_by"]
    assert waited and death["rejoined_s"] is not None
    assert all(served_by[str(rid)] == ["1.0", "1.1"] for rid in waited), served_by
    # the respawn ran in the spare rank 1's supervisor started once its first child was ready
    spare = [e["spare"] for e in events if e["event"] == "spare" and e["rank"] == 1 and e["endpoint"] == "1.0"]
    started = [e["pid"] for e in events if e["event"] == "started" and e["endpoint"] == "1.1"]
    assert spare and started == spare[:1], (spare, started)
    digests = summary["fault"]["weights_digest"]  # the respawned engine loaded what the first did
    assert digests["1"]["0"] == digests["1"]["1"] and digests["0"]["0"] == digests["1"]["0"]
    assert _gone(events)


def test_the_routers_process_lost_torchrun_restarts_the_job_and_nothing_finished_runs_again(tmp_path, reference):
    overrides = [*BASE, "parallel.tp=1", "workload.num_requests=8", "generation.max_new_tokens=16", *SAMPLED]
    expected = reference(overrides, 2)
    # rank 0's supervisor (the router's process) SIGKILLed once 3 requests completed: the job's
    # fallback is torchrun's restart, which runs only what the first attempt had not finished
    lost = ["fault.migrate=kv", "fault.kill_router_after=3"]
    tokens, summary, events = _run(tmp_path, [*overrides, *lost], 2, restarts=1)
    assert tokens == expected and summary["failures"] == 1  # one whole-job restart
    assert summary["fault"]["kept_from_earlier_attempts"] >= 3
    assert not (tmp_path / "run" / "finished.jsonl").exists()  # outputs.jsonl holds them all
    assert _gone(events)  # the lost attempt's children and spares too


def test_ctrl_c_stops_every_supervisor_child_and_spare(tmp_path):
    shm = _shm()
    overrides = [*COMMON, "parallel.tp=1", "workload.num_requests=400", "generation.max_new_tokens=64"]
    proc = subprocess.Popen(
        _command(tmp_path, [*overrides, "fault.migrate=reprefill"], 2), cwd=tmp_path, env=_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    log = tmp_path / "run" / "supervision.jsonl"
    deadline = time.monotonic() + 150
    while not (log.exists() and sum(e["event"] == "spare" for e in _events(tmp_path / "run")) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: every process of the job gets it
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _gone(_events(tmp_path / "run")) and _shm() <= shm
    assert not (tmp_path / "run" / "outputs.jsonl").exists()


_FORKED = """
import multiprocessing as mp, os, sys
sys.path.insert(0, sys.argv[1])
import marker  # counts its imports in imports.txt
from reshard.parallel.fault.fork_server import fork_server

forked = fork_server(["marker"])
again = fork_server(["marker"])
server = mp.forkserver._forkserver._forkserver_pid
child = mp.get_context("forkserver").Process(target=marker.report, args=(sys.argv[1],))
child.start()
child.join()
same = open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read()
print(forked, again, server, child.exitcode, same)
"""


@pytest.mark.skipif(
    __import__("torch").version.cuda is not None or __import__("torch").version.hip is not None,
    reason="a CUDA or ROCm build starts its server afresh",
)
def test_a_rank_forks_its_fork_server_with_its_imports_and_the_server_ends_with_it(tmp_path):
    """The server is forked from the rank (its command line is the rank's, not multiprocessing's
    ``python -c``), its child runs with the rank's imports (imported once, by the rank), and the
    server ends when the rank does."""
    (tmp_path / "marker.py").write_text(
        "import os, sys\n"
        "open(os.path.join(os.path.dirname(__file__), 'imports.txt'), 'a').write(f'{os.getpid()}\\n')\n"
        "def report(d):\n"
        "    open(os.path.join(d, 'child.txt'), 'w').write(f'{os.getppid()} {\"marker\" in sys.modules}')\n"
    )
    proc = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    forked, again, server, code, same_command = proc.stdout.split()
    assert (forked, again, code, same_command) == ("True", "False", "0", "True")
    assert (tmp_path / "child.txt").read_text() == f"{server} True"  # forked by the server, marker loaded
    assert len((tmp_path / "imports.txt").read_text().split()) == 1  # by the rank alone
    for _ in range(100):  # the rank has ended: the server sees its alive pipe close and ends
        if _state(int(server)) == "Z":
            break
        time.sleep(0.05)
    assert _state(int(server)) == "Z"


_RANK_0 = """
import multiprocessing as mp, os, sys
sys.path.insert(0, sys.argv[1])
from reshard.recipes.launch import init_distributed

init_distributed(fork_server=["no_such_module", "marker"])  # alone: rank 0; a module that is not there is skipped
server = mp.forkserver._forkserver._forkserver_pid
import marker  # (imported already: no second line in imports.txt)
child = mp.get_context("forkserver").Process(target=marker.report, args=(sys.argv[1],))
child.start()
child.join()
print(os.getpid(), server, child.exitcode)
"""


@pytest.mark.skipif(
    __import__("torch").version.cuda is not None or __import__("torch").version.hip is not None,
    reason="a CUDA or ROCm build starts its server afresh",
)
def test_rank_0_imports_the_preload_before_its_fork_server_and_the_server_inherits_it(tmp_path):
    """Rank 0 needs the preload itself (transformers, for the tokenizer at the job's end): it
    imports it before forking its server, once, and the server's children have it, instead of
    the server importing it and rank 0 importing it again as the job ends. A preload's module
    that does not import (a guess from the checkpoint's model type) is skipped, as the server
    skips it."""
    (tmp_path / "marker.py").write_text(
        "import os, sys\n"
        "open(os.path.join(os.path.dirname(__file__), 'imports.txt'), 'a').write(f'{os.getpid()}\\n')\n"
        "def report(d):\n"
        "    open(os.path.join(d, 'child.txt'), 'w').write(f'{os.getppid()} {\"marker\" in sys.modules}')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-c", _RANK_0, str(tmp_path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rank, server, code = proc.stdout.split()
    assert code == "0"
    assert (tmp_path / "imports.txt").read_text().split() == [rank]  # by rank 0, before the fork, once
    assert (tmp_path / "child.txt").read_text() == f"{server} True"  # the server's child has it


_NODE = """
import multiprocessing as mp, os, sys
sys.path.insert(0, sys.argv[1])
from reshard.recipes.launch import init_distributed
from reshard.parallel.fault.fork_server import FromParent

init_distributed(fork_server=["marker"])
import marker  # (the target's module: rank 0 imported it already)
child = mp.get_context("forkserver").Process(target=marker.report, args=(sys.argv[1], FromParent()))
child.start()
child.join()
print(os.environ["RANK"], os.getpid(), child.exitcode, flush=True)
"""


@pytest.mark.skipif(
    __import__("torch").version.cuda is not None or __import__("torch").version.hip is not None,
    reason="a CUDA or ROCm build starts its server afresh",
)
def test_a_nodes_ranks_share_one_fork_server_and_each_child_has_its_ranks_environment_and_output(tmp_path):
    """Under torchrun, the first local rank forks the node's server and the other ranks start
    their children from it: the preload is imported by rank 0 alone (a server per rank would
    import it again), both children have the same parent, and each child runs with the
    environment and stdout of the rank that asked for it, not the server's."""
    (tmp_path / "marker.py").write_text(
        "import os, sys\n"
        "open(os.path.join(os.path.dirname(__file__), 'imports.txt'), 'a').write(f'{os.getpid()}\\n')\n"
        "def report(d, parent):\n"
        "    parent.apply()\n"
        "    rank = os.environ['RANK']\n"
        "    open(os.path.join(d, f'child{rank}.txt'), 'w').write(f'{os.getppid()} {\"marker\" in sys.modules}')\n"
        "    print(f'the child of rank {rank}', flush=True)\n"
    )
    (tmp_path / "node.py").write_text(_NODE)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "3"]
    proc = subprocess.run(
        [*command, str(tmp_path / "node.py"), str(tmp_path)], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "[default0]:the child of rank 0" in lines and "[default1]:the child of rank 1" in lines, lines
    ends = [m.groups() for m in map(re.compile(r"\[default(\d)\]:(\d) (\d+) (-?\d+)$").match, lines) if m]
    assert sorted((local, rank, code) for local, rank, _, code in ends) == [("0", "0", "0"), ("1", "1", "0")], lines
    pids = {rank: pid for _, rank, pid, _ in ends}
    assert sorted((tmp_path / "imports.txt").read_text().split()) == sorted(pids.values())  # no server imported it
    server0, server1 = ((tmp_path / f"child{r}.txt").read_text() for r in "01")
    assert server0 == server1 and server0.endswith(" True")  # one server, which holds the preload
    assert server0.split()[0] not in pids.values()


def test_a_rank_with_no_node_server_to_take_keeps_multiprocessings_own():
    """A local rank whose node has no shared server (its first rank forked none) takes nothing
    and leaves multiprocessing to start its own server when first asked."""
    code = (
        "import multiprocessing as mp, os\n"
        "from reshard.parallel.fault.fork_server import NodeShare, attach\n"
        "share = NodeShare(f'\\0reshard-test-nobody-{os.getpid()}', ranks=2, first=False)\n"
        "print(attach(share, timeout=5.0), mp.forkserver._forkserver._forkserver_address)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "None"]


def test_the_fork_server_preloads_what_the_command_line_names(tmp_path):
    """Only a supervised job's ranks fork a server; it preloads the model's modules (from the
    checkpoint's config.json; without model.path, the built-in Llama's) with the collector
    paused, then freezes them and resumes it."""
    from reshard.parallel.fault.fork_server import FROZEN, PAUSED
    from reshard.recipes.launch import _supervised_preload
    from reshard.recipes.supervised import WARM

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert _supervised_preload([]) is None and _supervised_preload(["fault.migrate=null"]) is None
    llama = _supervised_preload(["fault.migrate=kv"])
    assert llama[: len(WARM) + 1] == (PAUSED, *WARM) and "transformers.models.llama.modeling_llama" in llama
    assert llama[-1] == FROZEN
    qwen2 = _supervised_preload(["fault.migrate=none", f"model.path={tmp_path}"])
    assert "transformers.models.qwen2.modeling_qwen2" in qwen2 and qwen2[0] == PAUSED and qwen2[-1] == FROZEN
    assert _supervised_preload(["fault.migrate=kv", "model.path=org/on-the-hub"]) == (PAUSED, *WARM, FROZEN)


def test_supervised_settings_are_checked():
    from reshard.recipes.config import FaultConfig

    with pytest.raises(ValueError, match=re.escape("fault.migrate must be kv, reprefill, none or null, got 'kvv'")):
        FaultConfig(migrate="kvv")
    with pytest.raises(ValueError, match=re.escape("fault.replicate=true (the whole-job restart with a KV ring) is")):
        FaultConfig(migrate="reprefill", replicate=True)
    with pytest.raises(ValueError, match=re.escape("fault.max_respawns must be an int >= 0, got -1")):
        FaultConfig(migrate="none", max_respawns=-1)
    with pytest.raises(ValueError, match=re.escape("fault.handoff_wait_s must be > 0 seconds, got 0")):
        FaultConfig(migrate="kv", handoff_wait_s=0)
    from reshard.parallel.strategies.dejavu import DejaVuStrategy, SideConfig
    from reshard.recipes.config import GenerateConfig
    from reshard.recipes.supervised import engine_group_of

    sides = DejaVuStrategy(prompt=SideConfig(tp=2), token=SideConfig(dp=2), prompt_ranks=2)
    message = "parallel.prompt is tp=2 pp=1, parallel.token tp=1 pp=1"  # a prompt's KV must land rank for rank
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_group_of(GenerateConfig(parallel=sides, fault=FaultConfig(migrate="kv")), 4, 0)
    one_prompt_rank = DejaVuStrategy(token=SideConfig(dp=2), prompt_ranks=1)
    dejavu = GenerateConfig(parallel=one_prompt_rank, fault=FaultConfig(migrate="kv"))
    assert [engine_group_of(dejavu, 3, r)[:2] for r in range(3)] == [(0, (0,)), (1, (1,)), (2, (2,))]
    assert engine_group_of(dejavu, 3, 0)[2].successor(0, kv=False) == 1  # the prompt group's KV: to token group 1


def _refused(overrides, run_dir):
    with pytest.raises(ValueError) as err:
        _run_recipe(overrides, run_dir)
    return str(err.value)


def test_kv_for_sidp_or_in_pipelines_is_refused(tmp_path):
    refused = [
        ("sidp", [], "runs a replica per rank"),
        (
            "seesaw",
            ["parallel.decode.dp=2", "parallel.decode.tp=1"],
            "decodes in 2 replicas x 1 pipeline stages (parallel.decode.dp/pp must be 1)",
        ),
    ]
    for strategy, layout, why in refused:
        overrides = [*BASE, f"parallel={strategy}", *layout, "fault.migrate=kv"]
        for message in dist_harness.run(2, _refused, overrides, str(tmp_path)):
            assert message == (
                "fault.migrate=kv keeps each rank's KV cache of one lockstep group in its supervisors for the group's "
                f"next generation; parallel.strategy={strategy!r} {why} (use fault.migrate=reprefill or none)"
            )
    overrides = [*BASE, "parallel.pp=2", "fault.migrate=kv"]
    for message in dist_harness.run(2, _refused, overrides, str(tmp_path)):
        assert message.startswith("fault.migrate=kv adopts KV on every rank of a group") and "parallel.pp=2" in message


def test_the_router_continues_a_dead_generations_requests_from_its_journal():
    """In one process, over an in-memory store: generation 0 of group 1 journals two steps and
    dies; its running request resumes with its tokens, its finished one completes from the
    journal, the one it never started starts over; migrate=none holds them for generation 1."""
    import pickle

    import torch.distributed as dist

    from reshard.parallel import Request
    from reshard.parallel.engine.channel import Channel, Topology
    from reshard.parallel.engine.router import Router
    from reshard.parallel.engine.sampling import SamplingParams
    from reshard.parallel.fault.journal import JournalEntry

    for migrate in ("reprefill", "none"):
        store = dist.HashStore()
        channel, generations = Channel("t", store=store), [0, 0]
        requests = [Request(i, [5 + i] * 3, SamplingParams(max_new_tokens=3)) for i in range(3)]
        router = Router(
            channel,
            requests,
            Topology.ring(2),
            time.time(),
            "round_robin",
            migrate,
            lambda g, gens=generations: gens[g],
        )
        for r in requests:
            router.pending.remove(r)
            router._send("1.0", r)
        steps = [((0, 0, 11, None), (1, 0, 21, None)), ((0, 1, 12, None), (1, 1, 22, None)), ((1, 2, 23, "length"),)]
        for tokens in steps:
            channel.store.append("journal/1.0", pickle.dumps(JournalEntry(time.time(), tokens)))
        generations[1] = 1
        router._watch()
        (m,) = router.migrations
        assert (m.endpoint, m.resumed, m.completed, m.restarted) == ("1.0", [0], [1], [2])
        done = router.book.completions[1]
        assert done.output_ids == [21, 22, 23] and done.finish_reason == "length"
        waiting = router.pending if migrate == "reprefill" else router.held[1]
        resumed, restarted = waiting
        assert resumed.prompt_ids == [5, 5, 5, 11, 12] and resumed.resumed == 2
        assert resumed.sampling.max_new_tokens == 1 and restarted is requests[2]
        assert "1.0" not in router.groups
        # what the router saw, in order, with the steps each endpoint had journaled then (no clock)
        assert router.observed == [("died", "1.0")] and (m.order, m.steps) == (0, {"1.0": 3})
        step = pickle.dumps(JournalEntry(time.time(), ((9, 0, 1, None),)))
        channel.store.append("journal/0.0", step)  # group 0 steps while group 1 is down
        router._watch()
        assert m.steps_down == {"0.0": 1, "1.0": 3} and m.rejoined is None
        channel.store.append("journal/0.0", step)  # ... and once more, as generation 1 gets ready
        channel.put("ready/1.1", time.time())  # generation 1 is ready
        router._watch()
        assert "1.1" in router.groups and m.rejoined is not None
        assert router.observed == [("died", "1.0"), ("ready", "1.1")] and m.rejoined_order == 1
        assert m.steps_down == {"0.0": 1, "1.0": 3}  # counted while it was down: not the step that may have followed
        if migrate == "none":  # handed to generation 1 of their group
            assert router.held == {} and [router.where[r.id] for r in waiting] == ["1.1", "1.1"]


def test_the_router_hands_a_prefilled_request_to_the_token_group_its_prompt_group_streams_to():
    """DejaVu under supervision, in one process: a prompt group runs a request to its first token;
    its completion there is a hand-off, sent on resumed after its first token with ``kv_source``
    naming that prompt group, to the token group it streams its KV to, or, that one down, to another; a request whose
    first token ends it completes there."""
    import torch.distributed as dist

    from reshard.parallel import Request
    from reshard.parallel.engine.channel import Channel, Topology
    from reshard.parallel.engine.request import Completion
    from reshard.parallel.engine.router import Router
    from reshard.parallel.engine.sampling import SamplingParams

    channel, topology = Channel("t", store=dist.HashStore()), Topology.disaggregated(2, 2)
    assert [topology.successor(g, kv=True) for g in range(4)] == [2, 3, 3, 2] and topology.sources(2, False) == (0,)
    requests = [Request(i, [7] * 4, SamplingParams(max_new_tokens=m)) for i, m in enumerate((5, 1, 5))]
    router = Router(channel, requests, topology, time.time(), "round_robin", "kv", lambda g: 0)
    for r, entry in zip(requests, ("1.0", "0.0", "0.0")):
        router.pending.remove(r)
        router._send(entry, r)
    assert all(channel.get(f"assign/{e}/0").sampling.max_new_tokens == 1 for e in ("0.0", "1.0"))  # prefill only
    router.takers.remove("3.0")  # token group 3 is down: prompt group 1's hand-off goes to group 2
    for rid, token in ((0, 40), (1, 41), (2, 42)):
        channel.append("done", Completion(rid, [7] * 4, [token], "length"))
    router._collect()
    assert list(router.book.completions) == [1]  # its one token was all it wanted
    handed = [channel.get(f"assign/2.0/{k}") for k in range(2)]
    assert [(m.id, m.prompt_ids, m.resumed, m.kv_source, m.sampling.max_new_tokens) for m in handed] == [
        (0, [7] * 4 + [40], 1, "1.0", 4),  # its first token is output; 4 more to come
        (2, [7] * 4 + [42], 1, "0.0", 4),
    ]
    assert router.where == {0: "2.0", 2: "2.0"}
    # back-pressure: prompt group 0 gets no more while token group 2 holds twice its slots
    from reshard.parallel.engine.channel import Load

    channel.put("load/0.0", Load(2, 1000, 2))  # it took both it was sent
    channel.put("load/2.0", Load(1, 1000, 2))  # one slot: a backlog of 2 is full
    assert router._room("0.0") == (0, 0)
    channel.put("load/2.0", Load(2, 1000, 2))  # two slots: room for two more
    assert router._room("0.0") == (2, 1000)
    channel.put("load/1.0", Load(2, 1000, 1))
    assert router._room("1.0") == (0, 0)  # the token group it streams to is down: its KV would go nowhere


def test_a_resumed_request_samples_what_it_would_have():
    """Resuming after k tokens: the generator skips k draws, the completion has the whole output."""
    import torch

    from reshard.parallel import Request
    from reshard.parallel.engine.request import Sequence
    from reshard.parallel.engine.sampling import SamplingParams, sample_tokens

    params = SamplingParams(max_new_tokens=6, temperature=0.9, seed=4)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    whole = Sequence.of(Request(7, [1, 2, 3], params), (), 50)
    drawn = [int(sample_tokens(logits[i : i + 1], [params], [whole.generator])[0]) for i in range(6)]
    resumed = Sequence.of(Request(7, [1, 2, 3], params).resume(drawn[:4]), (), 50)
    later = [int(sample_tokens(logits[i : i + 1], [params], [resumed.generator])[0]) for i in (4, 5)]
    assert later == drawn[4:]
    for t in later:
        resumed.append(t)
    c = resumed.completion()
    assert c.prompt_ids == [1, 2, 3] and c.output_ids == drawn and c.finish_reason == "length"
