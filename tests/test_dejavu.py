"""DejaVu disaggregation on the engine core: prompt ranks stream KV layer by layer to token
ranks (re-sharded on the way); tokens equal single-process HF generate."""

import re
import uuid

import pytest

from tests import dist_harness

PROMPTS = [[5, 9, 11, 2, 7], [3, 4], list(range(20, 37)), [8] * 9, [100, 101, 102], [60, 61, 62, 63]]


def _job(path, prompt, token, prompt_ranks, max_new, replicas="groups", temperature=0.0, prefill_sleep=0.0, gate=None):
    """Tokens, the strategy's summary, the layouts it reports (as ``summary.json``'s ``parallel``),
    the layouts its engine's runners ran, and this rank's steps with its group's index: one
    ``[kind, begin, end]`` per step, ``begin``/``end`` the job-wide order of its ``step_begin`` /
    ``step_end`` events (an atomic counter in the job's store, shared by every rank: a smaller
    number happened first). ``prefill_sleep``: seconds every prefill step lasts longer (a bigger
    model's prefill, inside its step), so that the other side has time to step meanwhile. ``gate``
    (a key unique to the job): every prefill step after a prompt rank's first stays open until each
    token rank has begun a decode step (at most ``GATE_S``), so that sides which run at the same
    time always overlap, however the machine's load delays either side, and sides which do not
    never do."""
    import time

    import torch.distributed as dist

    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import EngineConfig
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "prompt": prompt, "token": token, "prompt_ranks": prompt_ranks})
    engine = strategy.build(path, EngineConfig(max_batch_size=3, max_seq_len=64, replicas=replicas))
    store = dist.distributed_c10d._get_default_store()

    def order() -> int:  # the job-wide position of the event that calls it
        return store.add("test_dejavu/events", 1)

    steps = []
    engine.events.on("step_begin", lambda step, seqs: steps.append([step.kind, order(), None]))
    engine.events.on("step_end", lambda step, seqs: steps[-1].__setitem__(2, order()))
    if prefill_sleep:
        engine.events.on("step_begin", lambda step, seqs: step.kind == "prefill" and time.sleep(prefill_sleep))
    if gate is not None:
        token_ranks = dist.get_world_size() - prompt_ranks
        engine.events.on("step_begin", lambda step, seqs: _hold_open(step.kind, steps, store, gate, token_ranks))
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=20, seed=5)
    with engine:
        out = engine.generate([Request(i, p, params) for i, p in enumerate(PROMPTS)])
    reported = {name: d.describe() for name, d in strategy.layouts(dist.get_world_size()).items()}
    ran = {name: r.dims.describe() for name, r in engine.runners.items()}
    group = engine.engine_group.index if engine.engine_group else None
    return [c.output_ids for c in out], strategy.summary(engine), reported, ran, (group, steps)


GATE_S = 60.0  # how long a gated prefill step waits for the token side (then the overlap check fails)


def _hold_open(kind: str, steps: list, store, key: str, token_ranks: int) -> None:
    """A token rank's first decode step counts itself at ``key``; a prompt rank's second and later
    prefill steps wait for every token rank's count (``steps`` already holds the step beginning)."""
    import time

    if kind == "decode" and sum(s[0] == "decode" for s in steps) == 1:
        store.add(key, 1)
    elif kind == "prefill" and sum(s[0] == "prefill" for s in steps) > 1:
        deadline = time.monotonic() + GATE_S
        while store.add(key, 0) < token_ranks and time.monotonic() < deadline:
            time.sleep(0.005)


def _side(ranks, **degrees) -> dict:
    return {"dp": 1, "pp": 1, "sp": 1, "tp": 1, **degrees, "ranks": ranks}


@pytest.mark.parametrize(
    "world,prompt,token,prompt_ranks,layouts,replicas",
    [
        # one prompt rank, one token rank
        (2, {"tp": 1}, {"tp": 1}, 1, {"prompt": _side([0]), "token": _side([1])}, "groups"),
        # prompt on 2 ranks, tokens on 2 ranks (TP2 each)
        (4, {"tp": 2}, {"tp": 2}, 2, {"prompt": _side([0, 1], tp=2), "token": _side([2, 3], tp=2)}, "groups"),
        # prompt TP2 -> token pipeline 2: KV re-sharded by heads and layers; both sides in one
        # loop (as engine groups: test_sides_run_at_the_same_time_as_engine_groups)
        (4, {"tp": 2}, {"pp": 2}, 2, {"prompt": _side([0, 1], tp=2), "token": _side([2, 3], pp=2)}, "lockstep"),
        # prompt pipeline 2 -> token TP2
        (4, {"pp": 2}, {"tp": 2}, 2, {"prompt": _side([0, 1], pp=2), "token": _side([2, 3], tp=2)}, "groups"),
    ],
)
def test_disaggregated_generation_equals_hf(
    four_layer, hf_reference, world, prompt, token, prompt_ranks, layouts, replicas
):
    """Tokens equal HF; every request that ran on past its first token resumed on the token side
    through its KV connector, whether the sides are engine groups or step in one loop; every
    prompt's KV streamed once, its bytes summed over the token side's ranks."""
    from transformers import AutoConfig

    path = four_layer["llama"]
    c = AutoConfig.from_pretrained(path)
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    results = dist_harness.run(world, _job, path, prompt, token, prompt_ranks, 6, replicas, timeout=240)
    expected = hf_reference(path, PROMPTS, 6)
    for tokens, summary, reported, ran, _ in results:
        assert reported == ran == layouts  # summary.json's "parallel": the sides the engine ran
        assert tokens == expected
        assert summary["streamed_tokens"] == sum(map(len, PROMPTS))
        assert summary["streamed_bytes"] == per_token * sum(map(len, PROMPTS))
        assert summary["handoffs_loaded"] == sum(len(t) > 1 for t in expected)
        plan = summary["dejavu_plan"]
        assert plan["D_p"] + plan["D_t"] == world


