"""MoE checkpoints and expert parallelism that do not fit are refused in one line, never loaded as
something else and never left waiting: a ``config.json`` declaring more experts than its
safetensors hold (under a second key transformers silently overrides, or under its only key), an
expert tensor of the wrong shape under EP2 (refused by every rank before the first collective, so
one rank alone gets the error; ``reshard generate`` says it in one line every run), and ``ep`` on
a dense model."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dist_harness

ROOT = Path(__file__).resolve().parents[1]
BAD_TENSOR = "model.layers.1.mlp.experts.2.up_proj.weight"
SHAPE = r"is \[31, 64\] torch.float32 but parameter 'model.layers.1.mlp.experts.up_proj' is \[48, 64\]"


def _bench_loop():
    """``bench/bad_inputs_loop.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bad_inputs_loop", ROOT / "bench" / "bad_inputs_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _declaring(src: Path, dst: Path, **keys: int) -> str:
    """A copy of checkpoint ``src`` whose config.json sets ``keys`` (after its own)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **keys}))
    return str(dst)


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """Qwen3-MoE and Mixtral checkpoints of 4 experts whose config.json says 6, and a Qwen3-MoE of 8
    experts whose ``BAD_TENSOR`` is (31, 64) instead of (48, 64)."""
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("moe-bad")
    qwen = make_tiny_checkpoint("qwen3_moe", root / "qwen3_moe-4", seed=0, num_experts=4)
    mixtral = make_tiny_checkpoint("mixtral", root / "mixtral-4", seed=0, num_local_experts=4)
    return {
        "qwen_second_key": _declaring(qwen, root / "qwen-second-key", num_experts=6),  # beside num_local_experts 4
        "mixtral_only_key": _declaring(mixtral, root / "mixtral-only-key", num_local_experts=6),
        "misshapen": str(_bench_loop().misshapen_expert_checkpoint(root / "misshapen")),
    }


def test_a_config_declaring_6_experts_over_files_of_4_is_refused_naming_both(bad):
    from reshard import LLM

    second = r"declares num_experts = 6 experts, but the model transformers builds from it has 4 "
    second += r"\(num_local_experts = 4\) and the safetensors hold 4 per MoE layer"
    with pytest.raises(ValueError, match=second):
        LLM(bad["qwen_second_key"], max_seq_len=64)
    only = r"lacks expert tensor '.*experts\.4\.w1\.weight' .*: config.json declares 6 experts, the checkpoint holds 4"
    with pytest.raises(ValueError, match=only):
        LLM(bad["mixtral_only_key"], max_seq_len=64)


def _alone_on_rank0(path: str) -> tuple[str, int] | None:
    """Rank 0 alone loads ``path`` in an EP2 x TP2 layout (rank 1 does nothing): its refusal and
    how many device meshes (each collective on first use) it made before it."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from reshard.parallel.model.dims import ParallelDims
    from reshard.parallel.model.parallelize import parallelize

    if dist.get_rank() != 0:
        return None
    made, init = [], DeviceMesh.__init__

    def counted(self, *args, **kwargs) -> None:
        made.append(args)
        init(self, *args, **kwargs)

    with mock.patch.object(DeviceMesh, "__init__", counted):
        try:
            parallelize(path, ParallelDims(tp=2, ep=2, world_size=2))
        except ValueError as e:
            return str(e), len(made)
    return "loaded", len(made)


@pytest.mark.timeout(150)
def test_a_misshapen_expert_is_refused_before_any_mesh_is_made(bad):
    """Every tensor is checked before the first collective: a rank refuses without its peers."""
    (message, meshes), nothing = dist_harness.run(2, _alone_on_rank0, bad["misshapen"], timeout=90, fresh=True)
    assert nothing is None and meshes == 0
    assert BAD_TENSOR in message and re.search(SHAPE, message), message


def _refusal(path: str, **kw) -> str:
    """This rank's ``ValueError`` from ``LLM(path, **kw)`` (``"loaded"`` if none)."""
    from reshard import LLM

    try:
        LLM(path, max_seq_len=64, **kw).close()
    except ValueError as e:
        return str(e)
    return "loaded"


@pytest.mark.timeout(150)
def test_a_misshapen_expert_under_ep2_and_ep_on_a_dense_model_are_refused_on_every_rank(bad, checkpoints):
    shape = dist_harness.run(2, _refusal, bad["misshapen"], tp=2, ep=2, timeout=90)
    assert shape[0] == shape[1] and BAD_TENSOR in shape[0] and re.search(SHAPE, shape[0]), shape
    dense = dist_harness.run(2, _refusal, checkpoints["llama"], tp=2, ep=2, timeout=90)
    assert dense[0] == dense[1], dense
    assert dense[0] == (
        "ep (2) splits a mixture-of-experts model's experts over ranks, but LlamaForCausalLM "
        "(model_type 'llama') has no experts: leave ep at 1"
    )


def test_ep_on_a_dense_model_in_memory_is_refused():
    from transformers import AutoModelForCausalLM

    from reshard.parallel.model.dims import ParallelDims
    from reshard.parallel.model.parallelize import parallelize
    from reshard.parallel.model.tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    with pytest.raises(ValueError, match=r"^ep \(2\) splits .*\(model_type 'qwen3'\) has no experts"):
        parallelize(model, ParallelDims(tp=2, ep=2, world_size=2))


@pytest.mark.timeout(420)
def test_reshard_generate_refuses_a_misshapen_expert_under_ep2_in_one_line_each_run(bad, tmp_path):
    """The bench loop (``python bench/bad_inputs_loop.py --runs 20`` for the issue's count), twice,
    on the module's misshapen checkpoint (the loop's own ``misshapen_expert_checkpoint`` made it)."""
    loop = [sys.executable, str(ROOT / "bench" / "bad_inputs_loop.py"), "--checkpoint", bad["misshapen"]]
    run = subprocess.run(
        [*loop, "--runs", "2", "--timeout", "150"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 runs: 2 refused in one line (exit 2), 0 hung (> 150 s), 0 other" in run.stdout, run.stdout
