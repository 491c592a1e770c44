"""Fast contiguous stage cuts for the degree search: bisection on the bottleneck, greedy feasibility.

The search prices thousands of candidates, so it cannot run an exact solver on each. For a trial
bottleneck T, the greedy check gives each stage, in order, the longest run of units whose time
(plus the send at its outgoing cut) stays within T and whose memory fits the stage's device, while
leaving at least one unit for every later stage. When stage time and memory only grow as a stage
takes more units (true when the cut sends cost the same everywhere, as between identical layers),
the greedy uses the fewest stages for T, so bisection on T finds the optimal bottleneck to the
bisection tolerance (Nicol 1994, "Rectilinear partitioning of irregular data parallel
computations"). Uneven cut costs make it a heuristic; the search re-solves its top candidates with
the exact ``solve_stage_cuts``. Prefix sums make a stage O(log units), a check O(stages log units).

Devices of different speeds (``speeds[s]``, a mixed World: ``device_speeds``): stage s's time is its
units' time over its speed, so the check gives stage s the units that take at most T · speeds[s] on the
reference; the whole stage time is scaled (its cut send too), which the price of the cut does not do
(``plan_costs`` scales compute only): the fast cut is then a heuristic, and the exact solver re-cuts.
No torch here.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence
from xirang.ir.errors import InvalidValue

Bounds = tuple[tuple[int, int], ...]
TOLERANCE = 1e-6  # relative: bisection stops when the bracket is this narrow


@dataclass(frozen=True)
class UnitTable:
    """Per-unit numbers of one (tp, micro-batch, recompute) in execution order.

    ``seconds``: one micro-batch's forward + backward; ``static_bytes``: parameters, gradients and
    optimizer states; ``activation_bytes``: kept per micro-batch in flight; ``cut_seconds[k]``: the
    sends across a cut after unit k (k < units - 1).
    """

    seconds: tuple[float, ...]
    static_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    cut_seconds: tuple[float, ...]

    def __post_init__(self):
        prefix = lambda xs: list(itertools.accumulate(xs, initial=0.0))  # noqa: E731
        object.__setattr__(self, "_time", prefix(self.seconds))
        object.__setattr__(self, "_static", prefix(self.static_bytes))
        object.__setattr__(self, "_act", prefix(self.activation_bytes))
        object.__setattr__(self, "_min_cut", min(self.cut_seconds, default=0.0))

    @property
    def units(self) -> int:
        return len(self.seconds)

    def stage_time(self, start: int, stop: int) -> float:
        send = self.cut_seconds[stop - 1] if stop < self.units else 0.0
        return self._time[stop] - self._time[start] + send

    def stage_memory(self, start: int, stop: int, in_flight: float) -> float:
        return (self._static[stop] - self._static[start]
                + (self._act[stop] - self._act[start]) * in_flight)

    @property
    def total_seconds(self) -> float:
        return self._time[-1]


def _longest_stage(table: UnitTable, start: int, limit: int, bound: float,
                   cap: float, in_flight: float) -> int:
    """The largest stop in (start, limit] with time <= bound and memory <= cap, or start if none."""
    # the search calls this ~300k times: stage_time is written out here (the same arithmetic)
    time, cuts, units = table._time, table.cut_seconds, len(table.seconds)
    if limit == units and time[limit] - time[start] <= bound:
        stop = limit  # the last stage sends nothing
    else:
        # time[stop] + cut <= bound + time[start]; with the cheapest cut this bounds stop from above
        reach = bisect.bisect_right(time, bound + time[start] - table._min_cut, lo=start) - 1
        stop = limit if limit < reach else reach
        if stop < start:
            stop = start
        while stop > start and time[stop] - time[start] + (cuts[stop - 1] if stop < units else 0.0) > bound:
            stop -= 1
    if math.isfinite(cap) and stop > start and table.stage_memory(start, stop, in_flight) > cap:
        lo, hi = start, stop  # memory grows with stop: the largest stop that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if table.stage_memory(start, mid, in_flight) <= cap:
                lo = mid
            else:
                hi = mid - 1
        stop = lo
        while stop > start and table.stage_time(start, stop) > bound:  # a cut elsewhere may cost more
            stop -= 1
    return stop


def greedy_cuts(table: UnitTable, stages: int, bound: float, caps: Sequence[float],
                in_flight: Sequence[float], speeds: Optional[Sequence[float]] = None) -> Optional[Bounds]:
    """Stages within ``bound`` seconds and their caps, greedily; None when the greedy finds none.
    ``speeds[s]``: stage s runs that many times faster than the table says (None: all 1)."""
    units, start, bounds = table.units, 0, []
    for s in range(stages):
        reach = bound if speeds is None else bound * speeds[s]
        stop = _longest_stage(table, start, units - (stages - 1 - s), reach, caps[s], in_flight[s])
        if stop == start:
            return None
        bounds.append((start, stop))
        start = stop
    return tuple(bounds) if start == units else None


def fit_stages(table: UnitTable, stages: int, caps: Sequence[float],
               in_flight: Sequence[float], speeds: Optional[Sequence[float]] = None) -> Optional[Bounds]:
    """Contiguous cuts into ``stages`` minimising the slowest stage within each stage's memory cap
    (``caps[s]`` bytes, activations held ``in_flight[s]`` times); None when no greedy cut fits.
    Candidates that differ only in what the table does not hold (dp, say) ask the same question:
    each distinct one is answered once (``_cut_once``). ``speeds``: per stage, a mixed World's (module doc)."""
    if not 1 <= stages <= table.units:
        raise InvalidValue(f"stages must be in 1..{table.units}, got {stages}")
    return _cut_once(tuple(table.seconds), tuple(table.static_bytes), tuple(table.activation_bytes),
                     tuple(table.cut_seconds), stages, tuple(caps), tuple(in_flight),
                     None if speeds is None else tuple(speeds))


