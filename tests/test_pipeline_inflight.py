"""Pipelines that stay full: micro-batches in flight across decode steps (PP2, PP4) vs HF
``generate`` and vs the drained pipeline; one harness launch per pipeline depth."""

import time

import pytest

from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts
from tests.test_groups import _requests

LATE = 0.05  # seconds after the start: the online request arrives while the others decode


def _stage_runs(path, pp, prompts, max_new, stops):
    """Every engine run of one pipeline depth, on every stage: in flight (greedy, seeded, with a
    late arrival; greedy with log-probabilities and stop strings ``stops``) and drained (seeded;
    log-probabilities and stop strings); each with the stage's :class:`PipelineRecord`."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.pipeline import parallelize_pipeline
    from reshard.recipes.prompts import output_tokenizer

    model = parallelize_pipeline(path, ParallelDims(pp=pp, world_size=dist.get_world_size()))
    kw = dict(num_microbatches=pp, max_batch_size=8, max_seq_len=128)
    tok = output_tokenizer(path)
    inflight = Engine(model, EngineConfig(pipeline="inflight", **kw), tokenizer=tok)
    drained = Engine(model, EngineConfig(pipeline="drain", **kw), tokenizer=tok)
    assert Engine(model, EngineConfig(**kw)).flow is not None  # in flight is the default for pp > 1

    def run(engine, new=max_new, **req):
        completions = engine.generate(_requests(prompts, new, **req))
        return [c.output_ids for c in completions], [c.timing for c in completions], engine.flow.record

    def carried(engine):
        params = [SamplingParams(max_new_tokens=max_new, logprobs=3, stop=stop) for stop in stops]
        done = engine.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        return [(c.output_ids, c.finish_reason, c.logprobs) for c in done]

    arrivals = [0.0] * (len(prompts) - 1) + [LATE]
    ready = []  # step_ready's indices on this stage: each launched step's, in launch order
    stop_listening = inflight.events.on("step_ready", lambda index, step: ready.append(index))
    greedy = run(inflight)
    stop_listening()
    assert ready == list(range(greedy[2].steps)), ready
    online = run(inflight, arrivals=arrivals, new=[4 * max_new] * (len(prompts) - 1) + [max_new])
    sampled = run(inflight, temperature=0.9)
    drained_sampled = drained.generate(_requests(prompts, max_new, temperature=0.9))
    return greedy, online, sampled, drained_sampled, drained.flow, carried(inflight), carried(drained)


def _hf_carried(path, prompts, max_new, stops):
    """HF greedy ``generate`` with ``stop_strings`` (per prompt) and ``output_logits``: each
    prompt's tokens and each token's log-probability with its top 3 ``(id, logprob)``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for prompt, stop in zip(prompts, stops):
        kw = dict(stop_strings=list(stop), tokenizer=tok) if stop else {}
        with torch.no_grad():
            res = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, output_logits=True,
                return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw,
            )  # fmt: skip
        tokens = res.sequences[0, len(prompt) :].tolist()
        lps = [torch.log_softmax(logits[0].float(), -1) for logits in res.logits]
        out.append((tokens, [(lp[t].item(), lp.topk(3)) for lp, t in zip(lps, tokens)]))
    return out


