import gc
import os
import sys
from pathlib import Path

import pytest

gc.disable()  # the test modules' imports without the cyclic collector, resumed once they are collected

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "reshard" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's CPU codegen takes the vector ISA the CPU's flags name, without compiling and loading a
# probe library per ISA (8 s the first time a cache directory is used, then a python started per
# probe, about 1.2 s, in every process that compiles): 88 -> 68 s for the four compiled-decode tests
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ROOT = Path(__file__).resolve().parent.parent


def _compile_sources() -> None:
    """The package's bytecode, written once: where Python writes none itself
    (``PYTHONDONTWRITEBYTECODE``, as on this machine), every launcher, rank and fork server a
    test starts would compile the ~100 modules it imports anew (about 0.3 s of CPU a process, and
    the suite starts hundreds); each reads these instead (checked against its source's mtime)."""
    import compileall

    for folder in ("reshard", "parallel", "layers", "recipes", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=1)


_compile_sources()


def pytest_collection_finish(session) -> None:
    """The test modules' imports (torch, transformers) are never garbage: the session's cyclic
    collections skip them from here on, as every rank's do (:func:`reshard.recipes.exits.freeze_heap`,
    which resumes the collector paused above)."""
    from reshard.recipes.exits import freeze_heap

    freeze_heap()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """A test file's last test ends the harness's pools; the next file that needs one forks it
    afresh (0.2-0.5 s). A pool kept through other files' own jobs is not idle: gloo's threads of
    every group its jobs made take about 0.16% of a core per group and rank, which those jobs need."""
    harness = sys.modules.get("tests.dist_harness")
    if harness is not None and (nextitem is None or nextitem.path != item.path):
        harness.shutdown_all()


@pytest.fixture(scope="session", autouse=True)
def reshard_cache(tmp_path_factory) -> Path:
    """The session's ``RESHARD_CACHE``, which every job and process pool inherits, holding the
    built-in checkpoint: made once here, read by every job (making it takes a rank seconds of CPU,
    and its writer's progress bar would be in the job's output). A test whose subject is the
    making names a cache of its own."""
    from reshard.parallel.model.tiny_models import builtin_checkpoint

    root = tmp_path_factory.mktemp("reshard-cache")
    os.environ["RESHARD_CACHE"] = str(root)
    builtin_checkpoint(root)
    return root


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny seeded checkpoints per family, plus ``llama-multi``: the llama model in several files."""
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {f: str(make_tiny_checkpoint(f, root / f, seed=0)) for f in FAMILIES}
    paths["llama-multi"] = str(make_tiny_checkpoint("llama", root / "llama-multi", seed=0, max_shard_size="100KB"))
    return paths


@pytest.fixture(scope="session")
def four_layer(tmp_path_factory) -> dict[str, str]:
    """4-layer checkpoints of every family, for pipeline stages (P4, D2P2, T2P2)."""
    from reshard.parallel.model.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("pp")
    return {f: str(make_tiny_checkpoint(f, root / f, seed=0, num_hidden_layers=4)) for f in FAMILIES}


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(path, prompts, max_new_tokens)``: HF ``generate`` per prompt (greedy, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def generate(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model = cache[path]
        outs = []
        for p in prompts:
            with torch.no_grad():
                seq = model.generate(
                    torch.tensor([p]),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                )
            outs.append(seq[0, len(p) :].tolist())
        return outs

    return generate
