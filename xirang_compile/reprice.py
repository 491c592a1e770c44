"""``xirang.reprice``: correct the cost model with what a run's first steps measured, price the running
plan again, search the degrees again, and say whether another plan would now win.

    measured = MeasuredCosts.median([compiled.measured_costs() for each step after the first])
    report = xirang.reprice(compiled, measured, model=model, example_kwargs=batch)
    print(report.verdict)   # "the current plan is still the best" / "another plan would now win: ..."

Formulation. From the plan's own tensor split (``SplitPricer`` at its tp, micro-batch and seq) each
stage s has a predicted forward F̂_s and backward B̂_s per micro-batch (its units' compute plus their tp
collectives, the backward with the plan's recompute), of which T̂_s is tp collectives; the run measured
F_s, B_s (``codegen/runtime/calibration/step_costs.py``), optionally T (tp seconds per step), and the exposed
gradient sync S against the plan's Ŝ = dp_exposed + tied_sum. Three scales, each a property of the
machine that every candidate pays alike, not a factor on one plan:

- compute  k_c = (m·Σ_s (F_s + B_s) - T) / (m·Σ_s (F̂_s + B̂_s) - m·Σ_s T̂_s), T = 0 when not measured
  apart: the device's achieved FLOP/s and memory bandwidth are 1/k_c of the modelled ones, so every
  unit's forward, backward and recompute seconds are multiplied by k_c. On ranks sharing cores (a
  calibration with ``parallel_ranks`` k < N ranks) the modelled seconds are those of every rank busy,
  while an action measured with B̄ ranks loading the cores on average ran N / max(B̄, k) times faster
  (the pricer's Brent bound counts that speed-up itself), so F_s, B_s are multiplied by that factor
  first, lest the bubble's speed-up be counted twice. B̄ = ranks computing or syncing
  (``MeasuredCosts.busy_ranks``) + w · ranks waiting, w the calibration's ``waiting_share``;
- tp collectives  k_t = T / (m·Σ_s T̂_s) when T was measured; otherwise k_c (the tp collectives ran
  inside the stage seconds k_c was taken from, so they are corrected with them);
- links  k_l = S / Ŝ (1 when the plan predicts no sync: nothing measured the links): every link's
  latency α and per-byte time β (the World's intra- and inter-node links, and the calibration's
  measured lines) are multiplied by k_l, so the dp all-reduces, tied sums and pipeline sends of every
  candidate pay it;
- the step's own collectives  k_o = O / Ô, O the measured seconds outside the pipeline and the sync (the
  batch agreement and the loss's collectives, ``MeasuredCosts.outside_seconds``), Ô the running
  configuration's ``step_sync`` priced on the link-scaled World: every candidate's ``step_sync`` is
  multiplied by k_o (1 when O was not measured). They are a handful of tiny collectives over every
  rank, whose cost on shared cores is the ranks' scheduling more than bytes, so the gradient sync's k_l
  does not say what they cost; the running configuration's re-priced step holds O itself.

Then the running configuration is priced at its own stage cuts (``CandidatePricer.price``, exact dp
sync, plus its tied sums), and ``search_plan`` runs on the scaled unit costs and the scaled World
(with the caller's pins) for the best configuration; the best and its runners-up are ranked with their
tied sums added. A win of less than ``MARGIN`` is not reported: a few steps' medians do not resolve it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from xirang.codegen.runtime.calibration.step_costs import MeasuredCosts
from xirang.ir.errors import XirangError
from xirang.ir.plan import Plan
from xirang.ir.world import LinkSpec, World
from xirang.passes.analysis.trace import user_inputs
from xirang.passes.planning.plan_costs import CandidatePricer, Priced
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

from xirang.analyze import analyze
from xirang.plan_api import MEMORY_FRACTION
from xirang.plan_assemble import tied_sum_seconds

MARGIN = 0.02  # a rival must be this much faster to be named: below it, a few steps' noise decides


@dataclass(frozen=True)
class StageRow:
    """One stage: measured and predicted (before correction) seconds per micro-batch."""

    stage: int
    forward: float
    predicted_forward: float
    backward: float
    predicted_backward: float


@dataclass(frozen=True)
class Repricing:
    """What ``reprice`` found (see the module docstring); seconds throughout."""

    current: str  # the running configuration (Candidate.label)
    predicted_before: float  # the plan's step as planned
    measured_step: float
    repriced_current: float
    best: str
    best_mesh: tuple[int, int, int]  # (dp, tp, pp)
    best_schedule: str
    best_step: float
    compute_scale: float
    tp_scale: float
    link_scale: float
    stages: tuple[StageRow, ...]
    collectives: tuple[tuple[str, float, float], ...]  # (what, measured, predicted before) per step
    current_mesh: tuple[int, int, int] = (1, 1, 1)
    repriced_breakdown: tuple[tuple[str, float], ...] = ()  # the re-priced current step by cause
    shared_core_factor: float = 1.0  # measured stage seconds to the all-ranks-busy rate (shared cores)
    outside_scale: float = 1.0  # the step's own collectives, measured / priced on the link-scaled World

    @property
    def another_wins(self) -> bool:
        return self.best != self.current and self.best_step < self.repriced_current * (1 - MARGIN)

    @property
    def verdict(self) -> str:
        if not self.another_wins:
            return (f"the current plan is still the best: {self.current}, re-priced "
                    f"{self.repriced_current * 1e3:.4g} ms (measured {self.measured_step * 1e3:.4g} ms)")
        dp, tp, pp = self.best_mesh
        return (f"another plan would now win: (dp,tp,pp)=({dp},{tp},{pp}) schedule {self.best_schedule} "
                f"predicted {self.best_step * 1e3:.4g} ms vs current {self.repriced_current * 1e3:.4g} ms "
                f"({self.best})")

    def __str__(self) -> str:
        lines = [f"re-priced from {self.current}:",
                 f"  step: predicted {self.predicted_before * 1e3:.4g} ms, measured {self.measured_step * 1e3:.4g} ms, "
                 f"re-priced {self.repriced_current * 1e3:.4g} ms",
                 f"  scales (measured / predicted): compute x{self.compute_scale:.3g}, tp collectives "
                 f"x{self.tp_scale:.3g}, links x{self.link_scale:.3g}, step's own collectives x{self.outside_scale:.3g}"
                 + (f" (stage seconds x{self.shared_core_factor:.3g} to the all-busy rate of shared cores)"
                    if self.shared_core_factor != 1.0 else ""),
                 "  re-priced by cause: " + ", ".join(f"{cause} {seconds * 1e3:.3g}"
                                                      for cause, seconds in self.repriced_breakdown if seconds) + " ms",
                 "  stage  forward ms (predicted)   backward ms (predicted)   per micro-batch"]
        for row in self.stages:
            lines.append(f"  {row.stage:5d}  {row.forward * 1e3:9.3g} ({row.predicted_forward * 1e3:9.3g})  "
                         f"{row.backward * 1e3:10.3g} ({row.predicted_backward * 1e3:9.3g})")
        for what, measured, predicted in self.collectives:
            lines.append(f"  {what}: measured {measured * 1e3:.3g} ms, predicted {predicted * 1e3:.3g} ms per step")
        lines.append(f"  best under the corrected model: {self.best}, {self.best_step * 1e3:.4g} ms")
        return "\n".join(lines + [self.verdict])


def scaled_split(split: TensorSplit, compute: float, tp: float) -> TensorSplit:
    """``split`` with every unit's compute seconds times ``compute`` and tp collective seconds times ``tp``."""
    def scaled(u: UnitCost) -> UnitCost:
        return replace(u, forward_seconds=u.forward_seconds * compute, backward_seconds=u.backward_seconds * compute,
                       selective_recompute_seconds=u.selective_recompute_seconds * compute,
                       full_recompute_seconds=u.full_recompute_seconds * compute,
                       tp_comm_forward_seconds=u.tp_comm_forward_seconds * tp,
                       tp_comm_backward_seconds=u.tp_comm_backward_seconds * tp)
    return replace(split, units=tuple(scaled(u) for u in split.units))