def _assert_carried(got, expected, max_new):
    """Tokens, finish reasons and log-probabilities (ids equal, values within fp32 error) as HF's."""
    import pytest

    for (ids, reason, logprobs), (tokens, lps) in zip(got, expected):
        assert ids == tokens and reason == ("length" if len(ids) == max_new else "stop")
        for (lp, top), (want, want_top) in zip(logprobs, lps, strict=True):
            assert lp == pytest.approx(want, abs=1e-4) and [t[0] for t in top] == want_top.indices.tolist()
            assert [t[1] for t in top] == pytest.approx(want_top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("pp", [2, 4], ids=["PP2", "PP4"])
def test_inflight_pipeline_matches_hf_and_keeps_microbatches_in_flight(four_layer, hf_reference, pp, tmp_path):
    """Every stage runs the one loop: greedy and late-arriving tokens equal HF; seeded samples,
    log-probabilities and stop strings equal the drained engine's and HF's, on every stage."""
    from tests.test_text_io import _with_tokenizer

    path, prompts = str(tmp_path / "ckpt"), _prompts(8)  # every micro-batch has work at PP4
    tok = _with_tokenizer(four_layer["llama"], tmp_path / "ckpt", chat=False)
    expected = hf_reference(path, prompts, 4 * MAX_NEW)
    # stop strings of every other prompt: the word of its 3rd free-running token (ends it there or earlier)
    stops = [(tok.convert_ids_to_tokens(t[2]),) if i % 2 == 0 else () for i, t in enumerate(expected)]
    results = dist_harness.run(pp, _stage_runs, path, pp, prompts, MAX_NEW, stops)
    (tokens, _, head), (late_tokens, timings, _), (sampled, _, _), drained, no_flow, carried, drained_carried = results[
        0
    ]
    assert tokens == [t[:MAX_NEW] for t in expected]
    assert sampled == [c.output_ids for c in drained] and sampled != tokens  # seeded: as the drained engine
    assert no_flow is None
    _assert_carried(carried, _hf_carried(path, prompts, MAX_NEW, stops), MAX_NEW)
    assert [c[:2] for c in carried] == [c[:2] for c in drained_carried]
    assert sum(reason == "stop" for _, reason, _ in carried) >= 2  # the stop strings ended requests
    # the late request was admitted while the others decoded, and changed none of their tokens
    assert late_tokens == expected[:-1] + [expected[-1][:MAX_NEW]]
    late = timings[-1]
    assert late.started >= LATE and late.started < min(t.finished for t in timings[:-1])
    # micro-batches really were in flight across steps: every stage ran every launched step
    assert head.peak == pp and head.overlapped >= head.steps // 2
    for rank, (greedy, online, sampled_run, _, _, carried_run, _) in enumerate(results):
        assert greedy[0] == tokens and online[0] == late_tokens and sampled_run[0] == sampled  # every rank
        assert carried_run == carried  # every stage recorded the same tokens, reasons and log-probabilities
        assert greedy[2].steps == head.steps, f"stage {rank} ran {greedy[2].steps} of {head.steps} steps"


def _refused(path, pipeline, tp):
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=2, tp=tp, world_size=dist.get_world_size()))
    try:
        Engine(model, EngineConfig(pipeline=pipeline, num_microbatches=2, max_batch_size=4, max_seq_len=128))
    except ValueError as e:
        return str(e)
    return None


def test_inflight_refuses_what_it_cannot_run(four_layer):
    path = four_layer["llama"]
    assert dist_harness.run(2, _refused, path, "overlap", 1)[0] == (
        "engine.pipeline must be one of ['inflight', 'drain'] or None, got 'overlap'"
    )
    assert "one rank per stage (tp=1, sp=1), got tp=2" in dist_harness.run(4, _refused, path, "inflight", 2)[0]