def test_bad_sides_are_named():
    from reshard.recipes.schema import compose, strategy_config

    with pytest.raises(ValueError, match=r"parallel.token: dp \(1\) x tp \(2\) x pp \(2\) must equal its 2 ranks"):
        strategy_config({"strategy": "dejavu", "token": {"tp": 2, "pp": 2}}).sides(4)
    with pytest.raises(ValueError, match=r"parallel.prompt.dp must be >= 1, got 0"):
        strategy_config({"strategy": "dejavu", "prompt": {"dp": 0}}).sides(4)
    with pytest.raises(ValueError, match=r"parallel.prompt_ranks must be in 1..3 \(the job has 4 ranks\), got 4"):
        strategy_config({"strategy": "dejavu", "prompt_ranks": 4}).sides(4)
    with pytest.raises(ValueError, match=r"^parallel.prompt.sp: Key 'sp' not in 'SideConfig' \(given 2\)"):
        strategy_config({"strategy": "dejavu", "prompt": {"sp": 2}})
    with pytest.raises(ValueError, match=r"^parallel.prompt.sp: Key 'sp' not in 'SideConfig' \(given 2\)"):
        compose("generate", ["parallel=dejavu", "+parallel.prompt.sp=2"])
    with pytest.raises(ValueError, match=r"^parallel.token.pp: Value 'two' could not be converted to Integer"):
        compose("generate", ["parallel=dejavu", "parallel.token.pp=two"])
    with pytest.raises(
        ValueError, match=r"^parallel.prompt: Invalid type assigned: int is not a subclass of SideConfig"
    ):
        compose("generate", ["parallel=dejavu", "parallel.prompt=3"])


def _began_during(steps_a, steps_b) -> int:
    """How many steps of ``steps_b`` began while a step of ``steps_a`` was open: after its
    ``step_begin`` and before its ``step_end``, in the job-wide order of the events."""
    return sum(1 for _, b0, _ in steps_b if any(a0 < b0 < a1 for _, a0, a1 in steps_a))


@pytest.mark.parametrize(
    "world,prompt,token,prompt_ranks,groups",
    [
        (2, {"tp": 1}, {"tp": 1}, 1, [0, 1]),  # one prompt rank, one token rank
        (4, {"tp": 2}, {"pp": 2}, 2, [0, 0, 1, 1]),  # prompt TP2 -> token PP2
        (4, {"dp": 2}, {"tp": 2}, 2, [0, 1, 2, 2]),  # two prompt groups -> one TP2 token group
    ],
)
def test_sides_run_at_the_same_time_as_engine_groups(
    four_layer, hf_reference, world, prompt, token, prompt_ranks, groups
):
    """The prompt and token sides are engine groups: tokens equal HF, and the engine's events show
    decode steps beginning on the token ranks while a prefill step is open on a prompt rank (each
    prompt rank's later prefill steps held open until every token rank has begun a decode step:
    without the hold, a loaded machine sometimes delayed one token rank's first step past the last
    prefill; sides stepping in one loop would wait the hold out and still fail)."""
    path = four_layer["llama"]
    gate = f"test_dejavu/gate/{uuid.uuid4().hex}"
    results = dist_harness.run(world, _job, path, prompt, token, prompt_ranks, 6, gate=gate, timeout=240)
    expected = hf_reference(path, PROMPTS, 6)
    for rank, (tokens, summary, _, _, (group, steps)) in enumerate(results):
        assert tokens == expected
        assert group == groups[rank]
        assert summary["streamed_bytes"] > 0
        # every request that ran on past its first token resumed on the token group through its
        # KV connector (the group's leader counts; every rank of it loads its own shard)
        assert summary["handoffs_loaded"] == sum(len(t) > 1 for t in expected)
        phases = {phase for phase, _, _ in steps}
        assert phases == ({"prefill"} if rank < prompt_ranks else {"decode"})
    prompt_steps = [s for _, _, _, _, (_, steps) in results[:prompt_ranks] for s in steps]
    for rank in range(prompt_ranks, world):  # each token rank began a decode step during a prefill step
        assert _began_during(prompt_steps, results[rank][4][1]) >= 1, (rank, [r[4][1] for r in results])
    if world == 2:  # the same sides in lockstep: every step ends before the next one (either side's) begins
        lockstep = dist_harness.run(2, _job, path, prompt, token, 1, 6, "lockstep", prefill_sleep=0.02)
        prompt_steps, token_steps = lockstep[0][4][1], lockstep[1][4][1]
        assert _began_during(prompt_steps, token_steps) == _began_during(token_steps, prompt_steps) == 0


def _samples(path, replicas, n, temperature, share=True):
    """``n`` samples of each of ``PROMPTS`` (request ``i * n + j``, seeds differing; the first
    sample of prompt 1 ends at its first token, its siblings go on) through DejaVu's two sides,
    and through a static TP engine over the same ranks. Returns both's tokens, DejaVu's summary,
    the prompt tokens each request fed on the prompt side (``{id: tokens}``, rank 0), the
    prefix-cache figures and the token side's staging books after (rank 1)."""
    import torch.distributed as dist

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize
    from reshard.parallel.model.dims import ParallelDims
    from reshard.recipes.schema import strategy_config

    def params(i, j):
        return SamplingParams(max_new_tokens=1 if (i, j) == (1, 0) else 6, temperature=temperature, seed=10 + j)

    requests = [Request(i * n + j, p, params(i, j)) for i, p in enumerate(PROMPTS) for j in range(n)]
    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 1})
    config = EngineConfig(max_batch_size=4, max_seq_len=64, replicas=replicas, prefix_caching=share)
    engine = strategy.build(path, config)
    fed = {}
    engine.events.on(
        "step_begin",
        lambda step, seqs: (
            step.layout == "prompt" and fed.update(zip([s.request.id for s in step.seqs], step.num_tokens))
        ),
    )
    with engine:
        tokens = [c.output_ids for c in engine.generate(requests)]
    streamed = engine.policy.token.streamed if replicas == "lockstep" else getattr(engine.policy, "streamed", None)
    staged = (
        None if streamed is None else (len(streamed.free), len(streamed.kept), streamed.incoming, streamed.unposted)
    )
    cached = (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits)
    summary = strategy.summary(engine)
    dims = ParallelDims(tp=dist.get_world_size(), world_size=dist.get_world_size())
    static = Engine(parallelize(path, dims), EngineConfig(max_batch_size=4, max_seq_len=64, prefix_caching=False))
    return tokens, [c.output_ids for c in static.generate(requests)], summary, fed, cached, staged


