"""The main job: Hydra config, validation of overrides, outputs, and a real torchrun launch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dist_harness


def _compose(overrides):
    from reshard.recipes.schema import compose

    return compose("generate", overrides)


def _run_recipe(overrides, run_dir):
    from reshard.recipes.generate import run_generate

    return run_generate(_compose(overrides), Path(run_dir))


def _run_recipe_keeping_timings(overrides, run_dir):
    """The recipe, and the milestones of each completion its engine returned, by request id."""
    from reshard.parallel.engine import Engine

    generate, timings = Engine.generate, {}

    def recorded(self, *args, **kwargs):
        completions = generate(self, *args, **kwargs)
        timings.update({c.id: c.timing for c in completions})
        return completions

    Engine.generate = recorded
    try:
        return _run_recipe(overrides, run_dir), timings
    finally:
        Engine.generate = generate  # the harness's processes run later tests


@pytest.mark.parametrize(
    "override,message",
    [
        ("generation.temperature=-1", r"generation.temperature must be >= 0, got -1"),
        ("generation.top_p=1.5", r"generation.top_p must be in \(0, 1\], got 1.5"),
        (
            "workload.prompt_len_max=600 engine.max_seq_len=512",  # (null, the default: the model's, checked at run)
            r"workload.prompt_len_max \(600\) \+ generation.max_new_tokens \(32\) = 632 exceeds "
            r"engine.max_seq_len \(512\)",
        ),
        ("workload.prompt_len_min=50 workload.prompt_len_max=10", r"prompt_len_min \(50\)"),
        ("parallel.strategy=magic", r"parallel.strategy: Key 'strategy' not in 'TPStrategy' \(given 'magic'\)"),
        # the test toy strategy is registered too when tests/test_engine_core.py ran first
        (
            "parallel=magic",
            r"parallel: 'magic' is not one of \['dejavu', 'seesaw', 'shift', 'sidp', ('toy_alternating', )?'tp'\]",
        ),
        ("engine.max_batch_size=0", r"engine.max_batch_size must be >= 1, got 0"),
        ("workload.rate=0", r"workload.rate must be > 0 requests/s \(or null: offline\), got 0"),
        ("workload.burst=0", r"workload.burst must be >= 1, got 0"),
        ("engine.replicas=sometimes", r"engine.replicas must be one of \['lockstep', 'groups'\], got 'sometimes'"),
        ("engine.routing=random", r"engine.routing must be one of \['least_loaded', .*\], got 'random'"),
        ("parallel=shift parallel.shift_weights=mirror", r"parallel.shift_weights must be copy or slice, got 'mirror'"),
        ("parallel=shift parallel.threshold=-5", r"parallel.threshold must be >= 0, got -5"),
        ("parallel=seesaw parallel.weights=copy", r"parallel.weights must be move or reload, got 'copy'"),
        ("parallel=seesaw parallel.scheduler=fifo", r"parallel.scheduler 'fifo' is not one of"),
        ("parallel=seesaw parallel.cpu_kv_budget=0", r"parallel.cpu_kv_budget must be >= 1, got 0"),
        ("parallel=seesaw +parallel.prefill.sp=2", r"parallel.prefill.sp: Key 'sp' not in 'LayoutConfig' \(given 2\)"),
        # types: Hydra checks every value against its config field (the dataclasses), the key named
        ("compile=maybe", r"^compile: Value 'maybe' is not a valid bool"),
        ("progress=maybe", r"^progress: Value 'maybe' is not a valid bool"),
        ("workload.num_requests=abc", r"^workload.num_requests: Value 'abc' could not be converted to Integer"),
        ("generation.temperature=hot", r"^generation.temperature: Value 'hot' could not be converted to Float"),
        ("generation.seed=abc", r"^generation.seed: Value 'abc' could not be converted to Integer"),
        ("engine.max_batch_size=true", r"^engine.max_batch_size: Value 'True' could not be converted to Integer"),
        ("parallel.tp=two", r"^parallel.tp: Value 'two' could not be converted to Integer"),
        (
            "parallel=shift parallel.threshold=1.5",
            r"^parallel.threshold: Value '1.5' could not be converted to Integer",
        ),
        (
            "parallel=seesaw parallel.cpu_kv_budget=lots",
            r"^parallel.cpu_kv_budget: Value 'lots' could not be converted to Integer",
        ),
        ("+engine.slots=4", r"^engine.slots: Key 'slots' not in 'EngineConfig' \(given 4\)"),
        ("+slots=4", r"^slots: Key 'slots' not in 'GenerateConfig' \(given 4\)"),
        ("engine.slots=4", r"^engine.slots: Key 'slots' not in 'EngineConfig' \(given '4'\)"),
        ("+parallel.sp=2", r"^parallel.sp: Key 'sp' not in 'TPStrategy' \(given 2\)"),
        ("engine.admission=lifo", r"engine.admission must be one of \['fifo', 'longest_first'\], got 'lifo'"),
    ],
)
def test_bad_override_values_raise_value_error(override, message):
    with pytest.raises(ValueError, match=message):
        _compose(override.split())


def test_defaults_compose():
    cfg = _compose([])
    assert cfg.model.path is None and cfg.parallel.strategy == "tp" and cfg.generation.temperature == 0


def test_workload_rate_gives_seeded_poisson_arrivals(tmp_path):
    from reshard.recipes.prompts import build_requests

    cfg = _compose(["workload.rate=50", "workload.num_requests=200", "workload.seed=4"])
    arrivals = [r.arrival for r in build_requests(cfg, tmp_path, 256)]
    again = [r.arrival for r in build_requests(cfg, tmp_path, 256)]
    assert arrivals == again == sorted(arrivals) and arrivals[0] > 0  # seeded, ascending
    assert 200 / arrivals[-1] == pytest.approx(50, rel=0.25)  # about the asked rate
    bursts = [r.arrival for r in build_requests(_compose(["workload.rate=50", "workload.burst=4"]), tmp_path, 256)]
    assert bursts[:4] == [bursts[0]] * 4 and bursts[4] > bursts[3]  # four at a time


def test_workload_rate_refuses_to_replace_a_files_arrivals(tmp_path):
    from reshard.recipes.prompts import build_requests

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6], "arrival": 0.0}\n{"prompt_ids": [7], "arrival": 0.5}\n')
    cfg = _compose([f"workload.prompts_file={prompts}"])
    assert [r.arrival for r in build_requests(cfg, tmp_path, 256)] == [0.0, 0.5]
    with pytest.raises(ValueError, match=r"workload.rate=4.0 would replace the arrival times of .*prompts.jsonl"):
        build_requests(_compose([f"workload.prompts_file={prompts}", "workload.rate=4"]), tmp_path, 256)


def test_tp_not_dividing_world_is_rejected(tmp_path):
    with pytest.raises(RuntimeError, match=r"parallel.tp \(3\) must divide the world size \(2\)"):
        dist_harness.run(2, _run_recipe, ["parallel.tp=3"], str(tmp_path))


def test_shift_recipe_reports_switches(checkpoints, hf_reference, tmp_path):
    path = checkpoints["llama"]
    overrides = [
        f"model.path={path}",
        "parallel=shift",
        "parallel.sp=2",
        "parallel.threshold=4",
        "workload.num_requests=5",
        "workload.prompt_len_min=3",
        "workload.prompt_len_max=20",
        "generation.max_new_tokens=6",
        "engine.max_batch_size=3",
        "progress=false",
    ]
    summary = dist_harness.run(2, _run_recipe, overrides, str(tmp_path))[0]
    assert summary["strategy"] == "shift" and summary["parallel"] == {
        "sp": {"dp": 1, "pp": 1, "sp": 2, "tp": 1, "ranks": [0, 1]},  # big steps: Ulysses SP
        "tp": {"dp": 1, "pp": 1, "sp": 1, "tp": 2, "ranks": [0, 1]},  # small steps: full TP, same ranks
    }
    assert summary["layout"] == "sp S2 / tp T2"
    assert summary["mode_switches"] >= 1 and summary["switch_bytes"] == 0
    assert summary["steps_by_mode"]["sp"] > 0 and summary["steps_by_mode"]["tp"] > 0
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    prompts = [line["prompt_ids"] for line in lines]
    assert [line["output_ids"] for line in lines] == hf_reference(path, prompts, 6)


def test_shift_sp_must_divide_world(tmp_path):
    with pytest.raises(RuntimeError, match=r"parallel.sp \(4\) must divide the world size \(2\)"):
        dist_harness.run(2, _run_recipe, ["parallel=shift", "parallel.sp=4"], str(tmp_path))


def test_recipe_outputs_match_hf(checkpoints, hf_reference, tmp_path):
    path = checkpoints["qwen3"]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts = [[5, 6, 7, 8], [9, 10, 11], [100, 3, 4, 77, 23, 1]]
    prompts_file.write_text(  # the last one arrives 0.3 s after the start: an online workload
        "\n".join(json.dumps(p) for p in prompts[:2]) + "\n" + json.dumps({"prompt_ids": prompts[2], "arrival": 0.3})
    )
    overrides = [
        f"model.path={path}",
        f"workload.prompts_file={prompts_file}",
        "generation.max_new_tokens=8",
        "progress=false",
        "parallel.tp=1",
    ]
    results = dist_harness.run(2, _run_recipe_keeping_timings, overrides, str(tmp_path / "run"))  # dp=2 x tp=1
    summaries = [summary for summary, _ in results]
    assert summaries[0]["parallel"] == {"main": {"dp": 2, "pp": 1, "sp": 1, "tp": 1, "ranks": [0, 1]}}
    assert summaries[0]["layout"] == "D2" and summaries[0]["dtype"] == "float32"
    assert summaries[0]["sampling"] == {
        "max_new_tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
        "stop_token_ids": None, "min_tokens": 0, "ignore_eos": False, "stop": None, "logprobs": None, "n": 1,
    }  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine_groups"] == 2 and summary["online"] is True  # two replicas, each its own group
    latency = summary["latency"]
    for metric in ("ttft", "tpot", "latency", "normalized", "queued"):
        assert set(latency[metric]) == {"p50", "p90", "p99", "mean"}
        assert 0 <= latency[metric]["p50"] <= latency[metric]["p90"] <= latency[metric]["p99"]
    assert latency["requests_per_s"] > 0 and latency["output_tokens_per_s"] > 0
    assert latency["units"]["ttft"] == "s" and latency["units"]["tpot"] == "s/token"
    assert (tmp_path / "run" / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # an online run's plot
    from reshard.recipes.report import latency_lines

    lines = latency_lines(latency)  # what the run printed
    assert [line.split()[0] for line in lines] == ["TTFT", "TPOT", "latency", "queued"]
    assert lines[1].split()[1:4] == ["p50", f"{latency['tpot']['p50'] * 1e3:.1f}", "ms/token"], lines
    # in order: each request's first step began once it had arrived; the last arrived at 0.3 s
    timings = results[0][1]
    assert [timings[i].arrival for i in range(3)] == [0.0, 0.0, 0.3]
    assert all(t.arrival <= t.started <= t.first_token <= t.finished for t in timings.values()), timings
    lines = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert [line["prompt_ids"] for line in lines] == prompts
    assert [line["output_ids"] for line in lines] == hf_reference(path, prompts, 8)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the package installed from a wheel (``pip install``, not editable); the
    venv sees the system site-packages for torch and the other dependencies only."""
    root = tmp_path_factory.mktemp("install")
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "wheel"),
            str(repo),
        ],
        check=True,
        cwd=root,
        capture_output=True,
    )
    wheel = next((root / "wheel").glob("reshard-*.whl"))
    python = root / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    return python


