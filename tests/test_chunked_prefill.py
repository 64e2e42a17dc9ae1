"""Chunked prefill (``prefill_chunk``): prompts fed in chunks beside running decodes give HF's
tokens, seeded sampling unchanged, and refusals that name the values."""

import pytest
import torch

from tests import dist_harness

MAX_NEW = 10
CHUNK = 5  # smaller than every prompt


def _prompts(vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (8, 23, 12, 30, 9, 17)]


def _generate(path, prompts, *, chunk, temperature=0.0, paged=False, dp=1, replicas="lockstep") -> dict:
    """``tokens``, ``mixed`` steps, steps where decodes ``rode`` beside a prompt chunk (this
    rank's group), ``whole``-prompt prefill steps and whether every timing is ``timed`` in order,
    of one engine with 3 slots (later prompts are chunked while the first ones decode); ``dp``:
    data-parallel replicas (``replicas``: how they step)."""
    from reshard.parallel import Engine, EngineConfig, ParallelDims, Request, SamplingParams, parallelize
    from reshard.parallel.engine.request import EngineStats

    kv = {"kv_block_size": 8, "kv_tokens": 256} if paged else {}
    model = parallelize(path, ParallelDims.from_world(dp=dp) if dp > 1 else None)
    # chunk None: whole prompts, in steps of their own
    config = dict(prefill_chunk=chunk, chunked_prefill=chunk is not None, replicas=replicas, **kv)
    engine = Engine(model, EngineConfig(max_batch_size=3, max_seq_len=64, **config))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_k=40, top_p=0.9, seed=7)
    rode = []
    engine.events.on("step_ready", lambda index, step: rode.append(_decodes_beside_chunk(step)))
    done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    timed = all(c.timing is not None and c.timing.started <= c.timing.first_token <= c.timing.finished for c in done)
    stats = EngineStats.total(engine.group_stats) if engine.group_stats else engine.stats
    tokens = [c.output_ids for c in done]
    return dict(tokens=tokens, mixed=stats.mixed_steps, rode=sum(rode), whole=stats.prefill_steps, timed=timed)


def _decodes_beside_chunk(step) -> bool:
    """A step (before it runs) with a decoding sequence and a prompt chunk in it."""
    decoding = [s.num_computed_tokens >= s.prompt_len for s in step.seqs]
    return any(decoding) and not all(decoding)


def _tp2_checks(path, prompts) -> dict:
    """Every check of the TP2 test in one harness launch."""
    return {
        "contiguous": _generate(path, prompts, chunk=CHUNK),
        "paged": _generate(path, prompts, chunk=CHUNK, paged=True),
        "dp2 lockstep": _generate(path, prompts, chunk=CHUNK, dp=2),
        "dp2 groups": _generate(path, prompts, chunk=CHUNK, dp=2, replicas="groups"),
        "sampled": _generate(path, prompts, chunk=CHUNK, temperature=0.8),
        "sampled_whole": _generate(path, prompts, chunk=None, temperature=0.8),
    }


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_greedy_matches_hf_generate(checkpoints, hf_reference, family):
    """1 rank, chunks of 5 < every prompt (8..30 tokens), 6 requests in 3 slots: HF's tokens;
    chunks ran beside decodes in mixed steps and no prompt was prefilled whole."""
    path, prompts = checkpoints[family], _prompts()
    run = dist_harness.run(1, _generate, path, prompts, chunk=CHUNK)[0]
    assert run["tokens"] == hf_reference(path, prompts, MAX_NEW)
    assert run["mixed"] >= -(-max(len(p) for p in prompts) // CHUNK)  # a prompt gets at most CHUNK tokens a step
    assert run["rode"] > 0 and run["whole"] == 0 and run["timed"]


def test_chunked_tp2_matches_hf_and_unchunked_sampling(checkpoints, hf_reference):
    """2 gloo ranks: greedy chunked tokens equal HF's in TP2 with the contiguous and the paged
    cache and in two data-parallel replicas (lockstep, and engine groups); seeded sampling with chunks equals seeded
    sampling with whole prompts (generators draw only for chunks that emit a token); every rank
    agrees."""
    path, prompts = checkpoints["llama"], _prompts()
    results = dist_harness.run(2, _tp2_checks, path, prompts)
    out = results[0]
    assert all(results[1][key]["tokens"] == run["tokens"] for key, run in out.items())  # every rank agrees
    expected = hf_reference(path, prompts, MAX_NEW)
    for cache in ("contiguous", "paged", "dp2 lockstep", "dp2 groups"):
        run = out[cache]
        assert run["tokens"] == expected, cache
        assert run["mixed"] > 0 and run["rode"] > 0 and run["whole"] == 0 and run["timed"], cache
    assert out["sampled"]["mixed"] > 0 and out["sampled_whole"]["mixed"] == 0
    assert out["sampled"]["tokens"] == out["sampled_whole"]["tokens"]
    assert out["sampled"]["tokens"] != expected  # sampling did sample


# ---- requests at very different num_computed_tokens in one step ---------------------------------
# 4 slots, at most CHUNK prompt tokens per request and step. Step 0 feeds the first two prompts
# whole and chunks of the next two; the first request ends after its second token (step 1), so at
# step 2 the last prompt is admitted and fed whole from 0 while the 23-token prompt is half
# prefilled and the second request decodes.
MIXED_LENGTHS = (4, 3, 23, 12, 5)
MIXED_MAX_NEW = (2, MAX_NEW, MAX_NEW, MAX_NEW, MAX_NEW)


def _mixed_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in MIXED_LENGTHS]


