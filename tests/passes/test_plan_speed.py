"""What planning does to be fast changes no result: splits priced two at a time give the search what
one at a time gives, each (tp, micro-batch) priced once, the first failure in order raised; the
analysis lints its graph once unless asked after every pass; the search's cuts for time alone are shared
by candidates with equal unit times, the stage-cut DP keeps its cuts on ties, and the cyclic garbage
collector pauses while analysing (restored after). (Timings: benchmarks/plan_speed.py.)"""
from __future__ import annotations

import gc
import importlib
import itertools
import math
import random
from collections import Counter

import pulp
import pytest
import torch
from test_plan_search import pricer, tiny_device, unit
from test_solve_splits import random_problem

from examples.catalog import gpt_tiny
from xirang.ir.device import GiB
from xirang.ir.errors import XirangError
from xirang.ir.world import World
from xirang.passes.analysis.trace_normalize import canonical_names
from xirang.passes.planning import plan_partition, plan_search
from xirang.passes.planning.plan_partition import UnitTable
from xirang.passes.planning import solve_splits
from xirang.passes.planning.solve_cbc import LinearProgram, solve_cbc
from xirang.passes.planning.solve_splits import SplitEdge, SplitNode, SplitProblem, Strategy, split_program
from xirang.passes.planning.solve_stage_cuts import StageCutProblem, solve_stage_cuts_dp
from xirang.pipeline import ANALYSIS_PASSES

analyze_module = importlib.import_module("xirang.analyze")  # the module: ``xirang.analyze`` is also the function