def _shadowing_user_repo(path: Path) -> Path:
    """A training repository's own ``layers.py``, ``parallel.py``, ``recipes/`` and ``conf/``: any
    import of them fails loudly, any read of the YAML fails to parse."""
    for name in ("layers.py", "parallel.py", "recipes/__init__.py", "recipes/generate.py"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"raise ImportError('the user repository\\'s {name} was imported')\n")
    (path / "conf").mkdir()
    (path / "conf" / "generate.yaml").write_text("model: [unbalanced\n")
    return path


def test_installed_package_has_one_import_root(installed, tmp_path):
    """Installed from a wheel: ``reshard.*`` imports from the venv, ``layers`` does not exist."""
    probe = "import reshard, reshard.layers, reshard.parallel, reshard.recipes.generate; print(reshard.__file__)"
    out = subprocess.run([str(installed), "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(installed.parents[1])), out.stdout  # the wheel, not the repo
    for name in ("layers", "parallel", "recipes", "conf"):
        out = subprocess.run([str(installed), "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode != 0 and f"No module named '{name}'" in out.stderr, (name, out.stderr[-500:])


def test_main_job_under_torchrun(installed, hf_reference, tmp_path):
    """The README's main command, shrunk: built-in model, 2 ranks, files written by rank 0 only;
    run from the installed wheel in a directory whose own ``layers.py``, ``parallel.py``,
    ``recipes/`` and ``conf/`` would break it if anything imported them; tokens equal HF."""
    work = _shadowing_user_repo(tmp_path / "user-repo")
    env = {**os.environ, "RESHARD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [
        str(installed),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "reshard.recipes.generate",
        "workload.num_requests=6",
        "generation.max_new_tokens=4",
        "hydra.run.dir=" + str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"outputs written to {tmp_path / 'run'}" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "model_path",
        "world_size",
        "strategy",
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "phase_seconds",
    ):
        assert key in summary
    assert summary["world_size"] == 2 and summary["requests"] == 6
    assert Path(summary["model_path"]).is_absolute()
    assert summary["model_path"].startswith(str(tmp_path / "cache"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(len(line["output_ids"]) >= 1 for line in lines)
    assert summary["generated_tokens"] == sum(len(line["output_ids"]) for line in lines)
    reference = hf_reference(summary["model_path"], [line["prompt_ids"] for line in lines], 4)
    assert [line["output_ids"] for line in lines] == reference


def test_seesaw_recipe_matches_hf_and_reports_transitions(four_layer, hf_reference, tmp_path):
    path = four_layer["llama"]
    overrides = [
        f"model.path={path}",
        "parallel=seesaw",
        "parallel.prefill.pp=2",
        "parallel.decode.tp=2",
        "parallel.cpu_kv_budget=40",
        "workload.num_requests=6",
        "workload.prompt_len_min=3",
        "workload.prompt_len_max=20",
        "generation.max_new_tokens=6",
        "engine.max_batch_size=2",
        "progress=false",
    ]
    summaries = dist_harness.run(2, _run_recipe, overrides, str(tmp_path))
    s = summaries[0]
    assert s["parallel"] == {
        "prefill": {"dp": 1, "pp": 2, "sp": 1, "tp": 1, "ranks": [0, 1]},
        "decode": {"dp": 1, "pp": 1, "sp": 1, "tp": 2, "ranks": [0, 1]},
    }
    assert s["layout"] == "P2->T2" and s["dtype"] == "float32"
    assert s["transitions"] >= 2 and s["reshard_bytes"] == s["reshard_lower_bound_bytes"] > 0
    assert s["reshard_seconds"] > 0 and s["swap_seconds"] >= 0
    rows = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    expected = hf_reference(path, [r["prompt_ids"] for r in rows], 6)
    assert [r["output_ids"] for r in rows] == expected


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.prefill.pp=3", r"parallel.prefill: dp\(1\) \* pp\(3\) \* tp\(1\) != world size \(2\)"),
        ("parallel.decode.dp=null", r"parallel.decode: at most one of dp, pp, tp may be null"),
    ],
)
def test_seesaw_bad_layouts_are_rejected(tmp_path, override, message):
    with pytest.raises(RuntimeError, match=message):
        dist_harness.run(2, _run_recipe, ["parallel=seesaw", override], str(tmp_path))


def test_collective_timeout_is_configurable(monkeypatch):
    import datetime

    from reshard.recipes.generate import collective_timeout

    assert collective_timeout() == datetime.timedelta(minutes=10)
    monkeypatch.setenv("RESHARD_COLLECTIVE_TIMEOUT", "42")
    assert collective_timeout() == datetime.timedelta(seconds=42)
    monkeypatch.setenv("RESHARD_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(
        ValueError, match=r"RESHARD_COLLECTIVE_TIMEOUT must be a positive number of seconds, got 'soon'"
    ):
        collective_timeout()


def test_user_error_under_torchrun_is_one_line(tmp_path):
    """A config error is printed once, as one line, with no Python traceback from any rank."""
    env = {**os.environ, "RESHARD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "reshard.recipes.generate",
        "generation.temperature=hot",
        "hydra.run.dir=" + str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode != 0
    line = "error: generation.temperature: Value 'hot' could not be converted to Float"
    assert proc.stderr.count(line) == 1, proc.stderr[-2000:]
    assert "recipes/generate.py" not in proc.stderr  # no rank printed a traceback of ours


def test_checkpoint_with_unused_tensors_needs_the_opt_in(checkpoints, tmp_path):
    import shutil

    shutil.copytree(checkpoints["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    overrides = [
        f"model.path={tmp_path / 'm'}",
        "workload.num_requests=2",
        "generation.max_new_tokens=2",
        "progress=false",
    ]
    with pytest.raises(RuntimeError, match=r"9 tensors in the checkpoint at .* are not used"):
        dist_harness.run(2, _run_recipe, overrides, str(tmp_path / "run"))
    summary = dist_harness.run(2, _run_recipe, overrides + ["model.allow_unused_weights=true"], str(tmp_path / "run"))[
        0
    ]
    assert summary["requests"] == 2
