"""The cost model re-fitted from every trial of ``xirang tune`` at once: ``xirang.reprice``'s scales
(xirang_compile/reprice.py), each now fitted over several meshes by least squares, then every trial
re-priced with them.

Formulation. Trial i (its plan, m_i micro-batches, measured figures from ``MeasuredCosts``) gives one
observation per scale, as in ``reprice``:

- compute: x̂_i = m_i·Σ_s (F̂_s + B̂_s) predicted, x_i = f_i·m_i·Σ_s (F_s + B_s) measured, f_i the shared-core
  factor N / max(B̄_i, k) (``reprice.shared_core_factor``); the tp collectives stay inside the stage
  seconds on both sides, so they take the compute scale (k_t = k_c);
- links: x̂_i = Ŝ_i (the plan's dp_exposed + tied_sum), x_i = S_i (the measured exposed sync), trials with
  both > 0 only;
- the step's own collectives: x̂_i = Ô_i (step_sync priced on the link-scaled World), x_i = O_i (measured).

Each scale k minimises the squared relative error over its observations,

    k = argmin Σ_i ((k·x̂_i - x_i) / x_i)²  =  Σ_i r_i / Σ_i r_i²,   r_i = x̂_i / x_i,

so a trial whose step is ten times another's does not outweigh it (a plain least squares would fit the
slow trial alone); with no observation the scale is 1. Each trial is then priced at its own stage cuts
with the fitted scales (``CandidatePricer.price``, exact dp sync, plus its tied sums), the re-fitted
step, and its error against the measured one is the model's error on that mesh.

Plans with cp > 1 or ep > 1 are measured but neither fitted nor re-priced (``reprice.unrepriced_axes``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from xirang.passes.analysis.trace import user_inputs
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_splits import SplitPricer

from xirang.plan_api import MEMORY_FRACTION
from xirang.plan_assemble import tied_sum_seconds
from xirang.reprice import (plan_candidate, scaled_split, scaled_world, shared_core_factor, stage_predictions,
                            unrepriced_axes)


@dataclass(frozen=True)
class Refit:
    """The fitted scales (measured / predicted) and each trial's re-fitted step (0.0: not re-priced)."""

    compute_scale: float
    link_scale: float
    outside_scale: float
    steps: tuple[float, ...]  # seconds, one per trial
    observations: int  # trials the fit read

    def errors(self, measured: Sequence[float]) -> list:
        """Each trial's re-fitted / measured - 1 (None where not re-priced)."""
        return [step / seconds - 1.0 if step else None for step, seconds in zip(self.steps, measured)]

    def __str__(self) -> str:
        return (f"re-fitted from {self.observations} trials: compute x{self.compute_scale:.3g}, links "
                f"x{self.link_scale:.3g}, the step's own collectives x{self.outside_scale:.3g} (measured / predicted)")


def relative_least_squares(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """k minimising Σ ((k·p - m) / m)² over the pairs with p, m > 0 (1.0 when there is none)."""
    ratios = [p / m for p, m in zip(predicted, measured) if p > 0 and m > 0]
    if not ratios:
        return 1.0
    return math.fsum(ratios) / math.fsum(r * r for r in ratios)


def refit(plans: Sequence, measured: Sequence, analysed, seq: int) -> Refit:
    """Fit the scales from ``measured`` (one ``MeasuredCosts`` per plan) and re-price every plan (docstring)."""
    gm = analysed.graph_module
    fitted = [i for i, plan in enumerate(plans) if not unrepriced_axes(plan)]
    prices = {}
    for i in fitted:
        plan = plans[i]
        layout = {"sequence_parallel": True} if plan.sequence_parallel else {}
        split = SplitPricer(gm, plan.world, precision=plan.precision).price(
            plan.mesh.tp, tuple(range(plan.mesh.tp)), plan.micro_batch, seq, **layout)
        bounds, forward, backward, _ = stage_predictions(plan, split)
        costs, m = measured[i], plan.num_micro_batches
        shared = shared_core_factor(plan.world, costs)
        prices[i] = (split, bounds, m * math.fsum(f + b for f, b in zip(forward, backward)),
                     shared * m * math.fsum(costs.forward[s] + costs.backward[s] for s in costs.forward))
    compute = relative_least_squares([prices[i][2] for i in fitted], [prices[i][3] for i in fitted])
    sync = [plans[i].predicted.breakdown.get("dp_exposed", 0.0) + plans[i].predicted.breakdown.get("tied_sum", 0.0)
            for i in fitted]
    links = relative_least_squares(sync, [measured[i].sync_seconds for i in fitted])
    priced = {}
    for i in fitted:
        plan, (split, bounds, _, _) = plans[i], prices[i]
        world = scaled_world(plan.world, links)
        candidate = plan_candidate(plan)  # as reprice prices the running plan
        result = CandidatePricer({(plan.mesh.tp, plan.micro_batch): scaled_split(split, compute, compute)}, world,
                                 global_batch=plan.global_batch, precision=plan.precision,
                                 memory_fraction=MEMORY_FRACTION, batch_inputs=len(user_inputs(gm))
                                 ).price(candidate, bounds, exact=True)
        tied = tied_sum_seconds(gm, result, [u.name for u in split.units], split.placements, world)
        priced[i] = (result.step_seconds + tied, result.breakdown.get("step_sync", 0.0))
    outside = relative_least_squares([priced[i][1] for i in fitted],
                                     [measured[i].outside_seconds or 0.0 for i in fitted])
    steps = tuple(priced[i][0] + (outside - 1.0) * priced[i][1] if i in priced else 0.0 for i in range(len(plans)))
    return Refit(compute_scale=compute, link_scale=links, outside_scale=outside, steps=steps,
                 observations=len(fitted))