@pytest.mark.parametrize("replicas,temperature", [("groups", 0.0), ("groups", 0.9), ("lockstep", 0.9)])
def test_n_samples_of_a_prompt_are_computed_once(four_layer, hf_reference, replicas, temperature):
    """GRPO's shape: 4 samples of each prompt. The prompt side computes each prompt once: a
    sample beside it in its step streams with it (the token side feeds its last position), a
    later one feeds only its last token where the prompt's KV stayed, and streams nothing: the
    token side kept the prompt from its first hand-off and copies it. Tokens equal a static TP
    engine's (and HF's, greedy); the bytes streamed are each prompt's once; after, every staging
    slot is free but that of the one prompt the token side keeps (a quarter of its 4 slots)."""
    from transformers import AutoConfig

    path, n = four_layer["llama"], 4
    c = AutoConfig.from_pretrained(path)
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    expected = hf_reference(path, PROMPTS, 6)
    results = dist_harness.run(2, _samples, path, replicas, n, temperature, timeout=180)
    (_, _, _, fed, cached, _), (_, _, _, _, _, staged) = results
    for tokens, static, summary, *_ in results:
        assert tokens == static
        if temperature == 0.0:
            assert tokens == [e[: 1 if (i, j) == (1, 0) else 6] for i, e in enumerate(expected) for j in range(n)]
        assert summary["streamed_bytes"] == per_token * sum(map(len, PROMPTS))
        assert summary["kept_tokens_reused"] == sum(len(PROMPTS[rid // n]) for rid in fed) - sum(map(len, PROMPTS))
        assert summary["handoffs_loaded"] == n * len(PROMPTS) - 1  # all but prompt 1's first sample
        assert summary["kept_misses"] == 0
    again = [
        rid for rid, k in fed.items() if k == 1
    ]  # fed their last prompt token (their KV copied from the kept prompt)
    for i, prompt in enumerate(PROMPTS):  # each prompt computed once; its other samples fed 1 token or none
        computed = [rid for rid in range(i * n, i * n + n) if fed.get(rid) == len(prompt)]
        assert len(computed) == 1 and all(
            fed.get(rid, 1) == 1 for rid in range(i * n, i * n + n) if rid not in computed
        )
    if replicas == "lockstep":  # (a step hands off no more than the token side has room for: the rest come later)
        assert again, fed
    queries = n * sum(map(len, PROMPTS))
    assert cached == (queries, queries - sum(map(len, PROMPTS)) - (n - 1) * len(PROMPTS))
    assert staged == (4, 1, {}, {})


def test_n_samples_with_prefix_caching_off_are_each_computed_whole(four_layer):
    """``prefix_caching=False``: every sample computes and streams its whole prompt, and the
    tokens are those of the cache on (a static TP engine's)."""
    path, n = four_layer["llama"], 2
    results = dist_harness.run(2, _samples, path, "groups", n, 0.9, False)
    for tokens, static, _, _, cached, _ in results:
        assert tokens == static and cached == (0, 0)
    assert results[0][3] == {i * n + j: len(p) for i, p in enumerate(PROMPTS) for j in range(n)}  # rank 0: prompts


def _samples_across_a_weight_write(path, n, write):
    """``n`` greedy samples of ``PROMPTS[:2]`` through lockstep DejaVu's ``EngineCore`` (2 token
    slots: a prompt step hands off 2 requests at most), the prompt side's weights' version bumped
    after the first step where ``write`` (as a sync does): tokens, and the prompt tokens each
    request fed on the prompt side."""
    from reshard.parallel import EngineConfig, EngineCore, Request, SamplingParams
    from reshard.parallel.model.info import parallel_info
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 1})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=64, replicas="lockstep"))
    fed = {}
    engine.events.on(
        "step_begin",
        lambda step, seqs: (
            step.layout == "prompt" and fed.update(zip([s.request.id for s in step.seqs], step.num_tokens))
        ),
    )
    core = EngineCore(engine)
    for i, p in enumerate(PROMPTS[:2]):
        for j in range(n):
            core.add_request(Request(i * n + j, p, SamplingParams(max_new_tokens=4)))
    outputs = core.step()
    if write:
        parallel_info(engine.runners["prompt"].model).weight_version.writes += 1
    while core.has_unfinished():
        outputs += core.step()
    tokens = {}
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.close()
    return [tokens[k] for k in sorted(tokens)], fed


def test_a_prompt_retained_across_a_weight_write_is_computed_anew(four_layer, hf_reference):
    """A prompt's KV stays on the prompt side for its later samples only under the weights it was
    computed with: without a write, prompt 0's later samples feed one token; after one, the next
    computes the whole prompt again (the same tokens here: the version moved, not the values)."""
    path, n = four_layer["llama"], 4
    expected = hf_reference(path, PROMPTS[:2], 4)
    for write in (False, True):
        tokens, fed = dist_harness.run(2, _samples_across_a_weight_write, path, n, write)[0]
        assert tokens == [e for e in expected for _ in range(n)]
        full = [rid for rid in range(n) if fed.get(rid) == len(PROMPTS[0])]
        assert full == ([0, 2] if write else [0]), fed


