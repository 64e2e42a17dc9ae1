"""``reshard serve``: the official ``openai`` client and raw HTTP against a server on loopback.

One server (``reshard serve --nproc 2``, two data-parallel engine groups) answers the module's
tests in order; the last one drains it with SIGTERM. A second one, under ``fault.migrate=kv``,
loses a rank while eight streams are open. Every strategy serves from the harness's ranks
(:func:`reshard.recipes.serve.run_serve`, a client thread on rank 0). References: HF ``generate``
(greedy) on the same token ids, decoded as the offline job decodes.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import dist_harness

MODEL = "tiny"
NEW = 12  # new tokens per request


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    run_dir: Path
    log: Path

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """The built-in checkpoint (with its tokenizer and chat template)."""
    from reshard.parallel.model.tiny_models import builtin_checkpoint

    return builtin_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served)


def start_server(served: Path, run_dir: Path, extra: list[str]) -> Server:
    args = ["--nproc", "2", f"model.path={served}", f"serve.model_name={MODEL}", *extra]
    return launch_server(run_dir, args)


def launch_server(run_dir: Path, args: list[str], env: dict | None = None) -> Server:
    """``reshard serve --port 0 ARGS`` writing into ``run_dir``, once it says where it listens."""
    log = run_dir.parent / f"{run_dir.name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard.recipes.cli", "serve", "--port", "0", *args, f"hydra.run.dir={run_dir}"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}:\n{log.read_text()}")
        info = run_dir / "server.json"
        url = json.loads(info.read_text()).get("url") if info.exists() else None
        if url:
            return Server(url, proc, run_dir, log)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no server within 180 s:\n{log.read_text()}")


def stop(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(120)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    extra = ["parallel.tp=1", "engine.max_batch_size=4", "serve.max_waiting=12", "serve.grace_s=60"]
    s = start_server(served, tmp_path_factory.mktemp("serve") / "run", extra)
    yield s
    stop(s)


def reference(hf_reference, tokenizer, served: Path, ids: list[list[int]], new: int = NEW) -> list[str]:
    """HF ``generate``'s greedy text for each prompt's token ids (special tokens skipped)."""
    return [tokenizer.decode(out, skip_special_tokens=True) for out in hf_reference(str(served), ids, new)]


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


PROMPTS = ["Hello there", "The capital of", "one two three four five", "x"]


def test_openai_client_completions_and_chat_streamed_and_not_equal_hf_generate(server, served, tokenizer, hf_reference):
    client = server.client()
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    want = reference(hf_reference, tokenizer, served, ids)
    assert [m.id for m in client.models.list().data] == [MODEL]

    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
    assert whole.usage.prompt_tokens == sum(map(len, ids))
    hf_tokens = hf_reference(str(served), ids, NEW)
    assert whole.usage.completion_tokens == sum(map(len, hf_tokens))

    for prompt, text in zip(PROMPTS[:2], want):
        events = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
        assert "".join(e.choices[0].text for e in events if e.choices) == text
        assert len([e for e in events if e.choices and e.choices[0].text]) > 1  # token by token, not one blob

    messages = [{"role": "user", "content": "Say something"}]
    (chat_want,) = reference(hf_reference, tokenizer, served, [chat_ids(tokenizer, messages)])
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    assert chat.choices[0].message.content == chat_want
    assert chat.usage.prompt_tokens == len(chat_ids(tokenizer, messages))
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(streamed)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == chat_want
    assert events[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == [
        chat.choices[0].finish_reason
    ]


def _recipe_outputs(served: str, prompts_file: str, run_dir: str, stop: str) -> list[dict]:
    """The generate recipe's ``outputs.jsonl`` lines for ``prompts_file`` with stop string ``stop``."""
    from reshard.recipes.generate import run_generate
    from reshard.recipes.schema import compose

    overrides = [f"model.path={served}", f"workload.prompts_file={prompts_file}", "generation.max_new_tokens=12"]
    run_generate(compose("generate", [*overrides, f"generation.stop=[{stop}]"]), Path(run_dir))
    return [json.loads(line) for line in (Path(run_dir) / "outputs.jsonl").read_text().splitlines()]


