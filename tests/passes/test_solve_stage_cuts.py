"""The pipeline stage-cut solvers: hand-checked cuts, ILP == DP == brute force on random heterogeneous
problems, speed on a deep model, and a clear error when no cut fits device memory."""
from __future__ import annotations

import math
import random

import pytest

from xirang.passes.planning.solve_stage_cuts import (StageCutProblem, solve_stage_cuts, solve_stage_cuts_dp,
                                            solve_stage_cuts_exhaustive)

SOLVERS = [lambda p: solve_stage_cuts(p, method="ilp"), solve_stage_cuts_dp, solve_stage_cuts_exhaustive]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def problem(compute, stages, *, comm=None, memory=None, **devices):
    units = len(compute)
    return StageCutProblem(compute=compute, memory=memory or [0.0] * units,
                           boundary_comm=comm or [0.0] * (units - 1), stages=stages, **devices)


@pytest.mark.parametrize("solve", SOLVERS)
def test_even_layers_split_evenly(solve):
    solution = solve(problem([1.0] * 4, 2))
    assert solution.bounds == ((0, 2), (2, 4)) and solution.bottleneck == 2.0
    assert solution.stage_of_unit == (0, 0, 1, 1) and solution.status == "optimal"


@pytest.mark.parametrize("solve", SOLVERS)
def test_an_expensive_boundary_moves_the_cut(solve):
    """Compute 1,2,2,1 splits evenly after unit 1 (3 s each) but that send costs 3 s: 6 s. Cutting
    after unit 0 gives 1 + 0.5 and 5 s; after unit 2, 5 + 0.5 and 1 s. The optimum is 5 s."""
    solution = solve(problem([1.0, 2.0, 2.0, 1.0], 2, comm=[0.5, 3.0, 0.5]))
    assert solution.bounds == ((0, 1), (1, 4))
    assert solution.stage_times == (1.5, 5.0) and solution.bottleneck == 5.0


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_faster_device_takes_more_layers(solve):
    """Six unit layers on a 2x and a 1x device: 4 layers / 2 = 2 layers / 1 = 2 s."""
    solution = solve(problem([1.0] * 6, 2, speeds=[2.0, 1.0]))
    assert solution.bounds == ((0, 4), (4, 6)) and solution.bottleneck == 2.0


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_small_device_takes_fewer_layers(solve):
    """Stage 0's device holds one unit's bytes, so the even 2 + 2 split (2 s) is out: 1 + 3, 3 s."""
    tight = problem([1.0] * 4, 2, memory=[1.0] * 4, capacities=[1.0, 10.0])
    solution = solve(tight)
    assert solution.bounds == ((0, 1), (1, 4)) and solution.bottleneck == 3.0
    assert solution.stage_memory == (1.0, 3.0)


@pytest.mark.parametrize("solve", SOLVERS)
def test_activations_in_flight_count_per_stage(solve):
    """1F1B keeps two micro-batches alive on stage 0 and one on stage 1: 2 units there need 4 bytes
    of a 3-byte device, so stage 0 takes one unit; counting each once, the even split fits."""
    kwargs = dict(activation_memory=[1.0] * 4, capacities=[3.0, 3.0])
    assert solve(problem([1.0] * 4, 2, in_flight=[2, 1], **kwargs)).bounds == ((0, 1), (1, 4))
    assert solve(problem([1.0] * 4, 2, **kwargs)).bounds == ((0, 2), (2, 4))


@pytest.mark.parametrize("solve", SOLVERS)
def test_one_stage_holds_everything(solve):
    solution = solve(problem([1.0, 2.0], 1, comm=[9.0]))
    assert solution.bounds == ((0, 2),) and solution.bottleneck == 3.0


@pytest.mark.parametrize("solve", SOLVERS)
def test_no_fitting_cut_names_the_minimum_memory(solve):
    """Three 5 GB units on two 6 GB devices: some stage holds two units, 10 GB."""
    tight = problem([1.0] * 3, 2, memory=[5e9] * 3, capacities=[6e9, 6e9], unit_names=["l0", "l1", "l2"])
    with pytest.raises(ValueError, match=r"minimum of 1e\+10 bytes on stage 1 \(l1..l2\), whose device "
                                         r"holds 6e\+09 bytes \(1.67x\)"):
        solve(tight)


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_unit_larger_than_any_device_is_named(solve):
    tight = problem([1.0] * 3, 3, memory=[1.0, 80.0, 1.0], capacities=[40.0, 50.0, 40.0],
                    unit_names=["embed", "huge", "head"])
    with pytest.raises(ValueError, match=r"80 bytes on stage 1 \(huge\), whose device holds 50 bytes"):
        solve(tight)


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_zero_byte_device_is_reported(solve):
    with pytest.raises(ValueError, match="holds 0 bytes"):
        solve(problem([1.0] * 2, 2, memory=[1.0, 1.0], capacities=[0.0, 5.0]))


