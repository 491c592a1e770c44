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

from xirang.codegen.runtime.schedule_check import ScheduleError, check_schedule, max_in_flight
from xirang.codegen.runtime.schedule_sim import simulate, simulated_bubble
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
                if not chunked or m % p == 0:
                    yield p, m, v


CASES = [(name, p, m, v) for name in SCHEDULES for p, m, v in grid(name)]


def test_one_vocabulary():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved")
    assert plan_module.SCHEDULES is SCHEDULES  # what a Plan's schedule field accepts
    assert plan_search_space.SCHEDULES is SCHEDULES  # what the search may pin
    assert tuple(cost_model.SCHEDULES) == SCHEDULES  # what the cost model prices
    assert [SCHEDULE_SPECS[name].title for name in SCHEDULES] == ["GPipe", "1F1B", "interleaved 1F1B"]
    assert [name for name in SCHEDULES if SCHEDULE_SPECS[name].chunked] == ["interleaved"]
    for name in SCHEDULES:
        assert build_schedule(name, 2, 2).name == name
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; known: gpipe, 1f1b, interleaved"):
        schedule_spec("zb")


@pytest.mark.parametrize("name", SCHEDULES)
def test_planner_and_executor_refuse_the_same_sizes(name):
    for p, m, v in [(4, 6, 2), (4, 8, 2), (4, 8, 1), (0, 8, 1), (4, 0, 1), (2, 3, 1), (3, 6, 3), (2, 2, True)]:
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
    report = simulated_bubble(schedule, forward=forward, backward=backward)
    # Balanced stages: every rank idles the same share of the step, the closed form's.
    assert report.per_rank == (spec.bubble_share(p, m, v),) * p
    assert report.overall == spec.bubble_share(p, m, v) == Fraction(p - 1, v * m + p - 1)
    assert spec.bubble_fraction(p, m, v) == Fraction(p - 1, v * m)
    assert cost_model.bubble_share(name, p, m, v) == float(report.overall)
    # pipeline_step_time (what plan_costs prices a step with) for t = one device's forward and
    # backward of one micro-batch over all its v chunks is the simulated makespan.
    t = v * (forward + backward)
    makespan = simulate(schedule, forward=forward, backward=backward).makespan
    assert cost_model.pipeline_step_time(name, p, m, t, v) == pytest.approx(makespan, rel=1e-12)
    assert m * t * (1 + spec.bubble_fraction(p, m, v)) == makespan
