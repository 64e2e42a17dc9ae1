"""A vLLM user's script on ``reshard.LLM``: vLLM's documented offline example with only its import
changed (1 process and TP2 under torchrun), vLLM's prompt forms and names, ``Logprob`` objects,
stop strings cut as vLLM cuts them, ``max_model_len`` from the model, data-parallel ranks with
prompts of their own, and every input that is none of these refused in one line naming it."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests import dist_harness

EXAMPLE = Path(__file__).parent / "examples" / "vllm_offline.py"
STOPS = ("ound", "shout")  # the example's stop list


@pytest.fixture(scope="module")
def builtin(tmp_path_factory) -> str:
    """The built-in checkpoint: a tiny Llama with a tokenizer and a chat template."""
    from reshard.parallel.model.tiny_models import builtin_checkpoint

    return str(builtin_checkpoint(tmp_path_factory.mktemp("builtin")))


def _expected(hf_reference, tok, path: str, ids: list[int], new: int, stops=STOPS) -> tuple[list[int], str, str]:
    """HF ``generate``'s greedy tokens up to the one whose text completes a stop string (where
    one does), that text cut before it, and the finish reason."""
    free = hf_reference(path, [ids], new)[0]
    for k in range(1, len(free) + 1):
        text = tok.decode(free[:k], skip_special_tokens=True)
        found = [text.find(s) for s in stops if s in text]
        if found:
            return free[:k], text[: min(found)], "stop"
    done = len(free) < new or free[-1] == tok.eos_token_id
    return free, tok.decode(free, skip_special_tokens=True), "stop" if done else "length"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2], ids=["one-process", "tp2-torchrun"])
def test_vllms_offline_example_runs_with_only_the_import_changed(builtin, hf_reference, tmp_path, tp):
    from transformers import AutoTokenizer

    out = tmp_path / "seen.json"
    launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    done = subprocess.run([*launcher, str(EXAMPLE), builtin, str(tp), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(builtin)
    texts = ["Hello, my name is", "The capital of France is", None, "w5 w9 w11"]
    assert [s["prompt"] for s in seen] == texts and [s["request_id"] for s in seen] == ["0", "1", "2", "3"]
    for s, text in zip(seen, texts):
        ids = tok(text or "The future of AI is")["input_ids"]
        tokens, cut, reason = _expected(hf_reference, tok, builtin, ids, 12)
        assert s["prompt_token_ids"] == ids and s["finished"]
        assert (s["token_ids"], s["text"], s["finish_reason"]) == (tokens, cut, reason)
        assert s["stop_reason"] == (
            next(x for x in STOPS if x in tok.decode(tokens)) if cut != tok.decode(tokens) else None
        )
        lp, rank, piece = s["first_logprob"]
        assert rank == 1 and piece == tok.decode([tokens[0]]) and lp <= 0  # greedy: the top token
        assert s["cumulative_logprob"] <= lp + 1e-6
    assert any(s["stop_reason"] is not None for s in seen)  # the stop list did cut one


def test_text_prompt_dicts_are_prompts_and_anything_else_one_error(builtin, hf_reference):
    from transformers import AutoTokenizer

    from reshard import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(builtin)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(builtin, max_model_len=64) as llm:
        outs = llm.generate([{"prompt": "Hello there"}, {"prompt": "one two"}], params)
        single = llm.generate({"prompt_token_ids": [5, 9, 11]}, params)
        bad = {
            "prompt 1 is a dict with keys \\['text'\\]": [{"prompt": "a"}, {"text": "b"}],
            "prompt 0 is a dict with keys \\['content', 'role'\\] \\(a chat message": [
                {"role": "user", "content": "x"}
            ],
            "prompt 0 is a dict with keys \\['prompt', 'x'\\]": {"prompt": "a", "x": 1},
            "prompt 0 must be .*got float": [1.5],
            "prompt 1 is empty": ["ok", ""],
            "prompt 0 is empty": [[]],
            "prompt 0 must be .*got list": [[1, "2"]],
            # a text's bytes are ints when iterated: once read as token ids, a silent wrong answer
            "prompt 0 must be .*got bytes .* \\(bytes: decode them to a text": b"Hello",
            "prompt 1 must be .*got bytes": ["ok", b"x"],
            "prompt 0's prompt_token_ids must be a list of ints; got Tensor .*\\.tolist\\(\\)": {
                "prompt_token_ids": torch.tensor([5, 6])
            },
        }
        for message, prompts in bad.items():
            with pytest.raises(ValueError, match=message):
                llm.generate(prompts, params)
        with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams or a list of them.* got dict"):
            llm.generate("a", {"max_tokens": 3})  # (iterated before: its keys taken for SamplingParams)
        with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
            llm.generate(["a", "b"], [params, {"max_tokens": 3}])
        # vLLM's priority: an int per prompt, unread under first-come-first-served (vLLM's default policy)
        ranked = llm.generate([{"prompt": "Hello there"}, {"prompt": "one two"}], params, priority=[1, 0])
        with pytest.raises(ValueError, match=r"priority must be an int per prompt \(2\), got \[1\]"):
            llm.generate(["a", "b"], params, priority=[1])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in outs]
    assert len(outs) == 2 and [o.prompt for o in outs] == ["Hello there", "one two"]
    ids = [tok("Hello there")["input_ids"], tok("one two")["input_ids"]]
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(builtin, ids, 6)
    assert single[0].prompt is None and single[0].outputs[0].token_ids == hf_reference(builtin, [[5, 9, 11]], 6)[0]


def test_sampling_params_take_vllms_names_and_refuse_what_is_not_a_number():
    from reshard import SamplingParams

    p = SamplingParams(max_tokens=7, stop="x", stop_token_ids=[3, 4], top_k=-1, skip_special_tokens=False)
    assert (p.max_tokens, p.max_new_tokens, p.stop, p.stop_token_ids, p.top_k) == (7, 7, ("x",), (3, 4), 0)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams(max_new_tokens=5).max_tokens == 5
    with pytest.raises(ValueError, match="max_tokens=3 and max_new_tokens=4"):
        SamplingParams(max_tokens=3, max_new_tokens=4)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=f"{name} must be a finite number, got {value}"):
                SamplingParams(**{name: value})
    for bad, message in (
        ({"stop": [1]}, "stop must be a string or a list"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 1.0}}, "logit_bias is not one reshard honours"),
        ({"stop": "x", "detokenize": False}, "need detokenize=True"),
        # a text is true to Python whatever it says: "false" kept EOS from ending a request
        ({"ignore_eos": "false"}, "ignore_eos must be True or False, got 'false'"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False, got 'no'"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be True or False, got 1"),
        ({"min_tokens": "2"}, r"min_tokens must be in 0..max_new_tokens \(32\), got '2'"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    vllms = dict(stop=None, seed=-1, logprobs=True, prompt_logprobs=False, logit_bias=None, bad_words=None)
    assert SamplingParams(**vllms) == SamplingParams(logprobs=1, prompt_logprobs=0)  # vLLM's spellings
    assert SamplingParams(max_tokens=None).max_new_tokens is None  # (to the end of the context)


def test_llm_takes_vllms_engine_names_and_the_models_context(builtin):
    """vLLM's engine arguments under their names (and those with nothing to do here), the
    model's context by default, chat content as text parts; each other value one error."""
    from reshard import LLM, SamplingParams
    from reshard.parallel import Request
    from reshard.parallel.vllm_api import llm_options

    with pytest.raises(ValueError, match="tensor_parallel_size=1 and tp=1: they are one setting"):
        LLM(builtin, tensor_parallel_size=1, tp=1)
    with pytest.raises(
        ValueError, match=r"max_model_len\) 1024 exceeds the model's context: its max_position_embeddings is 512"
    ):
        LLM(builtin, max_model_len=1024)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        LLM(builtin, gpu_memory_utilization=1.5)
    # values of the wrong type, each one line before anything loads (a comparison's TypeError before)
    for given, message in (
        ({"tensor_parallel_size": "2"}, "parallel.tp must be int or None, got '2'"),
        ({"strategy": "sidp", "peak_shifting": 1}, "parallel.peak_shifting must be bool, got 1"),
        ({"seed": "1"}, "LLM: seed must be an int >= 0 or None, got '1'"),
        ({"model": None}, "a model is a checkpoint directory or a hub id"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(**{"model": builtin, **given})
    assert llm_options({"dtype": torch.bfloat16})["dtype"] == "bfloat16"  # (vLLM takes torch's dtypes)
    with LLM(builtin, tensor_parallel_size=1, max_num_seqs=3, dtype="auto", gpu_memory_utilization=0.9) as llm:
        assert llm.engine.max_seq_len == 512 and llm.engine.max_batch_size == 3  # the model's context by default
        assert llm.get_tokenizer() is llm.tokenizer is not None
        with pytest.raises(
            ValueError, match=r"prompt length \(600\) \+ max_new_tokens \(4\) = 604 exceeds max_seq_len \(512\)"
        ):
            llm.generate([[5] * 600], SamplingParams(max_tokens=4))
        capped = llm.generate([[5] * 508], SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
        assert (len(capped.token_ids), capped.finish_reason) == (4, "length")  # vLLM's cap at the context's end
        with pytest.raises(ValueError, match=r"stop_token_ids \[99999\] outside the vocabulary of \d+ tokens"):
            llm.generate("Hello", SamplingParams(max_tokens=4, stop_token_ids=[99999]))
        with pytest.raises(ValueError, match=r"max_new_tokens=None .* is resolved by reshard.LLM"):
            llm.engine.generate([Request(0, [5, 6], SamplingParams(max_tokens=None))])
    with pytest.raises(ValueError, match="LLM: generation_config='vllm' is not one reshard honours"):
        LLM(builtin, generation_config="vllm")
    with pytest.raises(ValueError, match=r"LLM: quantization='fp8' is not one reshard honours \(only None\)"):
        LLM(builtin, quantization="fp8")
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' is not one reshard honours"):
        LLM(builtin, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="scheduling_policy='priority' is not one reshard honours"):
        LLM(builtin, scheduling_policy="priority")
    trl = dict(distributed_executor_backend="external_launcher", enable_sleep_mode=True, model_impl="vllm")
    trl |= dict(max_num_batched_tokens=256, kv_cache_dtype="auto", quantization=None, block_size=8, seed=0)
    with LLM(builtin, max_model_len=64, **trl) as llm:  # (as TRL's colocated GRPO builds vLLM's, its defaults)
        assert (llm.engine.config.kv_block_size, llm.engine.config.max_prefill_tokens) == (8, 256)
        assert llm.engine.config.compile is False  # (a loop that sleeps: graphs would be thrown away)
        want = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    from transformers import AutoModelForCausalLM

    # verl's load_format="dummy": the weights are left unread, and a sync writes them
    with LLM(builtin, max_model_len=64, load_format="dummy", skip_tokenizer_init=False) as llm:
        assert llm.engine.config.load_weights is False
        llm.load_weights(AutoModelForCausalLM.from_pretrained(builtin).state_dict().items())
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids == want
    noops = dict(trust_remote_code=True, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True)
    with pytest.raises(ValueError, match="LLM got enforce_eager=True and compile=True: give one"):
        LLM(builtin, compile=True, enforce_eager=True)
    with LLM(builtin, max_model_len=64, **noops) as llm:
        assert not llm.engine.config.compile and not llm.engine.config.prefix_caching
        parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
        by_parts, joined = (
            llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=2))[0]
            for content in (parts, "w1 w2\nw3")
        )
        vllms = dict(tools=None, chat_template_content_format="string", lora_request=None)
        assert llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=2), **vllms)[0].prompt
        with pytest.raises(ValueError, match="lora_request='adapter': reshard serves one model's weights"):
            llm.generate("w1", lora_request="adapter")
        assert (by_parts.prompt, by_parts.prompt_token_ids) == (joined.prompt, joined.prompt_token_ids)
        assert "w1 w2\nw3" in joined.prompt
        with pytest.raises(ValueError, match="conversation 0, message 1: content must be a text or a list of"):
            llm.chat([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}])
        sampled = dict(max_tokens=4, temperature=0.7, top_k=5, seed=3, logprobs=2)
        processed = llm.generate("w1 w2", SamplingParams(**sampled, logprobs_mode="processed"))[0].outputs[0]
        raw = llm.generate("w1 w2", SamplingParams(**sampled))[0].outputs[0]
    # vLLM's engine-wide logprobs_mode: every request's (its logits modes are refused)
    with pytest.raises(ValueError, match="LLM: logprobs_mode='raw_logits' is not one reshard returns"):
        LLM(builtin, logprobs_mode="raw_logits")
    with LLM(builtin, max_model_len=64, logprobs_mode="processed_logprobs") as llm:
        engine_wide = llm.generate("w1 w2", SamplingParams(**sampled))[0].outputs[0]
        assert llm.sampling(SamplingParams()).logprobs_mode == "processed"  # (the verl adapter's path too)
    conflict = r"LLM\(logprobs_mode='raw'\) and a request's logprobs_mode='processed'"
    with LLM(builtin, max_model_len=64, logprobs_mode="raw_logprobs") as llm, pytest.raises(ValueError, match=conflict):
        llm.generate("w1", SamplingParams(logprobs_mode="processed"))
    assert engine_wide.token_ids == processed.token_ids == raw.token_ids
    assert engine_wide.logprobs == processed.logprobs != raw.logprobs


