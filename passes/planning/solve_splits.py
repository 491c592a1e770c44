"""Choose one sharding strategy per node so compute, collectives and resharding cost least (an ILP).

Every node has candidate strategies (rows of the sharding-rule table, priced by the cost model);
every edge says how many seconds it takes to turn what the producer's strategy writes into what
the consumer's strategy reads. Picking one strategy per node and paying node plus edge costs is the
quadratic assignment of Alpa's intra-operator pass (Zheng et al. 2022, sec. 4.2). The edge products
are linearised with one continuous variable per (edge, strategy pair) whose row sums equal the
producer's choice and column sums the consumer's: exact whenever the node choices are 0/1, and the
LP relaxation of this "local polytope" is already integral on trees (Wainwright & Jordan 2008,
sec. 8.4), so chains of layers solve at CBC's root node.

No torch here: a problem is named numbers, so tests hand-check optima against the brute-force
``solve_splits_exhaustive``.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Hashable, Optional

from xirang.ir.errors import InvalidValue
from xirang.passes.planning.solve_cbc import LinearProgram, solve_cbc

EXHAUSTIVE_LIMIT = 1_000_000  # assignments solve_splits_exhaustive is willing to enumerate


def _amount(value, what: str, *parts) -> float:
    """A finite non-negative number (seconds or bytes) as a float, or a ValueError naming
    ``what.format(*parts)`` (formatted only then: split problems hold tens of thousands of numbers)."""
    if type(value) is float and 0.0 <= value < math.inf:  # the usual case; numbers.Real's check is slow
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0:
        raise InvalidValue(f"{what.format(*parts)} must be a finite non-negative number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Strategy:
    """One way to run a node, and what it costs on its own (before resharding its inputs).

    ``compute`` and ``comm`` are seconds per step (``comm``: collectives the strategy itself issues,
    such as the all-reduce after a row-parallel matmul); ``memory`` is bytes per device.
    """

    name: Hashable
    compute: float = 0.0
    memory: float = 0.0
    comm: float = 0.0

    def __post_init__(self):
        for key in ("compute", "memory", "comm"):
            object.__setattr__(self, key, _amount(getattr(self, key), "strategy {!r} {}", self.name, key))

    @property
    def seconds(self) -> float:
        return self.compute + self.comm


@dataclass(frozen=True)
class SplitNode:
    """A node (any hashable name, usually the FX node name) and its candidate strategies."""

    name: Hashable
    strategies: tuple[Strategy, ...]

    def __post_init__(self):
        strategies = tuple(self.strategies)
        if not strategies or not all(isinstance(s, Strategy) for s in strategies):
            raise InvalidValue(f"node {self.name!r} needs a non-empty sequence of Strategy, "
                             f"got {self.strategies!r}")
        names = [s.name for s in strategies]
        if len(set(names)) != len(names):
            raise InvalidValue(f"node {self.name!r} has duplicate strategy names {names}")
        object.__setattr__(self, "strategies", strategies)


@dataclass(frozen=True)
class SplitEdge:
    """Data flowing from ``producer`` to ``consumer``; ``cost[i][j]`` is the seconds to reshard.

    Row i follows the producer's strategy order, column j the consumer's; 0 where the producer's
    output already has the layout the consumer's strategy reads.
    """

    producer: Hashable
    consumer: Hashable
    cost: tuple[tuple[float, ...], ...]

    def __post_init__(self):
        where = f"edge {self.producer!r} -> {self.consumer!r}"
        if self.producer == self.consumer:
            raise InvalidValue(f"{where} is a self-loop; a node cannot feed itself")
        try:
            rows = tuple(tuple(_amount(c, "{} reshard cost", where) for c in row) for row in self.cost)
        except TypeError:
            raise InvalidValue(f"{where}: cost must be a matrix (sequence of rows), got {self.cost!r}") \
                from None
        object.__setattr__(self, "cost", rows)


@dataclass(frozen=True)
class SplitProblem:
    """Nodes with strategies, resharding edges, and optionally a per-device memory budget (bytes)."""

    nodes: tuple[SplitNode, ...]
    edges: tuple[SplitEdge, ...] = ()
    memory_budget: Optional[float] = None

    def __post_init__(self):
        nodes, edges = tuple(self.nodes), tuple(self.edges)
        if not all(isinstance(n, SplitNode) for n in nodes) \
                or not all(isinstance(e, SplitEdge) for e in edges):
            raise InvalidValue("SplitProblem takes a sequence of SplitNode and a sequence of SplitEdge")
        index = {}
        for i, node in enumerate(nodes):
            if node.name in index:
                raise InvalidValue(f"node {node.name!r} appears twice in the split problem")
            index[node.name] = i
        for edge in edges:
            for end in (edge.producer, edge.consumer):
                if end not in index:
                    raise InvalidValue(f"edge {edge.producer!r} -> {edge.consumer!r} names unknown "
                                     f"node {end!r}")
            rows = len(nodes[index[edge.producer]].strategies)
            cols = len(nodes[index[edge.consumer]].strategies)
            if len(edge.cost) != rows or any(len(row) != cols for row in edge.cost):
                raise InvalidValue(f"edge {edge.producer!r} -> {edge.consumer!r}: cost must be "
                                 f"{rows}x{cols} (producer strategies x consumer strategies), got "
                                 f"{[len(row) for row in edge.cost]} row lengths")
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", _amount(self.memory_budget, "memory_budget"))
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "_index", index)

    @property
    def min_memory(self) -> float:
        """Bytes the leanest assignment needs: memory adds up per node, so each node's minimum."""
        return math.fsum(min(s.memory for s in n.strategies) for n in self.nodes)

    def _picks(self, choice: dict) -> list[int]:
        """Strategy index per node, in node order, from ``{node name: strategy name}``."""
        picks = []
        for node in self.nodes:
            names = [s.name for s in node.strategies]
            if node.name not in choice or choice[node.name] not in names:
                raise InvalidValue(f"choice for node {node.name!r} must be one of {names}, "
                                 f"got {choice.get(node.name, '<missing>')!r}")
            picks.append(names.index(choice[node.name]))
        return picks

    def _cost(self, picks) -> float:
        index = self._index
        terms = [n.strategies[i].seconds for n, i in zip(self.nodes, picks)]
        terms += [e.cost[picks[index[e.producer]]][picks[index[e.consumer]]] for e in self.edges]
        return math.fsum(terms)

    def _memory(self, picks) -> float:
        return math.fsum(n.strategies[i].memory for n, i in zip(self.nodes, picks))

    def cost_of(self, choice: dict) -> float:
        """Seconds of an assignment ``{node: strategy name}``: node compute + comm + resharding."""
        return self._cost(self._picks(choice))

    def memory_of(self, choice: dict) -> float:
        """Bytes per device of an assignment ``{node: strategy name}``."""
        return self._memory(self._picks(choice))