def test_a_stop_string_cuts_the_text_alike_in_llm_the_recipe_and_the_server(server, served, tmp_path):
    """One prompt, one stop string its greedy output holds: ``LLM``'s text, the recipe's
    ``output`` and the server's text are the same, cut before the stop string."""
    from reshard import LLM, SamplingParams

    prompt, stop = "The future of AI is", "ound"
    with LLM(str(served), max_model_len=64) as llm:
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=12, stop=[stop]))
        (kept,) = llm.generate(prompt, SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True))
    (prompts_file := tmp_path / "prompts.jsonl").write_text(json.dumps(prompt) + "\n")
    (line,) = dist_harness.run(1, _recipe_outputs, str(served), str(prompts_file), str(tmp_path / "run"), stop)[0]
    client = server.client()
    served_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop and stop not in sample.text
    assert sample.text == line["output"] == served_text.choices[0].text
    extra = {"include_stop_str_in_output": True}  # vLLM's extra field: the text keeps the stop string, alike
    served_kept = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop, extra_body=extra
    )
    assert kept.outputs[0].text == served_kept.choices[0].text == sample.text + stop


def test_logprobs_seeded_sampling_and_usage_of_several_choices(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    args = dict(model=MODEL, prompt="Hello there", max_tokens=8, temperature=1.0, seed=7, n=2)
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: the same draws
    one, x = (client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in ("Hello", "x"))
    two = client.completions.create(model=MODEL, prompt=["Hello", "x"], max_tokens=6, temperature=0, n=2)
    texts = [c.text for c in sorted(two.choices, key=lambda c: c.index)]
    assert texts == [one.choices[0].text] * 2 + [x.choices[0].text] * 2  # choice p * n + k
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + x.usage.prompt_tokens  # each prompt once
    assert two.usage.completion_tokens == 2 * (one.usage.completion_tokens + x.usage.completion_tokens)


def _ask(server: Server, prompt: str, delay: float, out: dict, k: int) -> None:
    time.sleep(delay)
    sent = time.time()
    stream = k % 2 == 0
    if stream:
        events = list(
            server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, stream=True)
        )
        text, timing = "".join(e.choices[0].text for e in events if e.choices), None
    else:
        r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
        text, timing = r.choices[0].text, r.model_extra["reshard_timing"][0]
    out[k] = (sent, text, timing, time.time())


def test_sixteen_poisson_clients_each_complete_equal_to_offline_and_none_starts_before_it_arrives(
    server, served, tokenizer, hf_reference
):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(rng.randint(1, 30)))]
    prompts += [f"request {k} " * rng.randint(1, 8) for k in range(15)]
    want = reference(hf_reference, tokenizer, served, [tokenizer(p)["input_ids"] for p in prompts])
    gaps = [rng.expovariate(8.0) for _ in prompts]  # Poisson arrivals at 8 requests/s
    arrivals = [sum(gaps[: k + 1]) for k in range(len(prompts))]
    out: dict = {}
    threads = [
        threading.Thread(target=_ask, args=(server, p, a, out, k)) for k, (p, a) in enumerate(zip(prompts, arrivals))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(out) == list(range(16))
    assert [out[k][1] for k in range(16)] == want
    for sent, _, timing, received in (out[k] for k in range(1, 16, 2)):
        marks = [sent, timing["arrival"], timing["started"], timing["first_token"], timing["finished"], received]
        assert marks == sorted(marks), marks  # the engine began each request after the client sent it


@pytest.mark.parametrize(
    "body,status,match",
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens=100000 with a prompt of"),
        ({"model": MODEL, "prompt": list(range(5, 600))}, 400, "the prompt is 595 tokens; the model's context is 512"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1}}, 400, "unsupported field 'logit_bias'"),
        ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "unsupported field 'best_of'"),
        (
            {"model": MODEL, "prompt": "hi", "temperature": "hot"},
            400,
            "temperature must be a number >= 0, got 'hot'",
        ),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must be an integer >= 1, got 0"),
        ({"model": MODEL, "prompt": "hi", "n": 13}, 400, r"x n=13 = 13 requests exceed serve.max_waiting=12"),
        ({"model": MODEL, "prompt": [3, 99999]}, 400, "token id 99999 is outside the vocabulary"),
        ("{not json", 400, "malformed JSON body"),
    ],
)
def test_bad_requests_are_4xx_naming_the_value_and_the_server_keeps_serving(server, body, status, match):
    import re

    import httpx

    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert re.search(match, r.json()["error"]["message"]), r.json()
    ok = httpx.post(f"{server.url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def _metric(server: Server, name: str) -> float:
    return _metric_at(server.url, name)


def _metric_at(url: str, name: str) -> float:
    """``name`` summed over its labels, from the ``/metrics`` of the server at ``url``."""
    import httpx

    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    ]
    return sum(values)


