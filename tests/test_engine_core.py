"""The engine core's plug-in interface: a strategy written only against it, the engine's events."""

from dataclasses import dataclass

import pytest

from reshard.parallel import ParallelDims
from reshard.parallel.engine import (
    ContinuousBatching,
    Engine,
    EngineConfig,
    ModelRunner,
    Strategy,
    TokenSplit,
    register_strategy,
)
from tests import dist_harness
from tests.test_generate import MAX_NEW, _prompts


# ---- a toy strategy, written against the public plug-in interface only -------------------------
class Alternating(ContinuousBatching):
    """Switch between two layouts every ``every`` steps, whatever the batch."""

    def __init__(self, layouts: tuple[str, str], every: int) -> None:
        super().__init__(layouts[0])
        self.layouts = layouts
        self.every = every
        self.steps = 0
        self.switches = 0

    def layout_for(self, seqs, num_tokens) -> str:
        self.steps += 1
        return self.layouts[(self.steps - 1) // self.every % 2]

    def on_switch(self, old, new) -> None:
        self.switches += old is not None


@register_strategy("toy_alternating")
@dataclass
class AlternatingStrategy(Strategy):
    """Ulysses SP and full TP over all ranks (one KV cache), alternating every ``every`` steps."""

    every: int = 2

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(sp=world_size, world_size=world_size)

    def build(self, path, config: EngineConfig) -> Engine:
        import torch.distributed as dist

        from reshard.layers.ulysses import SHIFT_WEIGHTS
        from reshard.parallel.strategies.shift import parallelize_shift

        dims = self.dims(dist.get_world_size())
        model = parallelize_shift(path, dims)
        sp = ModelRunner(model, config, split=TokenSplit(model.model.embed_tokens.weight.device_mesh, 0))
        tp = ModelRunner(model, config, kv=sp.kv, weights=SHIFT_WEIGHTS)
        return Engine(runners={"sp": sp, "tp": tp}, policy=Alternating(("sp", "tp"), self.every))

    def summary(self, engine: Engine) -> dict:
        return {"switches": engine.policy.switches, "steps": engine.policy.steps}


def _toy_job(path, prompts, max_new):
    from reshard.parallel import Request, SamplingParams
    from reshard.parallel.engine import make_strategy

    strategy = make_strategy({"strategy": "toy_alternating", "every": 3})
    engine = strategy.build(path, EngineConfig(max_batch_size=4, max_seq_len=128))
    requests = [Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(prompts)]
    tokens = [c.output_ids for c in engine.generate(requests)]
    return tokens, strategy.summary(engine)


def test_toy_strategy_on_the_plugin_interface_matches_hf(checkpoints, hf_reference):
    path, prompts = checkpoints["llama"], _prompts()
    expected = hf_reference(path, prompts, MAX_NEW)
    for tokens, summary in dist_harness.run(2, _toy_job, path, prompts, MAX_NEW):
        assert tokens == expected
        assert summary["switches"] >= summary["steps"] // 3 - 1 >= 3


def test_unknown_strategy_and_keys_are_named():
    from reshard.parallel.engine import make_strategy
    from reshard.recipes.schema import compose, strategy_config

    with pytest.raises(ValueError, match=r"parallel.strategy 'nope' is not one of \[.*'seesaw', 'shift'"):
        make_strategy({"strategy": "nope"})
    with pytest.raises(ValueError, match=r"^parallel.tp: Key 'tp' not in 'AlternatingStrategy' \(given 2\)"):
        strategy_config({"strategy": "toy_alternating", "tp": 2})
    # a registered strategy without a YAML is a Hydra option of its own schema
    assert compose("generate", ["parallel=toy_alternating", "parallel.every=3"]).parallel == AlternatingStrategy(
        every=3
    )
    with pytest.raises(ValueError, match=r"^parallel.tp: Key 'tp' not in 'AlternatingStrategy' \(given 2\)"):
        compose("generate", ["parallel=toy_alternating", "+parallel.tp=2"])
    with pytest.raises(
        ValueError, match=r"^parallel: 'nope' is not one of \[.*'seesaw', 'shift', 'sidp', 'toy_alternating', 'tp'\]"
    ):
        compose("generate", ["parallel=nope"])


# ---- events at layer and step edges ------------------------------------------------------------
def _hooked(path, prompts, zero_last_layer):
    import torch.distributed as dist

    from reshard.parallel import Request, SamplingParams, parallelize

    model = parallelize(path, ParallelDims.from_world(tp=dist.get_world_size()))
    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=128))
    events = []
    runner, on = engine.runner, engine.events.on
    on("step_begin", lambda step, seqs: events.append(("begin", step.kind, len(seqs))))
    on("step_end", lambda step, seqs: events.append(("end", step.kind, len(seqs))))
    on("layer_before", lambda i, h, ctx: events.append(("before", i)))
    last = runner.layer_ids[-1]
    on("layer_after", lambda i, h, ctx: h * 0 if zero_last_layer and i == last else events.append(("after", i)))
    requests = [Request(i, p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts)]
    tokens = [c.output_ids for c in engine.generate(requests)]
    s = engine.stats
    return tokens, events, s.prefill_steps + s.mixed_steps + s.decode_steps, runner.layer_ids


def test_layer_and_step_events_fire_in_order_and_can_replace_hidden_states(checkpoints, hf_reference):
    path, prompts = checkpoints["qwen3"], _prompts(3)
    tokens, events, steps, layers = dist_harness.run(2, _hooked, path, prompts, False)[0]
    assert tokens == hf_reference(path, prompts, 4)  # hooks that return nothing change nothing
    per_step = [("before", i) if k == 0 else ("after", i) for i in layers for k in (0, 1)]
    begins = [n for n, e in enumerate(events) if e[0] == "begin"]
    assert len(begins) == steps
    for n in begins:
        assert events[n + 1 : n + 1 + len(per_step)] == per_step
        assert events[n + 1 + len(per_step)][0] == "end"
    zeroed, *_ = dist_harness.run(2, _hooked, path, prompts, True)[0]
    assert all(len(set(t)) == 1 for t in zeroed) and zeroed != tokens  # every hidden state zeroed


# ---- admission order -----------------------------------------------------------------------------
def _admission(path, prompts, budgets, admission):
    from reshard.parallel import Request, SamplingParams, parallelize

    engine = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=128, admission=admission))
    requests = [
        Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, budgets))
    ]
    return [c.output_ids for c in engine.generate(requests)], engine.stats.decode_steps


def test_longest_first_admission_same_tokens_fewer_steps(checkpoints):
    """Budgets 10, 10, 20 on 2 slots: FIFO decodes 0 and 1, then 2 alone (28 steps);
    longest-first starts 2 at once and overlaps the others with it (19 steps)."""
    path = checkpoints["llama"]
    prompts = _prompts(3)
    budgets = [10, 10, 20]
    fifo, fifo_steps = dist_harness.run(1, _admission, path, prompts, budgets, "fifo")[0]
    lpt, lpt_steps = dist_harness.run(1, _admission, path, prompts, budgets, "longest_first")[0]
    assert fifo == lpt and [len(t) for t in fifo] == budgets
    assert lpt_steps < fifo_steps, (lpt_steps, fifo_steps)
    with pytest.raises(ValueError, match=r"admission must be one of \('fifo', 'longest_first'\), got 'lifo'"):
        ContinuousBatching("main", admission="lifo")