def scaled_world(world: World, links: float) -> World:
    """``world`` with every link's α and β (and every calibrated collective line's) times ``links``."""
    def link(spec: LinkSpec) -> LinkSpec:
        return LinkSpec(bandwidth=spec.bandwidth / links, latency=spec.latency * links)
    calibration = world.calibration
    if calibration is not None:
        fits = tuple(replace(fit, alpha=fit.alpha * links, beta=fit.beta * links) for fit in calibration.collectives)
        calibration = replace(calibration, collectives=fits)
    return replace(world, intra_node=link(world.intra_node), inter_node=link(world.inter_node), calibration=calibration)


def shared_core_factor(world: World, measured: MeasuredCosts) -> float:
    """N / max(B̄, k) on N ranks sharing k cores (module docstring), else 1."""
    calibration = world.calibration
    if calibration is None or calibration.parallel_ranks is None or calibration.parallel_ranks >= world.size \
            or not measured.busy_ranks:
        return 1.0
    loading = measured.busy_ranks + calibration.waiting_share * (measured.waiting_ranks or 0.0)
    return world.size / max(loading, calibration.parallel_ranks)


def plan_candidate(plan: Plan) -> Candidate:
    mesh = plan.mesh
    return Candidate(tp=mesh.tp, pp=mesh.pp, dp=mesh.dp, micro_batch=plan.micro_batch,
                     num_micro_batches=plan.num_micro_batches, schedule=plan.schedule,
                     virtual_stages=plan.virtual_stages, recompute=plan.recompute, offload=plan.offload,
                     zero_stage=getattr(plan, "zero_stage", 0), outermost=mesh.order[0])


