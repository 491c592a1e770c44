"""The tensor-split ILP: hand-checked optima, agreement with brute force on random problems, fast
paths, and a clear error when no assignment fits the memory budget."""
from __future__ import annotations

import math
import random

import pytest

from xirang.passes.planning.solve_splits import (SplitEdge, SplitNode, SplitProblem, Strategy, solve_splits,
                                        solve_splits_exhaustive)

SOLVERS = [solve_splits, solve_splits_exhaustive]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def megatron_mlp(budget=None):
    """x -> up -> down. Column-parallel up feeds row-parallel down with no reshard (Megatron-LM):
    col+row = 1 + 1 + 1 (all-reduce) = 3; col+rep = 1 + 4 + 2 (all-gather) = 7; rep+row = 4 + 1 + 1
    = 6; rep+rep = 8."""
    return SplitProblem(
        nodes=[SplitNode("x", [Strategy("R")]),
               SplitNode("up", [Strategy("col", compute=1, memory=10), Strategy("rep", compute=4, memory=40)]),
               SplitNode("down", [Strategy("row", compute=1, comm=1, memory=10),
                                  Strategy("rep", compute=4, memory=40)])],
        edges=[SplitEdge("x", "up", [[0, 0]]),
               SplitEdge("up", "down", [[0, 2], [0, 0]])],
        memory_budget=budget)


@pytest.mark.parametrize("solve", SOLVERS)
def test_megatron_pair_is_chosen(solve):
    solution = solve(megatron_mlp())
    assert solution.choice == {"x": "R", "up": "col", "down": "row"}
    assert solution.objective == 3.0 and solution.memory == 20.0 and solution.status == "optimal"


@pytest.mark.parametrize("solve", SOLVERS)
def test_cheap_compute_that_forces_a_reshard_loses(solve):
    """b's "S" strategy computes in 1 s instead of 3 s, but scattering its input costs 2 s and
    gathering its output 3 s: S totals 1 + 1 + 1 + 2 + 3 = 8, R totals 1 + 3 + 1 = 5."""
    problem = SplitProblem(
        nodes=[SplitNode("a", [Strategy("R", compute=1)]),
               SplitNode("b", [Strategy("S", compute=1), Strategy("R", compute=3)]),
               SplitNode("c", [Strategy("R", compute=1)])],
        edges=[SplitEdge("a", "b", [[2, 0]]), SplitEdge("b", "c", [[3], [0]])])
    solution = solve(problem)
    assert solution.choice == {"a": "R", "b": "R", "c": "R"}
    assert solution.objective == 5.0
    assert problem.cost_of({"a": "R", "b": "S", "c": "R"}) == 8.0


def budget_chain(budget):
    """a -> b -> c; replicated is fastest but heaviest. Assignments (b, c): RR costs 3 s and 210
    bytes, RS 4 s / 135, SR 1 + 3 + 1 + 4 = 9 s / 135, SS 1 + 3 + 2 = 6 s / 60."""
    return SplitProblem(
        nodes=[SplitNode("a", [Strategy("R", compute=1, memory=10)]),
               SplitNode("b", [Strategy("R", compute=1, memory=100), Strategy("S", compute=1, comm=2, memory=25)]),
               SplitNode("c", [Strategy("R", compute=1, memory=100), Strategy("S", compute=1, comm=1, memory=25)])],
        edges=[SplitEdge("a", "b", [[0, 0]]), SplitEdge("b", "c", [[0, 0], [4, 0]])],
        memory_budget=budget)


@pytest.mark.parametrize("solve", SOLVERS)
@pytest.mark.parametrize("budget, b, c, seconds", [
    (None, "R", "R", 3.0), (210, "R", "R", 3.0), (209, "R", "S", 4.0), (135, "R", "S", 4.0),
    (134, "S", "S", 6.0), (60, "S", "S", 6.0)])
def test_memory_budget_forces_a_different_choice(solve, budget, b, c, seconds):
    solution = solve(budget_chain(budget))
    assert (solution.choice["b"], solution.choice["c"], solution.objective) == (b, c, seconds)


@pytest.mark.parametrize("solve", SOLVERS)
def test_budget_below_the_minimum_names_the_minimum(solve):
    with pytest.raises(ValueError, match=r"minimum memory any assignment needs is 60 bytes, but the budget is 59"):
        solve(budget_chain(59))


def test_single_strategy_fast_path_still_checks_memory():
    nodes = [SplitNode(f"n{i}", [Strategy("R", compute=0.5, memory=8)]) for i in range(4)]
    edges = [SplitEdge(f"n{i}", f"n{i + 1}", [[0.25]]) for i in range(3)]
    solution = solve_splits(SplitProblem(nodes, edges))
    assert solution.solver == "single-strategy" and solution.objective == 2.75 and solution.memory == 32
    with pytest.raises(ValueError, match="needs is 32 bytes, but the budget is 31"):
        solve_splits(SplitProblem(nodes, edges, memory_budget=31))


def test_independent_nodes_take_their_cheapest_strategy():
    problem = SplitProblem([SplitNode("a", [Strategy("x", compute=2), Strategy("y", compute=1, comm=0.5)]),
                            SplitNode("b", [Strategy("x", compute=1)])])
    solution = solve_splits(problem)
    assert solution.solver == "independent" and solution.choice == {"a": "y", "b": "x"}