@dataclass(frozen=True)
class SplitSolution:
    """The chosen strategy name per node, its cost in seconds and memory in bytes.

    ``status`` is "optimal" for every returned solution (failures raise); ``solver`` says which
    path found it: "cbc", "single-strategy" (nothing to choose), "independent" (no edges, no budget)
    or "exhaustive".
    """

    choice: dict
    objective: float
    status: str = "optimal"
    memory: float = 0.0
    solver: str = "cbc"


def _check_budget(problem: SplitProblem) -> None:
    """Raise if no assignment fits: memory is separable, so the per-node minima decide."""
    budget, need = problem.memory_budget, problem.min_memory
    if budget is not None and need > budget:
        heavy = max(problem.nodes, key=lambda n: min(s.memory for s in n.strategies))
        raise InvalidValue(
            f"no strategy assignment fits the memory budget: the minimum memory any assignment "
            f"needs is {need:.6g} bytes, but the budget is {budget:.6g} bytes (largest minimum: node "
            f"{heavy.name!r}, {min(s.memory for s in heavy.strategies):.6g} bytes). Raise the budget, "
            f"add strategies that shard more, or recompute activations.")


def _solution(problem: SplitProblem, picks, solver: str) -> SplitSolution:
    choice = {n.name: n.strategies[i].name for n, i in zip(problem.nodes, picks)}
    return SplitSolution(choice, problem._cost(picks), "optimal", problem._memory(picks), solver)


def solve_splits(problem: SplitProblem) -> SplitSolution:
    """Least-cost strategy per node within the memory budget (CBC, deterministic, single thread)."""
    _check_budget(problem)
    if all(len(n.strategies) == 1 for n in problem.nodes):
        return _solution(problem, [0] * len(problem.nodes), "single-strategy")
    if not problem.edges and problem.memory_budget is None:
        picks = [min(range(len(n.strategies)), key=lambda i: n.strategies[i].seconds)
                 for n in problem.nodes]
        return _solution(problem, picks, "independent")
    return _solution(problem, _solve_ilp(problem), "cbc")


def _merged_edges(problem: SplitProblem) -> dict[tuple[int, int], list[list[float]]]:
    """Edges keyed by (lower node index, higher), parallel and opposite edges summed into one matrix.

    One matrix per node pair keeps one set of pair variables per pair; all-zero matrices are dropped.
    """
    index, merged = problem._index, {}
    for edge in problem.edges:
        u, v, cost = index[edge.producer], index[edge.consumer], edge.cost
        if u > v:
            u, v, cost = v, u, tuple(zip(*cost))
        rows, cols = len(problem.nodes[u].strategies), len(problem.nodes[v].strategies)
        acc = merged.setdefault((u, v), [[0.0] * cols for _ in range(rows)])
        for i in range(rows):
            for j in range(cols):
                acc[i][j] += cost[i][j]
    return {pair: m for pair, m in merged.items() if any(any(row) for row in m)}


