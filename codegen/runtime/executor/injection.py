"""Adaptive micro-batch injection: each pipeline rank's 1F1B warm-up deepened to its measured stage times.

A static 1F1B injects micro-batches at the pace of its fixed warm-up (rank r runs p - r - 1 forwards
before its first backward). When stages are uneven or jittery, a rank waits on its downstream
neighbour's backward while the neighbour waits for its next input; running a few more forwards
before the first backward keeps inputs queued ahead of the slow stage. In a simulation of p = 4,
m = 8 with F : B = 1 : 2, stage 0 made 1.5x slower: 40.5 -> 36 time units with 3 extra forwards on
rank 0; stage 1 slower: 42 -> 39 with (2, 2, 0, 0); equal stages: no gain, and none is made.

Formulation (``best_extra_warmup``): minimise the simulated makespan of ``one_f_one_b(p, m, e)``
(codegen/runtime/executor/schedule_sim.py, each stage's measured mean forward and backward seconds) over the
extra warm-ups e_r with 0 <= e_r <= bound_r, e_{p-1} = 0 (the last rank has nobody downstream) and
e_{r+1} <= e_r + 1 (a rank can feed only one forward beyond its own warm-up). Local search from
e = 0: each round tries every sequence of one or two moves (+1 on one rank, or +1 on ranks 0..j) and
takes the best strictly shorter makespan, ties to fewer extra micro-batches, then lower ranks; it
stops when no move shortens the step. On the p = 4 cases above it finds the exhaustive optimum.
Later decisions climb from the warm-ups running (when they still beat e = 0).

The bounds are the plan's (``warmup_bounds``): each extra micro-batch in flight holds one more
micro-batch of the rank's activations (the plan's ``memory_parts[r]["activations"]`` over the
schedule's in-flight count), and only what fits under the device's memory beside the plan's
predicted peak is allowed. A plan without memory parts allows nothing.

Each rank sums its own stage's forward and backward seconds every step (the executor's timestamps,
no communication); every ``every`` steps one all-reduce of those sums over the pp group gives each
stage's mean, the group's first rank runs the search and broadcasts the warm-ups: deterministic given
the measurements, and the search's CPU is spent once, not on every rank (on CPU ranks sharing cores
the copies competed with training). Backwards still run in micro-batch order, so gradients and
losses are bit-for-bit those of the plain 1F1B.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from xirang.codegen.runtime.executor.schedule_sim import simulate
from xirang.ir.errors import InvalidValue
from xirang.ir.schedules import Backward, Forward, build_schedule, schedule_spec

log = logging.getLogger("xirang.injection")


def warmup_bounds(plan, pp: int, num_micro_batches: int) -> tuple[int, ...]:
    """Per pipeline rank, how many extra micro-batches its activations may hold within the device's
    memory beside the plan's predicted peak (0 where the plan gives no memory parts)."""
    predicted = plan.predicted
    if not predicted.memory_parts or plan.schedule != "1f1b":
        return (0,) * pp
    in_flight = schedule_spec(plan.schedule).in_flight_by_rank(pp, num_micro_batches)
    bounds = []
    for rank in range(pp):
        if rank == pp - 1:
            bounds.append(0)
            continue
        devices = [plan.world.device_of(plan.mesh.rank_of(dp=d, pp=rank, tp=t))
                   for d in range(plan.mesh.dp) for t in range(plan.mesh.tp)]
        free = min(device.memory_bytes for device in devices) - predicted.memory_bytes_per_device[rank]
        per_micro_batch = predicted.memory_parts[rank]["activations"] / float(in_flight[rank])
        room = num_micro_batches - (pp - rank - 1)  # a warm-up of all m forwards is the deepest there is
        fits = room if per_micro_batch <= 0 else math.floor(max(free, 0) / per_micro_batch)
        bounds.append(max(0, min(fits, room)))
    return tuple(bounds)


def best_extra_warmup(p: int, m: int, forward: Sequence[float], backward: Sequence[float],
                      bounds: Sequence[int], start: Sequence[int] = ()) -> tuple[tuple[int, ...], float, float]:
    """(extra warm-ups, makespan with them, makespan of the plain 1F1B); see the module docstring.
    ``start``: the warm-ups running now; the search climbs from them when they beat the plain 1F1B
    (a steady run then costs one round of moves instead of the whole climb from zero)."""
    if len(bounds) != p or len(forward) != p or len(backward) != p:
        raise InvalidValue(f"best_extra_warmup: need one bound, forward and backward time per pipeline rank "
                           f"(p={p}), got {len(bounds)}, {len(forward)}, {len(backward)}")
    cache: dict = {}

    def makespan(extra):
        if extra not in cache:
            cache[extra] = float(simulate(build_schedule("1f1b", p, m, 1, extra), forward=list(forward),
                                          backward=list(backward)).makespan)
        return cache[extra]

    def allowed(extra) -> bool:
        return extra[-1] == 0 and all(0 <= e <= b for e, b in zip(extra, bounds)) and \
            all(extra[r + 1] <= extra[r] + 1 for r in range(p - 1))

    moves = list(dict.fromkeys(
        [tuple(int(j == i) for j in range(p)) for i in range(p - 1)]
        + [tuple(int(j <= i) for j in range(p)) for i in range(p - 1)]))
    current = (0,) * p
    plain = best = makespan(current)
    start = tuple(start)
    if len(start) == p and start != current and allowed(start) and makespan(start) < plain:
        current, best = start, makespan(start)
    while True:
        found = None
        for first in moves:
            for second in [None, *moves]:
                extra = tuple(c + a + (b if second else 0) for c, a, b in zip(current, first, second or current))
                if not allowed(extra):
                    continue
                key = (makespan(extra), sum(extra), extra)
                if found is None or key < found:
                    found = key
        if found is None or found[0] >= best * (1 - 1e-9):
            return current, best, plain
        best, current = found[0], found[2]


