"""Engine groups: data-parallel replicas that each run the one loop on their own, fed by the
router; online arrivals with latency figures. Every token is compared with HF ``generate``."""

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts


def _requests(prompts, max_new, arrivals=None, temperature=0.0):
    """``max_new``: one count for all, or one per request."""
    from reshard.parallel import Request, SamplingParams

    lengths = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    arrivals = arrivals or [0.0] * len(prompts)
    return [
        Request(i, p, SamplingParams(max_new_tokens=n, temperature=temperature, top_k=40, seed=7), arrival=a)
        for i, (p, n, a) in enumerate(zip(prompts, lengths, arrivals))
    ]


def _grouped(path, prompts, max_new, *, routing="least_loaded", arrivals=None, temperature=0.0, replicas="groups"):
    """Every rank a data-parallel replica of TP(1): (tokens, each group's step count, timings)."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize

    model = parallelize(path, ParallelDims.from_world(dp=dist.get_world_size()))
    engine = Engine(model, EngineConfig(max_batch_size=2, max_seq_len=128, routing=routing, replicas=replicas))
    completions = engine.generate(_requests(prompts, max_new, arrivals, temperature))
    steps = [s.prefill_steps + s.mixed_steps + s.decode_steps for s in engine.group_stats]
    return [c.output_ids for c in completions], steps, [c.timing for c in completions], engine.engine_group


@pytest.mark.parametrize("world,routing", [(2, "least_loaded"), (4, "round_robin"), (2, "longest_first")])
def test_data_parallel_groups_match_hf_and_step_on_their_own(checkpoints, hf_reference, world, routing):
    path, prompts = checkpoints["llama"], _prompts(7)
    # the group given request 0 takes >= MAX_NEW steps; any other takes <= 6 prefills + 3 decodes
    # whatever the routing, so groups that step on their own cannot all take as many steps
    lengths = [MAX_NEW, 1, 3, 1, 2, 1, 1]
    expected = [t[:n] for t, n in zip(hf_reference(path, prompts, MAX_NEW), lengths)]
    results = dist_harness.run(world, _grouped, path, prompts, lengths, routing=routing)
    for rank, (tokens, steps, timings, group) in enumerate(results):
        assert tokens == expected  # every rank gets every group's completions
        assert group.index == rank and group.count == world and group.ranks == (rank,)
        assert len(steps) == world and steps == results[0][1]
        assert all(t is not None and t.arrival == 0 for t in timings)
    assert len(set(results[0][1])) > 1  # the groups took different numbers of steps: not lockstep


def test_groups_sample_as_lockstep_replicas_do(checkpoints):
    """Seeded sampling: a request's tokens do not depend on which group ran it."""
    path, prompts = checkpoints["qwen3"], _prompts(6)
    grouped = dist_harness.run(2, _grouped, path, prompts, 8, temperature=0.9)
    lockstep = dist_harness.run(2, _grouped, path, prompts, 8, temperature=0.9, replicas="lockstep")
    assert grouped[0][0] == lockstep[0][0] == grouped[1][0]
    assert lockstep[0][3] is None  # lockstep replicas are one group


def _poisson(n, rate, seed):
    from reshard.parallel.engine.workload import poisson_arrivals

    return poisson_arrivals(n, rate, seed)


@pytest.mark.parametrize("world", [1, 2])
def test_online_arrivals_give_offline_tokens_and_wait_for_arrival(checkpoints, hf_reference, world):
    path, prompts = checkpoints["llama"], _prompts(6)
    arrivals = _poisson(len(prompts), rate=20.0, seed=3)
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    expected = hf_reference(path, prompts, MAX_NEW)
    for tokens, _steps, timings, _ in dist_harness.run(world, _grouped, path, prompts, MAX_NEW, arrivals=arrivals):
        assert tokens == expected
        for t, arrival in zip(timings, arrivals):
            assert t.arrival == arrival
            assert t.started >= arrival  # never before it arrived
            assert t.arrival <= t.first_token <= t.finished and t.tokens == MAX_NEW
            assert t.ttft >= 0 and t.tpot >= 0 and t.queued >= 0
            assert t.normalized == pytest.approx(t.latency / MAX_NEW)


