"""The figures the guides and the concepts page type in prose, read against what produces them: a recorded
benchmark run (benchmarks/results/), the tolerance a test asserts, or the code's own default. Figures shown
inside a ``recorded`` region are written by benchmarks/make_docs.py and checked by test_benchmarks_page.py;
README's own are in test_readme_figures.py. Default tier, in-process: it reads files, runs nothing."""
from __future__ import annotations

import inspect
import json
import re

import pytest

from tests.docs.doc_blocks import REPO


def _page(path: str) -> str:
    return " ".join((REPO / path).read_text().split())  # prose rewrapped anywhere reads the same


def _source(path: str) -> str:
    return (REPO / path).read_text()


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_the_tune_guides_near_tie_is_its_recorded_run():
    page = _page("docs/guides/tune.md")
    assert "predicts pp 2 with ZB-H1 5% ahead of dp 2, and the trials measure dp 2 twice as fast" in page
    run = json.loads((REPO / "benchmarks" / "results" / "tune_models__models_gpt_2ranks.json").read_text())
    assert run["exit_status"] == 0
    rows = {}
    for line in run["stdout"].splitlines():  # the trial table: marks, configuration, predicted, re-fit, measured
        row = re.match(r"^[ P*]{3}(dp=\S+ pp=(\d) .*?recompute=\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line)
        if row and row.group(1) not in rows:
            rows[row.group(1)] = (int(row.group(2)), float(row.group(3)), float(row.group(5)))
    planner = next(v for k, v in rows.items() if "pp=2" in k and "zb-h1" in k)
    data_parallel = next(v for k, v in rows.items() if k.startswith("dp=2 pp=1"))
    assert round(100 * (data_parallel[1] / planner[1] - 1)) == 5, (planner, data_parallel)  # "5% ahead"
    assert 1.75 <= planner[2] / data_parallel[2] <= 2.25, (planner, data_parallel)  # "twice as fast"


def test_the_resume_tolerance_is_the_tests():
    page = _page("docs/guides/checkpoints.md")
    assert ("within 1e-6 of the uninterrupted run's (the matrix test `tests/test_cli_train.py`, 4 ranks at dp 2 x "
            "pp 2)") in page
    test = _source("tests/test_cli_train.py")
    assert test.count("<= 1e-6") >= 2 and '"--world", "4", "--dp", "2", "--pp", "2"' in test


def test_the_checkpoint_guides_numbers_are_the_codes_defaults():
    from xirang import LossSpikes, NonFiniteGuard
    from xirang.cli.train_prechecks import CHECKPOINT_BYTES_PER_PARAMETER

    page = _page("docs/guides/checkpoints.md")
    assert f"{CHECKPOINT_BYTES_PER_PARAMETER} bytes a parameter" in page
    assert f"more than {_default(NonFiniteGuard, 'max_rollbacks')} rollbacks" in page
    assert f"the last {_default(LossSpikes, 'window')} steps" in page


def test_the_explain_guides_bytes_per_parameter_are_the_planners():
    from xirang.passes.planning.cost_model import RUNTIME_ADAM_BYTES, RUNTIME_GRAD_BYTES, RUNTIME_PARAM_BYTES

    page = _page("docs/guides/explain.md")
    assert RUNTIME_PARAM_BYTES == RUNTIME_GRAD_BYTES == 4
    assert f"parameters and gradients (fp32, {RUNTIME_PARAM_BYTES} bytes each per parameter;" in page
    assert f"AdamW's two fp32 moments, {RUNTIME_ADAM_BYTES} bytes per parameter" in page


def test_the_usable_memory_fraction_is_the_planners():
    from xirang.passes.planning.plan_costs import CandidatePricer

    percent = f"{_default(CandidatePricer, 'memory_fraction'):.0%}"
    assert f"within the usable memory ({percent} of the device's)" in _page("docs/guides/explain.md")
    assert f"of which the plan may use {percent}" in _page("docs/guides/troubleshooting.md")


@pytest.mark.parametrize("page", ["docs/index.md", "docs/guides/moe.md", "docs/reference/models.md",
                                  "docs/architecture.md"])
def test_the_equivalence_tolerance_and_eps_the_pages_state_are_the_tests(page):
    text = _page(page)
    assert "1e-5" in text and "eps = 1e-3" in text, page
    assert _source("tests/codegen/single_device.py").count("eps=1e-3)") == 2  # the reference and the compiled run
    for test in ("tests/models/test_family_matrix.py", "tests/models/test_moe_families.py"):
        source = _source(test)
        assert "from tests.codegen.single_device import" in source and re.search(r"TOLERANCE = [^\n]*1e-5\b", source)


def test_the_concepts_pages_tolerances_are_the_tests():
    page = _page("docs/architecture.md")
    assert "predicted activations are held within 5% of the dry run's" in page
    assert "pytest.approx(measured, rel=0.05)" in _source("tests/check/test_check_activation_dtypes.py")
    assert "the peak below 0.6 of the model" in page
    assert "< 0.6 * model" in _source("tests/codegen/test_meta_init.py")
    assert "to 0.9-1.1 of the prediction on every rank, and `tests/check/test_check_split_backward_loss.py` the dry " \
           "run's within 5%" in page
    assert 'MEMORY_RATIO = {"1f1b": ((0.9, 1.1), (0.9, 1.1)), "zb-h1": ((0.9, 1.1), (0.9, 1.1))}' \
        in _source("tests/test_cli_more.py")
    assert _source("tests/check/test_check_split_backward_loss.py").count("rel=0.05)") == 2
    assert "within 10% of the prediction on the ranks whose B runs before their W, and above it by at most 5% on any" \
        in page
    split_backward = _source("tests/check/test_check_split_backward_recompute.py")
    assert "rel=0.10)" in split_backward and "<= 1.05 * row" in split_backward


def test_the_concepts_pages_thresholds_are_the_codes():
    from xirang.codegen.runtime.executor.injection import AdaptiveInjection
    from xirang.passes.planning import plan_search, tp_overlap_cost
    from xirang_compile.reprice import MARGIN

    page = _page("docs/architecture.md")
    assert f"a simulated gain over {_default(AdaptiveInjection, 'min_gain'):.0%}" in page
    assert f"stage: {3 * plan_search.ZERO1_MARGIN:.0%} for zero 3" in page
    assert f"saves over {tp_overlap_cost.MIN_SAVING:.1%} of the step" in page
    assert f"a win under {MARGIN:.0%} is not named" in page