def test_stop_strings_and_tokens_end_outputs_as_vllms_do(builtin, hf_reference):
    """The text stops before the stop string (kept with ``include_stop_str_in_output``); the
    tokens keep the one that completed it; ``stop_token_ids`` end a request beside EOS."""
    from transformers import AutoTokenizer

    from reshard import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(builtin)
    ids = tok("w5 w9 w11")["input_ids"]
    free = hf_reference(builtin, [ids], 10)[0]
    whole = tok.decode(free, skip_special_tokens=True)
    stop = tok.decode(free[3:4], skip_special_tokens=True).strip()  # a word the free output holds
    tokens, cut, reason = _expected(hf_reference, tok, builtin, ids, 10, (stop,))
    assert reason == "stop" and cut != whole
    with LLM(builtin, max_model_len=64) as llm:
        cut_out, kept, by_id = (
            llm.generate([ids], SamplingParams(max_tokens=10, **kw))[0].outputs[0]
            for kw in (
                {"stop": stop},
                {"stop": [stop], "include_stop_str_in_output": True},
                {"stop_token_ids": [free[2]]},
            )
        )
    assert (cut_out.token_ids, cut_out.text, cut_out.stop_reason) == (tokens, cut, stop)
    assert kept.token_ids == tokens and kept.text == cut + stop
    assert (by_id.token_ids, by_id.finish_reason, by_id.stop_reason) == (free[:3], "stop", free[2])