def _solve_ilp(problem: SplitProblem) -> list[int]:
    """Strategy index per node from the linearised ILP."""
    program, x = split_program(problem)
    values = solve_cbc(program, f"a split problem of {len(problem.nodes)} nodes that has a feasible assignment "
                                f"(minimum memory fits the budget)")
    return [0 if len(row) == 1 else max(range(len(row)), key=lambda i: values[row[i]]) for row in x]


def split_program(problem: SplitProblem) -> tuple[LinearProgram, list[list]]:
    """The linearised ILP as CBC reads it, and per node the columns of its strategies ([1]: one strategy).

    Costs are divided by the largest one and the memory row by the budget, so CBC's absolute
    tolerances (about 1e-7 to 1e-10) act on numbers near 1 whether costs are micro- or whole seconds.
    Columns, rows and their names are those the PuLP model of it had (``solve_cbc``: the same file).
    """
    nodes, edges = problem.nodes, _merged_edges(problem)
    scale = max([s.seconds for n in nodes for s in n.strategies]
                + [c for m in edges.values() for row in m for c in row]) or 1.0
    program = LinearProgram()
    # x[n][i]: node n runs strategy i; a node with one strategy is the constant 1
    x: list[list] = []
    for n, node in enumerate(nodes):
        if len(node.strategies) == 1:
            x.append([1])
            continue
        row = [program.add_binary(f"x_{n}_{i}") for i in range(len(node.strategies))]
        program.add_row("E", dict.fromkeys(row, 1), 1)  # one_strategy_{n}
        x.append(row)

    add = program.add_objective  # objective: seconds / scale per column; a fixed node's share is a constant
    for n, node in enumerate(nodes):
        if len(x[n]) > 1:
            for i, s in enumerate(node.strategies):
                add(x[n][i], s.seconds / scale)
    for e, ((u, v), matrix) in enumerate(edges.items()):
        if len(x[u]) == 1 or len(x[v]) == 1:  # one side fixed: the edge cost is linear in the other
            if len(x[u]) > 1 or len(x[v]) > 1:
                for i, j in itertools.product(range(len(x[u])), range(len(x[v]))):
                    add(x[u][i] if len(x[u]) > 1 else x[v][j], matrix[i][j] / scale)
            continue
        # y[i][j] = x[u][i] * x[v][j] via the marginal constraints (rows sum to x_u, columns to x_v)
        y = [[f"y_{e}_{i}_{j}" for j in range(len(x[v]))] for i in range(len(x[u]))]
        for i, row in enumerate(y):  # rows_{e}_{i}
            program.add_row("E", {**dict.fromkeys(row, 1), x[u][i]: -1}, 0)
        for j in range(len(x[v])):  # cols_{e}_{j}
            program.add_row("E", {**{row[j]: 1 for row in y}, x[v][j]: -1}, 0)
        for i, row in enumerate(y):
            for j, var in enumerate(row):
                add(var, matrix[i][j] / scale)

    budget = problem.memory_budget
    if budget is not None:
        unit = budget or 1.0
        fixed = math.fsum(n.strategies[0].memory for n, row in zip(nodes, x) if len(row) == 1)
        row = {var: s.memory / unit for n, vars_ in zip(nodes, x) if len(vars_) > 1
               for var, s in zip(vars_, n.strategies) if s.memory}
        if row:
            program.add_row("L", row, (budget - fixed) / unit)  # memory_budget

    return program, x


def solve_splits_exhaustive(problem: SplitProblem) -> SplitSolution:
    """Least-cost assignment by trying every one (the reference for tests and tiny problems).

    Ties go to the first assignment in strategy order, so results are deterministic.
    """
    _check_budget(problem)
    sizes = [len(n.strategies) for n in problem.nodes]
    if math.prod(sizes) > EXHAUSTIVE_LIMIT:
        raise InvalidValue(f"{math.prod(sizes)} assignments is too many to enumerate "
                         f"(limit {EXHAUSTIVE_LIMIT}); use solve_splits")
    budget, best, best_cost = problem.memory_budget, None, math.inf
    for picks in itertools.product(*(range(k) for k in sizes)):
        if budget is not None and problem._memory(picks) > budget:
            continue
        cost = problem._cost(picks)
        if cost < best_cost:
            best, best_cost = picks, cost
    return _solution(problem, list(best), "exhaustive")