def _router_gone(path):
    """Rank 0 (the router) never serves; rank 1's group must fail by name, not hang."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize

    model = parallelize(path, ParallelDims.from_world(dp=2))
    engine = Engine(model, EngineConfig(max_batch_size=2, max_seq_len=128, group_timeout=2.0))
    if dist.get_rank() == 0:
        return None
    try:
        engine.generate(_requests([[5, 6, 7]], 2))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_group_whose_router_is_gone_fails_by_name(checkpoints):
    # the error names the wait and the group_timeout it gave up after (a group that waited on
    # instead would end the job by the harness's timeout); no wall-clock figure is asserted
    _, message = dist_harness.run(2, _router_gone, checkpoints["llama"])
    assert message.startswith("engine group 1 waiting for the router's start time: nothing arrived within 2 s"), message


def test_a_wait_gives_up_only_after_its_timeout(monkeypatch):
    """``Channel.wait`` on a clock of the test's own (each sleep, and each wait for its bell, moves
    it on): it looks, waits, looks again, and raises at its first look past the deadline, naming
    the limit; every look before found nothing. The order of its looks and the deadline, not the
    wall clock."""
    import datetime
    import types

    import torch.distributed as dist

    from reshard.parallel.engine import channel as control

    now = [1000.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(control, "time", clock)
    looks = []
    channel = control.Channel("t", store=dist.HashStore())
    channel.bell = types.SimpleNamespace(wait=clock.sleep, clear=lambda: None)  # (never rung)
    with pytest.raises(RuntimeError, match=r"^waiting for start: nothing arrived within 2 s"):
        channel.wait("start", "waiting for start", datetime.timedelta(seconds=2), poll=lambda: looks.append(now[0]))
    assert len(looks) > 1 and looks[0] == 1000.0 and max(looks) <= 1002.0 < now[0], looks


def test_percentiles_interpolate_between_closest_ranks():
    from reshard.parallel.engine.metrics import percentiles

    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    got = percentiles(values)
    assert got["p50"] == pytest.approx(3.5) and got["p90"] == pytest.approx(6.9) and got["p99"] == pytest.approx(8.79)
    assert got["mean"] == pytest.approx(3.875)
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0, "mean": 2.0}


def test_a_request_listed_late_but_arriving_first_is_admitted_first():
    import time

    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine.admission import LocalAdmission

    params = SamplingParams(max_new_tokens=2)
    requests = [Request(0, [5, 6], params, arrival=30.0), Request(1, [7], params, arrival=0.0)]
    admission = LocalAdmission(requests, time.time(), leader=True)
    assert admission.initial() == [] and admission.proposal() == 1  # request 1 has arrived
    assert [r.id for r in admission.take(1)] == [1]


def test_bad_group_timeout_is_named():
    from reshard.parallel import Engine, EngineConfig

    with pytest.raises(ValueError, match=r"group_timeout must be > 0 seconds .*got 0"):
        Engine(runners={"main": None}, config=EngineConfig(group_timeout=0))


def test_polling_backs_off_to_its_cap_however_long_it_waits():
    from reshard.parallel.engine.channel import POLL_S, backoff

    # an idle group polls for hours: 2**tries once overflowed a float after 1024 looks
    assert backoff(0) == POLL_S[0] and backoff(3) == 8 * POLL_S[0]
    assert backoff(1024) == backoff(10**6) == POLL_S[1]


def test_an_endpoint_is_text_with_typed_parts():
    """The router's name for a group's generation: a ``str`` (stores, journals and summary.json
    carry it as text, and it keys the same dict entries as its text) with its group and
    generation read once, and a name of another form refused in one line naming it."""
    import json

    from reshard.parallel.engine.admission import Endpoint, endpoint_of

    e = endpoint_of(3, 2)
    assert e == "3.2" and (e.group, e.generation) == (3, 2) and {"3.2": 1}[e] == 1
    assert json.loads(json.dumps({"served_by": [e]})) == {"served_by": ["3.2"]}
    assert Endpoint(json.loads(json.dumps(e))).group == 3
    for bad in ("0:7", "checkpoint", "1.", ".1", "a.b"):
        with pytest.raises(ValueError, match=r"an endpoint is '<group>.<generation>' \(two integers\), got"):
            Endpoint(bad)


def test_a_leader_puts_its_load_in_the_store_only_when_it_changed(monkeypatch):
    """Each step's report puts the group's :class:`Load` in the store, a round trip on the step's
    path, only when it differs from the last one put (its free room or the assignments taken):
    the router reads the same value either way."""
    import torch.distributed as dist

    from reshard.parallel.engine import channel as control
    from reshard.parallel.engine.admission import RoutedAdmission

    monkeypatch.setattr(control.dist, "get_rank", lambda group=None: 0)  # (the group's leader)
    channel, puts = control.Channel("t", store=dist.HashStore()), []
    put = channel.put
    monkeypatch.setattr(channel, "put", lambda key, value: (puts.append((key, value)), put(key, value))[1])
    admission = RoutedAdmission(channel, control.GroupLayout(0, 1, (0,)))
    for free in (4, 4, 3, 3, 3, 4):
        admission.report(control.Load(free, 100 * free, 0), [])
    admission.taken += 1  # an assignment taken into its queue
    admission.report(control.Load(4, 400, 0), [])
    assert [(key, load.free_slots, load.taken) for key, load in puts] == [
        ("load/0.0", 4, 0), ("load/0.0", 3, 0), ("load/0.0", 4, 0), ("load/0.0", 4, 1),
    ]  # fmt: skip
    assert channel.get("load/0.0") == control.Load(4, 400, 1)


def _grouped_looks(path, prompts, max_new):
    """``_grouped``, counting this rank's store looks for its group's next input (``assign/...``)."""
    from reshard.parallel.engine.channel import Channel

    looks, ready = [], Channel.ready

    def counted(channel, key):
        if key.startswith("assign/"):
            looks.append(key)
        return ready(channel, key)

    Channel.ready = counted
    try:
        tokens, steps, _, group = _grouped(path, prompts, max_new)
    finally:
        Channel.ready = ready
    return tokens, steps[group.index], len(looks)


def test_a_group_led_from_the_routers_process_counts_its_input_there(checkpoints, hf_reference):
    """Group 0's leader shares rank 0's process (and channel) with the router, which makes every
    post to it: it proposes what arrived from that count, with no store look a step; group 1, in
    another process, looks at the store each step."""
    path, prompts = checkpoints["llama"], _prompts(6)
    expected = hf_reference(path, prompts, MAX_NEW)
    (tokens0, steps0, looks0), (tokens1, steps1, looks1) = dist_harness.run(2, _grouped_looks, path, prompts, MAX_NEW)
    assert tokens0 == tokens1 == expected
    assert steps0 > 0 and looks0 == 0
    assert looks1 >= steps1 > 0