def random_problem(rng: random.Random) -> StageCutProblem:
    """2-9 units into 1-4 stages of different speeds and memories; some cannot fit, and integer
    costs on a third of them make ties likely."""
    units = rng.randint(2, 9)
    stages = rng.randint(1, min(units, 4))
    draw = (lambda: float(rng.randint(1, 4))) if rng.random() < 0.3 else rng.random
    memory = [rng.uniform(1, 3) * 1e9 for _ in range(units)]
    capacities = None
    if rng.random() < 0.7:
        mean = sum(memory) / stages
        capacities = [mean * rng.uniform(0.8, 2.5) for _ in range(stages)]
    return StageCutProblem(
        compute=[draw() for _ in range(units)], memory=memory,
        boundary_comm=[0.3 * draw() * (rng.random() < 0.7) for _ in range(units - 1)], stages=stages,
        speeds=[rng.uniform(0.5, 2.0) for _ in range(stages)] if rng.random() < 0.7 else None,
        capacities=capacities,
        activation_memory=[rng.uniform(0, 1e9) for _ in range(units)] if rng.random() < 0.3 else None,
        in_flight=[stages - s for s in range(stages)] if rng.random() < 0.3 else None)


def test_ilp_dp_and_brute_force_agree_on_random_problems():
    rng = random.Random(1729)
    infeasible = 0
    for case in range(200):
        cut = random_problem(rng)
        try:
            expected = solve_stage_cuts_exhaustive(cut)
        except ValueError as error:
            infeasible += 1
            assert "minimum of" in str(error)
            for solve in (solve_stage_cuts_dp, lambda p: solve_stage_cuts(p, method="ilp")):
                with pytest.raises(ValueError, match="minimum of"):
                    solve(cut)
            continue
        for got in (solve_stage_cuts(cut, method="ilp"), solve_stage_cuts_dp(cut)):
            assert close(got.bottleneck, expected.bottleneck), (case, got, expected)
            assert [b - a for a, b in got.bounds] and all(b > a for a, b in got.bounds)
            assert got.bounds[0][0] == 0 and got.bounds[-1][1] == cut.units
            assert all(got.bounds[s][1] == got.bounds[s + 1][0] for s in range(cut.stages - 1))
            assert all(m <= c * (1 + 1e-9) for m, c in zip(got.stage_memory, cut.capacities))
    assert 0 < infeasible < 80  # both branches were exercised


def deep_problem(seed: int, units: int, stages: int) -> StageCutProblem:
    rng = random.Random(seed)
    return StageCutProblem(
        compute=[rng.uniform(1, 2) for _ in range(units)], memory=[rng.uniform(1, 2) * 1e9 for _ in range(units)],
        boundary_comm=[rng.uniform(0, 0.2) for _ in range(units - 1)], stages=stages,
        speeds=[rng.uniform(0.5, 2) for _ in range(stages)],
        capacities=[rng.uniform(1.2, 3) * 1.5e9 * units / stages for _ in range(stages)])


@pytest.mark.parametrize("seed", range(3))
def test_ilp_and_dp_agree_beyond_brute_force_reach(seed):
    cut = deep_problem(seed, units=20, stages=5)
    assert close(solve_stage_cuts(cut, method="ilp").bottleneck, solve_stage_cuts_dp(cut).bottleneck)


def test_eighty_units_on_eight_stages_uses_the_exact_dp():
    cut = deep_problem(0, units=80, stages=8)
    solution = solve_stage_cuts(cut)
    assert solution.solver == "dp" and len(solution.bounds) == 8
    assert solve_stage_cuts(deep_problem(0, units=10, stages=3)).solver == "cbc"


@pytest.mark.parametrize("kwargs, message", [
    (dict(compute=[1.0], memory=[0.0], boundary_comm=[], stages=2), r"stages must be an int in 1..1"),
    (dict(compute=[1.0, 1.0], memory=[0.0], boundary_comm=[0.0], stages=1), "memory needs 2 values"),
    (dict(compute=[1.0, 1.0], memory=[0.0] * 2, boundary_comm=[], stages=1), "boundary_comm needs 1"),
    (dict(compute=[1.0], memory=[0.0], boundary_comm=[], stages=1, speeds=[0.0]), "positive numbers"),
    (dict(compute=[-1.0], memory=[0.0], boundary_comm=[], stages=1), "non-negative"),
    (dict(compute=[], memory=[], boundary_comm=[], stages=1), "at least one unit"),
])
def test_malformed_problems_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageCutProblem(**kwargs)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be"):
        solve_stage_cuts(problem([1.0], 1), method="greedy")
