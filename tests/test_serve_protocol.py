"""The server's pieces without a server: OpenAI's fields onto the engine's, streamed text against
the offline job's, and a cancellation inside an engine group."""

from __future__ import annotations

from collections import deque

import pytest

from reshard.parallel.engine.admission import withdraw
from reshard.parallel.engine.channel import Cancel
from reshard.parallel.engine.request import Completion, Request, Sequence
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.serve.protocol import BadRequest, Limits, parse

LIMITS = Limits("tiny", max_seq_len=64, vocab_size=100)


def _parse(kind: str, **body):
    tokenize = lambda text: [ord(c) % 100 for c in text]  # noqa: E731
    chat = lambda messages, template: [1, 2, *tokenize(messages[-1]["content"])]  # noqa: E731
    return parse(kind, {"model": "tiny", **body}, LIMITS, tokenize, chat)


def test_openai_fields_map_onto_the_engines_sampling_params():
    p = _parse(
        "completions",
        prompt=["ab", [5, 6, 7]],
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        stop="xy",
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logprobs=2,
        n=3,
        top_k=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert p.prompts == [[97, 98], [5, 6, 7]] and p.n == 3 and p.stream and p.include_usage
    s = p.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (9, 0.5, 0.9, 4, 3)
    assert (s.stop, s.presence_penalty, s.frequency_penalty, s.logprobs) == (("xy",), 0.5, -1.0, 2)
    chat = _parse("chat", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=5, temperature=0)
    assert chat.prompts == [[1, 2, 4, 5]] and chat.logprobs == 5 and chat.sampling.greedy
    assert chat.sampling.max_new_tokens == 64 - 4  # chat's default: the rest of the context
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert _parse("chat", messages=[{"role": "user", "content": parts}]).prompts == [[1, 2, 4, 10, 5]]  # ("h\ni")
    assert _parse("completions", prompt="a").sampling.max_new_tokens == 16  # OpenAI's default
    assert _parse("completions", prompt="a", max_tokens=None).sampling.max_new_tokens == 64 - 1  # vLLM's null
    assert _parse("completions", prompt="a", echo=False, best_of=1, logit_bias={}).n == 1  # "off" values pass
    vllm = _parse(
        "completions", prompt="a", stop_token_ids=[7, 9], include_stop_str_in_output=True, skip_special_tokens=False
    ).sampling  # vLLM's extras, with reshard.LLM's meaning
    assert (vllm.stop_token_ids, vllm.include_stop_str_in_output, vllm.skip_special_tokens) == ((7, 9), True, False)
    assert _parse("completions", prompt="a").sampling.skip_special_tokens  # (the default: skipped)


def test_vllms_server_defaults_the_checkpoints_sampling_values_and_its_extras():
    """As vLLM's server: a request that leaves a sampling value out gets the checkpoint's
    ``generation_config.json`` value (its ``max_new_tokens`` caps ``max_tokens``); no model named is
    the served one; ``stream_options`` means usage unless it says no, and needs ``stream``;
    ``top_k=-1`` is off; vLLM's extras at their defaults pass; a message's ``name`` reaches the
    template; a completion's top log-probabilities hold the sampled token; a choice says its
    ``stop_reason``; ``n`` and the stop strings are not capped."""
    from reshard.parallel.serve.protocol import choice, logprobs_of

    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5}
    limits = Limits("tiny", max_seq_len=64, vocab_size=100, defaults=defaults)
    given = parse("completions", {"prompt": "a", "top_p": 0.5}, limits, lambda t: [1], list).sampling
    assert (given.temperature, given.top_p, given.top_k, given.max_new_tokens) == (0.6, 0.5, 20, 5)
    assert _parse("completions", prompt="a", max_tokens=9).sampling.temperature == 1.0  # (no file: OpenAI's)
    assert _parse("completions", prompt="a", model=None).prompts == [[97]]
    assert _parse("completions", prompt="a", stream=True, stream_options={}).include_usage
    assert not _parse("completions", prompt="a", stream=True, stream_options={"include_usage": False}).include_usage
    with pytest.raises(BadRequest, match="stream_options can only be given with stream=true"):
        _parse("completions", prompt="a", stream_options={"include_usage": True})
    assert not _parse("completions", prompt="a", stream_options={}).stream  # (empty: vLLM takes it)
    quiet = dict(include_usage=None, continuous_usage_stats=False)
    assert not _parse("completions", prompt="a", stream=True, stream_options=quiet).include_usage
    for bad in (False, [], {"continuous_usage_stats": True}):
        with pytest.raises(BadRequest, match="stream_options must be"):
            _parse("completions", prompt="a", stream=True, stream_options=bad)
    extras = dict(add_generation_prompt=True, continue_final_message=False, chat_template_kwargs={}, top_k=-1)
    assert _parse("chat", messages=[{"role": "user", "content": "hi"}], **extras).sampling.top_k == 0
    seen = []
    named = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "bo"}]}
    record = lambda messages, template: seen.append((messages, template)) or [1, 2]  # noqa: E731
    parse("chat", named, LIMITS, list, record)
    defaults = {"add_generation_prompt": True, "continue_final_message": False}
    assert seen == [([{"role": "user", "content": "hi", "name": "bo"}], defaults)]
    # vLLM's chat template arguments reach the template (Qwen3's enable_thinking, a last message continued)
    kwargs = {"enable_thinking": False}
    given = dict(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs=kwargs)
    parse("chat", {**named, **given}, LIMITS, list, record)
    assert seen[-1][1] == {"add_generation_prompt": False, "continue_final_message": True, "enable_thinking": False}
    for bad in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": False}}):
        with pytest.raises(BadRequest, match=r"continue_final_message cannot both|chat_template_kwargs must be"):
            parse("chat", {**named, **bad}, LIMITS, list, record)
    with pytest.raises(BadRequest, match="chat_template_kwargs must be"):
        parse("chat", {**named, "chat_template_kwargs": []}, LIMITS, list, record)
    parse("chat", {**named, "add_generation_prompt": None}, LIMITS, list, record)  # (null: the default)
    assert seen[-1][1] == defaults
    piece = lambda t: chr(t)  # noqa: E731
    lps = logprobs_of("completions", [97], [(-2.0, ((98, -0.5),))], piece)
    assert lps["top_logprobs"] == [{"a": -2.0, "b": -0.5}]  # (the sampled token, then the top one)
    assert choice("completions", 0, "x", "stop", None, delta=False, stop_reason="STOP")["stop_reason"] == "STOP"
    many = _parse("completions", prompt="a", n=32, stop=list("abcde"))  # (vLLM caps neither; OpenAI 16 and 4)
    assert many.n == 32 and many.sampling.stop == tuple("abcde")


