"""Text in, text out: a real `tokenizers` tokenizer in the checkpoint gives decoded prompts and
outputs, chat messages rendered with its chat template; stop tokens, min_tokens and ignore_eos
sample as HF ``generate`` does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import dist_harness

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _with_tokenizer(src: str, dst: Path, chat: bool = True):
    """A copy of checkpoint ``src`` (vocab 256) with a WordLevel tokenizer over all 256 ids (built
    with the `tokenizers` library, saved as ``tokenizer.json``) and, with ``chat``, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    # ("abcdef": the prefix HF's stop-string matching puts before each token)
    words = ["<pad>", "<s>", "</s>", "<unk>", "system", "user", "assistant", ":"] + [f"w{i}" for i in range(247)]
    words.append("abcdef")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dst)
    return fast


def _run_recipe(overrides, run_dir):
    from reshard.recipes.generate import run_generate
    from reshard.recipes.schema import compose

    return run_generate(compose("generate", overrides), Path(run_dir))


def text_after(tok, prompt: list[int], output: list[int]) -> str:
    """The text ``output`` adds after ``prompt`` (special tokens skipped): an output's text, as vLLM
    decodes it (a space-joining tokenizer's starts with a space)."""
    before = tok.decode(prompt, skip_special_tokens=True)
    return tok.decode(prompt + output, skip_special_tokens=True)[len(before) :]


def test_text_and_chat_prompts_round_trip_with_a_real_tokenizer(checkpoints, hf_reference, tmp_path):
    path = tmp_path / "ckpt"
    tok = _with_tokenizer(checkpoints["llama"], path)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w7 w8 w9"}]
    lines = [{"text": "w5 w9 w11"}, {"messages": messages}, [40, 41, 42]]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    overrides = [f"model.path={path}", f"workload.prompts_file={prompts_file}", "generation.max_new_tokens=8"]
    dist_harness.run(1, _run_recipe, [*overrides, "progress=false"], str(tmp_path / "run"))
    out = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids  # a BatchEncoding in newer HF
    assert [o["prompt_ids"] for o in out] == [tok("w5 w9 w11")["input_ids"], list(chat_ids), [40, 41, 42]]
    assert out[1]["prompt"] == "system : w1 w2 user : w7 w8 w9 assistant :"
    assert out[0]["prompt"] == "w5 w9 w11" and out[2]["prompt"] == "w32 w33 w34"
    assert [o["output_ids"] for o in out] == hf_reference(str(path), [o["prompt_ids"] for o in out], 8)
    for o in out:  # the text the output adds after its prompt (vLLM's: here, a space first)
        after = text_after(tok, o["prompt_ids"], o["output_ids"])
        assert o["output"] == after and after.startswith(" ") and o["output"].strip()


def test_chat_messages_need_a_chat_template_and_well_formed_messages(checkpoints, tmp_path):
    from reshard.recipes.prompts import read_prompts

    path = tmp_path / "ckpt"
    _with_tokenizer(checkpoints["llama"], path, chat=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: chat messages need a chat template; the checkpoint's"):
        read_prompts(prompts, path)
    prompts.write_text(json.dumps({"messages": [{"content": "w1"}]}) + "\n")
    with pytest.raises(ValueError, match=r'prompts.jsonl:1: "messages" must be a non-empty list of \{"role"'):
        read_prompts(prompts, path)


def _stop_job(path, prompt, params):
    from reshard.parallel import Engine, EngineConfig, Request, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_seq_len=64))
    done = engine.generate([Request(i, prompt, p) for i, p in enumerate(params)])
    return [(c.output_ids, c.finish_reason) for c in done]


def _hf(path, prompt, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), do_sample=False, attention_mask=torch.ones(1, len(prompt)), **kw)
    return seq[0, len(prompt) :].tolist()


