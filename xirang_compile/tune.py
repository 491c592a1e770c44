"""``xirang.tune``: choose the plan by measurement. The planner's best few configurations, picked to differ
where the cost model is least sure, are each compiled and run for a few steps on the real ranks; the
fastest measured is kept, saved as a plan with the trial table in it (``Plan.trials``, ir/plan_trials.py).

    result = xirang.tune(model, world=8, example_kwargs=batch, global_batch=16, top_k=4, steps=5)
    print(result)                 # the trial table, the re-fitted model's error, the planner's gap
    result.plan.save("tuned.json")  # `xirang explain tuned.json` shows the table

1. Plan once (``xirang.plan``); the trials are its winner and the runners-up it kept (``Plan.alternatives``)
   that fit and are predicted within ``within`` times the winner's step, taken greedily: next, the fastest
   predicted one that differs from every plan already taken in pipeline depth, schedule, micro-batch, tp
   degree or recompute (the choices whose price the cost model is least sure of on a new machine: the
   bubble, per-op overheads at small micro-batches, the collectives), up to ``top_k`` (``pick_trials``).
   Where the runners-up give fewer, the best plan at each pipeline depth, then each tp degree, not among
   them joins them (one pinned ``xirang.plan`` each). Each trial is planned in full with its choices pinned.
2. Before any rank starts, the trials' time is estimated (each plan's predicted step times the steps it
   runs, plus a compile per trial: the trace measured here, times ranks per core, plus the ranks'
   start) and printed; with
   ``budget_s`` the slowest-estimated trials after the winner are dropped until it fits.
3. One ``xirang.launch``: every trial on the ranks from the same weights and batches, no optimizer update
   kept, ``warmup`` steps left out; by default in rounds of one step of each trial (``interleave``), so a
   loaded machine's drift falls on all alike, else in sequence (xirang_compile/tune_trials.py).
4. The cost model is re-fitted from all trials at once (xirang_compile/tune_fit.py: ``reprice``'s scales by
   least squares over the meshes), and each trial re-priced with it.
5. The choice: the trial with the smallest median measured step.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from xirang.codegen.emit import check_emittable
from xirang.ir.errors import XirangError
from xirang.ir.plan import Plan
from xirang.ir.plan_explain import as_row, label
from xirang.ir.plan_parts import Alternative
from xirang.ir.plan_trials import Trial, planner_gap, trial_lines

from xirang.passes.planning.plan_search_space import divisors

from xirang.analyze import analyze
from xirang.plan_api import as_world, plan as make_plan
from xirang.tune_fit import Refit, refit
from xirang.tune_trials import TrialMeasurement, measurements, run_trials

UNSURE = ("pp", "schedule", "micro_batch", "tp", "recompute")  # where trials should differ (module docstring)
# the ranks' start in the estimate (spawning them, their process group): a 2-rank `xirang tune` of the tiny GPT
# on 2 busy cores took 14.5 s of trials where its compiles and steps were estimated at 4.6 s
START_SECONDS = 8.0
# a rank silent this long is reported frozen: 8 ranks tracing their trials at once on 2 cores beside other
# work went 10 s (the launcher's default) without a heartbeat
HEARTBEAT_S = 60.0
RUN_STEPS = 1000  # the trials' time is reported as a fraction of a run this long at the chosen plan's step


def choices_of(row: Alternative) -> dict:
    """The choices a trial differs in (``UNSURE``)."""
    return {"pp": row.mesh.pp, "schedule": row.schedule, "micro_batch": row.micro_batch, "tp": row.mesh.tp,
            "recompute": row.recompute}


def pick_trials(rows: Sequence[Alternative], top_k: int, within: float = 2.0) -> list[Alternative]:
    """The trials among ``rows`` (the planner's winner first, then its runners-up): the winner, then greedily
    the fastest predicted fitting row within ``within`` times the winner's step that differs from every row
    taken in at least one of ``UNSURE``, until ``top_k`` or none is left."""
    if top_k < 1:
        raise XirangError(f"top_k={top_k!r} must be at least 1", where="xirang.tune(top_k=)",
                          hint="try the planner's best few, e.g. top_k=4")
    winner, taken = rows[0], [rows[0]]
    pool = sorted((r for r in rows[1:] if r.fits and r.step_seconds <= within * winner.step_seconds),
                  key=lambda r: r.step_seconds)
    while len(taken) < top_k:
        differing = [r for r in pool if all(choices_of(r) != choices_of(t) for t in taken)]
        if not differing:
            break
        taken.append(differing[0])
        pool.remove(differing[0])
    return taken


def pins_of(row: Alternative) -> dict:
    """``xirang.plan`` pins that reproduce ``row``'s configuration."""
    pins = {"tp": row.mesh.tp, "pp": row.mesh.pp, "dp": row.mesh.dp, "micro_batch": row.micro_batch,
            "schedule": row.schedule, "virtual_stages": row.virtual_stages, "recompute": row.recompute,
            "offload": row.offload, "zero_stage": row.zero_stage, "sequence_parallel": row.sequence_parallel,
            "cp": row.mesh.cp, "ep": row.mesh.ep}
    if row.mesh.cp > 1:
        pins["context_method"] = row.context_method
    return pins


@dataclass(frozen=True)
class TuneResult:
    """What ``tune`` did: the chosen plan (its ``trials`` the table), the re-fit, and the time it took."""

    plan: Plan
    trials: tuple[Trial, ...]
    refit: Refit
    estimated_seconds: float
    seconds: float
    skipped: tuple[str, ...] = ()  # configurations not tried, each with why
    plans: tuple[Plan, ...] = ()  # every trial's plan, in the table's order (to measure them again)

    @property
    def planner_gap(self) -> float:
        """How much slower the cost model's own choice measured than the fastest trial (0.0: it was)."""
        return planner_gap(self.trials)

    @property
    def trial_fraction(self) -> float:
        """The trials' seconds over a ``RUN_STEPS``-step run at the chosen plan's measured step."""
        chosen = next(t for t in self.trials if t.chosen)
        return self.seconds / (RUN_STEPS * chosen.measured_step_seconds)

    @property
    def rank_agreement(self) -> float:
        """Kendall's tau between the predicted and the measured order of the trials (1: the same order)."""
        return kendall_tau([t.predicted_step_seconds for t in self.trials],
                           [t.measured_step_seconds for t in self.trials])

    def __str__(self) -> str:
        errors = [f"{t.label.split(' recompute')[0]}: {t.refit_step_seconds / t.measured_step_seconds - 1:+.1%}"
                  for t in self.trials if t.refit_step_seconds]
        before = [f"{t.predicted_step_seconds / t.measured_step_seconds - 1:+.0%}" for t in self.trials]
        lines = trial_lines(self.trials)[1:]
        lines += [f"predicted vs measured order: Kendall tau {self.rank_agreement:+.2f} over {len(self.trials)} "
                  f"trials (predicted errors before the re-fit: {', '.join(before)})",
                  f"{self.refit}", "re-fitted error per trial: " + ("; ".join(errors) or "none re-priced (cp/ep)"),
                  f"trials took {self.seconds:.1f} s (estimated {self.estimated_seconds:.1f} s): "
                  f"{self.trial_fraction:.1%} of a {RUN_STEPS:,}-step run at the chosen plan's measured step"]
        lines += [f"not tried: {why}" for why in self.skipped]
        chosen = next(t for t in self.trials if t.chosen)
        others = sorted(t.measured_step_seconds for t in self.trials if not t.chosen)
        if others:  # a lead smaller than the steps' own spread is a tie a few steps cannot break
            lead, spread = others[0] / chosen.measured_step_seconds - 1, chosen.spread
            lines.append(f"the next fastest measured {lead:.1%} slower, "
                         + ("beyond" if lead > spread else "within") + f" the chosen plan's step spread {spread:.0%}")
        return "\n".join(lines + [f"chosen: {chosen.label}, {chosen.measured_step_seconds * 1e3:.4g} ms measured"])


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two orderings (1.0 for fewer than two items)."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    agree = sum(1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0
                for i, j in pairs)
    return agree / len(pairs)


