"""``reshard plan``'s hardware names: a datasheet card without socket topology (``a10``, ``l4``) is
planned with one line naming the Seesaw paper's machine of the same GPU (``g5.48xlarge`` =
``a10-g5``); the paper's machines and cards without such a twin plan without it; the hardware key's
docs name every profile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reshard.parallel.cost.profiles import HARDWARE, MACHINES

ROOT = Path(__file__).resolve().parents[1]
TWINS = {"a10": ("g5.48xlarge", "a10-g5"), "l4": ("g6.48xlarge", "l4-g6")}


@pytest.mark.parametrize("name", [*HARDWARE, *MACHINES])
def test_only_a_card_whose_gpu_has_a_papers_machine_gets_the_note(name):
    from reshard.recipes.plan import hardware_note

    note = hardware_note(name)
    if name not in TWINS:
        assert note is None
        return
    aws, twin = TWINS[name]
    assert note == (
        f"note: hardware={name} has no socket topology (one flat link between any two GPUs); the Seesaw "
        f"paper's machine is hardware={aws} (= {twin}): 8 GPUs, 2 sockets of 4"
    )
    assert not HARDWARE[name].topology and HARDWARE[twin].topology and MACHINES[aws] == twin


@pytest.mark.parametrize("hardware, noted", [("a10", True), ("g5.48xlarge", False)])
def test_the_plan_prints_the_note_once_after_its_summary(hardware, noted, tmp_path, capsys):
    from reshard.recipes.plan import run_plan
    from reshard.recipes.schema import compose

    run_plan(compose("plan", ["model=llama3-15b", f"hardware={hardware}", "num_gpus=4", "top=3"]), tmp_path)
    lines = capsys.readouterr().out.splitlines()
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == (1 if noted else 0), lines
    if noted:
        assert "hardware=g5.48xlarge (= a10-g5)" in notes[0]
        assert lines.index(notes[0]) == len(lines) - 2  # just before "outputs written to"


def _hardware_docs() -> dict[str, str]:
    """The hardware key's comments: conf/plan.yaml's line and PlanConfig's comment block."""
    yaml = next(line for line in (ROOT / "conf" / "plan.yaml").read_text().splitlines() if line.startswith("hardware:"))
    source = (ROOT / "recipes" / "plan_config.py").read_text()
    block = re.search(r"((?:\s*#.*\n)+)\s*hardware: str", source)
    return {"conf/plan.yaml": yaml, "recipes/plan_config.py": block.group(1) if block else ""}


def test_the_hardware_keys_docs_name_every_profile_and_which_have_socket_topology():
    for where, doc in _hardware_docs().items():
        for name in [*HARDWARE, *MACHINES, "this_machine"]:
            assert re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", doc), f"{where} does not name {name}"
        assert "two sockets of 4" in doc, where