SYSTEM = [(7 * i) % 200 + 3 for i in range(40)]  # a 40-token prompt two turns and a request share


def _turns(path, replicas, prompt=None, slots=4, forget=False):
    """Three ``generate`` calls on one DejaVu engine: a first turn (``SYSTEM`` + 4 tokens); its
    next turn (the first's prompt and output + 5 tokens) beside a request sharing the first 30
    tokens; the next turn again after a write of the weights. Tokens of each call, the prompt
    tokens each request fed on the prompt side and the summary. ``forget`` (lockstep): after
    the first call the token side drops what it kept, as books that disagree would have it."""
    from reshard.parallel import EngineConfig, Request, SamplingParams
    from reshard.parallel.model.info import parallel_info
    from reshard.recipes.schema import strategy_config

    sides = {"prompt": prompt or {}, "prompt_ranks": 2 if prompt else 1}
    strategy = strategy_config({"strategy": "dejavu", **sides})
    engine = strategy.build(path, EngineConfig(max_batch_size=slots, max_seq_len=96, replicas=replicas))
    fed = {}
    engine.events.on(
        "step_begin",
        lambda step, seqs: (
            step.layout == "prompt" and fed.update(zip([s.request.id for s in step.seqs], step.num_tokens))
        ),
    )
    params = SamplingParams(max_new_tokens=6)
    first = [*SYSTEM, 11, 12, 13, 14]
    (turn1,) = [c.output_ids for c in engine.generate([Request(0, first, params)])]
    streamed = engine.policy.token.streamed if forget else None
    for kept in list(streamed.kept) if forget else ():
        streamed._drop(kept)
    second = [*first, *turn1, 21, 22, 23, 24, 25]
    other = [*SYSTEM[:30], 31, 32, 33]
    turn2 = [c.output_ids for c in engine.generate([Request(1, second, params), Request(2, other, params)])]
    parallel_info(engine.runners["prompt"].model).weight_version.writes += 1
    turn3 = [c.output_ids for c in engine.generate([Request(3, second, params)])]
    summary = strategy.summary(engine)
    engine.close()
    return (first, second, other), [turn1, *turn2, *turn3], fed, summary


@pytest.mark.parametrize(
    "replicas,world,prompt,slots",
    [("groups", 2, None, 4), ("lockstep", 2, None, 4), ("lockstep", 2, None, 1), ("groups", 4, {"pp": 2}, 4)],
)
def test_a_chats_next_turn_computes_only_what_the_prompt_side_did_not_keep(
    four_layer, hf_reference, replicas, world, prompt, slots
):
    """A prompt's KV stays in its prompt-side slot across calls: the next turn (its prompt and
    output, and more) computes only the rest, a request sharing 30 of its tokens only what
    follows them (copied into a slot of its own); after a write of the weights, the next turn
    is computed whole (a prompt side of two pipeline stages too; with one slot each takes the
    kept prompt's slot over, as there is no other to copy into). Tokens equal HF's. The token
    side keeps what was streamed to it: the next turn and the request sharing 30 tokens stream
    only what follows the kept prompt; after the write, the whole prompt streams again."""
    path = four_layer["llama"]
    (prompts, tokens, fed, summary), *_ = dist_harness.run(world, _turns, path, replicas, prompt, slots, timeout=180)
    first, second, other = prompts
    assert tokens == hf_reference(path, [first, second, other, second], 6)
    assert fed == {0: len(first), 1: len(second) - len(first), 2: len(other) - 30, 3: len(second)}
    streamed = len(first) + (len(second) - len(first)) + (len(other) - 30) + len(second)
    assert summary["streamed_tokens"] == streamed
    assert summary["kept_tokens_reused"] == len(first) + 30 and summary["kept_misses"] == 0


def test_a_next_turn_whose_kept_prompt_the_token_side_lost_computes_it_there(four_layer, hf_reference):
    """The token side no longer holds the prompt the next turn's hand-off copies from (books that
    disagree): those requests compute their prompts on the token side, and the tokens still equal
    HF's. The prompt side computes as it would have."""
    path = four_layer["llama"]
    (prompts, tokens, fed, summary), _ = dist_harness.run(2, _turns, path, "lockstep", None, 4, True, timeout=180)
    first, second, other = prompts
    assert tokens == hf_reference(path, [first, second, other, second], 6)
    assert fed == {0: len(first), 1: len(second) - len(first), 2: len(other) - 30, 3: len(second)}  # (as ever)
    assert summary["kept_misses"] == 2 and summary["kept_tokens_reused"] == 0  # (turn 2's two requests)
    assert summary["handoffs_loaded"] == 2  # (turn 1's and turn 3's)


def _released(path):
    """A lockstep DejaVu chat's first turn, ``release_memory()`` and ``ready()``, then its next
    turn: the bytes freed against this rank's caches (its token cache and staging cache, its
    prompt cache), what the token side kept after the release, both turns' tokens and the
    summary."""
    from reshard.parallel import EngineConfig, Request, SamplingParams
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 1})
    engine = strategy.build(path, EngineConfig(max_batch_size=4, max_seq_len=96, replicas="lockstep"))
    streamed, params = engine.policy.token.streamed, SamplingParams(max_new_tokens=6)
    first = [*SYSTEM, 11, 12, 13, 14]
    (turn1,) = [c.output_ids for c in engine.generate([Request(0, first, params)])]
    caches = [kv for kv in (*(r.kv for r in engine.runners.values()), streamed.staging) if kv is not None]
    freed, held = engine.release_memory(), (len(streamed.kept), [kv.allocated for kv in caches])
    engine.ready()
    second = [*first, *turn1, 21, 22, 23]
    (turn2,) = [c.output_ids for c in engine.generate([Request(1, second, params)])]
    summary = strategy.summary(engine)
    engine.close()
    return freed - sum(kv.spec.bytes for kv in caches), held, (first, second), [turn1, turn2], summary