def estimate_seconds(plans: Sequence[Plan], compile_seconds: float, steps_each: int) -> list[float]:
    """Per trial: a compile plus its predicted step ``steps_each`` times (module docstring, step 2)."""
    return [compile_seconds + steps_each * plan.predicted.step_seconds for plan in plans]


def within_budget(estimates: Sequence[float], budget_s: Optional[float]) -> list[int]:
    """Indices of the trials kept: while the ranks' start and the estimates pass ``budget_s``, the trial
    estimated slowest after the first (the planner's choice, always kept) is dropped."""
    kept = list(range(len(estimates)))
    while budget_s is not None and len(kept) > 1 and START_SECONDS + sum(estimates[i] for i in kept) > budget_s:
        kept.remove(max(kept[1:], key=lambda i: estimates[i]))
    return kept


def trial_table(plans: Sequence[Plan], measured: Sequence[TrialMeasurement], fit: Refit) -> tuple[Trial, ...]:
    """The trial rows, the planner's choice (``plans[0]``) and the measured fastest marked."""
    fastest = min(range(len(plans)), key=lambda i: measured[i].step_seconds)
    return tuple(Trial(label=label(as_row(plan)), mesh=plan.mesh, micro_batch=plan.micro_batch,
                       num_micro_batches=plan.num_micro_batches, schedule=plan.schedule,
                       virtual_stages=plan.virtual_stages, recompute=plan.recompute,
                       predicted_step_seconds=plan.predicted.step_seconds, measured_step_seconds=m.step_seconds,
                       steps=m.steps, spread=m.spread, bubble_ratio=m.bubble_ratio,
                       peak_memory_bytes=m.peak_memory_bytes, refit_step_seconds=step, planner_choice=i == 0,
                       chosen=i == fastest)
                 for i, (plan, m, step) in enumerate(zip(plans, measured, fit.steps)))