@dataclass(frozen=True)
class InjectionDecision:
    """After ``step`` steps: each stage's measured mean forward and backward seconds, the warm-ups
    before and after, and the simulated step with each."""

    step: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]
    simulated_before: float
    simulated_after: float


class AdaptiveInjection:
    """Re-chooses ``compiled``'s extra warm-ups every ``every`` steps (``after_step`` is called by
    ``train_step`` on every rank); ``decisions`` keeps each, also logged on ``xirang.injection``.
    A change is made only when it shortens the simulated step by more than ``min_gain``."""

    def __init__(self, compiled, every: int, *, min_gain: float = 0.03):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidValue(f"adaptive injection every {every!r} steps: give a whole number of steps >= 1")
        if compiled.plan.schedule != "1f1b" or compiled.pp < 2:
            raise InvalidValue(f"adaptive micro-batch injection deepens 1F1B warm-ups; this plan runs "
                               f"{compiled.plan.schedule!r} on pp={compiled.pp}",
                               where="plan.schedule",
                               hint="plan with schedule='1f1b' and pp >= 2, or drop inject_every")
        self.compiled, self.every, self.min_gain = compiled, every, min_gain
        self.decisions: list[InjectionDecision] = []
        self._steps = 0
        self._sums = [[0.0, 0, 0.0, 0] for _ in range(compiled.pp)]  # forward s, count, backward s, count

    def after_step(self) -> None:
        compiled = self.compiled
        for _, action, start, end in compiled.last_step.timestamps:  # this rank's own stage: no communication
            sums = self._sums[action.stage]
            if isinstance(action, Forward):
                sums[0] += end - start
                sums[1] += 1
            elif isinstance(action, Backward):
                sums[2] += end - start
                sums[3] += 1
        self._steps += 1
        if self._steps % self.every:
            return
        group = compiled.groups.pp
        totals = torch.tensor(self._sums, dtype=torch.float64, device=compiled.device)
        if group is not None:  # each rank filled only its own stage's row
            dist.all_reduce(totals, group=group)
        self._sums = [[0.0, 0, 0.0, 0] for _ in range(compiled.pp)]
        forward = tuple(float(f / max(n, 1)) for f, n, _, _ in totals.tolist())
        backward = tuple(float(b / max(n, 1)) for _, _, b, n in totals.tolist())
        m = compiled.schedule.num_micro_batches
        before = tuple(compiled.extra_warmup) or (0,) * compiled.pp
        answer = torch.zeros(compiled.pp + 2, dtype=torch.float64, device=compiled.device)
        if compiled.pp_rank == 0:  # the search once, on the group's first rank; the others take its answer
            answer.copy_(torch.tensor([*self._decide(forward, backward, m, before)], dtype=torch.float64))
        if group is not None:
            dist.broadcast(answer, src=compiled.groups.pp_ranks[0], group=group)
        *after, now, later = answer.tolist()
        after = tuple(int(e) for e in after)
        decision = InjectionDecision(self._steps, forward, backward, before, after, now, later)
        self.decisions.append(decision)
        log.info("step %d: stage forward/backward ms %s; extra warm-up %s -> %s (simulated step %.1f -> %.1f ms, "
                 "bounds %s)", decision.step, [f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in zip(forward, backward)],
                 list(before), list(after), decision.simulated_before * 1e3, decision.simulated_after * 1e3,
                 list(warmup_bounds(compiled.plan, compiled.pp, m)))
        if after != before:
            compiled.set_extra_warmup(after)

    def _decide(self, forward, backward, m: int, before) -> tuple:
        """(extra warm-ups..., simulated step with ``before``, simulated step with the answer)."""
        compiled = self.compiled
        bounds = warmup_bounds(compiled.plan, compiled.pp, m)
        chosen, simulated, _ = best_extra_warmup(compiled.pp, m, forward, backward, bounds, start=before)
        now = simulated if chosen == before else float(simulate(
            build_schedule("1f1b", compiled.pp, m, 1, before), forward=list(forward), backward=list(backward)).makespan)
        after = chosen if simulated < now * (1 - self.min_gain) else before
        return (*after, now, simulated if after == chosen else now)