@pytest.mark.parametrize(
    "kind,body,param,status",
    [
        ("completions", {"model": "other", "prompt": "a"}, "model", 404),
        ("completions", {"prompt": "a", "max_tokens": 64}, "max_tokens", 400),
        ("completions", {"prompt": list(range(64))}, "prompt", 400),
        ("completions", {"prompt": "a", "suffix": "zz"}, "suffix", 400),
        ("completions", {"prompt": "a", "stop": ["a", ""]}, "stop", 400),
        ("completions", {"prompt": "a", "stop": {"a": 1}}, "stop", 400),  # (its keys were taken for stops)
        ("completions", {"prompt": "a", "logprobs": 21}, "logprobs", 400),
        ("completions", {"prompt": "a", "messages": []}, "messages", 400),
        ("chat", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs", 400),
        ("chat", {"messages": [{"role": "robot", "content": "a"}]}, "messages", 400),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", 400),
        ("chat", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools", 400),
        ("chat", {"messages": [{"role": "user", "content": "a"}], "stream": "yes"}, "stream", 400),
        ("completions", {"prompt": "a", "stop_token_ids": [100]}, "stop_token_ids", 400),  # outside the vocabulary
        ("completions", {"prompt": "a", "include_stop_str_in_output": 1}, "include_stop_str_in_output", 400),
    ],
)
def test_a_field_the_engine_cannot_honour_is_refused_by_name(kind, body, param, status):
    body = {"model": "tiny", **body}
    with pytest.raises(BadRequest) as e:
        parse(kind, body, LIMITS, lambda t: [1] * len(t), lambda m, template: [1, 2])
    assert (e.value.param, e.value.status) == (param, status) and param in str(e.value)


def test_logprobs_are_refused_where_a_migration_would_drop_them():
    limits = Limits("tiny", 64, 100, logprobs=False)
    with pytest.raises(BadRequest, match="logprobs are not kept across a failure"):
        parse("completions", {"model": "tiny", "prompt": [1], "logprobs": 1}, limits, list, list)


class _Chars:
    """A tokenizer of one character per id (ids are code points)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_a_stream_holds_back_what_may_start_a_stop_string_and_ends_on_the_offline_text():
    from reshard.parallel.serve.text import Text, TextCursor, final_text

    text, sampling = Text(_Chars()), SamplingParams(stop="STOP")
    out = [ord(c) for c in "hello STOP world"]
    prompt = [ord(c) for c in "say "]
    cursor, sent = TextCursor(text, sampling, prompt), []
    for k in range(1, 10):  # the engine ends the request at the token that completes "STOP"
        new, items = cursor.advance([(t, None) for t in out[:k]], None)
        sent.append(new)
        assert len(items) == 1
    assert "".join(sent) == "hello "  # "STO" could be a stop string's start: held back
    # the token completing "STOP" reaches the stream before the completion: nothing of it goes out
    assert cursor.advance([(t, None) for t in out[:10]], None)[0] == ""
    new, _ = cursor.advance([(t, None) for t in out[:10]], "stop", "STOP")
    done = Completion(0, prompt, out[:10], "stop", stopped_by="STOP")
    assert "".join(sent) + new == final_text(text, done, sampling) == "hello "
    kept = SamplingParams(stop="STOP", include_stop_str_in_output=True)  # vLLM's: the text keeps it
    assert final_text(text, done, kept) == "hello STOP"


def test_a_stream_holds_back_a_stop_tokens_text_and_a_stop_token_ends_the_text_before_it():
    """The tokens of a step reach a stream before the completion: a last token that may have ended
    the choice (EOS, a stop token) keeps its text back, and the final text leaves it out (vLLM's:
    no stop string is looked for in it either)."""
    from reshard.parallel.serve.text import Text, TextCursor, final_text

    text, dot = Text(_Chars(), eos_ids=frozenset({0})), ord(".")
    sampling = SamplingParams(stop_token_ids=[dot])
    out = [ord(c) for c in "ab."]
    cursor = TextCursor(text, sampling, [ord(c) for c in "say "])
    sent = [cursor.advance([(t, None) for t in out[:k]], None)[0] for k in (1, 2, 3)]
    assert sent == ["a", "b", ""]  # "." may have ended it: held back
    assert cursor.advance([(t, None) for t in out], "stop", dot)[0] == ""  # it did: never sent
    ended = Completion(0, [], [ord(c) for c in "go."], "stop", stopped_by=dot)  # ("o." is in it: not a cut)
    assert final_text(text, ended, SamplingParams(stop_token_ids=[dot], stop="o.")) == "go"
    assert TextCursor(text, SamplingParams(ignore_eos=True), []).advance([(97, None), (0, None)], None)[0] == "a\x00"


def test_a_cancel_ends_a_queued_request_at_once_and_marks_a_running_one():
    queued, running = Request(1, [5, 6], SamplingParams()), Request(2, [7], SamplingParams(max_new_tokens=9))
    seq = Sequence.of(running, eos_ids=(0,))
    other = Request(3, [1], SamplingParams())
    queue = deque([queued, other])
    ended = withdraw(queue, [1, 2, 99], {2: seq})  # 99: unknown, ignored
    assert list(queue) == [other]
    assert [(c.id, c.output_ids, c.finish_reason) for c in ended] == [(1, [], "abort")]
    assert seq.cancelled and seq.finish_reason is None
    seq.append(4)  # its next token ends it
    assert seq.finish_reason == "abort"
    resumed = Request(4, [1], SamplingParams(max_new_tokens=5)).resume([7, 8])  # preempted after two tokens
    ended = withdraw(deque([resumed]), [4], {})
    assert [(c.id, c.prompt_ids, c.output_ids, c.finish_reason) for c in ended] == [(4, [1], [7, 8], "abort")]


def test_a_servers_router_places_cancels_and_forgets_and_ends_once_its_inbox_closes():
    """The router with an inbox, against a store and a hand-written group: what it posts where."""
    import time

    import torch.distributed as dist

    from reshard.parallel.engine.channel import Channel, Load, Topology
    from reshard.parallel.engine.inbox import Inbox
    from reshard.parallel.engine.request import Completion
    from reshard.parallel.engine.router import Router

    channel, inbox, kept = Channel("t", store=dist.HashStore()), Inbox(), []
    channel.put("load/0.0", Load(4, 100, 0))

    def posted(k: int):
        deadline = time.monotonic() + 30
        while not channel.ready(f"assign/0.0/{k}"):
            assert time.monotonic() < deadline, f"nothing posted as assign/0.0/{k}"
            time.sleep(0.01)
        return channel.get(f"assign/0.0/{k}")

    with Router(channel, [], Topology.ring(1), time.time(), "least_loaded", inbox=inbox, keep=kept.append) as router:
        inbox.submit(Request(7, [1, 2], SamplingParams(max_new_tokens=3)))
        assert posted(0).id == 7
        inbox.cancel(7)
        assert posted(1) == Cancel(7)  # to the group that runs it
        channel.append("done", Completion(7, [1, 2], [5], "abort"))
        inbox.submit(Request(8, [1], SamplingParams(max_new_tokens=2)))
        assert posted(2).id == 8
        channel.append("done", Completion(8, [1], [4, 4], "length"))
        inbox.close()
        router.running.result(timeout=30)  # its loop ends by itself once the inbox is closed and all is done
        assert router.ended and channel.ready("all_done")
    assert [(c.id, c.finish_reason) for c in kept] == [(7, "abort"), (8, "length")]
    assert router.book.originals == {} and router.book.completions == {}  # a server's router keeps nothing done


def test_a_router_that_would_stream_tokens_without_a_server_is_refused_by_name():
    """``on_tokens`` relays a server's tokens: without the server's inbox it is one line."""
    import torch.distributed as dist

    from reshard.parallel.engine.channel import Channel, Topology
    from reshard.parallel.engine.router import Router

    channel, one = Channel("refused", store=dist.HashStore()), Topology.lockstep(hosted=False)
    with pytest.raises(ValueError, match=r"^on_tokens streams a server's tokens: pass its inbox too$"):
        Router(channel, [], one, 0.0, on_tokens=lambda tokens: None)
    with pytest.raises(ValueError, match=r"^routing must be one of \('least_loaded', 'round_robin', 'longest_first'\)"):
        Router(channel, [], one, 0.0, routing="nearest")


def test_the_checkpoints_generation_config_gives_the_servers_sampling_defaults(tmp_path):
    """``generation_defaults``: the sampling values ``generation_config.json`` sets away from HF's
    defaults (``top_k`` 50 is HF's: dropped), of the types a request could give; {} without the
    file or with one that is not an object."""
    import json

    from reshard.parallel.model.checkpoint import generation_defaults

    given = {"temperature": 0.7, "top_k": 50, "min_p": 0.1, "top_p": "x", "max_new_tokens": 5, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(given))
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "min_p": 0.1, "max_new_tokens": 5}
    assert generation_defaults(tmp_path / "none") == {}
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    assert generation_defaults(tmp_path) == {}


def _tokenizers(tmp_path):
    """Real HF tokenizers: byte-level BPE (random ids split characters across tokens), SentencePiece-
    style Metaspace (a text's first word loses its leading space) and Llama 2's byte fallback
    (``<0xNN>`` tokens, a run of which decodes to replacement characters while one byte is missing)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from reshard.parallel.model.tiny_models import save_tokenizer, synthetic_text

    save_tokenizer(tmp_path, 512)
    meta = Tokenizer(models.BPE(unk_token="<unk>"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    meta.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    meta.train_from_iterator(synthetic_text(0, 500), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    base.train_from_iterator(synthetic_text(0, 500), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"]))
    spec = json.loads(base.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    fallback = Tokenizer.from_str(json.dumps(spec))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    fallback.decoder = decoders.Sequence(steps)
    return {
        "byte-level": AutoTokenizer.from_pretrained(tmp_path),
        "metaspace": PreTrainedTokenizerFast(tokenizer_object=meta),
        "byte-fallback": PreTrainedTokenizerFast(tokenizer_object=fallback, unk_token="<unk>"),
    }


def _output(name: str, tokenizer, rng) -> list[int]:
    """600 or more output ids: random ones, or for byte fallback a text of 1- to 4-byte characters
    (random byte tokens would hardly ever make one)."""
    if name != "byte-fallback":
        return [rng.randrange(3, len(tokenizer)) for _ in range(600)]
    chars = ["a", "\u0436", "\u20ac", "\u4e2d", "\U0001f600"]
    words = ("hello " + "".join(rng.choice(chars) for _ in range(rng.randint(5, 40))) + " wor" for _ in range(30))
    return tokenizer("".join(words), add_special_tokens=False)["input_ids"]


class _Counted:
    """``tokenizer``'s decode, counting the ids it decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_long_stream_decodes_a_window_a_step_and_ends_on_the_offline_text(tmp_path):
    """A step's event decodes the output's tail (:class:`GrowingText`), not the whole output (which
    made a stream of n tokens cost O(n^2)): its text equals the whole decode at every length, and
    the stream's text, a stop string held back and cut, ends on the offline job's."""
    import random

    from reshard.parallel.serve.text import GrowingText, Text, TextCursor, decoder, final_text
    from reshard.parallel.vllm_api import ended_by_string

    rng = random.Random(0)
    window = 2 * GrowingText.SETTLE + GrowingText.ANCHOR + 23  # (+ the prompt's suffix it decodes after)
    for name, tokenizer in _tokenizers(tmp_path).items():
        prompt, out = tokenizer("the words before")["input_ids"], _output(name, tokenizer, rng)
        n = len(out)
        whole = decoder(Text(tokenizer), SamplingParams(), prompt)
        growing = GrowingText(whole)
        for k in range(1, n + 1):  # (the stop-string check decodes ids[:-1] too)
            assert growing(out[:k]) == whole(out[:k]) and growing(out[: k - 1]) == whole(out[: k - 1]), (name, k)

        # a stop string from late in the text: where the engine ends the choice
        sampling = SamplingParams(stop=["zq", whole(out)[-40:-34]], min_tokens=3)
        end = next(k for k in range(1, n + 1) if ended_by_string(whole, out[:k], sampling.stop, 3) is not None)
        stop = ended_by_string(whole, out[:end], sampling.stop, 3)[0]
        assert end > n - 100 and n >= 600, (name, end, n)
        counted = _Counted(tokenizer)
        text = Text(counted)
        cursor, sent, per_event = TextCursor(text, sampling, prompt), [], []
        for k in range(1, end + 1):
            before = counted.decoded
            sent.append(cursor.advance([(t, None) for t in out[:k]], None)[0])
            per_event.append(counted.decoded - before)
        done = Completion(0, prompt, out[:end], "stop", stopped_by=stop)
        last = cursor.advance([(t, None) for t in out[:end]], "stop", stop)[0]
        assert "".join(sent) + last == final_text(text, done, sampling) == whole(out[:end]).rpartition(stop)[0], name
        if name == "byte-fallback":  # (a valid text: a character split over byte tokens is sent whole)
            assert "\ufffd" not in "".join(sent)
        assert max(per_event[-100:]) <= 6 * window < end, (name, max(per_event[-100:]))
