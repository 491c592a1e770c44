"""The trial runs of ``xirang tune`` (xirang_compile/tune.py): every rank compiles each trial plan in turn from
the same initial weights and runs it on the same batches, and hands back what it measured; the parent
combines the ranks' figures per trial (``TrialMeasurement``).

Inside one ``xirang.launch``: for each plan, a fresh copy of the model (every rank got the same pickled
weights), ``xirang.compile`` with the plan, ``warmup`` steps left out (allocations, autograd set-up) and
``steps`` measured, by default in rounds of one step of every trial (``run_trials(interleave=True)``: on a
loaded machine, trials run one after another would each meet another load); the gradients are dropped
after each step and no optimizer runs, so every trial starts from the same weights and no update is kept.
Each step's ``compiled.measured_costs()`` (a collective: every rank's stage seconds, the gradient sync, the
step) feeds the re-fit; each rank's own compute seconds and the end of its last compute give the
pipeline's bubble. One more step, not timed, runs under
the memory probe (``memory_probe.measure_step``: its hooks would slow a timed one) for the peak.
"""
from __future__ import annotations

import copy
import gc
import statistics
from dataclasses import dataclass

import torch

from xirang.codegen.runtime.calibration.step_costs import MeasuredCosts, rank_summary


@dataclass(frozen=True)
class TrialMeasurement:
    """One trial's figures over its measured steps, combined over the ranks (see ``combine_ranks``)."""

    step_seconds: float  # median of the measured steps' ``MeasuredCosts.step_seconds``
    spread: float  # (slowest - fastest) / median of those steps
    bubble_ratio: float  # median over steps of 1 - mean rank compute / last compute's end
    peak_memory_bytes: tuple[int, ...]  # per rank
    costs: MeasuredCosts  # the steps' median figure by figure (xirang.reprice's input)
    steps: int


def run_trials(rank: int, size: int, model, plans: list, batches: list, warmup: int, steps: int, seed: int,
               interleave: bool = True) -> list[dict]:
    """This rank's part of every trial, in ``plans`` order (launched by ``xirang.tune``: every rank calls it).
    ``interleave``: every plan compiled first, then the steps taken in rounds, one step of each trial a
    round (the order rotated each round), so a change in the machine's load falls on every trial alike;
    else each trial compiled and run in turn, one held at a time (for models only one copy of fits)."""
    if not interleave:
        return [_measure(list(_compiled(model, [plan], batches, seed)), batches, warmup, steps)[0] for plan in plans]
    return _measure(list(_compiled(model, plans, batches, seed)), batches, warmup, steps)


def _compiled(model, plans: list, batches: list, seed: int):
    from xirang.compile_api import compile as compile_model
    from xirang.options import RuntimeOptions
    for plan in plans:  # a fresh copy each: the compile must not see another trial's state
        yield compile_model(copy.deepcopy(model), world=plan.world, plan=plan, example_kwargs=batches[0],
                            runtime=RuntimeOptions(seed=seed))


def _measure(trials: list, batches: list, warmup: int, steps: int) -> list[dict]:
    """Rounds of one step of each compiled trial (``warmup`` rounds left out), then each one's memory step."""
    from xirang.codegen.runtime.memory.memory_probe import measure_step
    results = [{"costs": [], "local": []} for _ in trials]
    for step in range(warmup + steps):
        for offset in range(len(trials)):
            index = (step + offset) % len(trials)
            compiled = trials[index]
            compiled.train_step(**batches[step % len(batches)])
            _drop_grads(compiled)
            measured = compiled.measured_costs()  # a collective: every rank, every step
            if step >= warmup:
                summary = rank_summary(compiled.last_step, compiled.schedule.num_micro_batches)
                results[index]["costs"].append(measured)
                results[index]["local"].append((summary["busy"], summary["last_compute"]))
    for compiled, result in zip(trials, results):
        _, memory = measure_step(compiled, **batches[0])
        _drop_grads(compiled)
        held = sum(t.numel() * t.element_size() for t in compiled.parameters())
        peak = memory.allocated_peak_bytes if memory.allocated_peak_bytes is not None \
            else memory.saved_peak_bytes + 2 * held  # parameters and their gradients beside the activations
        result["peak"] = int(peak)
    trials.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # so the next trial's peak is its own
    return results


def _drop_grads(compiled) -> None:
    for param in compiled.parameters():
        param.grad = None


def combine_ranks(per_rank: list[dict]) -> TrialMeasurement:
    """One trial's ``TrialMeasurement`` from every rank's ``run_trials`` entry for it (rank order)."""
    costs: list[MeasuredCosts] = per_rank[0]["costs"]  # gathered over the world: every rank holds the same
    seconds = [c.step_seconds for c in costs]
    median = statistics.median(seconds)
    bubbles = []
    for step in range(len(costs)):
        busy = [entry["local"][step][0] for entry in per_rank]
        end = max(entry["local"][step][1] for entry in per_rank)
        bubbles.append(1.0 - statistics.fmean(busy) / end if end > 0 else 0.0)
    return TrialMeasurement(step_seconds=median, spread=(max(seconds) - min(seconds)) / median if median else 0.0,
                            bubble_ratio=max(0.0, statistics.median(bubbles)),
                            peak_memory_bytes=tuple(entry["peak"] for entry in per_rank),
                            costs=MeasuredCosts.median(costs), steps=len(costs))


def measurements(results: list[list[dict]], trials: int) -> list[TrialMeasurement]:
    """Per trial, its ``TrialMeasurement`` from ``xirang.launch``'s results (one ``run_trials`` list per rank)."""
    return [combine_ranks([rank_results[index] for rank_results in results]) for index in range(trials)]