def test_release_memory_frees_the_token_sides_staging_and_what_it_kept(four_layer, hf_reference):
    """``release_memory()`` frees the token side's staging cache with its KV caches (every byte
    of this rank's caches), and the token side keeps no prompt after it; after ``ready()`` the
    next turn streams its whole prompt again, and the tokens equal HF's."""
    path = four_layer["llama"]
    for freed_less, held, prompts, tokens, summary in dist_harness.run(2, _released, path, timeout=180):
        assert freed_less == 0 and held == (0, [False] * len(held[1]))
        assert tokens == hf_reference(path, list(prompts), 6)
        assert summary["streamed_tokens"] == sum(map(len, prompts)) and summary["kept_tokens_reused"] == 0


def test_a_retained_prompt_matches_by_its_longest_common_prefix():
    """The prompt side's lookup: the same prompt (all but its last position shared), else the
    kept prompt sharing the most leading tokens, at least 16; the least recently used is evicted
    first, never one the step reads."""

    from reshard.parallel.engine.retained import RetainedPrompts, Reuse, common_prefix

    base = tuple(range(3, 43))
    kept = RetainedPrompts()
    assert kept.keep(base, 0) and kept.keep(base[:20] + (1, 2), 1) and not kept.keep(base, 2)
    assert not kept.keep((5,), 3)  # (one token: nothing to share)
    assert common_prefix(base, base[:20] + (1,)) == 20 and common_prefix((), base) == 0
    assert kept.match(list(base)) == Reuse(base, 39, True)
    assert kept.match([*base, 7, 8]) == Reuse(base, 40, False)  # a next turn
    assert kept.match([*base[:25], 9]) == Reuse(base, 25, False)  # the longest of the two
    assert kept.match([*base[:15], 9, 9]) is None  # (15 shared: not worth a step of its own)
    assert kept.match([*base[:20], 1, 2]) == Reuse(base[:20] + (1, 2), 21, True)
    assert kept.use(base) == 0  # (now the most recently used)
    assert kept.handles() == [1, 0]
    assert kept.evict({base[:20] + (1, 2)}) == 0 and kept.evict({base[:20] + (1, 2)}) is None
    assert kept.clear() == [1] and len(kept) == 0


def test_groups_sample_as_lockstep_sides_do(four_layer):
    path = four_layer["qwen3"]
    grouped = dist_harness.run(2, _job, path, {"tp": 1}, {"tp": 1}, 1, 6, temperature=0.8)
    lockstep = dist_harness.run(2, _job, path, {"tp": 1}, {"tp": 1}, 1, 6, replicas="lockstep", temperature=0.8)
    assert grouped[0][0] == grouped[1][0] == lockstep[0][0]


def _job_adding(*args, **kwargs):
    """``_job``'s tokens and summary, and each ``EngineCore.add_request`` call that names a KV
    source: ``(request id, kv_source)``."""
    from reshard.parallel.engine.core import EngineCore

    added, original = [], EngineCore.add_request

    def add_request(core, request, kv_source=None):
        if kv_source is not None:
            added.append((request.id, kv_source))
        return original(core, request, kv_source)

    EngineCore.add_request = add_request
    try:
        tokens, summary, *_ = _job(*args, **kwargs)
    finally:
        EngineCore.add_request = original
    return tokens, summary, added


def test_a_token_group_takes_each_handoff_as_requests_added_with_their_kv_source(four_layer, hf_reference):
    """A hand-off reaches its token group as ``EngineCore.add_request`` calls, one per request that
    runs on past its first token, each naming its hand-off (``"<prompt group>:<tag>"``) as KV
    source; the prompt group adds none. Tokens equal HF's."""
    path = four_layer["llama"]
    expected = hf_reference(path, PROMPTS, 6)
    (prompt_tokens, _, prompt_added), (tokens, summary, added) = dist_harness.run(
        2, _job_adding, path, {"tp": 1}, {"tp": 1}, 1, 6, timeout=120
    )
    assert tokens == prompt_tokens == expected
    assert prompt_added == []
    assert sorted(rid for rid, _ in added) == [i for i, t in enumerate(expected) if len(t) > 1]
    assert all(re.fullmatch(r"0:\d+", source) for _, source in added), added
    assert summary["handoffs_loaded"] == len(added)


def test_planner_chooses_the_split_the_sides_accept():
    """``prompt_ranks: null``: the appendix-D split with the lowest ``I_dis`` among the splits both
    sides' degrees accept, from configured step times."""
    from reshard.parallel.cost.dejavu_planner import plan_disaggregation
    from reshard.parallel.engine import WorkloadShape
    from reshard.recipes.schema import strategy_config

    work = WorkloadShape(prompt_len=64, new_tokens=10, batch=4)
    free = strategy_config({"strategy": "dejavu", "prefill_ms": 30.0, "decode_ms": 1.0})
    planned = free.planned("unused: times are given", 4, work)
    assert planned.prompt_ranks == plan_disaggregation(4, 30.0, 1.0, 10, 1.0).D_p == 3  # formula (1): 4*30/40
    assert planned.layouts(4)["prompt"].ranks == [0, 1, 2]
    pinned = strategy_config({"strategy": "dejavu", "prefill_ms": 30.0, "decode_ms": 1.0, "token": {"pp": 2}})
    assert pinned.planned("unused", 4, work).prompt_ranks == 2  # the token pipeline needs an even side
    slow_tokens = strategy_config({"strategy": "dejavu", "prefill_ms": 1.0, "decode_ms": 10.0})
    assert slow_tokens.planned("unused", 4, work).prompt_ranks == 1
    assert strategy_config({"strategy": "dejavu", "prompt_ranks": 2}).planned("unused", 4, work).prompt_ranks == 2
    with pytest.raises(ValueError, match=r"give both parallel.prefill_ms and parallel.decode_ms or neither, got 3.0"):
        strategy_config({"strategy": "dejavu", "prefill_ms": 3.0})
    with pytest.raises(ValueError, match=r"parallel.decode_ms must be > 0 ms, got -1.0"):
        strategy_config({"strategy": "dejavu", "prefill_ms": 3.0, "decode_ms": -1.0})
    with pytest.raises(ValueError, match=r"unknown hardware 'b300'"):
        strategy_config({"strategy": "dejavu", "hardware": "b300"})


