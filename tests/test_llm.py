"""``reshard.LLM``, the front door: text, token ids and chats in a plain process (its own one-rank
group), TP2 and DP2 over the harness's processes; a module in memory left untouched and synced
after training steps; seeds per call; processed log-probabilities equal HF's processors."""

from __future__ import annotations

import pytest
import torch

from tests import dist_harness
from tests.test_text_io import _with_tokenizer, text_after

NEW = 6


@pytest.fixture(scope="module")
def tokenized(checkpoints, tmp_path_factory):
    """The tiny llama checkpoint with a tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("llm") / "ckpt"
    _with_tokenizer(checkpoints["llama"], path)
    return str(path)


def _hf(path_or_model):
    from transformers import AutoModelForCausalLM

    if isinstance(path_or_model, str):
        return AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32).eval()
    return path_or_model


def _hf_generate(model, prompt: list[int], new: int, **kw):
    """HF ``generate`` (greedy unless ``kw`` says otherwise) with each step's raw logits."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            return_dict_in_generate=True, output_logits=True, do_sample=False, **kw,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def _sampled(sample) -> list[float]:
    """A :class:`CompletionOutput`'s sampled tokens' log-probabilities (vLLM's ``Logprob`` dicts)."""
    return [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]


def test_llm_in_a_plain_process_takes_text_ids_and_chats_as_hf_generate(tokenized):
    from reshard import LLM, SamplingParams

    hf = _hf(tokenized)
    chat = [{"role": "user", "content": "w7 w8 w9"}]
    with LLM(tokenized, max_seq_len=64) as llm:
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1  # its own group
        outs = llm.generate(["w5 w9 w11", [40, 41, 42]], SamplingParams(max_new_tokens=NEW, logprobs=2))
        chatted = llm.chat(chat, SamplingParams(max_new_tokens=NEW, logprobs=2))
        with pytest.raises(ValueError, match=r"prompt 1 must be .* \(a chat: give it to LLM.chat\)"):
            llm.generate(["w5", chat])  # a chat given to generate is refused, never read as prompts
    assert not torch.distributed.is_initialized()  # the group it made ended with it
    tok = llm.tokenizer
    assert outs[0].prompt == "w5 w9 w11" and outs[0].prompt_token_ids == tok("w5 w9 w11")["input_ids"]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [40, 41, 42]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (
        chatted[0].prompt == rendered
        and chatted[0].prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    )
    for out in outs + chatted:
        tokens, logits = _hf_generate(hf, out.prompt_token_ids, NEW)
        (sample,) = out.outputs
        assert sample.token_ids == tokens and sample.finish_reason in ("length", "stop")
        assert sample.text == text_after(tok, out.prompt_token_ids, tokens)
        raw = torch.stack([torch.log_softmax(step.float(), -1) for step in logits])[: len(tokens)]  # (T, V)
        ours = torch.tensor(_sampled(sample))
        torch.testing.assert_close(ours, raw.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-5, rtol=0)
        top = [[t for t, lp in entry.items() if lp.rank is not None] for entry in sample.logprobs]
        assert [sorted(t, key=lambda i, e=e: e[i].rank) for t, e in zip(top, sample.logprobs)] == raw.topk(
            2, -1
        ).indices.tolist()
        assert sample.cumulative_logprob == pytest.approx(sum(_sampled(sample)))


def test_prompt_logprobs_are_the_models_log_softmax_at_each_prompt_token(tokenized):
    from reshard import LLM, SamplingParams

    hf = _hf(tokenized)
    prompts = [[5, 9, 11, 13, 2, 7], [40, 41, 42]]
    with LLM(tokenized, max_seq_len=64, max_batch_size=1) as llm:  # (batches of one prompt)
        outs = llm.generate(prompts, [SamplingParams(max_new_tokens=2, prompt_logprobs=3), SamplingParams()])
    assert outs[1].prompt_logprobs is None
    (first, *rest) = outs[0].prompt_logprobs  # per token: {its id: Logprob, the top 3's: Logprob}
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompts[0]])).logits[0, :-1].float(), -1)  # (T - 1, V)
    assert first is None and len(rest) == len(prompts[0]) - 1
    torch.testing.assert_close(
        torch.tensor([entry[t].logprob for t, entry in zip(prompts[0][1:], rest)]),
        ref.gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0],
        atol=1e-5,
        rtol=0,
    )
    ranked = [sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None) for entry in rest]
    assert [[t for _, t in r] for r in ranked] == ref.topk(3, -1).indices.tolist()