def stage_predictions(plan: Plan, split: TensorSplit) -> tuple[list, list, list, list]:
    """(bounds, forward, backward, tp) per stage: unit index ranges and predicted seconds per micro-batch."""
    position = {u.name: i for i, u in enumerate(split.units)}
    bounds, forward, backward, tp = [], [], [], []
    for stage in plan.stages:
        units = [split.units[position[name]] for name in stage.units]
        modes = [plan.recompute if u.name.startswith("block:") else "none" for u in units]
        first = position[stage.units[0]]
        bounds.append((first, first + len(units)))
        fwd = [u.forward_seconds + u.tp_comm_forward_seconds for u in units]
        forward.append(math.fsum(fwd))
        backward.append(math.fsum(u.seconds(mode) - f for u, mode, f in zip(units, modes, fwd)))
        tp.append(math.fsum(u.tp_comm_forward_seconds * (2 if mode == "full" else 1) + u.tp_comm_backward_seconds
                            for u, mode in zip(units, modes)))
    return bounds, forward, backward, tp


def unrepriced_axes(plan: Plan) -> str:
    """The plan's mesh axes whose per-rank work the fit below does not re-price ("cp=2, ep=4"; "" if none):
    the search re-prices them by its own passes (context_parallel_cost, expert_costs), this fit not yet."""
    return ", ".join(f"{axis}={getattr(plan.mesh, axis)}" for axis in ("cp", "ep") if getattr(plan.mesh, axis) > 1)