def _units(tp, b):
    return [unit("segment:0", 0.3 * b / tp, params=10_000_000 // tp, cut=1e6 * b)] + \
           [unit(f"block:{i}", (1.0 + 0.1 * i) * b / tp + 0.01, params=50_000_000 // tp, saved=3e9 * b / tp,
                 inputs=1e8 * b, cut=1e6 * b) for i in range(6)]


def _search(price):
    return plan_search.search_plan(price, World.uniform(2, 4, tiny_device(40 * GiB)), global_batch=32, seq=8)


def test_splits_priced_on_threads_give_the_sequential_search(monkeypatch):
    threaded = pricer(_units)
    together = _search(threaded)
    monkeypatch.setattr(plan_search, "SPLIT_WORKERS", 1)
    alone = _search(pricer(_units))
    assert plan_search.SPLIT_WORKERS == 1 and together.splits_priced > 2
    assert set(Counter(threaded.calls).values()) == {1}  # every (tp, micro-batch) once
    assert together.best == alone.best and together.alternatives == alone.alternatives
    assert (together.candidates, together.priced, together.splits_priced) == \
        (alone.candidates, alone.priced, alone.splits_priced)
    assert together.price_cpu_seconds > 0


def test_the_first_failing_split_in_order_is_raised():
    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        if (tp, micro_batch) in ((2, 1), (4, 2)):
            raise XirangError(f"cannot split tp={tp} b={micro_batch}")
        return pricer(_units)(tp, tp_group, micro_batch, seq)
    with pytest.raises(XirangError, match="tp=2 b=1"):
        _search(price)


def test_analysis_lints_once_unless_asked_after_each_pass(monkeypatch):
    linted = []
    monkeypatch.setattr(analyze_module, "lint_graph", lambda gm, done_pass, done: linted.append(done_pass.name))
    model, batch = gpt_tiny()
    analyze_module.analyze(model, example_kwargs=batch)
    assert linted == [ANALYSIS_PASSES[-1].name]  # the pass manager itself linted nothing
    pass_manager = importlib.import_module("xirang.pass_manager")
    monkeypatch.setattr(pass_manager, "lint_graph", lambda gm, done_pass, done: linted.append(done_pass.name))
    linted.clear()
    analyze_module.analyze(model, example_kwargs=batch, lint_each_pass=True)
    assert linted == [p.name for p in ANALYSIS_PASSES]


def test_fastest_cuts_are_fit_stages_with_memory_ignored_and_shared_by_equal_times():
    rng = random.Random(7)
    for units in (5, 17, 40):
        seconds = tuple(rng.choice((1.0, 1.5, 2.0)) for _ in range(units))  # ties on purpose
        sends = tuple(rng.choice((0.0, 0.1, 0.3)) for _ in range(units - 1))
        for stages in sorted({1, 2, 3, units // 2, units}):
            cached_before = plan_partition._cut_once.cache_info().hits
            for static in (0.0, 5e9):  # bytes and in-flight counts differ; the cut for time alone does not
                table = UnitTable(seconds, (static,) * units, (1e9,) * units, sends)
                in_flight = [float(stages - s) for s in range(stages)]
                assert plan_partition.fastest_cuts(table, stages) == \
                    plan_partition.fit_stages(table, stages, [math.inf] * stages, in_flight)
            assert plan_partition._cut_once.cache_info().hits == cached_before + 1  # the second table: reused


def _first_best_cuts(problem):
    """The DP as first written (one call per (stage, start, stop)), to hold the row-at-a-time DP to
    the same cut on ties, not only the same bottleneck."""
    units, p = problem.units, problem.stages
    best = [[math.inf] * (units + 1) for _ in range(p)]
    start = [[-1] * (units + 1) for _ in range(p)]

    def cost(s, a, b):
        return problem.stage_time(s, a, b) if problem.fits(s, a, b) else math.inf
    for j in range(1, units - p + 2):
        best[0][j], start[0][j] = cost(0, 0, j), 0
    for s in range(1, p):
        for j in range(s + 1, units - (p - 1 - s) + 1):
            for i in range(s, j):
                if best[s - 1][i] < best[s][j]:
                    value = max(best[s - 1][i], cost(s, i, j))
                    if value < best[s][j]:
                        best[s][j], start[s][j] = value, i
    if math.isinf(best[p - 1][units]):
        return None  # nothing fits
    bounds, stop = [], units
    for s in reversed(range(p)):
        bounds.append((start[s][stop], stop))
        stop = start[s][stop]
    return tuple(bounds[::-1])


def test_stage_cut_dp_breaks_ties_as_the_pairwise_dp():
    rng = random.Random(11)
    for _ in range(40):
        units = rng.randint(2, 30)
        stages = rng.randint(1, units)
        problem = StageCutProblem(
            compute=[rng.choice((1.0, 2.0, 3.0)) for _ in range(units)],
            memory=[rng.choice((1.0, 2.0)) for _ in range(units)],
            boundary_comm=[rng.choice((0.0, 0.5)) for _ in range(units - 1)], stages=stages,
            speeds=[rng.choice((1.0, 2.0)) for _ in range(stages)],
            capacities=[rng.choice((6.0, 40.0)) for _ in range(stages)],
            activation_memory=[0.5] * units, in_flight=[float(stages - s) for s in range(stages)])
        expected = _first_best_cuts(problem)
        if expected is None:
            with pytest.raises(XirangError, match="fits device memory"):
                solve_stage_cuts_dp(problem)
        else:
            assert solve_stage_cuts_dp(problem).bounds == expected


def test_the_cyclic_collector_is_off_while_analysing_and_restored_after(monkeypatch):
    seen = []
    monkeypatch.setattr(analyze_module, "lint_graph", lambda gm, done_pass, done: seen.append(gc.isenabled()))
    model, batch = gpt_tiny()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            analyze_module.analyze(model, example_kwargs=batch)
            assert gc.isenabled() == enabled
        finally:
            gc.enable()
    assert seen == [False, False]


def _pulp_model(problem):
    """The split ILP as solve_splits built it through PuLP's objects before ``solve_cbc`` (the reference
    the direct writer must match byte for byte), and per node its variables."""
    nodes, edges = problem.nodes, solve_splits._merged_edges(problem)
    scale = max([s.seconds for n in nodes for s in n.strategies]
                + [c for m in edges.values() for row in m for c in row]) or 1.0
    model, x, terms = pulp.LpProblem("splits", pulp.LpMinimize), [], {}
    for n, node in enumerate(nodes):
        if len(node.strategies) == 1:
            x.append([1])
            continue
        row = [pulp.LpVariable(f"x_{n}_{i}", cat=pulp.LpBinary) for i in range(len(node.strategies))]
        model += pulp.lpSum(row) == 1, f"one_strategy_{n}"
        x.append(row)

    def add(var, coef):
        if coef != 0 and not isinstance(var, int):
            terms[var] = terms.get(var, 0.0) + coef
    for n, node in enumerate(nodes):
        for i, s in enumerate(node.strategies):
            add(x[n][i], s.seconds / scale)
    for e, ((u, v), matrix) in enumerate(edges.items()):
        if len(x[u]) == 1 or len(x[v]) == 1:
            for i, j in itertools.product(range(len(x[u])), range(len(x[v]))):
                add(x[u][i] if len(x[u]) > 1 else x[v][j], matrix[i][j] / scale)
            continue
        y = [[pulp.LpVariable(f"y_{e}_{i}_{j}", lowBound=0) for j in range(len(x[v]))] for i in range(len(x[u]))]
        for i, row in enumerate(y):
            model += pulp.lpSum(row) == x[u][i], f"rows_{e}_{i}"
        for j in range(len(x[v])):
            model += pulp.lpSum(row[j] for row in y) == x[v][j], f"cols_{e}_{j}"
        for i, row in enumerate(y):
            for j, var in enumerate(row):
                add(var, matrix[i][j] / scale)
    model += pulp.LpAffineExpression(list(terms.items()))
    if problem.memory_budget is not None:
        unit = problem.memory_budget or 1.0
        fixed = math.fsum(n.strategies[0].memory for n, row in zip(nodes, x) if len(row) == 1)
        row = [(var, s.memory / unit) for n, vars_ in zip(nodes, x) if len(vars_) > 1
               for var, s in zip(vars_, n.strategies) if s.memory]
        if row:
            model += pulp.LpAffineExpression(row) <= (problem.memory_budget - fixed) / unit, "memory_budget"
    return model, x


def test_split_ilps_reach_cbc_as_the_file_pulp_writes_and_solve_alike(tmp_path):
    """solve_cbc writes the MPS text itself: it must be PuLP's byte for byte (CBC breaks exact ties by
    the file it reads, and plans name the tie it picked), and CBC's answer must be PuLP's."""
    rng = random.Random(5)
    problems = [random_problem(rng) for _ in range(40)]
    free = [SplitNode(name, [Strategy("p"), Strategy("q")]) for name in "ab"]  # nothing costs: PuLP's dummy column
    zero = SplitProblem(free, [SplitEdge("a", "b", [[0.0, 0.0], [0.0, 0.0]])], memory_budget=0.0)
    solved = 0
    for case, problem in enumerate(problems + [zero]):
        if problem.memory_budget is not None and problem.min_memory > problem.memory_budget or \
                all(len(n.strategies) == 1 for n in problem.nodes):
            continue
        model, x = _pulp_model(problem)
        model.writeMPS(str(tmp_path / "pulp.mps"), rename=1)
        assert split_program(problem)[0].mps_text()[0] == (tmp_path / "pulp.mps").read_text(), case
        if solved < 12:  # CBC twice per problem: a dozen is enough to hold the reading of the answer
            model.solve(pulp.PULP_CBC_CMD(msg=False))
            expected = [0 if len(r) == 1 else max(range(len(r)), key=lambda i: r[i].varValue or 0.0) for r in x]
            assert solve_splits._solve_ilp(problem) == expected, case
            solved += 1
    assert solved == 12


def test_canonical_names_in_place_leave_the_graph_a_node_by_node_copy_would():
    """Renaming in place (not through a copy) must leave what the copy left: names, each node's users in
    graph order (stamping appends readers out of order; later passes walk users), plain generated code."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    late = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2), name="mul_6")
    with graph.inserting_before(late):  # made after `late`, placed before it: x's users are out of order
        early = graph.call_function(torch.ops.aten.neg.default, (x,), name="neg_3")
    total = graph.call_function(torch.ops.aten.add.Tensor, (early, late), name="add_9")
    graph.output((total,))
    assert list(x.users) == [late, early]
    renamed = canonical_names(graph)
    assert renamed is graph and [n.name for n in graph.nodes] == ["x", "neg", "mul", "add", "output"]
    assert list(x.users) == [early, late]
    code = torch.fx.GraphModule(torch.nn.Module(), graph).code
    assert "def forward(self, x):" in code and "neg = torch.ops.aten.neg.default(x)" in code


def test_a_cbc_run_past_its_time_limit_is_stopped_and_named():
    program = LinearProgram()
    x = program.add_binary("x")
    program.add_row("L", {x: 1.0}, 1.0)
    program.add_objective(x, -1.0)
    assert solve_cbc(program, "a one-column ILP") == {"x": 1.0}
    # no process starts, runs and exits in a microsecond: the limit is what stops it here
    with pytest.raises(XirangError, match=r"did not finish a one-column ILP within 1e-06 s"):
        solve_cbc(program, "a one-column ILP", timeout_s=1e-6)
