"""``xirang.tune``'s pieces on synthetic trial tables (xirang_compile/tune.py, tune_fit.py, tune_trials.py,
ir/plan_trials.py): which plans are tried, which is chosen, the least-squares re-fit, the plan JSON with
its trial table. Default tier, no rank launched (tests/test_cli_tune.py runs the command on 2 ranks)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.runtime.calibration.step_costs import MeasuredCosts
from xirang.ir.mesh import Mesh
from xirang.ir.plan import Plan
from xirang.ir.plan_parts import Alternative
from xirang.ir.plan_trials import Trial, planner_gap
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.reprice import stage_predictions
from xirang.tune import START_SECONDS, kendall_tau, pick_trials, trial_table, within_budget
from xirang.tune_fit import Refit, refit, relative_least_squares
from xirang.tune_trials import TrialMeasurement, combine_ranks


def row(dp=4, pp=1, tp=1, b=2, schedule="1f1b", recompute="none", step=1.0, fits=True, zero=0) -> Alternative:
    return Alternative(mesh=Mesh(dp=dp, pp=pp, tp=tp), micro_batch=b, num_micro_batches=8 // (dp * b),
                       schedule=schedule, virtual_stages=1, recompute=recompute, step_seconds=step,
                       tflops_per_device=1.0, memory_bytes_per_device=(1,) * pp, fits=fits, zero_stage=zero)


def test_trials_differ_in_an_unsure_choice_fastest_first_within_the_bound():
    winner = row(step=1.0)
    zero_twin = row(step=1.01, zero=1)  # differs only in ZeRO: not a choice the trials are for
    too_big = row(pp=2, dp=2, b=1, step=1.02, fits=False)
    tp2 = row(dp=2, tp=2, b=4, step=1.2)
    pp2 = row(dp=2, pp=2, b=1, schedule="zb-h1", step=1.1)
    pp2_again = row(dp=2, pp=2, b=1, schedule="zb-h1", step=1.15, recompute="none")  # same choices as pp2
    far = row(dp=1, pp=4, b=1, step=2.5)  # predicted beyond within=2 x the winner
    picked = pick_trials([winner, zero_twin, too_big, tp2, pp2, pp2_again, far], top_k=4)
    assert picked == [winner, pp2, tp2]
    assert pick_trials([winner, zero_twin, too_big, tp2, pp2, pp2_again, far], top_k=4, within=3.0)[-1] == far
    assert pick_trials([winner, pp2, tp2], top_k=2) == [winner, pp2]
    with pytest.raises(xirang.XirangError, match="top_k"):
        pick_trials([winner], top_k=0)


def measurement(seconds: float, steps=(1.0,)) -> TrialMeasurement:
    costs = MeasuredCosts({0: seconds / 3}, {0: 2 * seconds / 3}, 0.0, seconds, 1)
    return TrialMeasurement(step_seconds=seconds, spread=0.0, bubble_ratio=0.0, peak_memory_bytes=(1, 1),
                            costs=costs, steps=len(steps))


@pytest.fixture(scope="module")
def planned():
    """Two plans of the tiny GPT on 4 CPU-preset ranks: the planner's winner, and one pinned at pp 2."""
    model = build_gpt("tiny", device="meta")
    batch = {name: torch.zeros(8, 64, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    analysed = xirang.analyze(model, (), batch)
    common = dict(world=4, hardware="cpu", example_kwargs=batch, global_batch=8, analysed=analysed, cp=1)
    winner = xirang.plan(model, **common)
    other = xirang.plan(model, **common, pp=2 if winner.mesh.pp == 1 else 1, tp=1)
    return [winner, other], analysed


def test_the_measured_fastest_is_chosen_and_the_planners_gap_is_read_from_the_table(planned):
    plans, _ = planned
    fit = Refit(1.0, 1.0, 1.0, (0.0, 0.0), 0)
    table = trial_table(plans, [measurement(0.030), measurement(0.020)], fit)
    assert [t.chosen for t in table] == [False, True] and [t.planner_choice for t in table] == [True, False]
    assert planner_gap(table) == pytest.approx(0.5)
    table = trial_table(plans, [measurement(0.020), measurement(0.030)], fit)
    assert [t.chosen for t in table] == [True, False] and planner_gap(table) == 0.0


def test_relative_least_squares_recovers_a_common_scale_and_weighs_trials_alike():
    assert relative_least_squares([1.0, 10.0, 0.5], [3.0, 30.0, 1.5]) == pytest.approx(3.0)
    # one trial 2x off, one exact: the relative fit lands between them, not on the long trial's ratio
    k = relative_least_squares([1.0, 100.0], [1.0, 200.0])
    assert 1.0 < k < 2.0 and k == pytest.approx((1 + 0.5) / (1 + 0.25))
    assert relative_least_squares([0.0], [1.0]) == 1.0  # nothing observed: unscaled


def test_refit_of_trials_measured_three_times_slower_finds_compute_x3(planned):
    plans, analysed = planned
    measured = []
    for plan in plans:
        split = SplitPricer(analysed.graph_module, plan.world, precision=plan.precision).price(
            plan.mesh.tp, tuple(range(plan.mesh.tp)), plan.micro_batch, 64)
        _, forward, backward, _ = stage_predictions(plan, split)
        measured.append(MeasuredCosts(dict(enumerate(3 * f for f in forward)),
                                      dict(enumerate(3 * b for b in backward)), 0.0,
                                      3 * plan.predicted.step_seconds, plan.num_micro_batches))
    fit = refit(plans, measured, analysed, 64)
    assert fit.compute_scale == pytest.approx(3.0) and fit.observations == 2
    assert all(step > plan.predicted.step_seconds for step, plan in zip(fit.steps, plans))
    assert fit.steps[0] == pytest.approx(3 * plans[0].predicted.breakdown["compute"], rel=0.5)


def test_kendall_tau_of_orders():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0 and kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_bubble_ratio_and_peak_combine_over_ranks():
    costs = MeasuredCosts({0: 0.1}, {0: 0.2}, 0.0, 1.0, 1)
    ranks = [{"costs": [costs, costs], "local": [(0.5, 1.0), (0.5, 1.0)], "peak": 10},
             {"costs": [costs, costs], "local": [(1.0, 1.0), (1.0, 1.0)], "peak": 30}]
    combined = combine_ranks(ranks)
    assert combined.bubble_ratio == pytest.approx(0.25) and combined.peak_memory_bytes == (10, 30)
    assert combined.step_seconds == 1.0 and combined.spread == 0.0 and combined.steps == 2


def test_a_tuned_plan_round_trips_its_trials_and_explains_them(planned, tmp_path):
    plans, _ = planned
    table = trial_table(plans, [measurement(0.030), measurement(0.020)], Refit(2.0, 1.0, 1.0, (0.025, 0.0), 2))
    tuned = dataclasses.replace(plans[1], trials=table)
    tuned.save(tmp_path / "tuned.json")
    loaded = Plan.load(tmp_path / "tuned.json")
    assert loaded == tuned and loaded.trials == table and isinstance(loaded.trials[0], Trial)
    text = loaded.explain()
    assert "Tuned by trial runs" in text and "measured 50.0% slower than the fastest" in text
    assert "trials" not in plans[0].to_json()  # an untuned plan is written as before, and older files load
    assert Plan.from_json(plans[0].to_json()) == plans[0]


def test_the_budget_drops_the_slowest_estimated_trials_but_never_the_planners_choice():
    estimates = [30.0, 10.0, 20.0, 5.0]
    assert within_budget(estimates, None) == [0, 1, 2, 3]
    assert within_budget(estimates, START_SECONDS + 45.0) == [0, 1, 3]
    assert within_budget(estimates, START_SECONDS + 35.0) == [0, 3]
    assert within_budget(estimates, 1.0) == [0]