def test_processed_logprobs_are_the_distribution_sampled_from_as_hf_processors_make_it(tokenized):
    """Temperature, top-k, top-p, min-p and the repetition penalty, through HF's own processors
    over HF's logits: our ``processed`` log-probabilities equal their log-softmax, ``raw`` the
    model's."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from reshard import LLM, SamplingParams

    knobs = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    hf = _hf(tokenized)
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(40),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ]
    )
    prompts = [[5, 9, 11, 9, 5], [40, 41, 42]]
    with LLM(tokenized, max_seq_len=64) as llm:
        for mode in ("processed", "raw"):
            params = SamplingParams(max_new_tokens=8, logprobs=0, logprobs_mode=mode, seed=11, **knobs)
            for prompt, out in zip(prompts, llm.generate(prompts, params)):
                tokens = out.outputs[0].token_ids
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (T, V)
                ref = []
                for t in range(len(tokens)):
                    x = logits[t : t + 1].clone()
                    if mode == "processed":
                        x = processors(torch.tensor([prompt + tokens[:t]]), x)
                    ref.append(torch.log_softmax(x[0], -1)[tokens[t]])
                ours = torch.tensor(_sampled(out.outputs[0]))
                torch.testing.assert_close(ours, torch.stack(ref), atol=1e-4, rtol=0)
                assert mode == "raw" or all(torch.isfinite(ours))  # every sampled token kept by the processors


def test_a_seed_gives_the_same_tokens_whatever_the_ids_and_no_seed_fresh_ones(tokenized):
    from reshard import LLM, SamplingParams
    from reshard.parallel import Request

    sampled = SamplingParams(max_new_tokens=8, temperature=1.0)
    prompts = [[5, 9, 11], [40, 41, 42], [7, 7]]
    with LLM(tokenized, max_seq_len=64) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, seed=5)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, seed=5)] == first
        fresh = [[o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] for _ in range(2)]
        assert fresh[0] != fresh[1]  # no seed: each call its own noise (24 tokens over 256 ids)
        # the engine keys noise by the call's seed and the request's position, never its id
        engine_run = lambda ids: [  # noqa: E731
            c.output_ids for c in llm.engine.generate([Request(i, p, sampled) for i, p in zip(ids, prompts)], seed=5)
        ]
        assert engine_run([900, 3, 41]) == engine_run([0, 1, 2]) == first
        # n samples of one prompt differ; a prompt's own seed gives the same n samples again
        own = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=123)
        (four,) = llm.generate([[5, 9, 11]], own)
        assert len({tuple(o.token_ids) for o in four.outputs}) == 4 and [o.index for o in four.outputs] == [0, 1, 2, 3]
        assert [o.token_ids for o in llm.generate([[1, 2], [5, 9, 11]], own)[1].outputs] == [
            o.token_ids for o in four.outputs
        ]


def test_llm_of_a_module_in_training_leaves_it_untouched_and_syncs_after_steps(checkpoints):
    from reshard import LLM, SamplingParams

    model = _hf(checkpoints["qwen2"]).train()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many small models are
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer)
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in params.items()}
    greedy = SamplingParams(max_new_tokens=NEW)
    prompts = [[5, 9, 11, 13], [40, 41, 42]]
    with LLM(model, max_seq_len=64) as llm:
        assert dict(model.named_parameters()) == params and model.training  # same objects, still training
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
        assert all(torch.equal(optimizer.state[p][k], v) for n, p in params.items() for k, v in state[n].items())
        assert optimizer.param_groups[0]["params"][0] is params[next(iter(params))]
        _equals_hf(llm, model, prompts, greedy)
        for _ in range(2):
            _train_step(model, optimizer)
        llm.sync_weights(model)
        _weights_equal(llm, model)
        _equals_hf(llm, model, prompts, greedy)
        with torch.no_grad():  # weights from elsewhere, streamed as (name, full tensor) pairs
            for p in model.parameters():
                p.mul_(0.9)
        assert llm.load_weights(((n, t.detach().clone()) for n, t in model.state_dict().items()), bucket_bytes=1 << 16)
        _weights_equal(llm, model)
        with pytest.raises(ValueError, match=r"LLM.load_weights: 1 tensors the model has no parameter for: \['nope'\]"):
            llm.load_weights([("nope", torch.zeros(1))])


def _train_step(model, optimizer) -> None:
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(len(optimizer.state)))
    model(x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights_equal(llm, model) -> None:
    """Every parameter of the engine, gathered whole, equals the module's bit for bit."""
    ours = {n: p.full_tensor() for n, p in llm.engine.model.named_parameters(remove_duplicate=False)}
    theirs = dict(model.named_parameters(remove_duplicate=False))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], theirs[n].detach()) for n in ours), [
        n for n in ours if not torch.equal(ours[n], theirs[n].detach())
    ]


