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

    eager = {"sidp": {}, "dejavu": {}}
    compiling = {"tp": {}, "shift": {}, "seesaw": {}}
    for name, keys in {**eager, **compiling}.items():
        strategy = make_strategy({"strategy": name, **keys})
        settled = strategy.settled(default)
        assert settled.compile is (False if name in eager else None), (name, settled.compile)
        assert strategy.settled(EngineConfig(compile=True)).compile is True  # (given: the strategy refuses it)


def test_a_jobs_compile_settles_through_its_strategy_and_its_summary_says_what_ran():
    from reshard.recipes.schema import compose

    assert compose("generate", []).engine_config().compile is None
    assert compose("generate", ["parallel=dejavu"]).engine_config().compile is False
    assert compose("generate", ["compile=false"]).engine_config().compile is False
    assert compose("generate", ["compile=true"]).engine_config().compile is True


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
