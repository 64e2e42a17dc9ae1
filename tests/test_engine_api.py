"""``EngineCore``: ``add_request`` / ``abort`` / ``step``, request statuses, preemption under KV pressure.

References: HF ``generate`` (greedy), the same requests through ``Engine.generate`` without
pressure (sampled), and the cache's own block and slot counts before and after.
"""

import ast
from pathlib import Path

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts

ROOT = Path(__file__).resolve().parents[1]


def _engine(path, **config):
    from reshard.parallel import Engine, EngineConfig, parallelize

    return Engine(parallelize(path), EngineConfig(**{"max_batch_size": 4, "max_seq_len": 128, **config}))


def _requests(prompts, max_new=MAX_NEW, temperature=0.0):
    from reshard.parallel import Request, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=40, seed=7)
    return [Request(i, p, params) for i, p in enumerate(prompts)]


def _stream(core) -> tuple[dict, dict, list]:
    """Step ``core`` to the end: each request's tokens as they came, its final status, every status seen."""
    tokens, final, seen = {}, {}, []
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            seen.append(out.status)
            if out.finished:
                final[out.request_id] = (out.status, out.completion.output_ids)
    return tokens, final, seen


def _core_job(path, prompts):
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    engine = _engine(path)
    core = EngineCore(engine)
    requests = _requests(prompts)
    for r in requests[:3]:
        core.add_request(r)
    before = [core.status(r.id) for r in requests[:3]]
    first = core.step()  # the first step: every request added so far admitted and prefilled
    for r in requests[3:]:  # added while the first ones run
        core.add_request(r)
    after_first = [core.status(r.id) for r in requests]
    tokens, final, _ = _stream(core)
    for out in first:
        tokens[out.request_id] = out.new_token_ids + tokens.get(out.request_id, [])
    assert all(s is RequestStatus.WAITING for s in before), before
    assert after_first[:3] == [RequestStatus.RUNNING] * 3 and after_first[3] is RequestStatus.WAITING, after_first
    return [tokens[r.id] for r in requests], [final[r.id] for r in requests], core.status(0)


def test_add_request_and_step_stream_the_tokens_of_hf_generate(checkpoints, hf_reference):
    """Requests added before and after the first step; the tokens each step returns, joined,
    equal HF ``generate`` and the completion; every request ends FINISHED_LENGTH."""
    from reshard.parallel.engine.core import RequestStatus

    path, prompts = checkpoints["llama"], _prompts()
    streamed, final, status = dist_harness.run(1, _core_job, path, prompts)[0]
    assert streamed == hf_reference(path, prompts, MAX_NEW)
    assert [output for _, output in final] == streamed
    assert {s for s, _ in final} == {RequestStatus.FINISHED_LENGTH} and status is RequestStatus.FINISHED_LENGTH


