"""Solve times of the two ILPs on the sizes the planner meets (timings belong here, not in tests).

    python benchmarks/solvers.py
"""
from __future__ import annotations

import platform
import random
import time

from xirang.passes.planning.solve_splits import SplitEdge, SplitNode, SplitProblem, Strategy, solve_splits
from xirang.passes.planning.solve_stage_cuts import StageCutProblem, solve_stage_cuts


def chain(n: int, strategies: int, seed: int = 7) -> SplitProblem:
    rng = random.Random(seed)
    nodes = [SplitNode(f"op{i}", [Strategy(f"s{j}", compute=rng.random(), comm=rng.random(), memory=rng.random() * 1e9)
                                  for j in range(strategies)]) for i in range(n)]
    edges = [SplitEdge(f"op{i}", f"op{i + 1}", [[0.0 if a == b else 2 * rng.random() for b in range(strategies)]
                                                 for a in range(strategies)]) for i in range(n - 1)]
    return SplitProblem(nodes, edges)


def stages(units: int, p: int, seed: int = 0) -> StageCutProblem:
    rng = random.Random(seed)
    return StageCutProblem(compute=[rng.uniform(0.5, 1.5) for _ in range(units)], memory=[1e9] * units,
                           boundary_comm=[rng.uniform(0, 0.1) for _ in range(units - 1)], stages=p,
                           speeds=[1.0] * p, capacities=[4e9 * units / p] * p)


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    print(f"machine: {platform.machine()}, python {platform.python_version()}; best of 3")
    for n in (100, 400):
        seconds = timed(lambda n=n: solve_splits(chain(n, 4)))
        print(f"tensor-split ILP, {n}-op chain x4 strategies: {seconds:.3f} s")
    for units, p in ((80, 8), (96, 16)):
        seconds = timed(lambda units=units, p=p: solve_stage_cuts(stages(units, p), method="dp"))
        print(f"stage cuts DP, {units} units on {p} stages: {seconds:.3f} s")
    print(f"stage cuts ILP, 24 units on 8 stages: {timed(lambda: solve_stage_cuts(stages(24, 8), method='ilp')):.3f} s")