def test_parallel_and_opposite_edges_add_up():
    """Two edges a -> b and one b -> a between the same nodes: their costs add (transposed)."""
    nodes = [SplitNode("a", [Strategy("p"), Strategy("q", compute=1)]),
             SplitNode("b", [Strategy("p"), Strategy("q", compute=1)])]
    edges = [SplitEdge("a", "b", [[0, 1], [0, 0]]), SplitEdge("a", "b", [[0, 1], [5, 0]]),
             SplitEdge("b", "a", [[0, 9], [0, 0]])]
    problem = SplitProblem(nodes, edges)
    # (p,p) 0; (p,q) 1 + 2 = 3; (q,p) 1 + 5 + 9 = 15; (q,q) 2
    assert solve_splits(problem).choice == {"a": "p", "b": "p"}
    assert problem.cost_of({"a": "q", "b": "p"}) == 15.0


def random_problem(rng: random.Random) -> SplitProblem:
    """2-6 nodes with 1-3 strategies, a chain or a random DAG, costs at a random time scale."""
    scale = 10 ** rng.uniform(-6, 1)
    count = rng.randint(2, 6)
    names = [("node", i) for i in range(count)]  # any hashable name works
    nodes = [SplitNode(name, [Strategy(f"s{j}", compute=scale * rng.random(),
                                       comm=scale * rng.random() * (rng.random() < 0.5),
                                       memory=rng.choice([1e6, 1e9]) * rng.random())
                              for j in range(rng.randint(1, 3))]) for name in names]
    if rng.random() < 0.5:
        pairs = [(i, i + 1) for i in range(count - 1)]
    else:
        pairs = [(i, j) for i in range(count) for j in range(i + 1, count) if rng.random() < 0.5]
    edges = [SplitEdge(names[i], names[j],
                       [[0.0 if rng.random() < 0.3 else scale * 2 * rng.random()
                         for _ in nodes[j].strategies] for _ in nodes[i].strategies])
             for i, j in pairs]
    budget = None
    if rng.random() < 0.5:
        least = SplitProblem(nodes).min_memory
        most = sum(max(s.memory for s in n.strategies) for n in nodes)
        budget = max(0.0, least + rng.uniform(-0.1, 1) * (most - least))
    return SplitProblem(nodes, edges, budget)


def test_ilp_matches_brute_force_on_random_problems():
    rng = random.Random(20240611)
    infeasible = 0
    for case in range(200):
        problem = random_problem(rng)
        try:
            expected = solve_splits_exhaustive(problem)
        except ValueError:
            infeasible += 1
            with pytest.raises(ValueError, match="minimum memory any assignment needs"):
                solve_splits(problem)
            continue
        got = solve_splits(problem)
        assert close(got.objective, expected.objective), (case, got, expected)
        assert close(problem.cost_of(got.choice), got.objective)
        if problem.memory_budget is not None:
            assert problem.memory_of(got.choice) <= problem.memory_budget * (1 + 1e-9)
    assert 0 < infeasible < 40  # both branches were exercised


def chain_optimum(problem: SplitProblem) -> float:
    """Exact optimum of an unbudgeted chain by dynamic programming over strategies (Viterbi)."""
    best = [s.seconds for s in problem.nodes[0].strategies]
    for edge, node in zip(problem.edges, problem.nodes[1:]):
        best = [s.seconds + min(b + edge.cost[i][j] for i, b in enumerate(best))
                for j, s in enumerate(node.strategies)]
    return min(best)


def test_hundred_node_chain_is_exact():
    rng = random.Random(7)
    nodes = [SplitNode(f"layer{i}", [Strategy(f"s{j}", compute=rng.random(), comm=rng.random(),
                                              memory=rng.random() * 1e9) for j in range(4)])
             for i in range(100)]
    edges = [SplitEdge(f"layer{i}", f"layer{i + 1}",
                       [[0.0 if a == b else 2 * rng.random() for b in range(4)] for a in range(4)])
             for i in range(99)]
    problem = SplitProblem(nodes, edges)
    solution = solve_splits(problem)
    assert solution.solver == "cbc" and close(solution.objective, chain_optimum(problem))
    budgeted = SplitProblem(nodes, edges, memory_budget=0.8 * sum(n.strategies[0].memory for n in nodes))
    solution = solve_splits(budgeted)
    assert solution.memory <= budgeted.memory_budget


def test_solving_twice_gives_the_same_choice():
    problem = random_problem(random.Random(3))
    assert solve_splits(problem) == solve_splits(problem)


@pytest.mark.parametrize("build, message", [
    (lambda: SplitProblem([SplitNode("a", [Strategy("x")])], [SplitEdge("a", "b", [[0]])]), "unknown node 'b'"),
    (lambda: SplitProblem([SplitNode("a", [Strategy("x")]), SplitNode("b", [Strategy("x"), Strategy("y")])],
                          [SplitEdge("a", "b", [[0]])]), r"cost must be 1x2"),
    (lambda: SplitNode("a", [Strategy("x"), Strategy("x")]), "duplicate strategy names"),
    (lambda: SplitNode("a", []), "non-empty"),
    (lambda: SplitProblem([SplitNode("a", [Strategy("x")]), SplitNode("a", [Strategy("x")])]), "appears twice"),
    (lambda: Strategy("x", compute=-1), "compute must be a finite non-negative"),
    (lambda: SplitEdge("a", "a", [[0]]), "self-loop"),
    (lambda: SplitEdge("a", "b", [[math.nan]]), "reshard cost must be"),
])
def test_malformed_problems_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_exhaustive_refuses_huge_problems():
    nodes = [SplitNode(i, [Strategy(j) for j in range(10)]) for i in range(7)]
    with pytest.raises(ValueError, match="too many to enumerate"):
        solve_splits_exhaustive(SplitProblem(nodes))