def _abort_job(path, prompts, paged, ahead):
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    config = dict(prefill_chunk=4, max_prefill_tokens=8, async_scheduling=ahead)
    if paged:
        config.update(kv_block_size=8, kv_tokens=256)
    engine = _engine(path, **config)
    core = EngineCore(engine)
    for r in _requests(prompts):
        core.add_request(r)
    core.step()
    policy = engine.policy
    in_prefill = [s for s in policy.running.values() if s.num_computed_tokens < s.prompt_len]
    assert in_prefill, "a long prompt is still in its chunks after one step"
    core.abort([in_prefill[0].request.id])
    out = core.step()
    aborted = [o for o in out if o.request_id == in_prefill[0].request.id]
    for _ in range(3):
        core.step()
    decoding = next(s for s in policy.running.values() if s.output)
    core.abort([decoding.request.id, 99])  # 99: unknown, ignored
    out = core.step()
    aborted += [o for o in out if o.request_id == decoding.request.id]
    _, final, _ = _stream(core)
    free_blocks = None if not paged else [policy.slots.available(0)]  # (free, or cached for later prompts)
    statuses = [o.status is RequestStatus.FINISHED_ABORTED and o.finished for o in aborted]
    return dict(
        statuses=statuses,
        aborted=[o.request_id for o in aborted],
        kept_output=len(aborted[1].completion.output_ids),
        slots=len(policy.slots),
        free_blocks=free_blocks,
        num_blocks=engine.kv.spec.num_blocks,
        others={rid: out for rid, (_, out) in final.items()},
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_abort_mid_prefill_and_mid_decode_frees_the_kv_at_once(checkpoints, hf_reference, paged, ahead):
    """``abort`` of a request in its prompt chunks and of one decoding: each ends at that step
    FINISHED_ABORTED, its slot (and blocks) back at once; the other requests equal HF (with
    async scheduling too: an aborted request leaves the step scheduled ahead)."""
    path, prompts = checkpoints["llama"], _prompts()
    r = dist_harness.run(1, _abort_job, path, prompts, paged, ahead)[0]
    assert r["statuses"] == [True, True] and len(r["aborted"]) == 2
    assert r["kept_output"] > 0  # the decoding one keeps what it had
    assert r["slots"] == 4
    if paged:
        assert r["free_blocks"] == [r["num_blocks"]]
    reference = hf_reference(path, prompts, MAX_NEW)
    others = {i: reference[i] for i in range(len(prompts)) if i not in r["aborted"]}
    assert {i: r["others"][i] for i in others} == others


def _pressure_job(path, prompts, sampled):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, parallelize
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    world = dist.get_world_size()
    model = parallelize(path, ParallelDims(tp=world, world_size=world))
    requests = _requests(prompts, max_new=24, temperature=0.8 if sampled else 0.0)
    roomy = Engine(model, EngineConfig(max_batch_size=8, max_seq_len=128))
    expected = [c.output_ids for c in roomy.generate(requests)]
    # every request alone fits; the batch needs twice the cache's blocks
    need = sum(-(-(len(r.prompt_ids) + 24) // 4) for r in requests)
    tight = Engine(model, EngineConfig(max_batch_size=8, max_seq_len=128, kv_block_size=4, kv_tokens=4 * (need // 2)))
    core = EngineCore(tight)
    for r in requests:
        core.add_request(r)
    final, preempted = {}, set()
    while core.has_unfinished():
        final.update({o.request_id: o.completion.output_ids for o in core.step() if o.finished})
        preempted |= {r.id for r in requests if core.status(r.id) is RequestStatus.PREEMPTED}
    s = tight.stats
    return dict(
        same=[final[r.id] for r in requests] == expected,
        preemptions=s.preemptions,
        allocated=s.kv_blocks_allocated,
        freed=s.kv_blocks_freed,
        free=[tight.policy.slots.available(r) for r in range(len(tight.policy.slots.free_blocks))],
        blocks=tight.kv.spec.num_blocks,
        preempted=len(preempted),
    )


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "tp2"])
def test_kv_pressure_preempts_the_newest_and_tokens_equal_an_unpressured_run(checkpoints, hf_reference, world):
    """A paged cache holding half the batch: requests are preempted (counted), recomputed later,
    and every request's tokens (greedy and seeded sampling) equal a run with room for all; every
    block is back at the end."""
    path, prompts = checkpoints["llama"], _prompts(8)
    for sampled in (False, True):
        for r in dist_harness.run(world, _pressure_job, path, prompts, sampled):
            assert r["same"], sampled
            assert r["preemptions"] >= r["preempted"] > 0
            assert r["allocated"] == r["freed"] and r["free"] == [r["blocks"]]


def test_every_loop_runs_through_the_engine_core():
    """No front end steps the engine another way: the engine's steps (``_advance``, and
    ``_advance_ahead`` with async scheduling) are called only by ``EngineCore.step``, and
    ``Engine`` has no loop of its own left (``_serve``, ``_settle``)."""
    callers, loops = [], []
    for path in [*(ROOT / "parallel").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("_advance", "_advance_ahead"):
                callers.append(f"{path.relative_to(ROOT)}:{node.func.attr}")
            looped = isinstance(node, ast.FunctionDef) and node.name in ("_serve", "_settle")
            if looped and path.parent.name == "engine":
                loops.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert sorted(callers) == ["parallel/engine/core.py:_advance", "parallel/engine/core.py:_advance_ahead"], callers
    assert loops == ["parallel/engine/core.py:_settle"], loops


def _abort_preempted_job(path, prompts):
    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    model = parallelize(path)
    requests = _requests(prompts, max_new=24)
    expected = [c.output_ids for c in Engine(model, EngineConfig(max_batch_size=8, max_seq_len=128)).generate(requests)]
    need = sum(-(-(len(r.prompt_ids) + 24) // 4) for r in requests)
    tight = Engine(model, EngineConfig(max_batch_size=8, max_seq_len=128, kv_block_size=4, kv_tokens=4 * (need // 2)))
    core = EngineCore(tight)
    for r in requests:
        core.add_request(r)
    victim = None
    while victim is None and core.has_unfinished():
        core.step()
        queued = [r for r in core.queue if core.status(r.id) is RequestStatus.PREEMPTED and r.resumed]
        victim = queued[0] if queued else None
    assert victim is not None, "a request was preempted after it had tokens"
    core.abort([victim.id])
    (out,) = [o for o in core.step() if o.request_id == victim.id]
    original = requests[victim.id]
    return out.status, out.completion.prompt_ids == original.prompt_ids, out.completion.output_ids, expected[victim.id]


def test_aborting_a_preempted_request_returns_its_prompt_and_the_tokens_it_had(checkpoints):
    """A request preempted after some tokens (queued again with them in its prompt) and then
    aborted: its completion splits them back out (its prompt as given, its tokens so far)."""
    from reshard.parallel.engine.core import RequestStatus

    run = dist_harness.run(1, _abort_preempted_job, checkpoints["llama"], _prompts(8))
    status, same_prompt, output, expected = run[0]
    assert status is RequestStatus.FINISHED_ABORTED and same_prompt
    assert 0 < len(output) < len(expected) and output == expected[: len(output)]


def _abort_untaken_job(path, ahead):
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    engine = _engine(path, kv_block_size=4, kv_tokens=64, async_scheduling=ahead)
    core = EngineCore(engine)
    first, second = _requests([[5, 6, 7], [8, 9]], max_new=10)
    core.add_request(first)
    core.step()
    core.add_request(second)
    status = core.status(second.id)
    core.abort([second.id])  # before the group took it
    aborted = core.step()
    done = core.run()
    return dict(
        status=status,
        aborted=[(o.request_id, o.status is RequestStatus.FINISHED_ABORTED) for o in aborted if o.finished],
        done=sorted(done),
        first=len(done[first.id].output_ids),
        running=len(engine.policy.running),
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async-scheduling"])
def test_aborting_a_request_not_taken_yet_leaves_the_running_ones_to_finish(checkpoints, ahead):
    """A request added and aborted before the group took it ends FINISHED_ABORTED at once; the
    request already running still runs to its end (the core counted the aborted one as one of
    the requests it took, and stopped with the other still running)."""
    r = dist_harness.run(1, _abort_untaken_job, checkpoints["llama"], ahead)[0]
    assert r["aborted"] == [(1, True)] and r["done"] == [0, 1]
    assert r["first"] == 10 and r["running"] == 0


def _added_mid_step_job(path, prompts):
    """Request 0 runs; request 1 is added while step 2 computes (a ``step_end`` listener): the
    steps each request ran in, by index, and the tokens."""
    from reshard.parallel.engine.core import EngineCore

    engine = _engine(path)
    core = EngineCore(engine)
    first, late = _requests(prompts[:2])
    steps, ran = [], {}
    engine.events.on("step_ready", lambda index, step: steps.append(index))
    engine.events.on("step_begin", lambda step, seqs: ran.update({steps[-1]: [s.request.id for s in seqs]}))
    engine.events.on("step_end", lambda step, seqs: core.add_request(late) if steps[-1] == 2 else None)
    core.add_request(first)
    tokens, _, _ = _stream(core)
    return ran, [tokens[0], tokens[1]]


def test_a_request_added_while_a_step_computes_runs_in_the_next_step(checkpoints, hf_reference):
    """The leader reads the admission proposal once a step has computed, just before its token
    agreement: a request that comes while step 2 computes is prefilled in step 3 (before: step 4,
    a whole step of its time to first token). Tokens equal HF's."""
    path, prompts = checkpoints["llama"], _prompts(2)
    ran, tokens = dist_harness.run(1, _added_mid_step_job, path, prompts)[0]
    assert tokens == hf_reference(path, prompts, MAX_NEW)
    assert min(i for i, ids in ran.items() if 1 in ids) == 3, ran
    assert all(ids == [0] for i, ids in ran.items() if i < 3), ran


def _abort_awaiting_kv_job(path):
    from reshard.parallel.engine.connector import KVConnector
    from reshard.parallel.engine.core import EngineCore, RequestStatus

    class Awaited(KVConnector):
        """Supplies nothing and never has a request's KV in: it waits (records what is forgotten)."""

        def __init__(self) -> None:
            self.forgotten: list[tuple[int, str]] = []

        def matched_tokens(self, seq):
            return None if seq.request.kv_source == "later" else 0

        def forget(self, request):
            self.forgotten.append((request.id, request.kv_source))

    engine = _engine(path)
    connector = Awaited()
    engine.connector.add(connector)
    core = EngineCore(engine)
    waiting, fresh = _requests([[5, 6, 7], [8, 9]], max_new=4)
    core.add_request(waiting, kv_source="later")
    core.add_request(fresh)
    core.step()
    status = core.status(waiting.id)
    core.abort([waiting.id])
    ended = [(o.request_id, o.status) for o in core.step() if o.finished]
    done = core.run()
    return status, ended, connector.forgotten, len(done[fresh.id].output_ids), RequestStatus


def test_aborting_a_request_that_awaits_its_kv_tells_the_connector(checkpoints):
    """A request added with a KV source that never arrives waits (WAITING_FOR_KV) while another
    runs; aborting it ends it FINISHED_ABORTED and tells the connector, which gives back what it
    held for it (DejaVu: the hand-off's staging slots); the other request finishes."""
    status, ended, forgotten, fresh_tokens, statuses = dist_harness.run(
        1, _abort_awaiting_kv_job, checkpoints["llama"]
    )[0]
    assert status is statuses.WAITING_FOR_KV
    assert ended == [(0, statuses.FINISHED_ABORTED)] and forgotten == [(0, "later")]
    assert fresh_tokens == 4


def _reused_ids(path) -> dict:
    """An id added again while its request waits, while it runs and once it finished (each added
    before: the loop never counted the second one finished and stepped for ever), and abort given
    an id's text or an id alone; the first request's tokens, and the engine's state after."""
    from reshard.parallel.engine.core import EngineCore

    core, [first, other] = EngineCore(_engine(path)), _requests([[5, 9, 13], [3, 8, 40]])
    refused = []

    def again(request) -> None:
        try:
            core.add_request(request)
        except ValueError as e:
            refused.append(str(e))

    core.add_request(first)
    again(first)  # waiting
    core.step()
    again(first)  # running
    for ids in ("0", 0):
        try:
            core.abort(ids)
        except ValueError as e:
            refused.append(str(e))
    _, final, _ = _stream(core)
    again(first)  # finished (its completion kept)
    core.add_request(other)  # (a new id still goes in)
    _, more, _ = _stream(core)
    return {"refused": refused, "tokens": final[0][1], "other": list(more), "unfinished": core.has_unfinished()}


def test_an_id_added_again_or_an_abort_of_an_ids_text_is_one_line_not_a_hang(checkpoints, hf_reference):
    [out] = dist_harness.run(1, _reused_ids, checkpoints["llama"], timeout=120)
    same = "request id 0 is in this engine already; ids must be unique"
    assert out["refused"] == [same, same, "abort takes a list of request ids (ints), got '0'"] + [
        "abort takes a list of request ids (ints), got 0",
        same,
    ]
    assert out["tokens"] == hf_reference(checkpoints["llama"], [[5, 9, 13]], MAX_NEW)[0]
    assert out["other"] == [1] and out["unfinished"] is False
