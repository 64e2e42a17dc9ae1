"""The compiled decode step by default, as vLLM's: on CUDA, where the strategy's decode step
compiles and ``kv_swap`` is off; eager when asked (``compile=False``, ``LLM(enforce_eager=True)``)
and on this CPU. A step with layer listeners runs the eager body even when compiled."""

import pytest
import torch

from tests import dist_harness

PROMPTS = [[5, 9, 13, 7, 21], [3, 8, 40, 11, 12, 17, 30, 4, 9]]
MAX_NEW = 6


def test_compile_settles_by_the_device_the_strategy_and_kv_swap():
    from reshard.parallel import EngineConfig
    from reshard.parallel.engine import make_strategy

    default = EngineConfig()
    assert default.compile is None
    assert default.compiles("cuda") and not default.compiles("cpu")
    assert not EngineConfig(compile=False).compiles("cuda")  # (vLLM's enforce_eager)
    assert EngineConfig(compile=True).compiles("cpu")
    assert not EngineConfig(kv_swap=True, num_microbatches=2).compiles("cuda")  # (swapping runs eagerly)
    assert not default.compiles("cuda", microbatches=2)  # (a stage's micro-batches: each a graph replay)
    assert EngineConfig(compile=True).compiles("cuda", microbatches=2)  # (asked)

    eager = {"sidp": {}, "dejavu": {}, "seesaw": {}}  # (Seesaw: its transitions move the decode KV)
    compiling = {"tp": {}, "shift": {}}
    for name, keys in {**eager, **compiling}.items():
        strategy = make_strategy({"strategy": name, **keys})
        settled = strategy.settled(default)
        assert settled.compile is (False if name in eager else None), (name, settled.compile)
        assert strategy.settled(EngineConfig(compile=True)).compile is True  # (given: the strategy refuses it)


def test_a_jobs_compile_settles_through_its_strategy_and_supervision():
    from reshard.recipes.schema import compose

    assert compose("generate", []).engine_config().compile is None
    assert compose("generate", ["parallel=dejavu"]).engine_config().compile is False
    assert compose("generate", ["compile=false"]).engine_config().compile is False
    assert compose("generate", ["engine.compile=false"]).engine_config().compile is False  # (either key)
    assert compose("generate", ["compile=true"]).engine_config().compile is True
    # supervised groups decode eagerly unless asked: a first compile would outlast their heartbeat
    assert compose("generate", ["fault.migrate=kv"]).engine_config().compile is False
    assert compose("generate", ["fault.migrate=kv", "compile=true"]).engine_config().compile is True


def _listened(path: str) -> dict:
    """A compiled engine (``compile=True``) with a ``layer_after`` listener: the layers it heard per
    step kind, the graphs Dynamo compiled meanwhile, and the tokens."""
    from torch._dynamo.utils import counters

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=32, compile=True))
    heard: list[int] = []
    engine.events.on("layer_after", lambda index, h, ctx: heard.append(index))
    graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    out = engine.generate([Request(i, p, params) for i, p in enumerate(PROMPTS)])
    return {
        "tokens": [c.output_ids for c in out],
        "heard": len(heard),
        "layers": len(engine.runners["main"].layers),
        "decode_steps": engine.stats.decode_steps,
        "compiled": engine.runners["main"].compiled,
        "graphs": counters["stats"]["unique_graphs"] - graphs,
    }


def test_layer_listeners_run_the_eager_body_of_a_compiled_engine(checkpoints, hf_reference):
    [r] = dist_harness.run(1, _listened, checkpoints["llama"])
    assert r["compiled"] and r["decode_steps"] > 0
    # every layer of every step told its listener, the decode steps' too, and nothing compiled
    assert r["heard"] > r["layers"] * r["decode_steps"], r
    assert r["graphs"] == 0, r
    assert r["tokens"] == hf_reference(checkpoints["llama"], PROMPTS, MAX_NEW)


def _default_runner(path: str) -> tuple[bool, bool]:
    from reshard import LLM

    default, eager = LLM(path), LLM(path, enforce_eager=True)
    return tuple(all(not r.compiled for r in llm.engine.runners.values()) for llm in (default, eager))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default compiles on CUDA")
def test_llms_default_runs_eagerly_on_this_cpu_as_enforce_eager_does(checkpoints):
    assert dist_harness.run(1, _default_runner, checkpoints["llama"])[0] == (True, True)


def _released(path: str, compile: bool | None) -> dict:
    """Tokens before and after ``release_memory``, whether the runner decodes compiled before and
    after, and the graphs compiled by the second call; a default ``compile`` (None) is taken as
    this were a CUDA device (the patched ``compiles``), so its graphs are compiled here too."""
    from unittest import mock

    from torch._dynamo.utils import counters

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize

    as_cuda = lambda self, device_type, microbatches=1: self.compile is not False  # noqa: E731
    with mock.patch.object(EngineConfig, "compiles", as_cuda):
        engine = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=32, compile=compile))
    runner, params = engine.runners["main"], SamplingParams(max_new_tokens=MAX_NEW)
    requests = [Request(i, p, params) for i, p in enumerate(PROMPTS)]
    graphs = counters["stats"]["unique_graphs"]
    first, compiled = [c.output_ids for c in engine.generate(requests)], runner.compiled
    graphs = counters["stats"]["unique_graphs"] - graphs
    engine.release_memory(weights=True)
    second = [c.output_ids for c in engine.generate(requests)]
    return {
        "equal": first == second,
        "compiled": (compiled, runner.compiled),
        "graphs": graphs,
        "compile_seconds": runner.compile_seconds,
    }


def test_an_engine_that_released_its_memory_decodes_eagerly_unless_compile_was_asked(checkpoints):
    """A default ``compile`` stops compiling once the engine's memory moved (an RL loop releases
    it every iteration: CUDA graphs would re-record each time); ``compile=True`` keeps compiling."""
    default = dist_harness.run(1, _released, checkpoints["llama"], None)[0]
    assert default["compiled"] == (True, False) and default["equal"], default
    assert default["graphs"] > 0 and default["compile_seconds"] > 0, default  # (its compile still reported)
    asked = dist_harness.run(1, _released, checkpoints["llama"], True)[0]
    assert asked["compiled"] == (True, True) and asked["equal"], asked


def _asked_with(path: str) -> list:
    """The ``(device type, micro-batches)`` a runner of 2 micro-batches settles its compile with."""
    from unittest import mock

    from reshard.parallel import Engine, EngineConfig, parallelize

    asked = []
    record = lambda self, device_type, microbatches=1: asked.append((device_type, microbatches)) or False  # noqa: E731
    with mock.patch.object(EngineConfig, "compiles", record):
        Engine(parallelize(path), EngineConfig(max_batch_size=4, max_seq_len=32, num_microbatches=2)).close()
    return asked


def test_a_runner_settles_compile_by_its_micro_batches_and_seesaws_decode_by_its_own(checkpoints):
    """The runner asks with its micro-batches (a pipeline stage's several would each replay a CUDA
    graph over the last one's outputs); Seesaw's decode layout compiles only when asked."""
    from reshard.parallel import EngineConfig
    from reshard.parallel.strategies.seesaw.policy import _runner_config

    assert dist_harness.run(1, _asked_with, checkpoints["llama"])[0] == [("cpu", 2)]
    assert _runner_config(EngineConfig(), "decode", 1, 1).compile is False
    assert _runner_config(EngineConfig(compile=True), "decode", 1, 1).compile is True
