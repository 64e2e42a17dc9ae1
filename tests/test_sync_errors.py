"""A weight sync's user errors end every rank the same way (issue 59): a bad step, whichever ranks
give it, is one ValueError on every rank; generating during a background sync is refused on every
rank alike; and a script that ends on either error exits with status 1 and the error last, with no
rank left waiting and no abort at exit (``terminate called without an active exception``)."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import dist_harness

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    """``bench/error_exits.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("error_exits", ROOT / "bench" / "error_exits.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


# ---- whole scripts, two fresh processes each: how every rank ends ------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["step_tensor", "step_tensor_on_rank0", "generate_during_sync"])
def test_a_script_ending_on_a_sync_error_exits_1_with_one_line_on_every_rank(checkpoints, case):
    """Before: a tensor step on rank 0 alone left rank 1 in the step's all-gather (it died with
    gloo's "Connection closed by peer", or waited); generating during a sync aborted at exit in 2
    of 4 runs (the sync's thread ended inside gloo) and in the others one rank or both generated
    (the refusal hung on how far each rank's thread had got)."""
    bench = _bench()
    run = bench.run_once(case, checkpoints["llama"], timeout=200)
    lines = run.last_lines()
    assert run.returncodes == [1, 1], (run.returncodes, lines)
    for rank, err in enumerate(run.stderrs):
        assert "terminate called" not in err, f"rank {rank}:\n{err}"
        assert err.count("Traceback (most recent call last):") == 1, f"rank {rank}:\n{err}"
    assert lines[0] == lines[1] and lines[0].startswith(bench.CASES[case]), lines
    assert run.left == set()
    assert bench.classify(case, run).kind == "clean"


# ---- the same checks inside one job: every rank raises, the job goes on ---------------------------------
def _tiny_sync(**kwargs):
    """A WeightSync of one 4x4 tensor, whole on every rank, into a whole copy on every rank."""
    from reshard.sync import WeightSync

    return WeightSync({"w": torch.arange(16.0).view(4, 4)}, {"w": torch.zeros(4, 4)}, **kwargs)


def _bad_steps():
    """The errors of: a tensor step on rank 0 only (sync, then start), different int steps; then
    a good sync: the ranks are still in step."""
    import torch.distributed as dist

    sync, errors = _tiny_sync(), []
    for call, step in ((sync.sync, torch.tensor(3)), (sync.start, torch.tensor(3)), (sync.sync, 7)):
        try:
            call(step if dist.get_rank() == 0 else 3)
        except ValueError as e:
            errors.append(str(e))
    sync.sync(4)
    return errors, True


@pytest.mark.timeout(120)
def test_a_bad_step_on_one_rank_is_the_same_error_on_every_rank():
    for errors, synced in dist_harness.run(2, _bad_steps, timeout=90):
        assert errors == [
            "step must be an int, got Tensor tensor(3) (rank 0)",
            "step must be an int, got Tensor tensor(3) (rank 0)",
            "ranks sync different steps: rank 0 step 7 vs rank 1 step 3",
        ]
        assert synced


def _different_arguments():
    """The errors of WeightSyncs whose ranks disagree on an argument or where one rank's is wrong."""
    import torch.distributed as dist

    rank, errors = dist.get_rank(), []
    for kwargs in ({"bucket_bytes": 4096 * (rank + 1)}, {"method": "planned" if rank == 0 else "fastest"}):
        try:
            _tiny_sync(**kwargs)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.timeout(120)
def test_ranks_building_a_sync_differently_get_one_error_on_every_rank():
    """Before: different bucket sizes planned different rounds (a wait or wrong bytes); a bad
    method on rank 1 alone left rank 0 waiting in the layout exchange."""
    for errors in dist_harness.run(2, _different_arguments, timeout=90):
        assert errors == [
            "ranks built the WeightSync with different arguments: bucket_bytes=4096 on rank 0 vs "
            "bucket_bytes=8192 on rank 1",
            "weight sync method must be one of ('planned', 'full_tensor', 'broadcast'), got 'fastest' (rank 1)",
        ]


def _refused_until_waited(path):
    """Start a sync into a TP2 rollout model, wait until every rank's thread has finished, then
    generate (refused?), wait(), generate again: what each step gave."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from reshard.parallel import Engine, EngineConfig, Request, SamplingParams
    from reshard.parallel.model.weight_sync import model_sync
    from reshard.parallel.strategies.rollout import rollout_model

    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rollout = rollout_model(path, "tp", [0, 1])
    engine = Engine(rollout, EngineConfig(max_batch_size=2, max_seq_len=32))
    request = [Request(0, [5, 6], SamplingParams(max_new_tokens=2))]
    handle = model_sync(trained, rollout).start(5)
    while not handle.done():
        time.sleep(0.01)
    dist.barrier()  # every rank's sync thread has finished writing
    out = {}
    try:
        engine.generate(request)
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    handle.wait(timeout=60)
    out["version"] = rollout.parallel_info.weight_version.step
    out["generated"] = len(engine.generate(request))
    return out


@pytest.mark.timeout(180)
def test_a_finished_background_sync_refuses_generation_on_every_rank_until_waited(checkpoints):
    """The refusal depends on the calls (start, then wait), never on how far each rank's thread
    got: before, a rank whose thread had finished generated while its peer refused."""
    for out in dist_harness.run(2, _refused_until_waited, checkpoints["llama"]):
        assert out["refused"] is not None and out["refused"].startswith(
            "the weights are half-synced: step 5 is being written over the loaded weights"
        )
        assert out["version"] == 5 and out["generated"] == 1


# ---- the mechanism: an exit waits for a background call ---------------------------------------------
_EXIT_SCRIPT = """
import sys, time
from reshard.background import Background

def slow():
    time.sleep(1.0)
    open(sys.argv[1], "w").write("finished")

Background(slow, "reshard-test", "a slow call", exit_wait=30.0)
raise RuntimeError("the caller's error")
"""


@pytest.mark.timeout(60)
def test_an_exit_waits_for_a_background_call_then_ends_with_the_callers_error(tmp_path):
    marker = tmp_path / "finished"
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(marker)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "RuntimeError: the caller's error"
    assert marker.read_text() == "finished"  # the call ran to its end before the interpreter finalized