def test_predicted_step_times_follow_the_workload(four_layer):
    from reshard.parallel.engine import WorkloadShape
    from reshard.parallel.strategies.dejavu import predicted_step_ms

    short = predicted_step_ms(four_layer["llama"], 4, WorkloadShape(prompt_len=16, new_tokens=8, batch=4), "h100")
    long = predicted_step_ms(four_layer["llama"], 4, WorkloadShape(prompt_len=1024, new_tokens=8, batch=4), "h100")
    assert 0 < short[1] < short[0] < long[0]  # a prompt costs more than a token step, and grows with length
    assert long[1] >= short[1]  # a token step reads a longer context


def _planned_job(path):
    from reshard.parallel.engine import WorkloadShape
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "hardware": "h100"})
    return strategy.planned(path, 4, WorkloadShape(prompt_len=512, new_tokens=4, batch=8)).prompt_ranks


def test_every_rank_takes_rank0s_predicted_split(four_layer):
    from reshard.parallel.cost.dejavu_planner import best_split
    from reshard.parallel.engine import WorkloadShape
    from reshard.parallel.strategies.dejavu import predicted_step_ms

    path = four_layer["llama"]
    Y, t = predicted_step_ms(path, 4, WorkloadShape(prompt_len=512, new_tokens=4, batch=8), "h100")
    expected = 4 - best_split(4, Y, t, 4, 1.0, [1, 2, 3])
    assert dist_harness.run(2, _planned_job, path) == [expected, expected]


def test_a_failed_calibration_says_so(monkeypatch, capsys):
    import subprocess

    from reshard.parallel.engine import WorkloadShape
    from reshard.parallel.strategies.dejavu import strategy as dejavu

    def timed_out(*args):
        raise subprocess.TimeoutExpired("calibrate", 60)

    monkeypatch.setattr(dejavu, "predicted_step_ms", timed_out)
    assert dejavu._predicted_or_none("p", 4, WorkloadShape(64, 8, 4), "this_machine") is None
    assert "calibrating this_machine for the appendix-D split failed (TimeoutExpired)" in capsys.readouterr().out


def test_prompts_that_finish_at_their_first_token_are_still_received(four_layer, hf_reference):
    """``max_new_tokens=1``: every hand-off's sequences finished on the prompt side; the token
    group must still take each hand-off (and its streamed KV) before the job ends."""
    path = four_layer["llama"]
    expected = hf_reference(path, PROMPTS, 1)
    for replicas in ("groups", "lockstep"):
        for tokens, summary, *_ in dist_harness.run(2, _job, path, {"tp": 1}, {"tp": 1}, 1, 1, replicas, timeout=120):
            assert tokens == expected
            assert summary["streamed_bytes"] > 0


def test_a_prompt_groups_lease_book_shares_keeps_and_drops_least_recently_used_first():
    """The prompt side's book of what a token group keeps for it: a hand-off's prompts match
    the prompts kept before it (the same prompt, whole, or the longest common prefix of at least
    16 tokens), then are kept (a prompt kept already keeps its serial) and the least recently
    used go past the capacity; a reset (the weights written) shares nothing kept before."""
    from reshard.parallel.strategies.dejavu.lease import NONE, Lease, LeaseBook

    a, b, short = tuple(range(3, 43)), (*range(3, 23), 7, 7), (5, 6, 7)
    book = LeaseBook(2)
    assert book.plan([a, short]) == Lease(0, (NONE, NONE), (1, 2), ())
    assert book.plan([a, b]) == Lease(0, ((1, 40), (1, 20)), (-1, 3), (2,))  # (a read: short goes)
    assert book.plan([(5, 6, 7), a[:15] + (9,)]) == Lease(0, (NONE, NONE), (4, 5), (1, 3))
    book.reset(7)
    assert book.plan([short]) == Lease(7, ((-1, 0),), (6,), ())
    assert book.plan([short, (5, 6)]) == Lease(7, ((6, 3), NONE), (-1, 7), ())  # (short: the same prompt only)


def _handoff(tag, requests, lease, leaders=()):
    from reshard.parallel.engine.channel import Handoff

    n = len(requests)
    return Handoff(0, 1, tag, tuple(requests), ((1,),) * n, (False,) * n, leaders=leaders, lease=lease)


