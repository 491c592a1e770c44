"""What a run's steps measured, per pipeline stage and for the gradient sync after the last compute,
gathered from every rank: the input of re-pricing (``xirang.reprice``, xirang_compile/reprice.py).

Read from the records the executor keeps anyway (``StepRecord.timestamps``, the ones ``xirang run
--trace`` draws, and ``StepRecord.finished``); nothing is timed a second time:

- ``forward[s]`` / ``backward[s]``: seconds of stage s per micro-batch -- on each rank the mean over the
  step's micro-batches (a zero-bubble backward is its B plus its W), both from the one rank, of those
  that run stage s (its dp and tp replicas), whose forward plus backward is largest: the slowest
  replica sets the pipeline's pace, and one rank's pair never adds to more than its step held;
- ``sync_seconds``: from the last compute of any rank to the step's gradients being final on every rank
  (the dp buckets' waits, then the tied sums): the gradient sync the backward did not hide. Taken from
  the slowest rank's compute, not per rank: a rank that finishes its compute early waits for its
  peers inside the sync, and that wait is theirs (compute), not the links';
- ``step_seconds``: the largest over ranks of ``finished`` (from the batch agreement every rank leaves
  together) plus ``StepRecord.outside`` (the agreement itself, and the loss's collectives after the
  gradients: what the cost model's ``step_sync`` prices), the whole ``train_step``;
- ``outside_seconds``: ``step_seconds`` less the largest ``finished``: the step's own collectives as
  they ran, which ``xirang.reprice`` puts in the place of their price (None: not measured);
- ``busy_ranks``: how many ranks used their core at once on average: all ranks' compute and gradient
  sync seconds (a gloo collective reduces on the cores) over the step; ``waiting_ranks`` the same of
  the time ranks waited for a peer (a pipeline bubble). On ranks sharing cores an action runs faster
  while others wait, and these say how much (``xirang.reprice``).

The tensor-parallel collectives run inside the stage modules, so they are inside the stage seconds;
``tp_seconds`` (tp collectives per step on the busiest rank) is None unless a caller timed them apart.
Several steps combine figure by figure by the median (``MeasuredCosts.median``); leave the first step
out of it (its allocations and autograd set-up are not the steady state).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, Forward


@dataclass(frozen=True)
class MeasuredCosts:
    """Measured seconds of a run (see the module docstring); ``steps``: how many steps they summarise."""

    forward: Mapping[int, float]  # stage -> seconds per micro-batch
    backward: Mapping[int, float]
    sync_seconds: float
    step_seconds: float
    num_micro_batches: int  # per step on each rank
    tp_seconds: Optional[float] = None
    steps: int = 1
    ranks: int = field(default=1, compare=False)
    busy_ranks: Optional[float] = None
    waiting_ranks: Optional[float] = None
    outside_seconds: Optional[float] = None

    def __post_init__(self):
        if set(self.forward) != set(self.backward) or not self.forward:
            raise XirangError(f"measured forward stages {sorted(self.forward)} and backward stages "
                              f"{sorted(self.backward)} differ or are empty", where="MeasuredCosts",
                              hint="give every stage's forward and backward seconds per micro-batch")
        object.__setattr__(self, "forward", MappingProxyType({int(s): float(v) for s, v in self.forward.items()}))
        object.__setattr__(self, "backward", MappingProxyType({int(s): float(v) for s, v in self.backward.items()}))

    def __reduce__(self):  # read-only mappings do not pickle; launched ranks hand these back
        return (MeasuredCosts, (dict(self.forward), dict(self.backward), self.sync_seconds, self.step_seconds,
                                self.num_micro_batches, self.tp_seconds, self.steps, self.ranks, self.busy_ranks,
                                self.waiting_ranks, self.outside_seconds))

    @staticmethod
    def median(steps: Sequence["MeasuredCosts"]) -> "MeasuredCosts":
        """Each figure's median over ``steps`` (measurements of one plan)."""
        if not steps:
            raise XirangError("no measured steps to combine", where="MeasuredCosts.median",
                              hint="measure at least one step (compiled.measured_costs() after train_step)")
        stages = sorted(steps[0].forward)
        tp = [s.tp_seconds for s in steps if s.tp_seconds is not None]
        busy = [s.busy_ranks for s in steps if s.busy_ranks is not None]
        waiting = [s.waiting_ranks for s in steps if s.waiting_ranks is not None]
        outside = [s.outside_seconds for s in steps if s.outside_seconds is not None]
        return MeasuredCosts(
            forward={s: statistics.median(m.forward[s] for m in steps) for s in stages},
            backward={s: statistics.median(m.backward[s] for m in steps) for s in stages},
            sync_seconds=statistics.median(m.sync_seconds for m in steps),
            step_seconds=statistics.median(m.step_seconds for m in steps),
            num_micro_batches=steps[0].num_micro_batches, tp_seconds=statistics.median(tp) if tp else None,
            steps=sum(m.steps for m in steps), ranks=steps[0].ranks,
            busy_ranks=statistics.median(busy) if busy else None,
            waiting_ranks=statistics.median(waiting) if waiting else None,
            outside_seconds=statistics.median(outside) if outside else None)


