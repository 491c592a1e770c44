"""The planner's schedule numbers equal what the schedules the executor runs do.

The executor interprets ``build_schedule(plan.schedule, pp, m, v)`` (ir/schedules.py); the planner
prices the same plan with closed forms (``ScheduleSpec`` in ir/schedules.py, used through
``cost_model`` and ``plan_search_space`` / ``plan_costs``). Here both are computed over a grid of
(p, m, v) for every schedule in the vocabulary: activations in flight per rank against the
checker's ``max_in_flight``, the bubble and the step time against ``simulate``/``simulated_bubble``.
Exact (``Fraction``) where the closed form is exact; the planner's floats are its correctly rounded
values.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

from xirang.codegen.runtime.executor.schedule_check import ScheduleError, check_schedule, max_in_flight
from xirang.codegen.runtime.executor.schedule_sim import simulate, simulated_bubble
from xirang.ir import plan as plan_module
from xirang.ir.schedules import SCHEDULE_SPECS, SCHEDULES, build_schedule, schedule_spec
from xirang.ir.world import World
from xirang.passes.planning import cost_model, plan_search_space
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_search_space import Candidate


def grid(name: str):
    """(p, m, v) the schedule accepts: p = 1..6, m = 1..12, v = 1..4 where it runs chunks."""
    chunked = SCHEDULE_SPECS[name].chunked
    for p in range(1, 7):
        for m in range(1, 13):
            for v in (1, 2, 3, 4) if chunked else (1,):
                if (not chunked or m % p == 0) and (name != "zb-h2" or m >= 2 * p - 1):
                    yield p, m, v


CASES = [(name, p, m, v) for name in SCHEDULES for p, m, v in grid(name)]


def test_one_vocabulary():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
    assert plan_module.SCHEDULES is SCHEDULES  # what a Plan's schedule field accepts
    assert plan_search_space.SCHEDULES is SCHEDULES  # what the search may pin
    assert tuple(cost_model.SCHEDULES) == SCHEDULES  # what the cost model prices
    assert [SCHEDULE_SPECS[name].title for name in SCHEDULES] == ["GPipe", "1F1B", "interleaved 1F1B", "ZB-H1",
                                                                  "ZB-H2"]
    assert [name for name in SCHEDULES if SCHEDULE_SPECS[name].chunked] == ["interleaved"]
    assert [name for name in SCHEDULES if SCHEDULE_SPECS[name].split_backward] == ["zb-h1", "zb-h2"]
    for name in SCHEDULES:
        assert build_schedule(name, 2, 4).name == name
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; known: gpipe, 1f1b, interleaved, "
                                         "zb-h1, zb-h2"):
        schedule_spec("zb")


@pytest.mark.parametrize("name", SCHEDULES)
def test_planner_and_executor_refuse_the_same_sizes(name):
    for p, m, v in [(4, 6, 2), (4, 8, 2), (4, 8, 1), (0, 8, 1), (4, 0, 1), (2, 3, 1), (3, 6, 3), (2, 2, True),
                    (4, 6, 1), (4, 7, 1)]:
        refusals = []  # the executor's builder, then the planner's two closed forms
        for numbers in (build_schedule, cost_model.bubble_fraction, plan_search_space.in_flight_by_rank):
            try:
                numbers(name, p, m, v)
                refusals.append(None)
            except ValueError as error:
                refusals.append(str(error))
        assert refusals[0] == refusals[1] == refusals[2], (p, m, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_in_flight_equals_the_executed_schedule(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    # The checker counts (stage, micro-batch) pairs; with v chunks each is 1/v of the rank's layers.
    executed = tuple(Fraction(pairs, v) for pairs in max_in_flight(schedule))
    assert SCHEDULE_SPECS[name].in_flight_by_rank(p, m, v) == executed
    # The planner's floats: per rank (memory per pipeline rank), per stage (the cut solvers), rank 0
    # (the cost model's memory per device).
    floats = tuple(float(x) for x in executed)
    assert plan_search_space.in_flight_by_rank(name, p, m, v) == floats
    pricer = CandidatePricer({}, World.uniform(1, 1), global_batch=m)
    candidate = Candidate(tp=1, pp=p, dp=1, micro_batch=1, num_micro_batches=m, schedule=name,
                          virtual_stages=v, recompute="none")
    assert pricer.in_flight(candidate) == [floats[stage % p] for stage in range(p * v)]
    assert cost_model.SCHEDULES[name].in_flight(p, m, v) == executed[0] == max(executed)
    assert cost_model.activation_bytes_in_flight(1.0, 1, name, p, m, v) == floats[0]
    # Tight: the checker accepts the closed form as a budget and refuses one pair less on rank 0.
    budget = [int(x * v) for x in executed]
    check_schedule(schedule, in_flight_budget=budget)
    with pytest.raises(ScheduleError, match="over its budget"):
        check_schedule(schedule, in_flight_budget=[budget[0] - 1, *budget[1:]])


@pytest.mark.parametrize("name,p,m,v", CASES)
@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2)])
def test_bubble_and_step_time_equal_the_simulated_schedule(name, p, m, v, forward, backward):
    spec = SCHEDULE_SPECS[name]
    schedule = build_schedule(name, p, m, v)
    ratio = Fraction(backward, forward)  # a split backward gives half to B and half to W
    report = simulated_bubble(schedule, forward=forward, backward=backward)
    # Balanced stages: every rank idles the same share of the step, the closed form's.
    assert report.per_rank == (spec.bubble_share(p, m, v, ratio),) * p
    assert report.overall == spec.bubble_share(p, m, v, ratio)
    if not spec.split_backward:  # the classic schedules' bubble does not depend on the ratio
        assert report.overall == Fraction(p - 1, v * m + p - 1)
        assert spec.bubble_fraction(p, m, v, ratio) == Fraction(p - 1, v * m)
    assert cost_model.bubble_share(name, p, m, v, backward_ratio=float(ratio)) == float(report.overall)
    # pipeline_step_time (what plan_costs prices a step with) for t = one device's forward and
    # backward of one micro-batch over all its v chunks is the simulated makespan.
    t = v * (forward + backward)
    makespan = simulate(schedule, forward=forward, backward=backward).makespan
    assert cost_model.pipeline_step_time(name, p, m, t, v, float(ratio)) == pytest.approx(makespan, rel=1e-12)
    assert m * t * (1 + spec.bubble_fraction(p, m, v, ratio)) == makespan


def test_zero_bubble_at_unit_times():
    """p = 4, m = 8, T_F = T_B = T_W = 1: ZB-H1's bubble is a third of 1F1B's at 1F1B's peak memory;
    ZB-H2 holds 2p - 1 and, in one synchronous step, is left with the same (p - 1)·T_F ramp."""
    unit = dict(forward=1, backward_input=1, backward_weight=1, backward=2)
    shares = {name: simulated_bubble(build_schedule(name, 4, 8), **unit).overall
              for name in ("1f1b", "zb-h1", "zb-h2")}
    assert shares == {"1f1b": Fraction(3, 11), "zb-h1": Fraction(1, 9), "zb-h2": Fraction(1, 9)}
    for name, share in shares.items():
        assert SCHEDULE_SPECS[name].bubble_share(4, 8) == share
    one_f_one_b = SCHEDULE_SPECS["1f1b"].bubble_fraction(4, 8)
    assert SCHEDULE_SPECS["zb-h1"].bubble_fraction(4, 8) * 3 == one_f_one_b == Fraction(3, 8)
    assert max_in_flight(build_schedule("zb-h1", 4, 8)) == (4, 4, 4, 4)  # 1F1B: (4, 3, 2, 1)
    assert max_in_flight(build_schedule("zb-h2", 4, 8)) == (7, 7, 7, 7)
    # Where W is cheaper than B (attention has no weights), ZB-H2's extra warm-up pays: T_W = 1/2.
    cheap_w = dict(forward=1, backward_input=1, backward_weight=Fraction(1, 2))
    h1 = simulated_bubble(build_schedule("zb-h1", 4, 8), **cheap_w).overall
    h2 = simulated_bubble(build_schedule("zb-h2", 4, 8), **cheap_w).overall
    assert h2 < h1 < Fraction(3, 11)