def test_a_token_groups_kept_prompts_follow_the_lease_and_a_missing_one_is_computed_there():
    """The token side's books (a rank outside the token layout keeps the same ones): a kept
    prompt's staging slot stays taken after its request loaded; a hand-off copying from it posts
    at once, receives only the rest and copies the kept prefix when it is unpacked (the kept
    prompt's hand-off unpacked first); a kept prompt dropped while a copy from it waits keeps its
    slot until the copy is made. A kept prompt of another epoch, other tokens or not held at all
    (books that disagree) is a miss: that request's KV, and its siblings', is not supplied
    (they compute their prompt here). Nothing leaks."""
    import dataclasses

    from reshard.parallel.engine.request import Request, SamplingParams, Sequence
    from reshard.parallel.strategies.dejavu.connector import StreamedKV
    from reshard.parallel.strategies.dejavu.lease import NONE, Lease

    def seq(key, rid):
        resumed, source = next(x for x in received[key] if x[0].id == rid)
        return Sequence(dataclasses.replace(resumed, kv_source=source), None, frozenset(), slot=0)

    kv, received, params = StreamedKV({}, None, 2, 1, slots=2, kept=2), {}, SamplingParams(max_new_tokens=4)
    a, b, c = list(range(3, 43)), [*range(3, 43), 50, 51], [*range(3, 23), 7, 7]
    received["0:0"] = kv.receive(_handoff(0, [Request(0, a, params)], Lease(1, (NONE,), (1,), ())))
    received["0:1"] = kv.receive(_handoff(1, [Request(1, b, params)], Lease(1, ((1, 40),), (2,), ())))
    assert list(kv.incoming) == ["0:0", "0:1"] and kv.unposted == {}  # (0:1 receives 2 positions)
    assert (kv.positions, kv.reused, +kv.pins) == (42, 40, {0: 1})  # (a's slot 0 pinned for the copy)
    kv.land("0:1")  # (0:0 unpacked first: a's positions are there to copy)
    assert kv.incoming["0:0"].unpacked and not +kv.pins and kv.matched_tokens(seq("0:0", 0)) is None
    kv.land("0:0")
    assert kv.matched_tokens(seq("0:0", 0)) == 40
    kv.load(seq("0:0", 0), 40)
    assert sorted(kv.free) == [2, 3] and set(kv.kept) == {(0, 1), (0, 2)}  # (request 0's slot kept: prompt a)
    received["0:2"] = kv.receive(_handoff(2, [Request(2, c, params)], Lease(1, ((1, 20),), (3,), (1,))))
    assert 0 not in kv.free and set(kv.kept) == {(0, 2), (0, 3)}  # (a dropped, its slot pinned)
    kv.land("0:2")
    assert 0 in kv.free  # (the copy made)
    other = [Request(5, [*range(4, 24), 9, 9], params), Request(6, [*range(4, 24), 9, 9], params)]
    received["0:3"] = kv.receive(_handoff(3, other, Lease(1, ((3, 20),), (4,), ()), leaders=(0, 0)))
    stale = Request(7, b, params)  # (epoch 1's prompt b, asked for in epoch 2)
    received["0:4"] = kv.receive(_handoff(4, [stale], Lease(2, ((2, 42),), (-1,), ())))
    kv.land("0:3")
    kv.land("0:4")
    assert [kv.matched_tokens(seq(k, rid)) for k, rid in (("0:3", 5), ("0:3", 6), ("0:4", 7))] == [0, 0, 0]
    assert kv.misses == 3 and kv.kept == {}  # (other's first 20 tokens are not c's; epoch 2 drops epoch 1's)
    kv.load(seq("0:1", 1), 42)
    kv.load(seq("0:2", 2), 22)
    assert (sorted(kv.free), kv.incoming, kv.unposted) == ([0, 1, 2, 3], {}, {})
    gone = Request(8, a, params)  # (a serial this group never kept: books that disagree)
    received["0:5"] = kv.receive(_handoff(5, [gone], Lease(2, ((9, 40),), (-1,), ())))
    kv.land("0:5")
    assert kv.matched_tokens(seq("0:5", 8)) == 0 and kv.misses == 4 and len(kv.free) == 4


def test_a_handoff_that_repeats_an_old_key_frees_the_kept_prompt_it_drops():
    """A prompt group whose steps count from 0 again (respawned: its hand-offs' keys repeat) and
    whose new epoch drops what the token side kept for it: the kept prompt's slot is free at once
    (the new hand-off of that key does not hold it), so no staging slot leaks."""
    import dataclasses

    from reshard.parallel.engine.request import Request, SamplingParams, Sequence
    from reshard.parallel.strategies.dejavu.connector import StreamedKV
    from reshard.parallel.strategies.dejavu.lease import NONE, Lease

    kv, params = StreamedKV({}, None, 2, 1, slots=1, kept=1), SamplingParams(max_new_tokens=4)
    for rid, epoch in ((0, 1), (1, 5)):
        ((resumed, source),) = kv.receive(
            _handoff(0, [Request(rid, list(range(3, 43)), params)], Lease(epoch, (NONE,), (1,), ()))
        )
        kv.land(source)
        kv.load(Sequence(dataclasses.replace(resumed, kv_source=source), None, frozenset(), slot=0), 40)
    assert (sorted(kv.free), [k.slot for k in kv.kept.values()]) == ([0], [1])


def test_releasing_staging_while_handoffs_arrive_is_refused_in_one_line():
    """``release_memory()`` after a failed call, with a hand-off still arriving: refused, naming
    it, before anything is freed or forgotten (its KV would land in freed memory)."""
    from reshard.parallel.engine.channel import Handoff
    from reshard.parallel.engine.request import Request, SamplingParams
    from reshard.parallel.strategies.dejavu.connector import StreamedKV
    from reshard.parallel.strategies.dejavu.lease import NONE, Lease

    kv = StreamedKV({}, None, 2, 1, slots=2, kept=1)
    request = Request(0, list(range(3, 43)), SamplingParams(max_new_tokens=1))  # (it ends at its first token)
    kv.receive(Handoff(0, 1, 0, (request,), ((1,),), (True,), lease=Lease(1, (NONE,), (1,), ())))
    with pytest.raises(RuntimeError, match=r"release_memory\(\) while DejaVu hand-offs \['0:0'\] still arrive"):
        kv.released_caches()
    assert list(kv.kept) == [(0, 1)] and list(kv.incoming) == ["0:0"]
    kv.land("0:0")  # (landed, nothing waits for it: released)
    assert kv.released_caches() == [] and kv.kept == {} and sorted(kv.free) == [0, 1, 2]