def test_vllms_tokenize_and_detokenize_give_the_ids_the_server_runs(server, tokenizer):
    """vLLM's ``/tokenize`` (a prompt, or a chat through its template: the ids a chat completion
    counts as its prompt) and ``/detokenize``; bad values are one line naming the field."""
    import httpx

    root = server.url.removesuffix("/v1")
    r = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": "hello world", "return_token_strs": True})
    ids = tokenizer("hello world")["input_ids"]
    assert r.json() == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": "hello there"}]
    chat = httpx.post(f"{root}/tokenize", json={"messages": messages, "return_token_strs": None}).json()
    assert chat["token_strs"] is None  # (vLLM's: the key always there, null unless asked)
    done = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat["count"] == done.usage.prompt_tokens and chat["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # vLLM's chat template arguments: the same ids through /tokenize and a chat completion
    bare = httpx.post(f"{root}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    extra = {"add_generation_prompt": False, "chat_template_kwargs": {"unused_flag": True}}
    done = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    assert bare["tokens"] == want != chat["tokens"] and done.usage.prompt_tokens == bare["count"]
    cut = {"truncation": True, "max_length": 3, "padding": "max_length", "return_tensors": "pt"}  # (tokenizing: none)
    same = httpx.post(f"{root}/tokenize", json={"messages": messages, "chat_template_kwargs": cut}).json()
    assert same["tokens"] == chat["tokens"]  # (as vLLM renders, then tokenizes: they change nothing)
    for kwargs in ({"conversations": 1}, {"documents": 5}):
        r = httpx.post(f"{root}/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs})
        assert r.status_code == 400, (kwargs, r.text)
    back = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    refused = [
        ("tokenize", {"prompt": "a", "messages": messages}, 400, "give a prompt or messages, one of them"),
        ("tokenize", {"prompt": "a", "truncate": 3}, 400, "unsupported field 'truncate'"),
        ("tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model 'gpt-4' does not exist"),
        ("detokenize", {"tokens": [3, 99999]}, 400, "token id 99999 is outside the vocabulary"),
        ("detokenize", {"tokens": "abc"}, 400, "tokens must be a list of token ids, got 'abc'"),
    ]
    for route, body, status, message in refused:
        r = httpx.post(f"{root}/{route}", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], (route, body, r.text)


def test_a_full_queue_is_429_with_retry_after(server):
    import httpx

    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        results: list = []

        def one() -> None:
            results.append(http.post(f"{server.url}/completions", json=body))

        threads = [threading.Thread(target=one) for _ in range(30)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 12, codes  # 8 run, up to 12 more wait
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "serve.max_waiting=12" in refused.json()["error"]["message"]


def test_a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_kv(server):
    import httpx

    free = _metric(server, "reshard_kv_free_tokens")
    aborted, generated = (
        _metric(server, 'reshard_requests_finished_total{reason="abort"}'),
        _metric(server, "reshard_generation_tokens_total"),
    )
    body = {
        "model": MODEL,
        "prompt": "a long one",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
        chunks = [line for line, _ in zip(r.iter_lines(), range(6)) if line]
    assert len(chunks) >= 3  # it was streaming when the client left
    deadline = time.monotonic() + 60
    while _metric(server, 'reshard_requests_finished_total{reason="abort"}') == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, 'reshard_requests_finished_total{reason="abort"}') == aborted + 1
    assert _metric(server, "reshard_generation_tokens_total") - generated < 400  # ended early
    assert _metric(server, "reshard_kv_free_tokens") == free  # its KV is free again
    assert _metric(server, "reshard_requests_running") == 0
    generated = _metric(server, "reshard_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):  # a client that does not stream, gone before its answer
        httpx.post(f"{server.url}/completions", json={**body, "stream": False, "max_tokens": 480}, timeout=0.5)
    deadline = time.monotonic() + 60
    while (
        _metric(server, 'reshard_requests_finished_total{reason="abort"}') == aborted + 1
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert _metric(server, 'reshard_requests_finished_total{reason="abort"}') == aborted + 2
    assert _metric(server, "reshard_generation_tokens_total") - generated < 480
    assert _metric(server, "reshard_kv_free_tokens") == free


def test_sigterm_drains_running_requests_finish_new_ones_get_503_and_it_exits_0(
    server, served, tokenizer, hf_reference
):
    """Last of the module's: the server ends here."""
    import httpx

    prompts = ["drain me", "and me too", "me three", "last"]
    new = [30, 30, 30, 160]  # the last one outlasts the test's late request, however fast the others drain
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    want = reference(hf_reference, tokenizer, served, ids[:3], 30) + reference(
        hf_reference, tokenizer, served, ids[3:], 160
    )
    out: dict = {}

    def one(k: int) -> None:
        events = server.client().completions.create(
            model=MODEL, prompt=prompts[k], max_tokens=new[k], temperature=0, stream=True
        )
        out[k] = "".join(e.choices[0].text for e in events if e.choices)

    finished_before = _metric(server, "reshard_requests_finished_total")  # the module's server served others
    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # all four accepted, some still running (one may finish before the last starts)
        running = _metric(server, "reshard_requests_running")
        done = _metric(server, "reshard_requests_finished_total") - finished_before
        if running >= 1 and running + done >= 4:
            break
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    while httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200:
        time.sleep(0.02)
    late = httpx.post(f"{server.url}/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    for t in threads:
        t.join(120)
    assert [out.get(k) for k in range(4)] == want  # every running request finished
    assert server.proc.wait(120) == 0
    log = server.log.read_text()
    assert "drained:" in log and "0 cancelled" in log, log


def test_dp_groups_with_migrate_kv_keep_eight_streams_through_a_rank_kill(served, tokenizer, hf_reference, tmp_path):
    extra = [
        "parallel.tp=1",
        "engine.max_batch_size=8",
        "fault.migrate=kv",
        "fault.kill_at=[1,8]",
        "fault.warm_spare=false",
    ]
    server = start_server(served, tmp_path / "run", extra)
    try:
        prompts = [f"stream {k} " * (k + 1) for k in range(8)]
        want = reference(hf_reference, tokenizer, served, [tokenizer(p)["input_ids"] for p in prompts], 24)
        out, ends = {}, {}

        def one(k: int) -> None:
            events = list(
                server.client().completions.create(
                    model=MODEL, prompt=prompts[k], max_tokens=24, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )
            )  # fmt: skip
            out[k] = [e.choices[0].text for e in events if e.choices]
            ends[k] = [(e.choices[0].finish_reason if e.choices else None, e.usage) for e in events[-2:]]

        threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        got = ["".join(out.get(k, [])) for k in range(8)]
        assert got == want, (ends, server.log.read_text()[-3000:])  # no token twice, none missing
        events = [json.loads(line) for line in (server.run_dir / "supervision.jsonl").read_text().splitlines()]
        assert any(e.get("event") == "exited" and e.get("rank") == 1 for e in events), events
    finally:
        assert stop(server) == 0


# ---- every strategy, from the harness's ranks -------------------------------------------------------
def _serve_and_ask(overrides: list[str], run_dir: str, prompts: list[str], messages: list) -> tuple[dict | None, int]:
    """On every rank: serve (``run_serve``); on rank 0 a client thread asks, then drains. Rank 0's
    client's answers, and how many steps' tokens this rank sent through the store's ``tokens`` list."""
    import torch.distributed as dist

    from reshard.parallel.engine.channel import Channel
    from reshard.recipes import schema
    from reshard.recipes.serve import run_serve

    cfg = schema.compose("serve", overrides)
    drain, out, appended = threading.Event(), {}, []
    client = None
    if dist.get_rank() == 0:
        client = threading.Thread(target=_client, args=(Path(run_dir), prompts, messages, drain, out))
        client.start()
    append = Channel.append

    def counted(channel, name, value, count=None):
        appended.extend([name] if name == "tokens" else [])
        return append(channel, name, value, count)

    Channel.append = counted
    try:
        run_serve(cfg, Path(run_dir), drain)
    finally:
        Channel.append = append
        drain.set()
    if client is not None:
        client.join(60)
    return (out if client is not None else None), len(appended)


def _client(run_dir: Path, prompts: list[str], messages: list, drain: threading.Event, out: dict) -> None:
    import openai

    try:
        url = _wait_for_url(run_dir, drain)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=NEW, temperature=0)
        out["texts"] = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
        events = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW, temperature=0, stream=True
        )
        out["chat"] = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    except Exception as e:  # reported by the test
        out["error"] = repr(e)
    finally:
        drain.set()


@pytest.mark.parametrize(
    "strategy",
    [
        ["parallel=shift", "parallel.sp=2", "parallel.threshold=8"],
        ["parallel=seesaw"],
        ["parallel=sidp"],
        ["parallel=dejavu"],
    ],
    ids=["shift", "seesaw", "sidp", "dejavu"],
)
def test_every_strategy_serves_through_the_openai_client(strategy, served, tokenizer, hf_reference, tmp_path):
    messages = [{"role": "user", "content": "Say something"}]
    prompts = PROMPTS[:3]
    overrides = [f"model.path={served}", f"serve.model_name={MODEL}", "serve.port=0", *strategy]
    (out, sent0), (_, sent1) = dist_harness.run(2, _serve_and_ask, overrides, str(tmp_path / "run"), prompts, messages)
    assert "error" not in out, out["error"]
    # rank 0 (the router's process) leads a group: its tokens reach the front end with no store hop;
    # DejaVu's token group leads from rank 1, through the store
    assert sent0 == 0 and (sent1 > 0) == (strategy == ["parallel=dejavu"]), (sent0, sent1)
    assert out["texts"] == reference(hf_reference, tokenizer, served, [tokenizer(p)["input_ids"] for p in prompts])
    assert out["chat"] == reference(hf_reference, tokenizer, served, [chat_ids(tokenizer, messages)])[0]


def _prefix_hits(server: Server) -> int:
    """Prompt tokens the server's prefix caches held so far (``/metrics``, every group)."""
    import httpx

    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("reshard_prefix_cache_hits_total{")]
    return sum(int(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_chats_second_turn_hits_the_first_turns_blocks(served, tokenizer, hf_reference, tmp_path):
    """A paged cache: a chat's second turn (the first turn's prompt and answer, then a new
    message) finds the first turn's blocks cached (``/metrics``), and its answer equals HF's."""
    extra = ["parallel.tp=1", "engine.max_batch_size=2", "engine.kv_block_size=4", "engine.kv_tokens=1024"]
    args = ["--nproc", "1", f"model.path={served}", f"serve.model_name={MODEL}", *extra]
    server = launch_server(tmp_path / "run", args)
    try:
        client = server.client()
        first = [{"role": "user", "content": "Tell me about the sea and the ships on it"}]
        answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=NEW, temperature=0)
        before = _prefix_hits(server)
        second = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
        second.append({"role": "user", "content": "And then?"})
        reply = client.chat.completions.create(model=MODEL, messages=second, max_tokens=NEW, temperature=0)
        after = _prefix_hits(server)
    finally:
        assert stop(server) == 0
    ids, earlier = chat_ids(tokenizer, second), chat_ids(tokenizer, first)
    shared = next((i for i, (a, b) in enumerate(zip(ids, earlier)) if a != b), len(earlier))
    assert shared >= 8, shared  # the template renders the first turn as the second's beginning
    assert after - before >= shared // 4 * 4 > 0, (before, after, shared)
    assert reply.choices[0].message.content == reference(hf_reference, tokenizer, served, [ids])[0]


def _serve_and_disconnect(overrides: list[str], run_dir: str, prompts: list[str]) -> dict | None:
    """On every rank: serve (``run_serve``); on rank 0 a client streams a long request and goes
    away after a few chunks, then asks for ``prompts`` whole, then drains. What rank 0's client saw."""
    import torch.distributed as dist

    from reshard.recipes import schema
    from reshard.recipes.serve import run_serve

    drain, out = threading.Event(), {}
    client = None
    if dist.get_rank() == 0:
        client = threading.Thread(target=_disconnecting_client, args=(Path(run_dir), prompts, drain, out))
        client.start()
    try:
        run_serve(schema.compose("serve", overrides), Path(run_dir), drain)
    finally:
        drain.set()
    if client is not None:
        client.join(60)
    return out if client is not None else None


def _disconnecting_client(run_dir: Path, prompts: list[str], drain: threading.Event, out: dict) -> None:
    import httpx
    import openai

    aborted = 'reshard_requests_finished_total{reason="abort"}'
    try:
        url = _wait_for_url(run_dir, drain)
        out["free"] = _metric_at(url, "reshard_kv_free_tokens")
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json={**body, "temperature": 0}, timeout=60) as r:
            out["chunks"] = len([line for line, _ in zip(r.iter_lines(), range(6)) if line])
        deadline = time.monotonic() + 60
        while _metric_at(url, aborted) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        out["aborted"] = _metric_at(url, aborted)
        out["generated"] = _metric_at(url, "reshard_generation_tokens_total")
        out["free_after"] = _metric_at(url, "reshard_kv_free_tokens")
        out["running"] = _metric_at(url, "reshard_requests_running")
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=NEW, temperature=0)
        out["texts"] = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    except Exception as e:  # reported by the test
        out["error"] = repr(e)
    finally:
        drain.set()


def _wait_for_url(run_dir: Path, drain: threading.Event) -> str:
    """The URL the server in ``run_dir`` writes to ``server.json`` once it listens (at most 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not drain.is_set():
        info = run_dir / "server.json"
        url = json.loads(info.read_text()).get("url") if info.exists() else None
        if url:
            return url
        time.sleep(0.1)
    raise TimeoutError(f"no server.json url in {run_dir}")


@pytest.mark.parametrize("strategy", [["parallel.pp=2"], ["parallel=dejavu"]], ids=["pp2-in-flight", "dejavu"])
def test_a_client_gone_mid_stream_is_aborted_where_its_request_runs(
    strategy, served, tokenizer, hf_reference, tmp_path
):
    """A client that leaves mid-stream cancels its request where it runs by then: on an in-flight
    pipeline the first stage aborts it and its notes end it on the second; under DejaVu the prompt
    group that handed it on passes the cancel to the token group (``/metrics``: one abort, fewer
    tokens than asked, the KV free again, nothing running). The next answers equal HF's."""
    prompts = PROMPTS[:2]
    overrides = [f"model.path={served}", f"serve.model_name={MODEL}", "serve.port=0", *strategy]
    out, _ = dist_harness.run(2, _serve_and_disconnect, overrides, str(tmp_path / "run"), prompts)
    assert "error" not in out, out["error"]
    assert out["chunks"] >= 3 and out["aborted"] == 1 and out["generated"] < 200, out
    assert out["free_after"] == out["free"] and out["running"] == 0, out
    assert out["texts"] == reference(hf_reference, tokenizer, served, [tokenizer(p)["input_ids"] for p in prompts])
