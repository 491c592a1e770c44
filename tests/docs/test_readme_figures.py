"""README's own figures read against what produces them (issue 38 item 4): the families it counts are the
ones examples/ builds and the tests train, the device presets it names are the planner's, and "planning
Llama-2-70B for 1,024 GPUs takes seconds" is the recorded plan_speed run (benchmarks/results/), not a
figure typed in. The README's tolerances (1e-5, eps = 1e-3) are checked against the tests' own settings.
Every other README figure links to docs/benchmarks.md, which make_docs writes from recorded runs.
Default tier, in-process: it reads files, runs nothing."""
from __future__ import annotations

import json
import re

from examples.hf_families import FAMILIES
from examples.hf_moe import FAMILIES as MOE_FAMILIES
from tests.docs.doc_blocks import REPO
from xirang.ir.device import DEVICE_PRESETS

README = (REPO / "README.md").read_text()


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def test_the_families_readme_counts_are_the_ones_examples_build():
    match = re.search(r"(\d+) Hugging Face families tested \(([^)]*)\)", README)
    assert match, "README no longer says how many Hugging Face families are tested"
    count, listed = int(match.group(1)), re.split(r"[,;]\s*", match.group(2))
    built = {_key(name) for name in [*FAMILIES, *MOE_FAMILIES]}
    assert {_key(name) for name in listed} == built, (sorted(_key(n) for n in listed), sorted(built))
    assert count == len(built) == len(listed), (count, len(built), len(listed))


def test_the_device_presets_readme_names_are_the_planners():
    match = re.search(r"device presets ((?:`[\w-]+`(?:, )?)+)", README)
    assert match, "README no longer lists the device presets"
    assert set(re.findall(r"`([\w-]+)`", match.group(1))) == set(DEVICE_PRESETS)


def test_planning_llama2_70b_for_1024_gpus_takes_seconds_in_the_recorded_run():
    assert "Planning Llama-2-70B for 1,024 GPUs takes seconds on two CPU cores" in README
    run = json.loads((REPO / "benchmarks" / "results" / "plan_speed__models_llama2_70b.json").read_text())
    assert run["exit_status"] == 0 and run["machine"]["cores"] == 2
    heading = re.search(r"^llama2_70b: seq \d+, global batch \d+, world (\d+)x(\d+) ", run["stdout"], re.M)
    assert heading and int(heading.group(1)) * int(heading.group(2)) == 1024, run["stdout"][:300]
    total = re.search(r"^\s+total\s+([\d.]+)\s+([\d.]+)\s*$", run["stdout"], re.M)
    assert total and float(total.group(1)) < 60, total  # "seconds", not minutes: a recorded figure, not a clock


def test_the_tolerances_readme_states_are_the_tests():
    words = " ".join(README.split())
    assert "within 1e-5 (fp32)" in words and "The tests' AdamW uses eps = 1e-3" in words
    reference = (REPO / "tests" / "codegen" / "single_device.py").read_text()
    assert reference.count("torch.optim.AdamW(") == reference.count("eps=1e-3)") == 2, "the reference's AdamW eps"
    for test in ("test_equivalence.py", "test_3d.py", "test_recompute_3d.py"):
        source = (REPO / "tests" / "codegen" / test).read_text()
        assert re.search(r"TOLERANCE = [^\n]*1e-5\b", source), test