def _eos_ids(path) -> list[int]:
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(path).eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def test_stop_tokens_and_min_tokens_sample_as_hf_generate(checkpoints):
    """A stop id taken from the free-running output ends the request where HF's ``eos_token_id``
    does (beside the model's own EOS: vLLM's meaning of ``stop_token_ids``); with ``min_tokens``
    it is masked until then, as HF's ``min_new_tokens`` masks it."""
    from reshard.parallel import SamplingParams

    path, prompt = checkpoints["llama"], [5, 9, 11, 2, 7]
    free = _hf(path, prompt, max_new_tokens=12)
    stop = free[2]
    eos = [stop, *_eos_ids(path)]  # stop_token_ids end a request besides the model's EOS ids
    params = [
        SamplingParams(max_new_tokens=12),
        SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), min_tokens=5),
    ]
    got = dist_harness.run(1, _stop_job, path, prompt, params)[0]
    assert got[0] == (free, "length")
    assert got[1] == (_hf(path, prompt, max_new_tokens=12, eos_token_id=eos), "stop") and len(got[1][0]) <= 3
    masked = _hf(path, prompt, max_new_tokens=12, eos_token_id=eos, min_new_tokens=5)
    assert got[2][0] == masked and stop not in masked[:5] and masked != free


def test_ignore_eos_runs_past_the_models_eos_and_min_tokens_is_checked():
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine.request import Sequence

    seq = Sequence.of(Request(0, [1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True)), eos_ids=(2,))
    seq.append(2)
    assert seq.finish_reason is None and seq.stop_ids == frozenset()
    kept = Sequence.of(Request(0, [1], SamplingParams(max_new_tokens=3, ignore_eos=True, stop_token_ids=(9,))), (2,))
    assert kept.stop_ids == {9}  # explicit stop ids still stop
    short = Sequence.of(Request(0, [1], SamplingParams(max_new_tokens=3, ignore_eos=True, min_tokens=1)), (2,))
    assert short.banned == {2} and short.stop_ids == frozenset()  # (EOS not sampled short of min_tokens: vLLM's)
    with pytest.raises(ValueError, match=r"min_tokens must be in 0..max_new_tokens \(3\), got 4"):
        SamplingParams(max_new_tokens=3, min_tokens=4)
    # a request resumed after 5 tokens (migrated, prefilled again) counts min_tokens, as max_new_tokens, by what is left
    resumed = Request(0, [1, 2, 3], SamplingParams(max_new_tokens=32, min_tokens=20)).resume(list(range(5)))
    assert (resumed.sampling.max_new_tokens, resumed.sampling.min_tokens) == (27, 15)
    again = resumed.resume(list(range(5, 25)))  # 25 generated in all: past min_tokens
    assert (again.sampling.max_new_tokens, again.sampling.min_tokens) == (7, 0)
    seq = Sequence.of(resumed, eos_ids=(2,))
    assert seq.banned == {2}  # 15 more before the EOS may be sampled
    for t in range(15):
        seq.append(10 + t)
    assert seq.banned == frozenset()


def test_n_samples_per_prompt_are_requests_of_their_own_seed(checkpoints, tmp_path):
    """generation.n=3: each prompt becomes 3 requests (ids 3i..3i+2, each its own seeded sample);
    outputs.jsonl names the prompt and the sample; greedy n > 1 is refused."""
    from reshard.recipes.prompts import build_requests
    from reshard.recipes.schema import compose

    sampled = ["generation.temperature=0.9", "generation.n=3", "workload.num_requests=2"]
    requests = build_requests(compose("generate", sampled), tmp_path, 256)
    assert [r.id for r in requests] == list(range(6))
    assert [r.prompt_ids for r in requests[:3]] == [requests[0].prompt_ids] * 3 != [requests[3].prompt_ids] * 3
    with pytest.raises(ValueError, match=r"^generation.n=3 samples per prompt need generation.temperature > 0"):
        compose("generate", ["generation.n=3"])
    overrides = [f"model.path={checkpoints['llama']}", *sampled, "generation.max_new_tokens=6", "progress=false"]
    dist_harness.run(1, _run_recipe, overrides, str(tmp_path / "run"))
    out = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert [(o["prompt_index"], o["sample"]) for o in out] == [(i, k) for i in range(2) for k in range(3)]
    for i in range(2):
        samples = [o["output_ids"] for o in out if o["prompt_index"] == i]
        assert len({tuple(s) for s in samples}) > 1  # seeded per request: the samples differ


def _stop_string_job(path, prompt, stops):
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize
    from reshard.recipes.prompts import output_tokenizer

    engine = Engine(parallelize(path), EngineConfig(max_seq_len=64))
    request = Request(0, prompt, SamplingParams(max_new_tokens=12, stop=stops))
    with pytest.raises(ValueError, match=r"request 0: stop strings \('.+',\) are matched in decoded text and the"):
        engine.generate([request])
    engine.tokenizer = output_tokenizer(path)
    done = engine.generate([request, Request(1, prompt, SamplingParams(max_new_tokens=12, stop=stops, min_tokens=6))])
    return [(c.output_ids, c.finish_reason) for c in done]