def _step_record(engine) -> list[list[tuple[int, int, int]]]:
    """Every step's ``(num_computed_tokens, num_tokens, prompt_len)`` per sequence, recorded as
    the step is about to run (``step_ready``)."""
    steps = []

    def ready(index, step) -> None:
        steps.append([(s.num_computed_tokens, n, s.prompt_len) for s, n in zip(step.seqs, step.num_tokens)])

    engine.events.on("step_ready", ready)
    return steps


def _one_step_of_every_kind(path, prompts) -> dict:
    """Greedy tokens and the step record (:func:`_step_record`) with a contiguous and a paged cache."""
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    model, out = parallelize(path), {}
    requests = [Request(i, p, SamplingParams(max_new_tokens=m)) for i, (p, m) in enumerate(zip(prompts, MIXED_MAX_NEW))]
    for cache, kv in (("contiguous", {}), ("paged", {"kv_block_size": 4, "kv_tokens": 256})):
        engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=64, prefill_chunk=CHUNK, **kv))
        steps = _step_record(engine)
        out[cache] = dict(tokens=[c.output_ids for c in engine.generate(requests)], steps=steps)
    return out


def _holds_every_kind(step: list[tuple[int, int, int]]) -> bool:
    """A fresh prompt (nothing computed), a half-prefilled one (part of its prompt computed, more
    to come after this step) and a decoding sequence in one step."""
    fresh = any(c == 0 for c, _, _ in step)
    half = any(c > 0 and c + n < p for c, n, p in step)
    decoding = any(c >= p for c, _, p in step)
    return fresh and half and decoding


def _check_every_kind(run: dict, expected: list[list[int]]) -> None:
    assert run["tokens"] == expected
    assert any(_holds_every_kind(step) for step in run["steps"]), run["steps"]
    for step in run["steps"]:  # decode tokens one each, prompts at most CHUNK tokens a step
        assert all(n == 1 if c >= p else 1 <= n <= min(CHUNK, p - c) for c, n, p in step), step


def _expected_mixed(hf_reference, path, prompts) -> list[list[int]]:
    """HF's greedy tokens, cut at each request's max_new_tokens (greedy: a prefix of the longer run)."""
    return [out[:m] for out, m in zip(hf_reference(path, prompts, MAX_NEW), MIXED_MAX_NEW)]