def reprice(plan_or_compiled, measured: MeasuredCosts, *, model=None, example_inputs=(), example_kwargs=None,
            seq: Optional[int] = None, analysed=None, **pins) -> Repricing:
    """Re-price the running plan from ``measured`` and search again (module docstring). ``model`` and
    its example inputs (or ``analysed``, its ``AnalysisReport``) as given to ``xirang.plan``; ``seq``:
    the sequence length the plan was made for (default: the example inputs'); ``pins``: choices the new
    search keeps (tp, pp, dp, micro_batch, schedule, ...), as ``xirang.plan`` takes them."""
    plan = getattr(plan_or_compiled, "plan", plan_or_compiled)
    if not isinstance(plan, Plan):
        raise XirangError(f"reprice needs a Plan or a CompiledModel, got {type(plan_or_compiled).__name__}",
                          where="xirang.reprice", hint="pass compiled (from xirang.compile) or its plan")
    unpriced = unrepriced_axes(plan)
    if unpriced:
        raise XirangError(f"reprice fits the plan's stages from its tensor split alone, and this plan has {unpriced}: "
                          f"the sequence cut over cp and the experts spread over ep (with their exchanges) are not "
                          f"re-priced yet, so the fitted scales would be wrong", where="xirang.reprice",
                          hint="compare compiled.measured_costs() with plan.predicted directly, or reprice a run of "
                               "a plan made with cp=1 and ep=1")
    if sorted(measured.forward) != list(range(len(plan.stages))):
        raise XirangError(f"measured stages {sorted(measured.forward)} are not the plan's {len(plan.stages)}",
                          where="xirang.reprice", hint="measure a run of this plan (compiled.measured_costs())")
    if analysed is None:
        if model is None:
            raise XirangError("reprice needs the model (or analysed=) to price its units", where="xirang.reprice",
                              hint="pass model= and the example inputs given to xirang.plan")
        analysed = analyze(model, example_inputs, example_kwargs)
    gm = analysed.graph_module
    seq = seq if seq is not None else analysed.symbols.get("seq", 1)
    pricer = SplitPricer(gm, plan.world, precision=plan.precision, run_dtypes=analysed.run_dtypes(plan.precision))
    layout = {"sequence_parallel": True} if getattr(plan, "sequence_parallel", False) else {}  # as planned
    raw: dict = {}

    def split_of(tp, tp_group, micro_batch, seq, *rest) -> TensorSplit:
        key = (tp, micro_batch, seq)
        if key not in raw:
            raw[key] = pricer.price(tp, tp_group, micro_batch, seq, *rest, **layout)
        return raw[key]

    current = plan_candidate(plan)
    split = split_of(current.tp, tuple(range(current.tp)), current.micro_batch, seq)
    bounds, forward, backward, tp = stage_predictions(plan, split)
    m, stages = plan.num_micro_batches, range(len(plan.stages))
    shared = shared_core_factor(plan.world, measured)
    predicted_tp = m * math.fsum(tp)
    apart = measured.tp_seconds is not None  # else the tp collectives stay inside the stage seconds, both sides
    compute_scale = (shared * (m * math.fsum(measured.forward[s] + measured.backward[s] for s in stages)
                               - (measured.tp_seconds if apart else 0.0))
                     / max(m * math.fsum(f + b for f, b in zip(forward, backward)) - (predicted_tp if apart else 0.0),
                           1e-30))
    tp_scale = shared * measured.tp_seconds / predicted_tp if apart and predicted_tp > 0 else compute_scale
    breakdown = plan.predicted.breakdown
    predicted_sync = breakdown.get("dp_exposed", 0.0) + breakdown.get("tied_sum", 0.0)
    link_scale = measured.sync_seconds / predicted_sync if predicted_sync > 0 and measured.sync_seconds > 0 else 1.0
    world = scaled_world(plan.world, link_scale)

    def corrected(tp, tp_group, micro_batch, seq, *rest) -> TensorSplit:
        return scaled_split(split_of(tp, tp_group, micro_batch, seq, *rest), compute_scale, tp_scale)

    names, batch_inputs = [u.name for u in split.units], len(user_inputs(gm))
    corrected_current = corrected(current.tp, tuple(range(current.tp)), current.micro_batch, seq)
    priced = CandidatePricer({(current.tp, current.micro_batch): corrected_current}, world,
                             global_batch=plan.global_batch, precision=plan.precision,
                             memory_fraction=MEMORY_FRACTION, batch_inputs=batch_inputs
                             ).price(current, bounds, exact=True)
    tied = tied_sum_seconds(gm, priced, names, split.placements, world)
    priced_outside = priced.breakdown.get("step_sync", 0.0)
    outside_scale = (measured.outside_seconds / priced_outside
                     if measured.outside_seconds is not None and priced_outside > 0 else 1.0)

    def settled(p: Priced) -> float:
        """``p``'s step with its own collectives at the measured scale k_o."""
        return p.step_seconds + (outside_scale - 1.0) * p.breakdown.get("step_sync", 0.0)
    repriced = settled(priced) + tied
    result = search_plan(corrected, world, global_batch=plan.global_batch, seq=seq, precision=plan.precision,
                         memory_fraction=MEMORY_FRACTION, batch_inputs=batch_inputs, **pins)

    def with_tied(p: Priced) -> float:
        placements = raw[(p.candidate.tp, p.candidate.micro_batch, seq)].placements
        return settled(p) + tied_sum_seconds(gm, p, names, placements, world)
    ranked = sorted(((with_tied(p), p) for p in (result.best, *result.alternatives) if p.fits),
                    key=lambda pair: pair[0])
    best_step, best = ranked[0]
    if best.candidate == current or best_step > repriced:
        best_step, best = repriced, priced
    c = best.candidate
    rows = tuple(StageRow(s, measured.forward[s], forward[s], measured.backward[s], backward[s]) for s in stages)
    collectives = [("gradient sync (dp buckets and tied sums, exposed)", measured.sync_seconds, predicted_sync)]
    if measured.tp_seconds is not None:
        collectives.insert(0, ("tp collectives", measured.tp_seconds, predicted_tp))
    if measured.outside_seconds is not None:
        collectives.append(("the step's own collectives (batch agreement, loss)", measured.outside_seconds,
                            breakdown.get("step_sync", 0.0)))
    repriced_breakdown = {**priced.breakdown, "step_sync": outside_scale * priced_outside, "tied_sum": tied}
    return Repricing(current=current.label(), predicted_before=plan.predicted.step_seconds,
                     measured_step=measured.step_seconds, repriced_current=repriced, best=c.label(),
                     best_mesh=(c.dp, c.tp, c.pp), best_schedule=c.schedule, best_step=best_step,
                     compute_scale=compute_scale, tp_scale=tp_scale, link_scale=link_scale, stages=rows,
                     collectives=tuple(collectives), current_mesh=(current.dp, current.tp, current.pp),
                     repriced_breakdown=tuple(repriced_breakdown.items()), shared_core_factor=shared,
                     outside_scale=outside_scale)