def _equals_hf(llm, model, prompts, params) -> None:
    was = model.training
    model.eval()
    expected = [_hf_generate(model, p, params.max_new_tokens)[0] for p in prompts]
    model.train(was)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def _llm_ranks(path: str, tp: int, prompts_of_rank):
    """An LLM over the harness's ranks (``tp`` of them per engine); each rank's outputs of two
    calls, and the router threads alive after each call (their idents) that were not before."""
    import threading

    import torch.distributed as dist

    from reshard import LLM, SamplingParams

    def routers() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name == "reshard-router"}

    before, seen, outputs = routers(), [], []
    llm = LLM(path, tp=tp, max_seq_len=64)
    try:
        for _ in range(2):
            outs = llm.generate(prompts_of_rank(dist.get_rank()), SamplingParams(max_new_tokens=NEW, logprobs=1))
            outputs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].logprobs) for o in outs])
            seen.append(routers() - before)
    finally:
        llm.close()
    return outputs, seen, routers() - before


def _same_prompts(rank: int):
    return ["w5 w9 w11", [40, 41, 42, 43], [7, 8]]


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_llm_under_torchrun_tp2_and_dp2_equals_hf(tokenized, hf_reference, tp):
    from transformers import AutoTokenizer

    results = dist_harness.run(2, _llm_ranks, tokenized, tp, _same_prompts)
    per_rank = [outputs[0] for outputs, _, _ in results]
    # a second call gives the same tokens and text (its prompts cached: log-probabilities within fp noise)
    assert all([o[:2] for o in outputs[0]] == [o[:2] for o in outputs[1]] for outputs, _, _ in results)
    assert per_rank[0] == per_rank[1]  # every rank gets every output
    # dp2: rank 0 routes both calls on one router thread, the engine's, gone at close; tp2 has one group, no router
    (seen0, left0), (seen1, left1) = [(seen, left) for _, seen, left in results]
    assert seen1 == [set(), set()] and left0 == left1 == set()
    assert len(seen0[0]) == (0 if tp == 2 else 1) and seen0[1] == seen0[0], seen0
    tok = AutoTokenizer.from_pretrained(tokenized)
    ids = [tok("w5 w9 w11")["input_ids"], [40, 41, 42, 43], [7, 8]]
    assert [t for t, _, _ in per_rank[0]] == hf_reference(tokenized, ids, NEW)
    assert [text for _, text, _ in per_rank[0]] == [text_after(tok, p, t) for p, (t, _, _) in zip(ids, per_rank[0])]