def tune(model, *, world, global_batch: int, example_inputs=(), example_kwargs=None, top_k: int = 4,
         steps: int = 5, warmup: int = 1, batches: Optional[Sequence[dict]] = None, seq: Optional[int] = None,
         hardware=None, within: float = 2.0, budget_s: Optional[float] = None, timeout_s: Optional[float] = None,
         seed: int = 0, interleave: bool = True, heartbeat_s: float = HEARTBEAT_S,
         say: Optional[Callable[[str], None]] = print, analysed=None, **pins) -> TuneResult:
    """Tune ``model``'s plan on ``world`` local ranks by trial runs (module docstring).

    ``world``, ``global_batch``, ``example_inputs``/``example_kwargs``, ``seq``, ``hardware`` and ``pins``
    as ``xirang.plan`` takes them (``hardware`` defaults to "cpu": the trials run on local CPU ranks; a
    World, e.g. one ``xirang calibrate`` wrote, prices them as it says). ``top_k``: trials at most;
    ``steps``: measured steps of each, after ``warmup`` steps left out; ``batches``: the global batches the
    steps cycle through (default: ``example_kwargs``), the same for every trial. ``within``: runners-up
    predicted slower than this times the winner are not tried. ``budget_s``: trials are dropped until the
    estimate fits. ``interleave``: every trial compiled at once and stepped in rounds (False: one at a
    time, for a model only one compiled copy of fits). ``timeout_s`` bounds the launch; ``heartbeat_s``: a rank silent
    this long is reported frozen. ``say`` receives
    the progress lines (None: silent).
    """
    if example_inputs:
        raise XirangError("xirang.tune takes the example inputs by name", where="xirang.tune(example_inputs=)",
                          hint="pass example_kwargs={name: tensor} (the steps call train_step(**batch))")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise XirangError(f"{name}={value!r} must be an int of at least {least}", where=f"xirang.tune({name}=)",
                              hint="e.g. steps=5, warmup=1")
    report = say or (lambda line: None)
    world = as_world(world, hardware or ("cpu" if not hasattr(world, "nodes") else None))
    started = time.perf_counter()
    analysed = analysed or analyze(model, (), example_kwargs)
    trace_seconds = time.perf_counter() - started
    common = dict(world=world, example_kwargs=example_kwargs, global_batch=global_batch, seq=seq, analysed=analysed)
    planned = make_plan(model, **common, **pins)
    rows = [as_row(planned), *planned.alternatives]
    for axis in ("pp", "tp"):  # the runners-up kept may all share a depth: each other degree's best joins them
        if len(pick_trials(rows, top_k, within)) >= top_k or axis in pins:
            continue
        for degree in divisors(world.size):
            if all(getattr(row.mesh, axis) != degree for row in rows):
                try:
                    rows.append(as_row(make_plan(model, **common, **{**pins, axis: degree})))
                except XirangError:
                    continue  # nothing fits or runs at that degree: no trial there
    plans, skipped = [planned], []
    for row in pick_trials(rows, top_k, within)[1:]:
        try:  # a plan the runtime cannot run is said here, not failed on every rank
            pinned = make_plan(model, **common, **{**pins, **pins_of(row)})
            check_emittable(pinned)
            plans.append(pinned)
        except XirangError as error:
            skipped.append(f"{label(row)}: {error.what}")
    ranks_per_core = max(1.0, world.size / (os.cpu_count() or 1))
    compile_seconds = 2.0 * trace_seconds * ranks_per_core  # each rank traces and lowers, the ranks sharing cores
    estimates = estimate_seconds(plans, compile_seconds, warmup + steps + 1)
    kept = within_budget(estimates, budget_s)
    skipped += [f"{label(as_row(plan))}: over the budget of {budget_s:g} s" for i, plan in enumerate(plans)
                if i not in kept]
    plans, estimates = [plans[i] for i in kept], [estimates[i] for i in kept]
    estimated = START_SECONDS + sum(estimates)
    report(f"tuning {len(plans)} plans on {world.size} ranks, {warmup} + {steps} steps each: estimated "
           f"{estimated:.0f} s (a compile ~{compile_seconds:.1f} s each, steps from the plans' predictions)")
    for plan in plans:
        report(f"  trial: {label(as_row(plan))}, predicted {plan.predicted.step_seconds * 1e3:.4g} ms")
    from xirang.codegen.runtime.launch.launcher import launch
    began = time.perf_counter()
    results = launch(run_trials, world.size, args=(model, plans, list(batches or [example_kwargs]), warmup, steps,
                                                   seed, interleave), timeout_s=timeout_s, heartbeat_s=heartbeat_s)
    measured = measurements(results, len(plans))
    seconds = time.perf_counter() - began
    fit = refit(plans, [m.costs for m in measured], analysed, seq or analysed.symbols.get("seq", 1))
    table = trial_table(plans, measured, fit)
    chosen = plans[next(i for i, t in enumerate(table) if t.chosen)]
    result = TuneResult(plan=dataclasses.replace(chosen, trials=table), trials=table, refit=fit,
                        estimated_seconds=estimated, seconds=seconds, skipped=tuple(skipped), plans=tuple(plans))
    report(str(result))
    return result