class RepriceAfter:
    """Re-pricing inside a training loop (``xirang train --reprice-after N``): collects every rank's
    measured costs of the steps after the run's first (its warm-up: allocation, autograd caches) up to
    step ``at`` of the run, then prints ``reprice``'s report once on the rank that ``say``s. The
    measurement is a collective: every rank calls ``after_step(steps done)`` after every step."""

    def __init__(self, at: int, start: int, compiled, *, model, example_kwargs: dict, pins: dict, say: bool,
                 show=lambda text: print(text, flush=True)):
        self.at = at if at > start else 0  # a run resumed past step ``at`` has nothing to re-price
        self.start, self.compiled, self.say, self.show = start, compiled, say, show
        unpriced = unrepriced_axes(compiled.plan)
        if unpriced and self.at:  # said once, and the run goes on: a report is not worth a stopped training
            self.at = 0
            if say:
                show(f"re-pricing skipped: the plan has {unpriced}, which xirang.reprice does not re-price yet")
        self.model, self.example_kwargs, self.pins, self.measured = model, example_kwargs, pins, []
        self.report: Optional[Repricing] = None

    def after_step(self, done: int) -> None:
        if not self.at or done > self.at:
            return
        if done - self.start > 1 or self.at - self.start == 1:  # the first step only when it is all there is
            self.measured.append(self.compiled.measured_costs())
        if done == self.at and self.say:
            self.report = reprice(self.compiled, MeasuredCosts.median(self.measured), model=self.model,
                                  example_kwargs=self.example_kwargs, **self.pins)
            self.show(f"after step {done} ({len(self.measured)} measured): {self.report}")