def _llm_given_different_prompts(path: str, tp: int):
    """An LLM whose rank 1 passes (a) one token changed (equal shapes), (b) one prompt more; then
    the same prompts: each rank's refusals and its outputs of the last call."""
    import torch.distributed as dist

    from reshard import LLM, SamplingParams

    errors, rank = [], dist.get_rank()
    with LLM(path, tp=tp, max_seq_len=64) as llm:
        for prompts in ([[5, 6, 7], [8 + rank, 9, 10]], [[5, 6, 7]] + [[8, 9]] * rank):
            try:
                llm.generate(prompts, SamplingParams(max_new_tokens=3))
            except ValueError as e:
                errors.append(str(e))
        same = llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_new_tokens=3))
    return errors, [o.outputs[0].token_ids for o in same]


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_ranks_passing_different_prompts_get_one_error_each(tokenized, hf_reference, tp):
    """Equal shapes would pair rank 1's prompts with rank 0's completions; different shapes would
    hang a collective: each is one ValueError on every rank, and the LLM serves on."""
    expected = hf_reference(tokenized, [[5, 6, 7], [8, 9, 10]], 3)
    for errors, same in dist_harness.run(2, _llm_given_different_prompts, tokenized, tp):
        assert len(errors) == 2, errors
        assert errors[0].startswith("ranks passed different requests to generate: request 1 (id 1 on rank ")
        assert errors[1].startswith("ranks passed different requests to generate: rank 0 passed 1, rank 1 passed 2")
        assert same == expected


def test_a_verl_shaped_rollout_batches_requests_in_flight_and_takes_weights_streamed(checkpoints, hf_reference):
    """verl's rollout surface over one LLM, driven as verl drives it: many ``generate`` calls in
    flight at once (asyncio), added to the engine core as they come (later ones join running ones);
    ``update_weights`` streams ``(name, tensor)`` pairs;
    ``release`` / ``resume`` around a training step. Tokens equal HF's, before and after."""
    import asyncio

    from reshard import LLM
    from reshard.integrations.verl import Rollout

    path = checkpoints["llama"]
    prompts = [[5, 9, 11, 13], [40, 41, 42], [7, 8], [100, 101, 102, 103, 104], [3, 4, 5], [60, 61, 62, 63]]
    greedy = {"max_tokens": NEW, "temperature": 0.0, "top_k": -1, "logprobs": True}
    with LLM(path, max_seq_len=64, max_batch_size=4) as llm:
        held = [p.to_local().untyped_storage().nbytes() for p in llm.engine.model.parameters()]  # (DTensors)
        assert llm.release(weights=True) >= sum(held) > 0  # a plain release and resume: tokens unchanged
        assert [p.to_local().untyped_storage().nbytes() for p in llm.engine.model.parameters()] == [0] * len(held)
        llm.resume()
        first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], None)]
        assert llm.sleep(level=2) >= sum(held)  # vLLM's spelling (TRL's and verl's colocated loops)
        llm.wake_up(["weights"])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], None)] == first
        with pytest.raises(ValueError, match=r"LLM\.sleep: level must be 1 or 2 \(vLLM's\), got 3"):
            llm.sleep(level=3)
        steps, freed = [], []
        llm.generate = None  # the rollout adds requests to the engine core and steps it: no generate call
        llm.engine.events.on("step_agreed", lambda index, step, tokens: steps.append({s.request.id for s in step.seqs}))
        rollout = Rollout(llm)

        async def serve():
            asking = lambda ps: [asyncio.create_task(rollout.generate(p, greedy, f"req-{p[0]}")) for p in ps]  # noqa: E731
            first = asking(prompts[:2])
            while not steps:  # the first two run; the others come while they do
                await asyncio.sleep(0.001)
            outs = await asyncio.gather(*first, *asking(prompts[2:]))
            await rollout.release()  # KV freed, weights moved to host: their device storages hold nothing
            freed.extend(p.to_local().untyped_storage().nbytes() for p in llm.engine.model.parameters())
            model = _hf(path)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.8)
            with pytest.raises(ValueError, match=r"wire_format 'delta_flush' is not supported; give 'named_tensors'"):
                await rollout.update_weights([], wire_format="delta_flush")
            await rollout.update_weights((n, t.detach()) for n, t in model.state_dict().items())
            await rollout.resume(["kv_cache"])
            again = await asyncio.gather(*[rollout.generate(p, greedy, f"again-{i}") for i, p in enumerate(prompts)])
            long = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}  # (past the context's end: capped)
            return outs, again, model, await rollout.generate([5] * 60, long, "long")

        outs, again, model, capped = asyncio.run(serve())
    assert (len(capped.token_ids), capped.finish_reason) == (4, "length")  # vLLM's cap at max_seq_len (64)
    # six requests in flight: four run at once (max_batch_size), the others join as slots free up
    assert max(map(len, steps)) == 4 and set().union(*steps) == set(range(13))  # (the capped one: 12)
    assert any(step & {0, 1} and step & {2, 3} for step in steps)  # a batcher would run them after
    assert freed and set(freed) == {0} and first == hf_reference(path, prompts[:2], 16)
    assert [o.token_ids for o in outs] == hf_reference(path, prompts, NEW)
    assert all(len(o.log_probs) == len(o.token_ids) and o.finish_reason in ("length", "stop") for o in outs)
    assert [o.token_ids for o in again] == [_hf_generate(model.eval(), p, NEW)[0] for p in prompts]
    assert [o.token_ids for o in again] != [o.token_ids for o in outs]  # the new weights took effect
    with pytest.raises(ValueError, match=r"request r1: sampling parameter 'best_of' is not one reshard honours"):
        from reshard.integrations import vllm_sampling

        vllm_sampling({"best_of": 2}, "request r1")


