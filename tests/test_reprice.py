"""``xirang.reprice`` with synthetic measurements (xirang_compile/reprice.py,
codegen/runtime/calibration/step_costs.py).

The plan: the tiny GPT at seq 4096 on one node of four A100s whose links are PCIe-class (50 GB/s), one
sample per step, so the planner takes tp = 4 and the tp collectives are a fifth of the step. The
measurements are made from the plan's own predictions per stage, then changed one figure at a time.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.runtime.calibration.step_costs import MeasuredCosts, combine, rank_summary
from xirang.codegen.runtime.executor.pipeline_executor import StepRecord
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard
from xirang.ir.schedules import Backward, Forward
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.ir.calibration import Calibration
from xirang.reprice import scaled_world, shared_core_factor, stage_predictions

SEQ = 4096


@pytest.fixture(scope="module")
def planned():
    model = build_gpt("tiny", device="meta")
    batch = {name: torch.zeros(2, 16, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    analysed = xirang.analyze(model, (), batch)
    world = xirang.World.uniform(1, 4, "a100-80g", intra_node=xirang.LinkSpec(bandwidth=50e9, latency=1e-5))
    # cp = 1: the planner now prices cp 4 faster here, and reprice re-searches cp = 1 meshes only
    plan = xirang.plan(model, world=world, example_kwargs=batch, global_batch=1, seq=SEQ, precision="fp32",
                       analysed=analysed, cp=1)
    assert plan.mesh.tp == 4  # the premise: tp wins here
    assert any(isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items() if n.startswith("p_"))
    split = SplitPricer(analysed.graph_module, world, precision="fp32").price(4, (0, 1, 2, 3), plan.micro_batch, SEQ)
    _, forward, backward, tp = stage_predictions(plan, split)
    return plan, analysed, forward, backward, tp


def as_predicted(plan, forward, backward, **changes) -> MeasuredCosts:
    breakdown = plan.predicted.breakdown
    figures = dict(forward=dict(enumerate(forward)), backward=dict(enumerate(backward)),
                   sync_seconds=breakdown["dp_exposed"] + breakdown.get("tied_sum", 0.0),
                   step_seconds=plan.predicted.step_seconds, num_micro_batches=plan.num_micro_batches)
    return MeasuredCosts(**{**figures, **changes})


def test_measured_as_predicted_leaves_the_plan_the_best(planned):
    plan, analysed, forward, backward, _ = planned
    report = xirang.reprice(plan, as_predicted(plan, forward, backward), analysed=analysed, seq=SEQ)
    assert report.compute_scale == pytest.approx(1.0) and report.tp_scale == pytest.approx(1.0)
    assert report.repriced_current == pytest.approx(plan.predicted.step_seconds, rel=1e-9)
    assert not report.another_wins and report.verdict.startswith("the current plan is still the best")


def test_tp_collectives_five_times_slower_make_a_less_tp_mesh_win(planned):
    plan, analysed, forward, backward, tp = planned
    m = plan.num_micro_batches
    slower = as_predicted(plan, [f + 4 * t / 2 for f, t in zip(forward, tp)],  # tp's extra, half in each pass
                          [b + 4 * t / 2 for b, t in zip(backward, tp)], tp_seconds=5 * m * sum(tp))
    report = xirang.reprice(plan, slower, analysed=analysed, seq=SEQ)
    assert report.tp_scale == pytest.approx(5.0) and report.compute_scale == pytest.approx(1.0)
    assert report.repriced_current > plan.predicted.step_seconds
    assert report.another_wins and report.best_mesh[1] < plan.mesh.tp
    dp, tp_degree, pp = report.best_mesh
    assert report.verdict.startswith(f"another plan would now win: (dp,tp,pp)=({dp},{tp_degree},{pp}) schedule "
                                     f"{report.best_schedule} predicted")
    assert str(report).splitlines()[-1] == report.verdict and "tp collectives: measured" in str(report)


def test_stages_twice_as_slow_double_a_step_that_is_all_stage_time(planned):
    plan, analysed, forward, backward, _ = planned
    assert plan.mesh.pp == 1 and plan.mesh.dp == 1  # the step is m x (forward + backward): no bubble, no dp sync
    report = xirang.reprice(plan, as_predicted(plan, [2 * f for f in forward], [2 * b for b in backward]),
                            analysed=analysed, seq=SEQ)
    assert report.compute_scale == pytest.approx(2.0) and report.tp_scale == pytest.approx(2.0)
    # the step's own collectives (batch agreement over the 4 tp ranks) are links, not stage time
    collectives = plan.predicted.breakdown["step_sync"]
    assert report.repriced_current == pytest.approx(2 * (plan.predicted.step_seconds - collectives) + collectives,
                                                     rel=1e-6)


def test_the_step_own_collectives_as_measured_replace_their_price(planned):
    plan, analysed, forward, backward, _ = planned
    priced = plan.predicted.breakdown["step_sync"]
    assert priced > 0  # the batch agreement over the 4 tp ranks
    slow = as_predicted(plan, forward, backward, outside_seconds=3 * priced)
    report = xirang.reprice(plan, slow, analysed=analysed, seq=SEQ)
    assert report.compute_scale == pytest.approx(1.0) and report.outside_scale == pytest.approx(3.0)
    assert report.repriced_current == pytest.approx(plan.predicted.step_seconds + 2 * priced, rel=1e-9)
    assert dict(report.repriced_breakdown)["step_sync"] == pytest.approx(3 * priced)
    assert "the step's own collectives (batch agreement, loss): measured" in str(report)
    unmeasured = xirang.reprice(plan, as_predicted(plan, forward, backward), analysed=analysed, seq=SEQ)
    assert unmeasured.outside_scale == 1.0  # not measured: priced as before


def test_link_scale_multiplies_every_collective_price():
    world = xirang.World.uniform(2, 4, "a100-80g")
    slow = scaled_world(world, 3.0)
    for group in ((0, 1, 2, 3), (0, 4), tuple(range(8))):
        assert collective_cost("all_reduce", 1e8, group, slow).seconds == pytest.approx(
            3 * collective_cost("all_reduce", 1e8, group, world).seconds)


def test_rank_records_combine_to_the_slowest_rank_per_stage():
    def record(stage, f, b, finished, outside=0.0):
        step = StepRecord(timestamps=[(0, Forward(stage, 0), 0.0, f), (0, Forward(stage, 1), f, 2 * f),
                                      (0, Backward(stage, 0), 2 * f, 2 * f + b), (0, Backward(stage, 1), 2 * f + b,
                                                                                 2 * f + 2 * b)])
        step.finished, step.outside = finished, outside
        return rank_summary(step, 2)
    one = combine([record(0, 1.0, 2.0, 8.0), record(0, 1.5, 2.0, 7.5), record(1, 0.5, 1.0, 3.5)], 2)
    assert one.outside_seconds == 0.0
    assert dict(one.forward) == {0: 1.5, 1: 0.5} and dict(one.backward) == {0: 2.0, 1: 1.0}
    # the sync runs from the slowest compute (rank 1's, ending at 7) to the last rank's end (8)
    assert one.sync_seconds == pytest.approx(1.0) and one.step_seconds == 8.0
    # ranks loading the cores: compute and own sync, 8 + 7.5 + 3.5 rank-seconds over the 8 s step
    assert one.busy_ranks == pytest.approx(19 / 8) and one.waiting_ranks == pytest.approx(3 - 19 / 8)
    # agreement and loss: the step ends 0.75 s after the last rank's gradients are final
    late = combine([record(0, 1.0, 2.0, 8.0, outside=0.75), record(1, 0.5, 1.0, 3.5, outside=5.0)], 2)
    assert late.step_seconds == 8.75 and late.outside_seconds == pytest.approx(0.75)
    both = MeasuredCosts.median([one, combine([record(0, 3.0, 2.0, 10.0), record(1, 0.5, 1.0, 3.0)], 2), one])
    assert both.forward[0] == 1.5 and both.steps == 3
    # one replica's slow forward and another's slow backward: both figures from the slower pair (1 + 3 > 2 + 1)
    crossed = combine([record(0, 2.0, 1.0, 8.0), record(0, 1.0, 3.0, 8.0)], 2)
    assert (crossed.forward[0], crossed.backward[0]) == (1.0, 3.0)


def test_measurements_of_another_plan_are_refused(planned):
    plan, analysed, forward, backward, _ = planned
    other = as_predicted(plan, forward + [1.0], backward + [1.0])
    with pytest.raises(XirangError, match="not the plan's"):
        xirang.reprice(plan, other, analysed=analysed, seq=SEQ)


@pytest.mark.parametrize("extra, words", [
    (["--world-file", "w.json", "--plan", "p.json"], "--world-file and --plan both"),
    (["--world-file", "{world}"], "describes 2 ranks, not --world 3"),
])
def test_train_refuses_a_world_file_that_does_not_fit(extra, words, tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from xirang.cli import main
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    world = tmp_path / "world.json"
    xirang.World.uniform(1, 2, "cpu").save(world)
    argv = ["train", "examples/catalog.py:gpt_tiny", "--world", "3", "--synthetic",
            *[item.format(world=world) for item in extra]]
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_stage_seconds_on_shared_cores_are_brought_to_the_all_busy_rate():
    sharing = Calibration(8, "gloo", "cpu", parallel_ranks=2.0)  # 8 ranks on 2 cores
    calibrated = xirang.World((xirang.NodeSpec(8, "cpu"),), calibration=sharing)

    def costs(busy):
        return MeasuredCosts({0: 1.0}, {0: 2.0}, 0.0, 3.0, 1, busy_ranks=busy)
    assert shared_core_factor(calibrated, costs(8.0)) == 1.0  # every rank busy: the modelled rate already
    assert shared_core_factor(calibrated, costs(4.0)) == 2.0  # half the ranks busy: each ran twice as fast
    assert shared_core_factor(calibrated, costs(1.0)) == 4.0  # fewer busy than cores: a core each, no faster
    assert shared_core_factor(xirang.World.uniform(1, 8, "cpu"), costs(1.0)) == 1.0  # own devices: no sharing
    spinning = xirang.World((xirang.NodeSpec(8, "cpu"),), calibration=Calibration(8, "gloo", "cpu", parallel_ranks=2.0,
                                                                                  waiting_share=0.5))
    waited = MeasuredCosts({0: 1.0}, {0: 2.0}, 0.0, 3.0, 1, busy_ranks=2.0, waiting_ranks=6.0)
    assert shared_core_factor(spinning, waited) == pytest.approx(8 / (2 + 0.5 * 6))  # a waiter costs half a busy rank


def test_a_plan_with_cp_is_refused_rather_than_fitted_wrong(planned):
    """reprice prices the stages from the split at the whole sequence; a cp rank runs seq / cp of it, so the
    fitted compute scale would be cp times off. Refused, naming the axis, until the fit re-prices cp and ep."""
    plan, analysed, *_ = planned
    with_cp = xirang.plan(build_gpt("tiny", device="meta"), world=plan.world, example_kwargs={
        name: torch.zeros(2, 16, dtype=torch.long, device="meta") for name in ("input_ids", "labels")},
        global_batch=1, seq=SEQ, precision="fp32", analysed=analysed, cp=4)
    measured = MeasuredCosts(forward={0: 1.0}, backward={0: 1.0}, sync_seconds=0.0, step_seconds=2.0,
                             num_micro_batches=with_cp.num_micro_batches)
    with pytest.raises(XirangError) as refused:
        xirang.reprice(with_cp, measured, analysed=analysed, seq=SEQ)
    assert "cp=4" in refused.value.what and "cp=1" in refused.value.hint
    # inside `xirang train` the report is skipped with a line, and the run goes on (no measurement is taken)
    from types import SimpleNamespace
    from xirang.reprice import RepriceAfter
    shown = []
    after = RepriceAfter(3, 0, SimpleNamespace(plan=with_cp), model=None, example_kwargs={}, pins={}, say=True,
                         show=shown.append)
    for done in (1, 2, 3):
        after.after_step(done)  # would call compiled.measured_costs(), which this stand-in lacks
    assert after.report is None and shown == ["re-pricing skipped: the plan has cp=4, which xirang.reprice does "
                                              "not re-price yet"]