def test_one_step_of_fresh_half_prefilled_and_decoding_requests_matches_hf(checkpoints, hf_reference):
    """One step whose batch holds a fresh prompt, a half-prefilled one and a decoding sequence
    (seen in the engine's step record) gives HF's tokens, with a contiguous and a paged cache."""
    path, prompts = checkpoints["llama"], _mixed_prompts()
    out = dist_harness.run(1, _one_step_of_every_kind, path, prompts)[0]
    expected = _expected_mixed(hf_reference, path, prompts)
    for run in out.values():
        _check_every_kind(run, expected)
    assert out["paged"]["steps"] == out["contiguous"]["steps"]


def test_one_step_of_fresh_half_prefilled_and_decoding_requests_tp2(checkpoints, hf_reference):
    """The same on 2 gloo ranks (TP2), contiguous and paged: HF's tokens, every rank agrees."""
    path, prompts = checkpoints["llama"], _mixed_prompts()
    results = dist_harness.run(2, _one_step_of_every_kind, path, prompts)
    assert results[1] == results[0]
    expected = _expected_mixed(hf_reference, path, prompts)
    for run in results[0].values():
        _check_every_kind(run, expected)


def _refusals(path) -> list[str]:
    from reshard.parallel import Engine, EngineConfig, parallelize
    from reshard.parallel.engine.batching import ContinuousBatching

    model = parallelize(path)
    cases = [
        (dict(prefill_chunk=0), None),
        (dict(prefill_chunk=4), ContinuousBatching("main")),
    ]
    messages = []
    for kw, policy in cases:
        with pytest.raises(ValueError) as err:
            Engine(model, EngineConfig(max_batch_size=2, max_seq_len=64, **kw), policy=policy)
        messages.append(str(err.value))
    return messages


def test_chunked_refusals_name_the_values(checkpoints):
    zero, policy = dist_harness.run(1, _refusals, checkpoints["llama"])[0]  # (with kv_swap it runs:
    assert "prefill_chunk must be >= 1" in zero and "got 0" in zero  # tests/test_microbatch_swap.py)
    assert "prefill_chunk (4)" in policy and "ContinuousBatching" in policy


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["engine.prefill_chunk=0"], r"engine.prefill_chunk must be >= 1, got 0"),
        (["engine.prefill_chunk=16", "parallel.pp=2"], r"prefill_chunk \(16\).*pp \(2\)"),
        (["engine.prefill_chunk=8", "parallel=shift"], r"prefill_chunk \(8\).*'shift'"),
    ],
)
def test_recipe_refuses_unsupported_chunking(overrides, match):
    """The job config refuses (on every rank, before anything loads) what chunking does not run."""
    from reshard.recipes.schema import compose

    with pytest.raises(ValueError, match=match):
        compose("generate", overrides)


def test_recipe_exposes_prefill_chunk():
    """``engine.prefill_chunk=16`` from the command line reaches the engine's arguments."""
    from reshard.recipes.schema import compose

    job = compose("generate", ["engine.prefill_chunk=16"])
    assert job.engine_config().prefill_chunk == 16
    assert compose("generate").engine.prefill_chunk is None


def _run_recipe(overrides: list[str], run_dir: str) -> dict:
    from pathlib import Path

    from reshard.recipes.generate import run_generate
    from reshard.recipes.schema import compose

    return run_generate(compose("generate", overrides), Path(run_dir))


def test_recipe_chunked_tp2_outputs_match_hf(checkpoints, hf_reference, tmp_path):
    """The job with ``engine.prefill_chunk=4`` on TP2: outputs equal HF's; the summary counts the
    mixed steps."""
    import json

    path, prompts = checkpoints["llama"], _prompts()[:4]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(p) for p in prompts))
    overrides = [
        f"model.path={path}",
        f"workload.prompts_file={prompts_file}",
        "generation.max_new_tokens=6",
        "engine.max_batch_size=2",
        "engine.prefill_chunk=4",
        "progress=false",
    ]
    summary = dist_harness.run(2, _run_recipe, overrides, str(tmp_path / "run"))[0]
    assert summary["mixed_steps"] > 0 and summary["phase_seconds"]["prefill"] == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert [line["output_ids"] for line in lines] == hf_reference(path, prompts, 6)
