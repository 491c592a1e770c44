"""Cut an ordered sequence of layers into contiguous pipeline stages so the slowest stage is fastest.

Stage s runs on its own devices (speed factor ``speeds[s]``, ``capacities[s]`` bytes); its time is
its units' compute divided by its speed plus the send across its outgoing cut. In a steady pipeline
every micro-batch waits for the slowest stage, so that bottleneck sets the throughput (Narayanan et
al. 2019, PipeDream sec. 3.1). Three exact solvers agree on the bottleneck:

- ``solve_stage_cuts``: an ILP over prefix indicators z[u][s] = "unit u is in stage s or earlier",
  monotone in u and s, so stages are contiguous by construction and both a stage's compute and its
  outgoing cut are linear in z; this is the form to extend with coupled decisions.
- ``solve_stage_cuts_dp``: a dynamic programme over (stage, last unit), O(L^2 p); stages keep their
  order, so it is exact for heterogeneous devices too. ``method="auto"`` uses it for long sequences.
- ``solve_stage_cuts_exhaustive``: every composition of L into p parts (tests, tiny problems).

Memory may depend on the stage: 1F1B keeps ``p - s`` micro-batches of activations alive on stage s
(Narayanan et al. 2021, sec. 2.2), so a unit costs ``memory[u] + activation_memory[u] * in_flight[s]``.
No torch here: problems are named numbers.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import pulp
from xirang.ir.errors import InvalidValue, SolverFailure

AUTO_DP_UNITS = 24  # method="auto" switches from the ILP to the DP above this many units


def _amounts(values, what: str, length: int, *, positive: bool = False, infinite: bool = False):
    """A tuple of ``length`` non-negative (or positive) floats, or a ValueError naming ``what``."""
    values = tuple(values)
    if len(values) != length:
        raise InvalidValue(f"{what} needs {length} values, got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) or v < 0 \
                or (positive and v == 0) or (not infinite and math.isinf(v)):
            kind = "positive" if positive else "non-negative"
            raise InvalidValue(f"{what} must hold {'' if infinite else 'finite '}{kind} numbers, "
                             f"got {v!r}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True, kw_only=True)
class StageCutProblem:
    """Units in execution order, the cut costs between them, and the devices of each stage.

    ``compute[u]``: seconds of one micro-batch's forward + backward on a speed-1 device.
    ``memory[u]``: bytes unit u keeps on its stage (parameters, gradients, optimizer state, and
    activations unless they are given separately). ``boundary_comm[k]``: seconds to send across a
    cut after unit k (k = 0..L-2). ``speeds[s]`` / ``capacities[s]``: stage s's speed factor
    (default 1) and device memory in bytes (default unlimited). ``activation_memory[u]`` bytes are
    held ``in_flight[s]`` times on stage s (defaults: none, 1).
    """

    compute: tuple[float, ...]
    memory: tuple[float, ...]
    boundary_comm: tuple[float, ...]
    stages: int
    speeds: Optional[tuple[float, ...]] = None
    capacities: Optional[tuple[float, ...]] = None
    activation_memory: Optional[tuple[float, ...]] = None
    in_flight: Optional[tuple[float, ...]] = None
    unit_names: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        units, p = len(tuple(self.compute)), self.stages
        if units == 0:
            raise InvalidValue("StageCutProblem needs at least one unit")
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= units:
            raise InvalidValue(f"stages must be an int in 1..{units} (every stage holds at least one "
                             f"of the {units} units), got {p!r}")
        fields = {"compute": (self.compute, units, {}),
                  "memory": (self.memory, units, {}),
                  "boundary_comm": (self.boundary_comm, units - 1, {}),
                  "speeds": (self.speeds, p, {"positive": True}),
                  "capacities": (self.capacities, p, {"infinite": True}),
                  "activation_memory": (self.activation_memory, units, {}),
                  "in_flight": (self.in_flight, p, {})}
        defaults = {"speeds": 1.0, "capacities": math.inf, "activation_memory": 0.0, "in_flight": 1.0}
        for key, (values, length, flags) in fields.items():
            if values is None:
                values = (defaults[key],) * length
            object.__setattr__(self, key, _amounts(values, key, length, **flags))
        names = tuple(f"unit {u}" for u in range(units)) if self.unit_names is None \
            else tuple(str(n) for n in self.unit_names)
        if len(names) != units:
            raise InvalidValue(f"unit_names needs {units} names, got {len(names)}")
        object.__setattr__(self, "unit_names", names)
        prefix = lambda xs: tuple(itertools.accumulate(xs, initial=0.0))  # noqa: E731
        object.__setattr__(self, "_prefix", (prefix(self.compute), prefix(self.memory),
                                             prefix(self.activation_memory)))

    @property
    def units(self) -> int:
        return len(self.compute)

    def stage_time(self, s: int, start: int, stop: int) -> float:
        """Seconds of stage s holding units [start, stop): compute / speed + its outgoing send."""
        compute = self._prefix[0]
        send = self.boundary_comm[stop - 1] if stop < self.units else 0.0
        return (compute[stop] - compute[start]) / self.speeds[s] + send

    def stage_memory(self, s: int, start: int, stop: int) -> float:
        """Bytes stage s holds for units [start, stop)."""
        _, static, act = self._prefix
        return static[stop] - static[start] + (act[stop] - act[start]) * self.in_flight[s]

    def fits(self, s: int, start: int, stop: int) -> bool:
        return self.stage_memory(s, start, stop) <= self.capacities[s]


@dataclass(frozen=True)
class StageCutSolution:
    """Stage s holds units ``range(*bounds[s])`` (half-open); times in seconds, memory in bytes.

    ``status`` is "optimal" for every returned solution (failures raise); ``solver`` names the
    path that found it: "cbc", "dp", "exhaustive" or "single-stage" (nothing to cut).
    """

    bounds: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    bottleneck: float
    status: str = "optimal"
    solver: str = "cbc"

    @property
    def stage_of_unit(self) -> tuple[int, ...]:
        return tuple(s for s, (start, stop) in enumerate(self.bounds) for _ in range(start, stop))


def _solution(problem: StageCutProblem, bounds, solver: str) -> StageCutSolution:
    bounds = tuple((int(a), int(b)) for a, b in bounds)
    times = tuple(problem.stage_time(s, a, b) for s, (a, b) in enumerate(bounds))
    memory = tuple(problem.stage_memory(s, a, b) for s, (a, b) in enumerate(bounds))
    return StageCutSolution(bounds, times, memory, max(times), "optimal", solver)


def _min_bottleneck(problem: StageCutProblem, stage_costs):
    """(least max over stages of a stage's cost, bounds), or (inf, None). ``stage_costs(s, j)`` lists
    the cost of stage s covering [i, j) for i = s .. j-1 (one call per row, not one per pair: the
    DP is O(L^2 p) and a Python call per pair was most of the degree search on 126-layer models).

    best[s][j] is the least bottleneck of stages 0..s covering units [0, j); stage s then covers
    [i, j) for some i, and stages before it need at least one unit each, so i >= s. Ties go to the
    smallest i.
    """
    units, p = problem.units, problem.stages
    best = [[math.inf] * (units + 1) for _ in range(p)]
    start = [[-1] * (units + 1) for _ in range(p)]
    for j in range(1, units - p + 2):
        best[0][j], start[0][j] = stage_costs(0, j)[0], 0
    for s in range(1, p):
        before, row_best, row_start = best[s - 1], best[s], start[s]
        for j in range(s + 1, units - (p - 1 - s) + 1):
            least, argument = math.inf, -1
            for i, cost in zip(range(s, j), stage_costs(s, j)):
                earlier = before[i]
                if earlier < least:
                    value = earlier if earlier >= cost else cost  # max(), without the call
                    if value < least:
                        least, argument = value, i
            row_best[j], row_start[j] = least, argument
    if math.isinf(best[p - 1][units]):
        return math.inf, None
    bounds, stop = [], units
    for s in reversed(range(p)):
        bounds.append((start[s][stop], stop))
        stop = start[s][stop]
    return best[p - 1][units], bounds[::-1]


def _pairwise(stage_cost):
    """``stage_costs`` for ``_min_bottleneck`` from a cost of one (stage, start, stop)."""
    return lambda s, j: [stage_cost(s, i, j) for i in range(s, j)]


def _fitting_times(problem: StageCutProblem):
    """``stage_costs`` of stage times, infinite where the stage does not fit its memory; the same
    arithmetic as ``stage_time`` and ``fits``, so the same floats, a row at a time."""
    compute, static, activation = problem._prefix
    units, comm = problem.units, problem.boundary_comm

    def row(s, j):
        speed, cap, in_flight = problem.speeds[s], problem.capacities[s], problem.in_flight[s]
        send = comm[j - 1] if j < units else 0.0
        compute_j, static_j, activation_j = compute[j], static[j], activation[j]
        return [(compute_j - compute[i]) / speed + send
                if static_j - static[i] + (activation_j - activation[i]) * in_flight <= cap else math.inf
                for i in range(s, j)]
    return row


def _check_memory(problem: StageCutProblem) -> None:
    """Raise when no split fits: the split least loaded relative to capacity shows what is missing."""
    def load(s, a, b):  # 0 where the stage fits, else how many times its capacity it needs
        need, cap = problem.stage_memory(s, a, b), problem.capacities[s]
        if need <= cap:
            return 0.0
        return need / cap if cap else math.inf

    worst, bounds = _min_bottleneck(problem, _pairwise(load))
    if worst == 0.0:
        return
    if bounds is None:  # every split puts bytes on a zero-byte device: show the least-loaded split
        _, bounds = _min_bottleneck(problem, _pairwise(problem.stage_memory))
    s = max(range(problem.stages), key=lambda t: load(t, *bounds[t]))
    need, cap = problem.stage_memory(s, *bounds[s]), problem.capacities[s]
    a, b = bounds[s]
    units = problem.unit_names[a] if b - a == 1 else f"{problem.unit_names[a]}..{problem.unit_names[b - 1]}"
    raise InvalidValue(
        f"no cut of {problem.units} units into {problem.stages} pipeline stages fits device memory: "
        f"the split needing the least memory relative to capacity, stages {bounds} (half-open unit "
        f"ranges), still needs a minimum of {need:.6g} bytes on stage {s} ({units}), whose device "
        f"holds {cap:.6g} bytes{f' ({need / cap:.3g}x)' if cap else ''}. Use more pipeline stages, "
        f"recompute activations, or devices with more memory.")


def solve_stage_cuts(problem: StageCutProblem, *, method: str = "auto") -> StageCutSolution:
    """Contiguous stages minimising the slowest stage's time within each stage's device memory.

    ``method``: "ilp" (CBC), "dp", or "auto" (the ILP up to ``AUTO_DP_UNITS`` units, the DP above;
    both are exact and deterministic, but may break ties between equally fast cuts differently).
    """
    if method not in ("auto", "ilp", "dp"):
        raise InvalidValue(f"method must be 'auto', 'ilp' or 'dp', got {method!r}")
    if method == "dp" or (method == "auto" and problem.units > AUTO_DP_UNITS):
        return solve_stage_cuts_dp(problem)
    _check_memory(problem)
    if problem.stages == 1:
        return _solution(problem, [(0, problem.units)], "single-stage")
    return _solution(problem, _solve_ilp(problem), "cbc")


def solve_stage_cuts_dp(problem: StageCutProblem) -> StageCutSolution:
    """The same optimum by dynamic programming over (stage, last unit): O(L^2 p), no solver."""
    _, bounds = _min_bottleneck(problem, _fitting_times(problem))
    if bounds is None:  # no split fits: _check_memory says which comes closest
        _check_memory(problem)
        raise SolverFailure(f"the stage-cut DP found no split of {problem.units} units into {problem.stages} "
                            f"stages although one fits device memory")
    return _solution(problem, bounds, "dp")


def solve_stage_cuts_exhaustive(problem: StageCutProblem) -> StageCutSolution:
    """The same optimum by trying every composition of the units into stages (first one on ties)."""
    _check_memory(problem)
    units, best, best_time = problem.units, None, math.inf
    for cuts in itertools.combinations(range(1, units), problem.stages - 1):
        bounds = list(zip((0,) + cuts, cuts + (units,)))
        if all(problem.fits(s, a, b) for s, (a, b) in enumerate(bounds)):
            time = max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(bounds))
            if time < best_time:
                best, best_time = bounds, time
    return _solution(problem, best, "exhaustive")


def _solve_ilp(problem: StageCutProblem) -> list[tuple[int, int]]:
    """Bounds from the ILP in prefix indicators.

    z[u][s] = 1 when unit u sits in stage s or earlier (z[u][p-1] = 1). Unit u belongs to stage s
    exactly when z[u][s] - z[u][s-1] = 1, and stage s (s < p-1) ends at unit k exactly when
    z[k][s] - z[k+1][s] = 1, so compute, memory and the outgoing send are all linear in z. Times
    are divided by an upper bound of any stage time and memory rows by capacity, keeping CBC's
    absolute tolerances relative.
    """
    units, p = problem.units, problem.stages
    scale = (sum(problem.compute) / min(problem.speeds) + max(problem.boundary_comm, default=0.0)) or 1.0
    model = pulp.LpProblem("stage_cuts", pulp.LpMinimize)
    z = [[pulp.LpVariable(f"z_{u}_{s}", cat=pulp.LpBinary) for s in range(p - 1)] + [1]
         for u in range(units)]
    bottleneck = pulp.LpVariable("bottleneck", lowBound=0)
    model += bottleneck
    for u in range(units):
        for s in range(p - 1):
            if u + 1 < units:
                model += z[u + 1][s] <= z[u][s], f"contiguous_{u}_{s}"
            if s + 1 < p - 1:
                model += z[u][s] <= z[u][s + 1], f"ordered_{u}_{s}"

    def member(u, s):  # 1 when unit u is in stage s, as (variable or 1, coefficient) pairs
        return [(z[u][s], 1.0)] + ([(z[u][s - 1], -1.0)] if s else [])

    def expr(pairs):
        terms, constant = {}, 0.0
        for var, coef in pairs:
            if isinstance(var, int):
                constant += coef * var
            else:
                terms[var] = terms.get(var, 0.0) + coef
        return pulp.LpAffineExpression([(v, c) for v, c in terms.items() if c], constant=constant)

    for s in range(p):
        size = [pair for u in range(units) for pair in member(u, s)]
        model += expr(size) >= 1, f"nonempty_{s}"
        time = [(var, coef * problem.compute[u] / problem.speeds[s] / scale)
                for u in range(units) for var, coef in member(u, s)]
        if s < p - 1:
            time += [(var, coef * problem.boundary_comm[k] / scale) for k in range(units - 1)
                     for var, coef in ((z[k][s], 1.0), (z[k + 1][s], -1.0))]
        model += expr(time) <= bottleneck, f"time_{s}"
        cap = problem.capacities[s]
        if math.isfinite(cap):
            unit = cap or 1.0
            need = [(var, coef * problem.stage_memory(s, u, u + 1) / unit)
                    for u in range(units) for var, coef in member(u, s)]
            model += expr(need) <= cap / unit, f"memory_{s}"

    model.solve(pulp.PULP_CBC_CMD(msg=False))
    status = pulp.LpStatus[model.status]
    if status != "Optimal":
        raise SolverFailure(f"CBC returned status {status!r} for a stage-cut problem of {units} "
                           f"units and {p} stages that has a feasible split")
    ends = [sum(round(z[u][s].varValue or 0.0) for u in range(units)) for s in range(p - 1)]
    starts = [0] + ends
    return list(zip(starts, ends + [units]))