def _two_prompt_groups(path, n):
    """Greedy ``n`` samples of ``PROMPTS``, twice, through two prompt groups and one token group
    (2 token slots): tokens of each call, the summary and the token group's staging books."""
    from reshard.parallel import EngineConfig, Request, SamplingParams
    from reshard.recipes.schema import strategy_config

    requests = [
        Request(i * n + j, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(PROMPTS) for j in range(n)
    ]
    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 2, "prompt": {"dp": 2}})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=64, replicas="groups"))
    with engine:
        calls = [[c.output_ids for c in engine.generate(requests)] for _ in range(2)]
    kv = getattr(engine.policy, "streamed", None)
    staged = None if kv is None else (len(kv.free), sorted(group for group, _ in kv.kept), kv.incoming, kv.unposted)
    return calls, strategy.summary(engine), staged


def test_two_prompt_groups_each_keep_their_own_prompts_at_one_token_group(four_layer, hf_reference):
    """Two prompt groups stream to one token group, which keeps prompts for each apart (their
    serials are their own): tokens equal HF's in both calls, no kept prompt is missed, and some
    prompt positions are copied instead of received; after, every staging slot is free but the
    kept prompts' (2 token slots: 1 kept per prompt group)."""
    path, n = four_layer["llama"], 3
    expected = [e for e in hf_reference(path, PROMPTS, 6) for _ in range(n)]
    results = dist_harness.run(3, _two_prompt_groups, path, n, timeout=180)
    for calls, summary, _ in results:
        assert calls == [expected, expected]
        assert summary["kept_misses"] == 0 and summary["kept_tokens_reused"] > 0
    assert results[2][2] == (2, [0, 1], {}, {})  # (2 + 2 staging slots on the token rank: 1 kept per group)


def test_aborted_requests_awaiting_their_kv_give_their_handoffs_staging_slots_back():
    """The token side's books when requests waiting for their KV are aborted (``forget``): one of
    a posted hand-off (its sibling still loads), the only one of a hand-off still waiting for
    staging slots. Each hand-off's slots come back once it landed and no request of it waits."""
    import dataclasses

    from reshard.parallel.engine.request import Request, SamplingParams, Sequence
    from reshard.parallel.strategies.dejavu.connector import StreamedKV

    kv, params = StreamedKV({}, None, 2, 1, slots=2), SamplingParams(max_new_tokens=4)
    pair = kv.receive(
        _handoff(0, [Request(0, list(range(3, 43)), params), Request(1, list(range(5, 45)), params)], None)
    )
    ((late, late_key),) = kv.receive(_handoff(1, [Request(2, list(range(7, 47)), params)], None))
    assert list(kv.incoming) == ["0:0"] and list(kv.unposted) == ["0:1"] and kv.free == []
    (first, key), (second, _) = pair
    kv.forget(dataclasses.replace(first, kv_source=key))
    kv.forget(dataclasses.replace(late, kv_source=late_key))
    kv.land("0:0")
    assert kv.free == [] and list(kv.unposted) == ["0:1"]  # (request 1 still waits for its KV)
    kv.load(Sequence(dataclasses.replace(second, kv_source=key), None, frozenset(), slot=0), 40)
    assert list(kv.incoming) == ["0:1"] and kv.unposted == {}  # (0:0's slots back: 0:1 posted into them)
    kv.land("0:1")
    assert (sorted(kv.free), kv.incoming, kv.unposted) == ([0, 1], {}, {})
    assert set(kv.marks) == {1}  # (the aborted ones' times are gone; request 1's are its sequence's to take)


def _abort_resumed(path):
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import EngineConfig
    from reshard.parallel.engine.core import EngineCore
    from reshard.recipes.schema import strategy_config

    strategy = strategy_config({"strategy": "dejavu", "prompt_ranks": 1})
    engine = strategy.build(path, EngineConfig(max_batch_size=2, max_seq_len=64, replicas="lockstep"))
    core = EngineCore(engine)
    for i, p in enumerate(PROMPTS):
        core.add_request(Request(i, p, SamplingParams(max_new_tokens=6)))
    core.step()  # (the policy starts)
    while not any(r.kv_source for r in core.queue) and core.has_unfinished():
        core.step()
    aborted = sorted(r.id for r in core.queue if r.kv_source)  # (the same books on every rank)
    waiting = {core.status(rid).name for rid in aborted}  # (in the engine's queue: the policy keeps none)
    kept_by_policy = [r.id for r in engine.policy.waiting()]
    core.abort(aborted)
    done = core.run()
    streamed = engine.policy.token.streamed
    staged = (len(streamed.free), streamed.incoming, streamed.unposted)
    return (
        aborted,
        waiting,
        {rid: (c.finish_reason, c.output_ids) for rid, c in done.items()},
        staged,
        len(engine.policy.token.slots),
        kept_by_policy,
    )


def test_a_lockstep_token_side_aborts_requests_that_wait_for_a_slot_or_their_kv(four_layer, hf_reference):
    """Lockstep sides: requests handed to the token side and waiting there (for a slot or their
    KV) read ``WAITING_FOR_KV``, in the engine's queue (the policy holds no queue of its own, as a
    token group's does not); aborted, each ends "abort" with the token it had (HF's first), its
    hand-off's staging slots come back, and the other requests equal HF."""
    path = four_layer["llama"]
    expected = hf_reference(path, PROMPTS, 6)
    for aborted, waiting, done, (free, incoming, unposted), slots, kept in dist_harness.run(2, _abort_resumed, path):
        assert aborted and waiting == {"WAITING_FOR_KV"} and kept == []
        assert sorted(done) == list(range(len(PROMPTS)))
        for rid, (reason, tokens) in done.items():
            cut = rid in aborted
            assert reason == ("abort" if cut else "length") and tokens == expected[rid][: len(tokens)], rid
            assert cut or len(tokens) == 6, rid
        assert (free, incoming, unposted) == (slots, {}, {})
