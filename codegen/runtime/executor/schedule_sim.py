"""Time a pipeline schedule, and measure idle time the same way for a simulation and a real run.

``simulate`` gives each compute action a start and an end: an action starts when its rank is free
and its input exists (the producing compute on the neighbour stage has ended). Point-to-point costs
nothing and never delays a rank, as with non-blocking isend/irecv on an idle link; put the transfer
time into the durations to model it. ``idle_fractions`` then reads any list of
``(rank, action, start, end)`` records -- a simulated ``Timeline`` or an executor's timestamps -- so
the measured bubble can be printed beside the simulated one and the closed form the planner uses,
``ScheduleSpec.bubble_share`` in ir/schedules.py ((p-1)/(v·m+p-1) of the step, v = 1 but for
interleaved; Narayanan et al. 2021; the zero-bubble schedules' depends on the F : B : W times), which
equals ``simulated_bubble`` with balanced stages.

Durations may be ints or ``fractions.Fraction`` for exact results, or floats.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational, Real
from typing import Iterable, NamedTuple, Sequence

from xirang.codegen.runtime.executor.schedule_check import check_schedule
from xirang.ir.schedules import (Action, Backward, BackwardInput, BackwardWeight, Compute, Forward, Schedule, describe,
                                 is_compute)
from xirang.ir.errors import InvalidValue, SolverFailure


class TimedAction(NamedTuple):
    """One compute action as it ran (or would run) on pipeline rank ``rank``; a plain tuple too."""

    rank: int
    action: Action
    start: Real
    end: Real


@dataclass(frozen=True)
class Timeline:
    """Every compute action of a schedule with its simulated times, per rank in issue order."""

    schedule: Schedule
    entries: tuple[TimedAction, ...]

    @property
    def makespan(self) -> Real:
        return max((entry.end for entry in self.entries), default=0)


@dataclass(frozen=True)
class IdleReport:
    """Idle time as a fraction of the step window (first start to last end over all ranks)."""

    per_rank: tuple[Real, ...]
    overall: Real  # idle time of all ranks / (ranks x window)
    window: Real


def _per_stage(name: str, value, num_stages: int) -> tuple[Real, ...]:
    values = tuple(value) if isinstance(value, Sequence) else (value,) * num_stages
    if len(values) != num_stages:
        raise InvalidValue(f"{name} durations: got {len(values)} values for {num_stages} stages; give one "
                         f"number, or one per stage")
    for stage, duration in enumerate(values):
        if isinstance(duration, bool) or not isinstance(duration, Real) or duration < 0:
            raise InvalidValue(f"{name} duration of stage {stage} must be a number >= 0, got {duration!r}")
    return values


def _producer_candidates(schedule: Schedule, compute: Compute) -> tuple[Compute, ...]:
    """The computes (either form of a backward) whose output ``compute`` consumes from another stage."""
    stage, mb = compute.stage, compute.micro_batch
    if isinstance(compute, Forward) and stage > 0:
        return (Forward(stage - 1, mb),)
    if isinstance(compute, (Backward, BackwardInput)) and stage + 1 < schedule.num_stages:
        return Backward(stage + 1, mb), BackwardInput(stage + 1, mb)
    return ()


def simulate(schedule: Schedule, *, forward: Real | Sequence[Real] = 1,
             backward: Real | Sequence[Real] = 2, backward_input: Real | Sequence[Real] | None = None,
             backward_weight: Real | Sequence[Real] | None = None) -> Timeline:
    """Start and end of every compute action of ``schedule`` (checked first, so it cannot hang).

    ``forward``/``backward``: time of one micro-batch on a stage, one number or one per stage. The
    default 1 : 2 is the usual ratio (a backward computes two matmuls per forward one). A split
    backward runs ``backward_input`` (B) and ``backward_weight`` (W); each defaults to half of
    ``backward`` (Qi et al. 2024 take them equal), so F = B = W = 1 is ``backward=2``.
    """
    check_schedule(schedule)
    forward_time = _per_stage("forward", forward, schedule.num_stages)
    backward_time = _per_stage("backward", backward, schedule.num_stages)
    half = tuple(_ratio(full, 2) for full in backward_time)
    input_time = half if backward_input is None else _per_stage("backward_input", backward_input,
                                                                schedule.num_stages)
    weight_time = half if backward_weight is None else _per_stage("backward_weight", backward_weight,
                                                                  schedule.num_stages)

    def duration(compute: Compute) -> Real:
        if isinstance(compute, Forward):
            return forward_time[compute.stage]
        if isinstance(compute, BackwardInput):
            return input_time[compute.stage]
        if isinstance(compute, BackwardWeight):
            return weight_time[compute.stage]
        return backward_time[compute.stage]

    end_of: dict[Compute, Real] = {}
    rank_free = [0] * schedule.pipeline_ranks
    next_index = [0] * schedule.pipeline_ranks
    timed: list[list[TimedAction]] = [[] for _ in schedule.ranks]
    progress = True
    while progress:  # each sweep runs every rank as far as its inputs allow
        progress = False
        for rank, actions in enumerate(schedule.ranks):
            while next_index[rank] < len(actions):
                action = actions[next_index[rank]]
                if is_compute(action):
                    producers = _producer_candidates(schedule, action)
                    inputs_ready = [end_of[p] for p in producers if p in end_of]
                    if producers and not inputs_ready:
                        break  # its input is produced by a rank that has not got there yet
                    start = max([rank_free[rank], *inputs_ready])
                    end = start + duration(action)
                    end_of[action] = rank_free[rank] = end
                    timed[rank].append(TimedAction(rank, action, start, end))
                next_index[rank] += 1
                progress = True
    if any(next_index[rank] < len(actions) for rank, actions in enumerate(schedule.ranks)):
        stuck = [describe(actions[next_index[r]]) for r, actions in enumerate(schedule.ranks)
                 if next_index[r] < len(actions)]
        raise SolverFailure(f"simulate({schedule.name!r}) stalled at {stuck} although check_schedule passed; "
                           f"this is a bug in schedule_sim.py, please report it with the schedule")
    return Timeline(schedule, tuple(entry for per_rank in timed for entry in per_rank))


def _ratio(numerator: Real, denominator: Real) -> Real:
    """Exact when both are rational (ints, Fractions), a float otherwise."""
    if isinstance(numerator, Rational) and isinstance(denominator, Rational):
        return Fraction(numerator) / Fraction(denominator)
    return numerator / denominator


def idle_fractions(records: Iterable[tuple[int, Action, Real, Real]], *,
                   pipeline_ranks: int | None = None) -> IdleReport:
    """Idle fraction per rank and overall from ``(rank, action, start, end)`` records.

    Works for ``Timeline.entries`` and for an executor's timestamps alike. Only compute actions
    count as busy (a rank waiting inside a Recv is idle); overlapping records of one rank are merged.
    The window runs from the earliest start to the latest end over all ranks, so measured
    timestamps must share one clock (e.g. each rank's ``time.perf_counter()`` offset by its reading
    as it leaves a collective of every rank just before the step: ``CompiledModel.train_step`` takes
    the batch agreement's). ``pipeline_ranks`` counts ranks that recorded nothing.
    """
    busy_intervals: dict[int, list[tuple[Real, Real]]] = {}
    for position, record in enumerate(records):
        rank, action, start, end = record
        if end < start:
            raise InvalidValue(f"record {position} ({describe(action)} on rank {rank}) ends at {end} before it "
                             f"starts at {start}; pass (rank, action, start, end)")
        busy_intervals.setdefault(rank, [])
        if is_compute(action):
            busy_intervals[rank].append((start, end))
    if not busy_intervals:
        raise InvalidValue("idle_fractions needs at least one (rank, action, start, end) record")
    ranks = pipeline_ranks if pipeline_ranks is not None else max(busy_intervals) + 1
    if max(busy_intervals) >= ranks:
        raise InvalidValue(f"a record names rank {max(busy_intervals)} but pipeline_ranks is {ranks}")
    everything = [interval for intervals in busy_intervals.values() for interval in intervals]
    if not everything:
        raise InvalidValue("idle_fractions found no compute action (Forward/Backward...) among the records")
    window_start = min(start for start, _ in everything)
    window = max(end for _, end in everything) - window_start
    if window == 0:
        raise InvalidValue("all compute records have zero length; cannot measure idle time")
    idle = []
    for rank in range(ranks):
        busy, covered_until = 0, window_start
        for start, end in sorted(busy_intervals.get(rank, [])):  # merge overlaps
            start = max(start, covered_until)
            if end > start:
                busy += end - start
                covered_until = end
        idle.append(window - busy)
    return IdleReport(per_rank=tuple(_ratio(time, window) for time in idle),
                      overall=_ratio(sum(idle), ranks * window), window=window)


def simulated_bubble(schedule: Schedule, **durations) -> IdleReport:
    """``idle_fractions`` of ``simulate(schedule, **durations)``: the schedule's bubble share."""
    timeline = simulate(schedule, **durations)
    return idle_fractions(timeline.entries, pipeline_ranks=schedule.pipeline_ranks)