def _llm_synced_from_fsdp2(path: str):
    """TP2 LLM over the harness's two ranks, from the checkpoint; then (a) ``sync_weights`` from an
    FSDP2 model after an Adam step, (b) ``load_weights`` from DTensors (``Shard(0)`` over both
    ranks) of other weights, (c) ``sync_weights`` from a DDP-wrapped plain module: the rollout
    tensors differing from each source's sliced full tensors (none expected), and the bytes this
    rank received for (b) against what it lacked."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from reshard import LLM
    from reshard.parallel.model.dims import ParallelDims
    from tests.test_weight_sync import _full, _sliced_equal, _trained

    mismatches = []
    with LLM(path, tp=2, max_seq_len=64) as llm:
        model, _ = _trained(path, [0, 1])  # FSDP2 over both ranks, one Adam step off the file
        llm.sync_weights(model)
        mismatches.append(_sliced_equal(llm.engine.model, _full(model)))
        full = {n: t * 0.5 for n, t in _full(model).items()}
        mesh = ParallelDims(dp=2, world_size=2).mesh("dp")
        llm.load_weights((n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items())
        mismatches.append(_sliced_equal(llm.engine.model, full))
        plain = _hf(path)
        ddp = torch.nn.parallel.DistributedDataParallel(plain)
        llm.sync_weights(ddp)
        mismatches.append(_sliced_equal(llm.engine.model, {n: p.detach() for n, p in plain.named_parameters()}))
        tokens = [o.outputs[0].token_ids for o in llm.generate([[5, 9, 11]], None)]
    dist.barrier()
    return mismatches, tokens


def test_sync_from_fsdp2_and_ddp_and_load_from_dtensors_is_bitwise(checkpoints, hf_reference):
    path = checkpoints["llama"]
    for mismatches, tokens in dist_harness.run(2, _llm_synced_from_fsdp2, path):
        assert mismatches == [[], [], []]
        assert tokens == hf_reference(path, [[5, 9, 11]], 16)  # the DDP module holds the file's weights
