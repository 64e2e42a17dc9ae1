"""The KV connector (``parallel/engine/connector.py``): a request resumed mid-generation with
its KV supplied from elsewhere computes only what the connector lacks and gives HF's tokens;
while its KV is awaited the engine takes wait steps and it keeps its place."""

import pytest
import torch

from tests import dist_harness

MAX_NEW = 8
RESUME_AT = 3  # output tokens a request had when its engine handed it over
LAG = 2  # positions before the last whose KV the connector lacks (a mirror a step or two behind)
WAITS = 2  # agreed steps a request's KV takes to land once asked for


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in (9, 14, 6)]


def _resumed_elsewhere(path: str, prompts: list[list[int]], paged: bool) -> dict:
    """Engine A generates every prompt; engine B (its own cache, paged or not) takes each
    request resumed after ``RESUME_AT`` tokens with its KV copied from A's slot by a connector
    that holds all but the last ``LAG`` + 1 positions, which land ``WAITS`` agreed steps after
    the first ask (each step's agreement carries "landed here" for every awaited request)."""
    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams, parallelize
    from reshard.parallel.engine.connector import KVConnector

    params = SamplingParams(max_new_tokens=MAX_NEW)
    a = Engine(parallelize(path), EngineConfig(max_batch_size=len(prompts), max_seq_len=64))
    slots: dict[int, int] = {}
    a.events.on("step_agreed", lambda i, step, tokens: slots.update((s.request.id, s.slot) for s in step.seqs))
    done = a.generate([Request(i, p, params) for i, p in enumerate(prompts)])

    class CopiedKV(KVConnector):
        """KV of engine A's slots (A's run is over: its cache holds every computed position)."""

        def __init__(self) -> None:
            self.steps: dict[int, int] = {}  # request id -> agreed steps since its first ask
            self.loads: list[tuple[int, int]] = []
            self.waited: list[tuple[int, int]] = []  # (request the policy waited for, sequences running)

        def matched_tokens(self, seq) -> int | None:
            if seq.request.kv_source != "A":
                return 0
            return None if self.steps.setdefault(seq.request.id, 0) < WAITS else seq.prompt_len - 1 - LAG

        def agree(self) -> dict:
            return {str(rid): (lambda: 1) for rid, n in self.steps.items() if n < WAITS}

        def agreed(self, sums) -> None:
            for rid, total in sums.items():
                self.steps[int(rid)] += total  # one rank: each agreed step adds 1

        def wait_for(self, request) -> None:
            self.waited.append((request.id, len(b.policy.running)))

        def load(self, seq, num_tokens: int) -> None:
            if b.kv.spec.paged:
                b.kv.assign(seq.slot, seq.blocks)
            for layer in range(b.kv.spec.num_layers):
                b.kv.write_slot(layer, seq.slot, *a.kv.read_slot(layer, slots[seq.request.id], num_tokens))
            self.loads.append((seq.request.id, num_tokens))

    kv = {"kv_block_size": 4, "kv_tokens": 128} if paged else {}
    b = Engine(parallelize(path), EngineConfig(max_batch_size=2, max_seq_len=64, **kv))
    b.connector.add(connector := CopiedKV())
    steps: list[tuple[str, list[int], list[int]]] = []  # (kind, request ids, tokens fed) per step
    b.events.on("step_ready", lambda i, s: steps.append((s.kind, [q.request.id for q in s.seqs], list(s.num_tokens))))
    fresh = Request(len(prompts), prompts[0], params)  # queued behind the resumed ones: computed whole
    resumed = [Request(i, p, params).resume(c.output_ids[:RESUME_AT]) for i, (p, c) in enumerate(zip(prompts, done))]
    handed = [Request(r.id, r.prompt_ids, r.sampling, resumed=r.resumed, kv_source="A") for r in resumed]
    again = b.generate([*handed, fresh])
    return {
        "a": [c.output_ids for c in done],
        "b": [c.output_ids for c in again],
        "prompts_b": [c.prompt_ids for c in again],
        "steps": steps,
        "loads": connector.loads,
        "waited": connector.waited,
    }


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_request_resumed_with_its_kv_from_a_connector_matches_hf(checkpoints, hf_reference, paged):
    path, prompts = checkpoints["llama"], _prompts()
    (run,) = dist_harness.run(1, _resumed_elsewhere, path, prompts, paged)
    expected = hf_reference(path, prompts, MAX_NEW)
    assert run["a"] == expected
    assert run["b"] == [*expected, expected[0]] and run["prompts_b"] == [*prompts, prompts[0]]
    # each resumed request loaded all but its last LAG + 1 positions, once
    lengths = [len(p) + RESUME_AT for p in prompts]
    assert sorted(run["loads"]) == [(i, n - 1 - LAG) for i, n in enumerate(lengths)]
    kinds = [kind for kind, _, _ in run["steps"]]
    # nothing ran while the head's KV was awaited: the policy waited in the connector (only ever
    # with nothing running), then took wait steps whose agreements landed it
    assert kinds[:WAITS] == ["wait"] * WAITS and kinds[WAITS] != "wait"
    assert run["waited"][0] == (0, 0) and all(running == 0 for _, running in run["waited"])
    # the resumed requests' first step fed only what the connector lacked (LAG + 1 positions)
    first: dict[int, int] = {}
    for _, ids, counts in run["steps"]:
        for rid, n in zip(ids, counts):
            first.setdefault(rid, n)
    assert all(first[i] == LAG + 1 for i in range(len(prompts))), first
    assert first[len(prompts)] == len(prompts[0])  # the fresh request: its whole prompt
