"""Price the collectives every step runs besides the plan's own (the "step_sync" cause).

``codegen/runtime`` runs them every step, before and after the pipeline, so nothing hides them:

- the batch agreement (``batch_checks.agree``): one all-reduce over every rank of a small float64
  vector per input (each rank's problem flag and batch layout, the max and the min at once:
  ``agreement_bytes``), so that a bad batch fails on every rank together;
- the loss of the global batch (``CompiledModel._step_loss``): all-reduced over dp on the last
  pipeline rank, then broadcast over pp.

Each is priced on its group like any collective (``cost_collectives.collective_cost`` through the
pricer's cache): tens of microseconds on NCCL, milliseconds on gloo ranks sharing cores (on the 2-core
development box the 8-rank all-reduce's calibrated line starts at 12-20 ms, calibration to calibration). No torch here.
"""
from __future__ import annotations

from typing import Callable

from xirang.passes.planning.plan_search_space import Candidate

LOSS_BYTES = 4  # the step's loss, one fp32 scalar, reduced over dp and broadcast over pp


def agreement_width(batch_inputs: int) -> int:
    """Figures in the batch agreement (``batch_checks.agree`` lays them out): a problem flag and 64 per
    input."""
    return 1 + 64 * max(1, batch_inputs)


def agreement_bytes(batch_inputs: int) -> int:
    """Bytes of the batch agreement's all-reduce: its figures as float64, with their negations (max and
    min in one call)."""
    return 2 * 8 * agreement_width(batch_inputs)


def step_sync_seconds(c: Candidate, batch_inputs: int, cost: Callable[[str, float, tuple], float]) -> float:
    """Seconds of the step's own collectives on ``c``'s mesh, one after the other: the agreement over
    every rank, then the loss's all-reduce over dp and broadcast over pp; ``cost(kind, nbytes, group)``
    prices one collective. 0 on one device."""
    if c.mesh.size == 1:
        return 0.0
    seconds = cost("all_reduce", agreement_bytes(batch_inputs), tuple(range(c.mesh.size)))
    last = c.mesh.rank_of(dp=0, pp=c.pp - 1, tp=0, cp=0)  # it reduces the loss over dp, then broadcasts it
    if c.dp > 1:
        seconds += cost("all_reduce", LOSS_BYTES, c.mesh.group("dp", last))
    if c.pp > 1:
        seconds += cost("broadcast", LOSS_BYTES, c.mesh.group("pp", last))
    return seconds