def test_stop_strings_end_requests_where_hf_stop_strings_does(checkpoints, tmp_path):
    """A word of the free-running output as a stop string ends the request at the token that
    completes it, as HF ``generate(stop_strings=, tokenizer=)`` does; past ``min_tokens`` only;
    the recipe's ``outputs.jsonl`` text ends before it (as vLLM's), its ids keep the token."""
    path, prompt = tmp_path / "ckpt", [5, 9, 11, 2, 7]
    tok = _with_tokenizer(checkpoints["llama"], path)
    free = _hf(path, prompt, max_new_tokens=12)
    word = tok.convert_ids_to_tokens(free[3])
    expected = _hf(path, prompt, max_new_tokens=12, stop_strings=[word], tokenizer=tok)
    assert len(expected) <= 4 < len(free)
    got = dist_harness.run(1, _stop_string_job, str(path), prompt, (word,))[0]
    assert got[0] == (expected, "stop")
    late = [i for i, t in enumerate(free) if word in tok.convert_ids_to_tokens(t) and i >= 6]  # past min_tokens=6
    assert got[1] == ((free[: late[0] + 1], "stop") if late else (free, "length"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(prompt) + "\n")
    stop = f"generation.stop=[{word}]"
    overrides = [f"model.path={path}", f"workload.prompts_file={prompts}", "generation.max_new_tokens=12", stop]
    dist_harness.run(1, _run_recipe, [*overrides, "progress=false"], str(tmp_path / "run"))
    out = json.loads((tmp_path / "run" / "outputs.jsonl").read_text())
    assert out["finish_reason"] == "stop" and tok.convert_ids_to_tokens(out["output_ids"][-1]).find(word) >= 0
    text = text_after(tok, prompt, out["output_ids"])
    assert out["output"] == text[: text.find(word)] and word not in out["output"]
    with pytest.raises(ValueError, match=r"^generation.stop must be a non-empty list of non-empty strings or null"):
        from reshard.recipes.schema import compose

        compose("generate", ["generation.stop=[]"])


def _hf_logprobs(path, prompt, new_tokens, k):
    """HF greedy ``generate``'s tokens and, per token, its log-probability and the top ``k``
    ``(id, logprob)`` of the raw logits (``output_logits``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(logits[0].float(), -1) for logits in out.logits]
    tops = [lp.topk(k) for lp in lps]
    pairs = [list(zip(top.indices.tolist(), top.values.tolist())) for top in tops]
    return tokens, [(lp[t].item(), top) for lp, t, top in zip(lps, tokens, pairs)]


@pytest.mark.parametrize(
    "layout", [["parallel.tp=2"], ["parallel=dejavu"], ["parallel=seesaw"]], ids=["tp2", "dejavu", "seesaw"]
)
def test_logprobs_equal_hf_generates_raw_logits(checkpoints, tmp_path, layout):
    """``generation.logprobs=3`` on 2 ranks (TP2; DejaVu 1+1 and Seesaw PP2 -> TP2, whose first
    token's log-probabilities travel with the hand-off to the other side): each output token's
    log-probability and its top 3 as HF's ``output_logits`` give them (ids equal, values within
    fp32 reduction error)."""
    path, prompts = checkpoints["llama"], [[5, 9, 11, 2, 7], [40, 41, 42]]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    overrides = [f"model.path={path}", f"workload.prompts_file={prompts_file}", "generation.max_new_tokens=6"]
    dist_harness.run(2, _run_recipe, [*overrides, *layout, "generation.logprobs=3", "progress=false"], str(tmp_path))
    out = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    for o, prompt in zip(out, prompts):
        tokens, expected = _hf_logprobs(path, prompt, 6, 3)
        assert o["output_ids"] == tokens and len(o["logprobs"]) == len(tokens)
        for (lp, top), (want, want_top) in zip(o["logprobs"], expected):
            assert lp == pytest.approx(want, abs=1e-4) and [t[0] for t in top] == [t[0] for t in want_top]
            assert [t[1] for t in top] == pytest.approx([t[1] for t in want_top], abs=1e-4)
            assert top[0][1] >= top[1][1] >= top[2][1] and lp == pytest.approx(top[0][1], abs=1e-6)  # greedy: the top


def test_logprobs_are_refused_where_they_are_not_carried(checkpoints):
    from reshard.recipes.schema import compose

    with pytest.raises(ValueError, match=r"^generation.logprobs \(2\) are not kept across a failure"):
        compose("generate", ["generation.logprobs=2", "fault.migrate=reprefill"])
    with pytest.raises(ValueError, match=r"^generation.logprobs must be an int in 0..20 or None, got 21"):
        compose("generate", ["generation.logprobs=21"])


def test_the_default_job_takes_text_chats_and_stop_strings_with_the_builtin_tokenizer(tmp_path):
    """The built-in checkpoint ships a tokenizer (byte-level BPE over its 4096 ids, a chat
    template): text and chat prompts, decoded outputs and stop strings work on the default job."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Shoukai traim dou?"}]
    lines = [{"text": "Tra la boumest sheed."}, {"messages": messages}]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    cache = tmp_path / "cache"
    overrides = [f"model.cache_dir={cache}", f"workload.prompts_file={prompts_file}", "progress=false"]
    run = tmp_path / "run"
    dist_harness.run(1, _run_recipe, [*overrides, "generation.max_new_tokens=12"], str(run))
    out = [json.loads(line) for line in (run / "outputs.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(next(cache.rglob("tokenizer.json")).parent)
    assert tok.vocab_size == 4096 and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert (
        out[0]["prompt"] == "Tra la boumest sheed."
        and out[0]["prompt_ids"] == tok("Tra la boumest sheed.")["input_ids"]
    )
    assert out[1]["prompt"] == "<|user|> Shoukai traim dou?\n<|assistant|> "
    for o in out:
        assert o["output"] == tok.decode(o["output_ids"], skip_special_tokens=True) and len(o["output_ids"]) == 12
    # a stop string taken from the first output's text ends it there
    stop = out[0]["output"][len(out[0]["output"]) // 2 :][:3]
    assert stop.strip(), out[0]["output"]
    run2 = tmp_path / "run2"
    dist_harness.run(
        1, _run_recipe, [*overrides, "generation.max_new_tokens=12", f"generation.stop=[{json.dumps(stop)}]"], str(run2)
    )
    first = json.loads((run2 / "outputs.jsonl").read_text().splitlines()[0])
    assert first["finish_reason"] == "stop" and stop not in first["output"]
    assert out[0]["output"].startswith(first["output"])


def test_n_samples_share_their_prompt_in_a_paged_recipe_run(checkpoints, tmp_path):
    """generation.n=3 on a paged cache: summary.json counts every prompt token queried and the
    two later samples' shared full blocks as hits (the prompt computed once per prompt)."""
    sampled = ["generation.temperature=0.9", "generation.n=3", "workload.num_requests=2"]
    paged = ["engine.kv_block_size=4", "engine.kv_tokens=512", "generation.max_new_tokens=6", "progress=false"]
    dist_harness.run(1, _run_recipe, [f"model.path={checkpoints['llama']}", *sampled, *paged], str(tmp_path / "run"))
    kv = json.loads((tmp_path / "run" / "summary.json").read_text())["kv"]
    out = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    prompts = [o["prompt_ids"] for o in out if o["sample"] == 0]
    assert kv["prefix_cache_queries"] == 3 * sum(map(len, prompts))
    assert kv["prefix_cache_hits"] == 2 * sum((len(p) - 1) // 4 * 4 for p in prompts) > 0
    assert kv["prompt_tokens_computed"] == kv["prefix_cache_queries"] - kv["prefix_cache_hits"]


def test_n_samples_share_their_prompt_in_a_dejavu_recipe_run(checkpoints, tmp_path):
    """generation.n=3 on DejaVu's contiguous caches: summary.json counts each prompt's later
    samples as hits of all but its last token (the prompt computed once on the prompt side)."""
    sampled = ["generation.temperature=0.9", "generation.n=3", "workload.num_requests=2", "parallel=dejavu"]
    rest = ["generation.max_new_tokens=6", "progress=false"]
    dist_harness.run(2, _run_recipe, [f"model.path={checkpoints['llama']}", *sampled, *rest], str(tmp_path / "run"))
    kv = json.loads((tmp_path / "run" / "summary.json").read_text())["kv"]
    out = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    prompts = [o["prompt_ids"] for o in out if o["sample"] == 0]
    assert kv["paged"] is False and len(out) == 6
    assert kv["prefix_cache_queries"] == 3 * sum(map(len, prompts))
    assert kv["prefix_cache_hits"] == 2 * sum(len(p) - 1 for p in prompts) > 0


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "PP2-in-flight"])
def test_the_main_job_pages_its_cache_and_shares_prompts_by_default(checkpoints, tmp_path, ranks):
    """``engine.kv_block_size`` unset: the tp strategy's paged cache of 16-token blocks (pipeline
    stages included), so generation.n=3's later samples hit their prompt's full blocks;
    ``engine.kv_block_size=null`` (contiguous slots, no prefix cache) gives the same outputs with
    no hit."""
    from reshard.recipes.schema import compose

    sampled = ["generation.temperature=0.9", "generation.n=3", "workload.num_requests=2", "progress=false"]
    lengths = ["workload.prompt_len_min=40", "workload.prompt_len_max=60", "generation.max_new_tokens=6"]
    stages = [f"parallel.pp={ranks}"] if ranks > 1 else []
    base = [f"model.path={checkpoints['llama']}", *sampled, *lengths, *stages]
    assert compose("generate", base).engine.kv_block_size == 16
    if not stages:
        assert compose("generate", [*base, "parallel=dejavu"]).engine.kv_block_size is None  # streams contiguous KV
    runs = {}
    for name, extra in (("default", []), ("contiguous", ["engine.kv_block_size=null"])):
        dist_harness.run(ranks, _run_recipe, [*base, *extra], str(tmp_path / name))
        kv = json.loads((tmp_path / name / "summary.json").read_text())["kv"]
        out = [json.loads(line) for line in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
        runs[name] = kv, [o["output_ids"] for o in out], [o["prompt_ids"] for o in out if o["sample"] == 0]
    (kv, outputs, prompts), (flat, flat_outputs, _) = runs["default"], runs["contiguous"]
    assert outputs == flat_outputs
    assert kv["prefix_cache_hits"] == 2 * sum((len(p) - 1) // 16 * 16 for p in prompts) > 0
    assert not flat.get("prefix_cache_hits")


def test_an_outputs_text_is_decoded_after_its_prompt_as_vllm_decodes_it():
    """A SentencePiece-style tokenizer (Metaspace) drops a word's leading space at the start of a
    text: an output decoded alone would lose its first space. Decoded after the prompt's last
    tokens (vLLM's detokenizer), it keeps it; a byte-level tokenizer's text is the same either way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from reshard.parallel import SamplingParams
    from reshard.parallel.model.tiny_models import synthetic_text
    from reshard.parallel.vllm_api import in_context, output_text

    meta = Tokenizer(models.BPE(unk_token="<unk>"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    meta.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    meta.train_from_iterator(synthetic_text(0, 500), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=meta, unk_token="<unk>")
    prompt, output = tok("the words before")["input_ids"], tok(" and the words after")["input_ids"]
    whole = tok.decode(prompt + output)
    assert tok.decode(output) == "and the words after" and whole.endswith(" and the words after")
    text, _ = output_text(in_context(tok.decode, prompt), output, "length", SamplingParams())
    assert text == " and the words after"
    after = in_context(tok.decode, prompt)
    k = next(k for k in range(1, len(output) + 1) if " words a" in after(output[:k]))  # (where the engine stops)
    stopped, stop = output_text(after, output[:k], "stop", SamplingParams(stop=" words a"))
    assert (stopped, stop) == (" and the", " words a")
    from reshard.parallel import Request
    from reshard.parallel.engine.request import Sequence

    k = next(k for k in range(1, len(output) + 1) if after(output[:k]).startswith(" and"))
    ends = {}  # the engine's check sees the same text: " and" begins the output, "before and" spans the prompt
    for stop in (" and", "before and"):
        seq = Sequence.of(Request(0, prompt, SamplingParams(max_new_tokens=8, stop=stop)), (), decode=tok.decode)
        for t in output[:k]:
            seq.append(t)
        ends[stop] = seq.finish_reason
    assert ends == {" and": "stop", "before and": None}
    chars = lambda ids: "".join(map(chr, ids))  # noqa: E731 (a byte-level tokenizer's decode: context-free)
    assert output_text(in_context(chars, [104, 105]), [32, 121, 111], "length", SamplingParams())[0] == " yo"