def rank_summary(record, num_micro_batches: int) -> dict:
    """This rank's part of one step: per local stage its forward and backward seconds per micro-batch (the
    step's sum over micro-batches over their number), the end of its last compute and ``finished``."""
    forward, backward, last, busy = {}, {}, 0.0, 0.0
    for _, action, start, end in record.timestamps:
        busy += end - start
        if isinstance(action, Forward):
            forward.setdefault(action.stage, []).append(end - start)
        elif isinstance(action, (Backward, BackwardInput, BackwardWeight)):
            backward.setdefault(action.stage, []).append(end - start)
        last = max(last, end)
    finished = record.finished if record.finished is not None else last
    return {"forward": {s: sum(v) / num_micro_batches for s, v in forward.items()},
            "backward": {s: sum(v) / num_micro_batches for s, v in backward.items()},
            "last_compute": last, "finished": finished, "busy": busy, "outside": record.outside}


def combine(summaries: Sequence[dict], num_micro_batches: int) -> MeasuredCosts:
    """One step's ``MeasuredCosts`` from every rank's ``rank_summary``: each stage's pair of figures from its
    slowest replica, the sync and step from the slowest rank."""
    forward, backward = {}, {}
    for summary in summaries:
        for stage, seconds in summary["forward"].items():
            back = summary["backward"].get(stage, 0.0)
            # both figures from the one slowest replica: the largest forward of one replica beside the
            # largest backward of another is a micro-batch no rank ran, longer than the step allowed
            if stage not in forward or seconds + back > forward[stage] + backward[stage]:
                forward[stage], backward[stage] = seconds, back
    finished = max(s["finished"] for s in summaries)
    sync = max(0.0, finished - max(s["last_compute"] for s in summaries))
    step = max(s["finished"] + s["outside"] for s in summaries)
    outside = max(0.0, step - finished)
    if finished <= 0:
        return MeasuredCosts(forward, backward, sync, step, num_micro_batches, ranks=len(summaries),
                             outside_seconds=outside)
    # a rank's own sync runs from its last compute to its end; before its end and outside compute it waited
    busy = sum(s["busy"] + s["finished"] - s["last_compute"] for s in summaries) / finished
    return MeasuredCosts(forward, backward, sync, step, num_micro_batches, ranks=len(summaries), busy_ranks=busy,
                         waiting_ranks=len(summaries) - busy, outside_seconds=outside)


def measure_step(compiled) -> MeasuredCosts:
    """The last ``train_step`` of ``compiled`` (a CompiledModel), gathered over the whole world: a
    collective, every rank calls it after the same step."""
    if compiled.last_step is None:
        raise XirangError("no step measured yet", where="CompiledModel.measured_costs",
                          hint="call it after train_step")
    m = compiled.schedule.num_micro_batches
    mine = rank_summary(compiled.last_step, m)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return combine([mine], m)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return combine(everyone, m)