def _budget_runs(path, prompts, lengths):
    """PP2 in flight on a token budget of 8 (prompts in chunks beside decodes) and with whole
    prompts (``chunked_prefill=False``), greedy and seeded; each run's step kinds on this stage."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=2, world_size=dist.get_world_size()))
    out = {}
    for chunked in (True, False):
        config = EngineConfig(max_batch_size=4, max_seq_len=64, max_prefill_tokens=8, chunked_prefill=chunked)
        engine = Engine(model, config)
        assert engine.flow is not None  # in flight
        for temperature in (0.0, 0.9):
            kinds = []
            engine.events.on("step_ready", lambda index, step, seen=kinds: seen.append(step.kind))
            done = engine.generate(_requests(prompts, lengths, temperature=temperature))
            out[chunked, temperature] = ([c.output_ids for c in done], kinds, engine.flow.record.peak)
    return out


def test_inflight_micro_batches_take_prompt_chunks_beside_decodes(four_layer, hf_reference):
    """The token budget in flight: each micro-batch's step gives its running sequences their
    decode token and its prompts up to 8 tokens, so prompts of 17-29 tokens run in chunks beside
    decodes (early finishers free slots for the queue). Greedy tokens equal HF's; seeded samples
    equal the whole-prompt run's; every stage runs the same steps, two micro-batches in flight."""
    from tests.test_prefix_cache import _prompt

    path = four_layer["llama"]
    prompts = [_prompt(17 + 2 * i, 30 + i) for i in range(7)]
    lengths = [8, 3, 8, 2, 8, 5, 8]
    expected = [t[:n] for t, n in zip(hf_reference(path, prompts, 8), lengths)]
    results = dist_harness.run(2, _budget_runs, path, prompts, lengths)
    first = results[0]
    for chunked in (True, False):
        assert first[chunked, 0.0][0] == expected, chunked
        assert first[chunked, 0.0][2] == 2  # the first stage kept both micro-batches in flight
    assert first[True, 0.9][0] == first[False, 0.9][0] != first[True, 0.0][0]
    assert "mixed" in first[True, 0.0][1] and "mixed" not in first[False, 0.0][1]
    for stage in results[1:]:  # every stage: the same tokens and the same steps
        assert {k: v[:2] for k, v in stage.items()} == {k: v[:2] for k, v in first.items()}


