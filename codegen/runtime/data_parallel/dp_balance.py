"""Dynamic data-parallel rebalancing: whole micro-batches move from slow dp replicas to fast ones.

Every ``every`` steps each rank reports the seconds it spent computing (its schedule's forward and
backward actions; the time it waits for others is left out, or a fast rank waiting on a slow one
would look slow) and the samples it ran since the last decision. One all-gather gives every rank
the same figures, so every rank computes the same new shares: the decision is deterministic given
the measurements. A dp replica (its pp x tp ranks) is as fast as its slowest member.

Formulation (``balanced_shares``): with U micro-batches of ``micro_batch`` samples per step and
replica i measured at t_i seconds per sample, the ideal share is U * (1/t_i) / sum_j (1/t_j)
micro-batches (equal finishing times). Shares are whole multiples of ``granule`` micro-batches (pp
for the interleaved schedule, 1 otherwise), at least one granule each, at most ``max_move`` granules
away from the current share (bounded: one noisy measurement moves little), summing to U; within those
bounds the rounding goes by largest remainder, a tie favouring the lower dp index. A move is made only when
the predicted step (the slowest replica's share times its time per sample) improves by more than
``min_gain``, so equal ranks never oscillate.

The global batch is unchanged and the runtime weighs each replica's loss and gradient by its share
(``CompiledModel.set_dp_shares``), so training stays equal to one device whatever the shares.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from xirang.ir.errors import InvalidValue

log = logging.getLogger("xirang.rebalance")


def balanced_shares(seconds_per_sample: Sequence[float], shares: Sequence[int], micro_batch: int, *,
                    granule: int = 1, max_move: int = 1, min_gain: float = 0.05) -> tuple[int, ...]:
    """New samples per dp replica (see the module docstring); ``shares`` are the current ones."""
    if len(seconds_per_sample) != len(shares):
        raise InvalidValue(f"{len(seconds_per_sample)} measurements for {len(shares)} dp shares")
    if any(not math.isfinite(t) or t <= 0 for t in seconds_per_sample):
        return tuple(shares)  # a replica that measured nothing (or nonsense) gives no reason to move
    step = micro_batch * granule  # samples per granule
    current = [n // step for n in shares]
    total = sum(current)
    speed = [1.0 / t for t in seconds_per_sample]
    ideal = [total * s / sum(speed) for s in speed]
    low = [max(1, c - max_move) for c in current]
    high = [c + max_move for c in current]
    chosen = [min(max(math.floor(x), lo), hi) for x, lo, hi in zip(ideal, low, high)]
    while sum(chosen) < total:  # the largest shortfall first; ties to the lower index
        i = max((i for i in range(len(chosen)) if chosen[i] < high[i]), key=lambda i: (ideal[i] - chosen[i], -i))
        chosen[i] += 1
    while sum(chosen) > total:  # the largest excess first; ties take from the higher index
        i = max((i for i in range(len(chosen)) if chosen[i] > low[i]), key=lambda i: (chosen[i] - ideal[i], i))
        chosen[i] -= 1

    def slowest(granules):
        return max(g * t for g, t in zip(granules, seconds_per_sample))
    if slowest(chosen) >= slowest(current) * (1 - min_gain):
        return tuple(shares)
    return tuple(g * step for g in chosen)


@dataclass(frozen=True)
class Decision:
    """One rebalancing decision: after ``step`` steps, each replica's measured seconds per sample,
    the shares before and after (equal when nothing moved)."""

    step: int
    seconds_per_sample: tuple[float, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]


class DpRebalancer:
    """Rebalances ``compiled``'s dp shares every ``every`` steps (``after_step`` is called by
    ``train_step``); ``decisions`` keeps every decision, and each is logged on the ``xirang.rebalance``
    logger."""

    def __init__(self, compiled, every: int, *, max_move: int = 1, min_gain: float = 0.05):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidValue(f"rebalance every {every!r} steps: give a whole number of steps >= 1")
        self.compiled, self.every, self.max_move, self.min_gain = compiled, every, max_move, min_gain
        self.decisions: list[Decision] = []
        self._steps = 0
        self._busy = self._samples = 0.0

    def after_step(self) -> None:
        compiled = self.compiled
        record = compiled.last_step
        self._busy += sum(end - start for _, _, start, end in record.timestamps)
        self._samples += compiled.dp_shares[compiled.dp_rank]
        self._steps += 1
        if self._steps % self.every:
            return
        mine = torch.tensor([compiled.dp_rank, self._busy, self._samples], dtype=torch.float64,
                            device=compiled.device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)  # the same figures on every rank: the same decision
        per_replica = [0.0] * compiled.dp
        for dp_rank, busy, samples in (t.tolist() for t in everyone):
            per_replica[int(dp_rank)] = max(per_replica[int(dp_rank)], busy / max(samples, 1.0))
        before = compiled.dp_shares
        granule = compiled.pp if compiled.plan.schedule == "interleaved" else 1
        after = balanced_shares(per_replica, before, compiled.plan.micro_batch, granule=granule,
                                max_move=self.max_move, min_gain=self.min_gain)
        decision = Decision(self._steps, tuple(per_replica), tuple(before), after)
        self.decisions.append(decision)
        log.info("step %d: seconds per sample by dp rank %s; shares %s -> %s", decision.step,
                 [f"{t:.4f}" for t in per_replica], list(before), list(after))
        if after != tuple(before):
            compiled.set_dp_shares(after)
        self._busy = self._samples = 0.0