@pytest.mark.timeout(240)
def test_outputs_end_where_vllms_do_stop_tokens_min_tokens_generation_config(builtin, hf_reference, tmp_path):
    """As vLLM: a stop token's text is left out of the output's text (kept with
    ``include_stop_str_in_output``); a stop string counts only past ``min_tokens`` tokens and the
    text is cut where the string that ended it begins (not at an earlier occurrence); an EOS id
    only ``generation_config.json`` names ends a request (its ``stop_reason``: that id);
    ``max_tokens=None`` runs to the end of the context."""
    import shutil

    from transformers import AutoTokenizer

    from reshard import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(builtin)
    ids = tok("w5 w9 w11")["input_ids"]
    free = hf_reference(builtin, [ids], 12)[0]
    text = lambda k: tok.decode(free[:k], skip_special_tokens=True)  # noqa: E731
    stop = tok.decode(free[1:2]).strip()  # a word the output holds at its 2nd token and again later
    again = next(k for k in range(3, 13) if text(k).count(stop) == 2)
    eos_config = tmp_path / "eos"
    shutil.copytree(builtin, eos_config)
    (eos_config / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, free[3]]}))
    with LLM(builtin, max_model_len=64) as llm:
        by_id, kept = (
            llm.generate([ids], SamplingParams(max_tokens=12, stop_token_ids=[free[2]], **kw))[0].outputs[0]
            for kw in ({}, {"include_stop_str_in_output": True})
        )
        short = {m: llm.generate([ids], SamplingParams(max_tokens=12, stop=stop, min_tokens=m))[0] for m in (1, 2, 3)}
        to_the_end = llm.generate([ids], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    with LLM(str(eos_config), max_model_len=64) as llm:
        by_config = llm.generate([ids], SamplingParams(max_tokens=12))[0].outputs[0]
    assert (by_id.token_ids, by_id.text, by_id.stop_reason) == (free[:3], text(2), free[2])
    assert kept.text == text(3) and kept.finished()
    assert short[1].outputs[0].token_ids == free[:2] and short[1].outputs[0].text == text(2)[: text(2).find(stop)]
    for m in (2, 3):  # (its 2nd token is not past min_tokens: the next occurrence ends it)
        out = short[m].outputs[0]
        assert (out.token_ids, out.stop_reason) == (free[:again], stop), m
        assert out.text == text(again)[: text(again).rfind(stop)], m
    assert (by_config.token_ids, by_config.finish_reason, by_config.stop_reason) == (free[:4], "stop", free[3])
    assert by_config.text == text(3) and len(to_the_end.token_ids) == 64 - len(ids)


def _local_prompts_job(path: str, tp: int):
    """Each rank passes prompts of its own (a different count too); its outputs."""
    import torch.distributed as dist

    from reshard import LLM, SamplingParams

    rank = dist.get_rank()
    mine = [[5 + rank, 9, 11], [40, 41 + rank]] + [[7, 8, 9, 10]] * rank
    with LLM(path, tp=tp, max_model_len=64, dp_prompts="local") as llm:
        outs = llm.generate(mine, SamplingParams(max_tokens=6))
    return mine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_data_parallel_ranks_with_prompts_of_their_own_get_their_own_outputs(checkpoints, hf_reference, tp):
    path = checkpoints["llama"]
    per_rank = dist_harness.run(2, _local_prompts_job, path, tp)
    assert [len(outs) for _, outs in per_rank] == [2, 3]
    for prompts, outs in per_rank:
        assert outs == hf_reference(path, prompts, 6)


def test_a_repeated_prompt_and_seed_warns_and_old_engine_keywords_point_to_the_config(checkpoints):
    from reshard import LLM, SamplingParams
    from reshard.parallel import Engine

    with LLM(checkpoints["llama"], max_model_len=64) as llm:
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
        with pytest.warns(UserWarning, match="2 sampled requests have the same prompt .* and the same seed 7"):
            same = llm.generate([[5, 9, 11], [5, 9, 11]], params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # n samples of one prompt take seed, seed + 1: no warning
            distinct = llm.generate([[5, 9, 11]], SamplingParams(max_tokens=3, temperature=1.0, seed=7, n=2))
        assert same[0].outputs[0].token_ids == same[1].outputs[0].token_ids  # vLLM's meaning: identical samples
        assert len(distinct[0].outputs) == 2
        with pytest.raises(TypeError, match=r"Engine\(max_batch_size=4\) is a key of EngineConfig now"):
            Engine(llm.engine.model, max_batch_size=4)


def test_load_weights_takes_a_state_dict(checkpoints):
    from transformers import AutoModelForCausalLM

    from reshard import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32)
    with LLM(checkpoints["llama"], max_model_len=64) as llm:
        before = llm.generate([[5, 9, 11]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.5)
        assert llm.load_weights(hf.state_dict()) > 0  # a mapping, the commonest thing to pass
        after = llm.generate([[5, 9, 11]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids
        with pytest.raises(TypeError, match="item 0 is str"):
            llm.load_weights(["model.norm.weight"])
    with torch.no_grad():
        want = hf.generate(torch.tensor([[5, 9, 11]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert after == want and after != before


def test_a_request_output_counts_its_prompt_tokens_found_cached(builtin):
    """vLLM's ``RequestOutput.num_cached_tokens``: the prompt tokens a request's first admission
    found in the prefix cache (full blocks only; a prompt's ``n`` samples: the first one's), None
    where no cache was looked up."""
    from reshard import LLM, SamplingParams

    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: 2 full blocks of 16
    params = SamplingParams(max_tokens=2, n=3, temperature=0.8, seed=1)
    with LLM(builtin, max_model_len=64, block_size=16) as llm:
        first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    with LLM(builtin, max_model_len=64, enable_prefix_caching=False) as llm:
        assert llm.generate(prompt, params)[0].num_cached_tokens is None


def _cached_in_flight(path: str) -> tuple:
    """``num_cached_tokens`` of one prompt generated twice by a 2-stage in-flight pipeline."""
    from reshard import LLM, SamplingParams

    prompt, params = {"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=2)
    with LLM(path, pipeline_parallel_size=2, max_model_len=64, block_size=16) as llm:
        return tuple(llm.generate(prompt, params)[0].num_cached_tokens for _ in range(2))


def test_every_stage_of_a_pipeline_reports_the_first_stages_cached_tokens(builtin):
    """A later stage's sequences come from the first stage's notes, which carry its admission's
    prefix-cache hits: every rank's output says the same (a later stage's said None)."""
    from tests import dist_harness

    assert dist_harness.run(2, _cached_in_flight, builtin) == [(0, 32), (0, 32)]