def fastest_cuts(table: UnitTable, stages: int, speeds: Optional[Sequence[float]] = None) -> Optional[Bounds]:
    """``fit_stages`` with memory ignored: that reads only the units' seconds and the cut sends, which
    candidates differing in dp, ZeRO or memory share, so each (seconds, sends, stages) is cut once."""
    if not 1 <= stages <= table.units:
        raise InvalidValue(f"stages must be in 1..{table.units}, got {stages}")
    nothing = (0.0,) * table.units  # bytes are not read when every cap is infinite
    return _cut_once(tuple(table.seconds), nothing, nothing, tuple(table.cut_seconds), stages,
                     (math.inf,) * stages, (1.0,) * stages, None if speeds is None else tuple(speeds))


@functools.lru_cache(maxsize=4096)
def _cut_once(seconds, static_bytes, activation_bytes, cut_seconds, stages: int, caps, in_flight,
              speeds=None) -> Optional[Bounds]:
    """Bisection on the bottleneck, the greedy check at each trial (module doc)."""
    table = UnitTable(seconds, static_bytes, activation_bytes, cut_seconds)
    pace = speeds or (1.0,) * stages

    def slowest(bounds: Bounds) -> float:
        return max(table.stage_time(a, b) / s for (a, b), s in zip(bounds, pace))

    best = greedy_cuts(table, stages, math.inf, caps, in_flight, speeds)
    if best is None:
        return None
    hi = slowest(best)
    # no stage beats the longest unit on the fastest device, nor the work spread over all of them
    lo = max(max(table.seconds) / max(pace), table.total_seconds / math.fsum(pace))
    while hi - lo > TOLERANCE * hi:
        mid = (lo + hi) / 2
        found = greedy_cuts(table, stages, mid, caps, in_flight, speeds)
        if found is None:
            lo = mid
        else:
            best, hi = found, slowest(found)
    return best


def least_memory_cuts(table: UnitTable, stages: int, in_flight: Sequence[float]) -> Bounds:
    """Cuts minimising the largest stage memory (time ignored), by bisection on a common cap; what
    a candidate needs at least, for the error when nothing fits."""
    def cuts(cap):
        return greedy_cuts(table, stages, math.inf, [cap] * stages, in_flight)

    hi = max(table.stage_memory(0, table.units, f) for f in in_flight)
    best, lo = cuts(hi), 0.0
    while hi - lo > TOLERANCE * hi:
        mid = (lo + hi) / 2
        found = cuts(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    return best