def _written_in_flight(path, prompt, write):
    """PP2 in flight on a paged prefix cache: ``prompt`` once, then four greedy samples of it,
    which start past its cached blocks; with ``write``, the weights are written (the same values)
    on every stage right after the first step of the samples is scheduled, while it is in flight."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams
    from reshard.parallel.model.info import parallel_info
    from reshard.parallel.model.pipeline import parallelize_pipeline
    from tests.test_prefix_cache import PAGED

    model = parallelize_pipeline(path, ParallelDims(pp=2, world_size=dist.get_world_size()))
    engine = Engine(model, EngineConfig(**PAGED))
    engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=4))])
    written = []

    def on_scheduled(step):
        if write and not written:
            parallel_info(model).weight_version.writes += 1  # (what a sync does to the version)
            written.append(step.kind)

    engine.events.on("step_scheduled", on_scheduled)
    samples = [Request(1 + i, prompt, SamplingParams(max_new_tokens=6)) for i in range(4)]
    return [c.output_ids for c in engine.generate(samples)], engine.stats.prefix_cache_hits


def test_weights_written_while_a_cached_prefix_step_is_in_flight(four_layer, hf_reference):
    """A step of requests that started past a cached prefix is in flight when the weights are
    written: those requests keep their slots and blocks and run on (only requests not yet in a
    step are queued again); every stage's tokens equal HF's and the run without the write."""
    from tests.test_prefix_cache import _prompt

    path, prompt = four_layer["llama"], _prompt(23, 5)
    (expected,) = hf_reference(path, [prompt], 6)
    written = dist_harness.run(2, _written_in_flight, path, prompt, True)
    quiet = dist_harness.run(2, _written_in_flight, path, prompt, False)
    assert quiet[0][1] > 0  # the samples did start past the cached blocks
    for (tokens, _), (calm, _) in zip(written, quiet):
        assert tokens == calm == [expected] * 4


def _pressed_in_flight(path, prompts, pp, pipeline):
    """``pp`` stages (``pipeline``: in flight, or drained) on a paged cache holding half the batch's blocks, chunked and
    whole-prompt steps, greedy and seeded (with each token's log-probability), against the same
    engine with room for all: each run's tokens and log-probabilities, its preemptions and
    whether every block came back (the last two on the first stage only)."""
    import dataclasses

    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.engine.batching import ContinuousBatching
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=pp, world_size=dist.get_world_size()))
    need = sum(-(-(len(p) + 24) // 4) for p in prompts)  # every request's blocks, whole
    out = {}
    for chunked in (True, False):
        base = dict(max_batch_size=8, max_seq_len=128, kv_block_size=4, chunked_prefill=chunked, num_microbatches=pp)
        base["pipeline"] = pipeline
        roomy = Engine(model, EngineConfig(**base, kv_tokens=4 * need))
        tight = Engine(model, EngineConfig(**base, kv_tokens=4 * (need // 2)))
        assert (tight.flow is not None) == (pipeline == "inflight")
        for temperature in (0.0, 0.9):
            requests = _requests(prompts, 24, temperature=temperature)
            requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logprobs=1)) for r in requests]
            expected = [(c.output_ids, c.logprobs) for c in roomy.generate(requests)]
            before = tight.stats.preemptions
            got = [(c.output_ids, c.logprobs) for c in tight.generate(requests)]
            first = isinstance(tight.policy, ContinuousBatching)  # (a later in-flight stage's is NotedSteps)
            back = tight.policy.slots.available(0) == tight.kv.spec.num_blocks if first else None
            out[chunked, temperature] = (got, expected, tight.stats.preemptions - before, back)
    return out


@pytest.mark.parametrize(
    "pp,pipeline", [(2, "inflight"), (3, "inflight"), (2, "drain")], ids=["PP2", "PP3", "PP2-drained"]
)
def test_kv_pressure_in_flight_preempts_and_tokens_equal_an_unpressured_run(four_layer, hf_reference, pp, pipeline):
    """An in-flight pipeline on a paged cache holding half the batch: blocks are taken as tokens
    need them (the notes carry them to the later stages, a middle stage's included, whose own
    count lags the first stage's); requests are preempted (counted) and recomputed; every stage's
    tokens, greedy and seeded, equal the run with room for all (greedy: HF's), chunked or
    whole-prompt steps, and so do the log-probabilities (those before a preemption carried over on
    every stage); every block is back at the end. A drained pipeline preempts as one stage does."""
    path, prompts = four_layer["llama"], _prompts(8)  # (a 40-token prompt: its first decode takes a block)
    expected = hf_reference(path, prompts, 24)
    first, *later = dist_harness.run(pp, _pressed_in_flight, path, prompts, pp, pipeline)
    for (chunked, temperature), (got, roomy, preemptions, back) in first.items():
        assert [t for t, _ in got] == [t for t, _ in roomy], (chunked, temperature)
        for (_, lps), (_, want) in zip(got, roomy):
            assert [lp[0] for lp in lps] == pytest.approx([lp[0] for lp in want], abs=1e-4)
        assert preemptions > 0 and back, (chunked, temperature, preemptions, back)
        if temperature == 0.0:
            assert [t for t, _ in got] == expected, chunked
    for stage in later:  # the same tokens and log-probabilities on every stage
        assert {k: v[:2] for k, v in stage.items()} == {k: v[:2] for k, v in first.items()}


def _aborted_in_flight(path, prompts, pp, plans, kv_tokens):
    """``pp`` in-flight stages, each rank stepping its own :class:`EngineCore`. Per cache
    (contiguous, ``plans[None]``; paged, ``plans[4]``: blocks of 4, ``kv_tokens`` of them) the ids
    of ``plan[i]`` are aborted before core step ``i`` (every rank makes the same calls; a later
    stage's are ignored, the first stage's notes say what ends there). On the contiguous cache the
    first stage also aborts the last request left, once it runs alone: no step is noted after it,
    so only the ``"stop"`` note tells the later stages. Per cache: each request's final status
    and tokens, what each aborted request was doing on the first stage when it was aborted
    (``"last"``: that one), and what this stage still holds at the end."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.engine.batching import ContinuousBatching
    from reshard.parallel.engine.core import EngineCore
    from reshard.parallel.model.pipeline import parallelize_pipeline

    model = parallelize_pipeline(path, ParallelDims(pp=pp, world_size=dist.get_world_size()))
    out = {}
    for blocks, plan in plans.items():
        paged = {} if blocks is None else dict(kv_block_size=blocks, kv_tokens=kv_tokens)
        config = EngineConfig(max_batch_size=4, max_seq_len=128, num_microbatches=pp, max_prefill_tokens=8, **paged)
        engine = Engine(model, config)
        core = EngineCore(engine)
        lengths = [24] * len(prompts) if blocks else [24] * (len(prompts) - 1) + [40]  # (the last runs alone)
        for r in _requests(prompts, lengths):
            core.add_request(r)
        first = isinstance(engine.policy, ContinuousBatching)
        final, seen, i = {}, {}, 0
        while core.has_unfinished():
            ids = list(plan.get(i, ()))
            for rid in ids:
                seen[rid] = _doing(engine, core, rid) if first else None
            left = [r for r in range(len(prompts)) if r not in final]
            alone = engine.policy.running.get(left[0]) if first and len(left) == 1 else None
            if blocks is None and alone is not None and len(alone.generated) < 36 and "last" not in seen.values():
                ids.append(left[0])
                seen[left[0]] = "last"
            core.abort(ids)
            final.update({o.request_id: (o.status.name, o.completion.output_ids) for o in core.step() if o.finished})
            i += 1
        policy = engine.policy
        if first:
            held = (len(policy.running), len(policy.slots), policy.slots.available(0) if blocks else None)
        else:
            held = (len(policy.live), len(policy.slots), len(policy.ending))
        done = {rid: (c.finish_reason, c.output_ids) for rid, c in core.done.items()}
        out[blocks] = dict(final=final, seen=seen, held=held, done=done, preemptions=engine.stats.preemptions)
    return out


def _doing(engine, core, rid) -> str:
    """What request ``rid`` does on the first stage now: ``"prefill"`` (running, in its prompt's
    chunks), ``"decode"`` or ``"decode-in-flight"`` (its micro-batch's step not landed),
    ``"preempted"`` (queued again with tokens) or its status's name."""
    from reshard.parallel.engine.core import RequestStatus

    policy, status = engine.policy, core.status(rid)
    seq = policy.running.get(rid)
    if status is RequestStatus.RUNNING and seq is not None:
        phase = "prefill" if seq.num_computed_tokens < seq.prompt_len else "decode"
        return phase if policy._preemptible(seq) else f"{phase}-in-flight"
    queued = [r for r in core.queue if r.id == rid]
    return "preempted" if status is RequestStatus.PREEMPTED and queued and queued[0].resumed else status.name


def _aborted_before_idle(path, prompts):
    """PP2 in flight, each rank stepping its own :class:`EngineCore`: request 0 runs alone and is
    aborted at core step 3; request 1 comes only once the first stage, idle meanwhile, hears from
    the later stage that request 0 ended there (or after 20 s). Per stage: the final status and
    tokens of each request, whether the first stage heard (first stage) or how many requests the
    later stage had been noted when request 0 ended there (later stage), and what it holds."""
    import datetime

    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, ParallelDims
    from reshard.parallel.engine.admission import LocalAdmission
    from reshard.parallel.engine.batching import ContinuousBatching
    from reshard.parallel.engine.core import EngineCore
    from reshard.parallel.model.pipeline import parallelize_pipeline

    store = dist.distributed_c10d._get_default_store()

    class AfterTheLaterStage(LocalAdmission):
        """The late request taken once the later stage ended request 0 (a server's next client)."""

        heard = None

        def wait_next(self):
            if self.taken == 1 and self.heard is None:  # (request 0 taken and ended: request 1 waits)
                try:
                    store.wait(["ended"], datetime.timedelta(seconds=20))
                    self.heard = True
                except Exception:  # (the store's timeout: the later stage still holds request 0)
                    self.heard = False
            return self._next(1)

    model = parallelize_pipeline(path, ParallelDims(pp=2, world_size=dist.get_world_size()))
    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=128, num_microbatches=2))
    first = isinstance(engine.policy, ContinuousBatching)
    admission = AfterTheLaterStage([], time.time(), engine._leads_group())
    core = EngineCore(engine, admission)
    for r in _requests(prompts[:2], [24, 8], arrivals=[0.0, 3600.0]):  # (request 1 only through wait_next)
        core.add_request(r)
    final, seen, i = {}, None, 0
    while core.has_unfinished():
        core.abort([0] if i == 3 else [])
        for o in core.step():
            if o.finished:
                final[o.request_id] = (o.status.name, o.completion.output_ids)
                if o.request_id == 0 and not first:
                    seen = engine.policy.taken
                    store.set("ended", "1")
        i += 1
    policy = engine.policy
    held = (len(policy.running), len(policy.slots)) if first else (len(policy.live), len(policy.slots))
    return final, admission.heard if first else seen, held


def test_an_idle_first_stage_notes_its_aborts_at_once(four_layer, hf_reference):
    """A request aborted on an in-flight pipeline whose first stage then waits for requests (a
    server between clients): the first stage sends its abort down in a note of its own, so the
    later stage ends it and frees its KV before the next request comes (not when that request's
    step is noted). Request 0 ends FINISHED_ABORTED with the same tokens (HF's, cut short) on both
    stages; request 1 equals HF; no stage holds a sequence at the end."""
    path, prompts = four_layer["llama"], _prompts(2)
    expected = hf_reference(path, prompts, 24)
    (final, heard, held), (later_final, noted, later_held) = dist_harness.run(2, _aborted_before_idle, path, prompts)
    assert heard is True and noted == 1  # the later stage ended it before request 1 was noted
    status, tokens = final[0]
    assert status == "FINISHED_ABORTED" and 0 < len(tokens) < 24 and tokens == expected[0][: len(tokens)]
    assert final[1] == ("FINISHED_LENGTH", expected[1][:8]) and later_final == final
    assert held == (0, 4) and later_held == (0, 0)


ABORTS = {  # per cache, core step -> ids aborted before it (what each is doing then: asserted below)
    None: {2: [6], 7: [0], 10: [1], 12: [2]},
    4: {2: [6], 34: [3], 37: [0], 38: [1]},  # a paged cache of 96 tokens: request 3 preempted by then
}


@pytest.mark.parametrize("pp", [2, 3], ids=["PP2", "PP3"])
def test_abort_in_flight_ends_the_request_on_every_stage_and_frees_its_kv(four_layer, hf_reference, pp):
    """``abort`` on an in-flight pipeline: of a request still queued, one in its prompt's chunks,
    one decoding between its steps (it ends at once), one whose micro-batch is in flight (it ends
    at that step's token), one preempted with tokens (queued again) and the last one left (only
    the ``"stop"`` note carries its abort). Each ends
    FINISHED_ABORTED with the tokens it had (HF's, cut short); the first stage's notes end it on
    every later stage with as many tokens (a middle stage's included); every other request equals
    HF; no stage holds a slot, block or sequence at the end."""
    path, prompts = four_layer["llama"], _prompts(8)
    expected = hf_reference(path, prompts, 40)  # (24 tokens each, the contiguous run's last one 40)
    first, *later = dist_harness.run(pp, _aborted_in_flight, path, prompts, pp, ABORTS, 96)
    doing = [d for run in first.values() for d in run["seen"].values()]
    assert {"WAITING", "decode", "decode-in-flight", "preempted", "last"} <= set(doing), doing
    assert any(d.startswith("prefill") for d in doing), doing
    for blocks, run in first.items():
        aborted = set(run["seen"])
        for rid, (status, tokens) in run["final"].items():
            cut = rid in aborted
            assert status == ("FINISHED_ABORTED" if cut else "FINISHED_LENGTH"), (blocks, rid, status)
            want = 40 if blocks is None and rid == len(prompts) - 1 else 24
            assert tokens == expected[rid][: len(tokens)] and (cut or len(tokens) == want), (blocks, rid)
        assert sorted(run["final"]) == list(range(8)) and run["held"] == (0, 4, 24 if blocks else None)
        never_noted = {rid for rid, d in run["seen"].items() if d == "WAITING"}
        for stage in later:
            here = stage[blocks]
            assert here["done"] == {k: v for k, v in run["done"].items() if k not in never_noted}, blocks
            assert here["held"] == (0, 0, 0), (blocks, here["held"])
    assert first[4]["preemptions"] > 0
