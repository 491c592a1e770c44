"""``xirang.plan``: trace and analyse a model, split its tensors per tp degree, search the degrees,
and return the Plan with what the cost model predicts for it.

    plan = xirang.plan(model, world="16x8", example_kwargs=batch, global_batch=1024)
    print(plan.explain())
    plan.save("plan.json")

Any choice can be pinned, e.g. to price a published configuration:
``xirang.plan(..., tp=8, pp=2, micro_batch=4, schedule="interleaved", recompute="full")``
(or ``choices=xirang.PlanChoices(tp=8, ...)``, xirang_compile/options.py).
"""
from __future__ import annotations

import dataclasses

import time
from typing import Callable, NamedTuple, Optional, Union

from xirang.ir.device import DEVICE_PRESETS, DeviceSpec
from xirang.ir.plan import PRECISIONS, Plan
from xirang.ir.world import World, parse_world
from xirang.passes.analysis.trace import user_inputs
from xirang.passes.analysis.expert_ops import expert_count
from xirang.passes.planning.context_parallel_cost import NO_CONTEXT
from xirang.passes.planning.cost_model import Efficiency
from xirang.passes.planning.expert_costs import (DEFAULT_ROUTING_IMBALANCE, check_capacity_factor,
                                                 check_routing_imbalance)
from xirang.passes.planning.plan_search import cpu_seconds, search_plan
from xirang.passes.planning.plan_search_space import check_global_batch
from xirang.passes.planning.tp_overlap_cost import choose_tp_overlap

from xirang.analyze import analyze, gc_paused
from xirang.context_facts import context_facts
from xirang.model_checks import batch_statistics_nodes, check_plan_batch_split, check_trainable
from xirang.ir.errors import XirangError
from xirang.ir.renamed import renamed_keywords
from xirang.options import PlanChoices, merged_choices
from xirang.plan_assemble import assemble_plan

MEMORY_FRACTION = 0.9  # of each device's memory the plan may use; see search_plan


class PlanProgress(NamedTuple):
    """One step of planning done: ``stage`` ("analyse", "splits", "search", "assemble"), its wall
    time, and a line for people (``progress=print`` prints it). ``step_done`` is False for the
    events inside a stage (one per tensor-split problem solved while the search runs, the slow part
    for big models), True for the event that ends the stage. ``cpu_seconds`` beside ``seconds`` tells
    work from waiting on a loaded machine."""

    stage: str
    seconds: float
    message: str
    step_done: bool = True
    cpu_seconds: Optional[float] = None  # CPU time of the step: this process and the solver processes it ran

    def __str__(self) -> str:
        return self.message


@gc_paused()
@renamed_keywords(device="hardware=")
def plan(model, *, world: Union[int, str, World], global_batch: int, example_inputs=(), example_kwargs=None,
         seq: Optional[int] = None, hardware: Union[str, DeviceSpec, None] = None,
         choices: Optional[PlanChoices] = None, progress: Optional[Callable[[PlanProgress], None]] = None,
         efficiency: Optional[Efficiency] = None, analysed=None, **pins) -> Plan:
    """The fastest predicted 3D-parallel plan for ``model`` on ``world`` that fits device memory.

    ``world``: a device count, "NxM" (N nodes of M devices) or a World; ``hardware`` names the device
    preset the planner prices (a key of ``xirang.DEVICE_PRESETS``, default "a100-80g") or gives a
    DeviceSpec, when ``world`` is not a World. ``global_batch``: samples per optimizer step. ``seq``:
    sequence length to plan for (default: the example inputs'). ``choices`` (a ``PlanChoices``) pins
    what the search would choose; each choice may also be given directly (``tp=2``, ``schedule="1f1b"``,
    ``precision="fp32"``; see ``PlanChoices``). Unpinned, ``sequence_parallel`` is priced both ways for
    the search's best few tp > 1 configurations and the faster kept (plan_search, step 4), ``zero_stage``
    is priced at 0, 1 and 3 wherever dp > 1, and ``tp_overlap`` is taken where it hides time
    (passes/planning/tp_overlap_cost.py; never where the World's calibration says comm slows compute).
    ``progress`` receives a ``PlanProgress`` after each step. ``efficiency`` overrides each device's
    kernel efficiencies (DeviceSpec.efficiency). ``analysed``: the model's ``AnalysisReport`` when the
    caller has it already (``xirang.compile`` traces once for planning and lowering).
    """
    choices = merged_choices(choices, pins, "xirang.plan")
    tp, pp, dp, micro_batch = choices.tp, choices.pp, choices.dp, choices.micro_batch
    schedule, virtual_stages, recompute, offload = (choices.schedule, choices.virtual_stages, choices.recompute,
                                                    choices.offload)
    precision, sequence_parallel = choices.precision, choices.sequence_parallel
    zero_stage, tp_overlap = choices.zero_stage, choices.tp_overlap
    imbalance = check_routing_imbalance(DEFAULT_ROUTING_IMBALANCE if choices.routing_imbalance is None
                                        else choices.routing_imbalance)
    ep_overlap = bool(choices.ep_overlap)
    if choices.ep_overlap is not None and not isinstance(choices.ep_overlap, bool):
        raise XirangError(f"ep_overlap={choices.ep_overlap!r} must be True or False",
                          where="xirang.plan(ep_overlap=...)",
                          hint="True prices the expert all-to-alls as Megatron's batch-level overlap runs them")
    capacity_factor = check_capacity_factor(choices.capacity_factor)
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise XirangError(f"sequence_parallel={sequence_parallel!r} must be True, False or None",
                          where="xirang.plan(sequence_parallel=...)",
                          hint="pass True or False, or leave it unset to let the planner choose")
    world = as_world(world, hardware)
    precision = _precision(precision, world)
    check_global_batch(global_batch)  # before the trace, which is the slow part
    report_progress = progress or (lambda event: None)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    report = analysed or analyze(model, example_inputs, example_kwargs)
    gm, seq = report.graph_module, _seq(seq, report.symbols)
    check_trainable(gm)  # a model that cannot train is refused before the search (xirang_compile/model_checks.py)
    dp, micro_batch, whole_batch = _batch_statistics_pins(gm, global_batch, dp, micro_batch)
    seconds = time.perf_counter() - start
    report_progress(PlanProgress("analyse", seconds, f"traced and analysed {report.total_params:,} parameters, "
                                                     f"{len(report.rows)} units in {seconds:.2f} s",
                                 cpu_seconds=cpu_seconds() - cpu_start))

    from xirang.passes.planning.plan_splits import SplitPricer  # the tensor-split pricer (its own file)
    # efficiency=None: each device's own (DeviceSpec.efficiency: its generation's kernels and software)
    pricer = SplitPricer(gm, world, efficiency=efficiency, precision=precision,
                         run_dtypes=report.run_dtypes(precision))  # saved activations at their dtypes
    solved = []

    def price(tp, tp_group, micro_batch, seq, *rest, sequence_parallel=False):  # once per split, 2 at once
        began = time.perf_counter()
        split = pricer.price(tp, tp_group, micro_batch, seq, *rest, sequence_parallel=sequence_parallel)
        solved.append((tp, micro_batch))
        layout = ", sequence parallel" if sequence_parallel else ""
        report_progress(PlanProgress("splits", time.perf_counter() - began,
                                     f"tensor split {len(solved)} solved: tp={tp}, micro-batch {micro_batch}{layout}",
                                     step_done=False))
        return split
    search_cpu = cpu_seconds()
    try:
        result = search_plan(price, world, global_batch=global_batch, seq=seq, precision=precision,
                             memory_fraction=MEMORY_FRACTION, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch,
                             schedule=schedule, virtual_stages=virtual_stages, recompute=recompute, offload=offload,
                             zero_stage=zero_stage, sequence_parallel=sequence_parallel,
                             batch_inputs=len(user_inputs(gm)), ep=choices.ep, experts=expert_count(gm.graph),
                             routing_imbalance=imbalance, cp=choices.cp, context_method=choices.context_method,
                             context=NO_CONTEXT if choices.cp == 1 else context_facts(gm), ep_overlap=ep_overlap,
                             capacity_factor=capacity_factor)
    except XirangError as error:
        if not whole_batch:
            raise
        raise XirangError(error.what, where=error.where, hint=f"{error.hint}; note: dp=1 and micro_batch="
                          f"{global_batch} were pinned because the model normalises with batch statistics "
                          f"(BatchNorm in training), which a split batch would change") from None
    search_cpu = cpu_seconds() - search_cpu - result.price_cpu_seconds
    report_progress(PlanProgress("splits", result.price_seconds, f"solved {result.splits_priced} tensor splits "
                                                                 f"(tp, micro-batch) in {result.price_seconds:.2f} s",
                                 cpu_seconds=result.price_cpu_seconds))
    report_progress(PlanProgress("search", result.search_seconds,
                                 f"searched {result.candidates} configurations, priced {result.priced}, "
                                 f"in {result.search_seconds:.2f} s: {result.best.candidate.label()}",
                                 cpu_seconds=search_cpu))
    start, cpu_start = time.perf_counter(), cpu_seconds()
    made = assemble_plan(gm, world, result, global_batch=global_batch, precision=precision,
                         memory_fraction=MEMORY_FRACTION)
    if sequence_parallel or result.best.candidate.sequence_parallel:  # pinned on keeps tp 1 plans as before
        made = dataclasses.replace(made, sequence_parallel=True)
    made = dataclasses.replace(made, routing_imbalance=imbalance, ep_overlap=ep_overlap and made.mesh.ep > 1,
                               capacity_factor=capacity_factor)
    made = choose_tp_overlap(gm, made, seq, pinned=tp_overlap)
    seconds = time.perf_counter() - start
    report_progress(PlanProgress("assemble", seconds, f"assembled the plan in {seconds:.2f} s",
                                 cpu_seconds=cpu_seconds() - cpu_start))
    return made


def _batch_statistics_pins(gm, global_batch: int, dp, micro_batch) -> tuple:
    """(dp, micro_batch, pinned here): a model with batch statistics (BatchNorm in training) trains as on
    one device only when one rank sees the whole batch at once, so the search is held to dp=1 and one
    micro-batch; pins that split the batch are refused with the reason (model_checks.py)."""
    if not batch_statistics_nodes(gm):
        return dp, micro_batch, False
    pinned_dp = 1 if dp is None else dp
    pieces = global_batch // (pinned_dp * micro_batch) if micro_batch else 1
    check_plan_batch_split(gm, pinned_dp, pieces, "dp=, micro_batch=")
    return 1, global_batch, True


def as_world(world, hardware=None) -> World:
    """The World ``world`` names (a device count, "NxM" or a World, ``hardware`` the preset of a count),
    as ``parse_world``, but a bad argument raises a XirangError naming it and what would be valid."""
    try:
        return parse_world(world, hardware)
    except ValueError as error:
        if "unknown device" in str(error):
            raise XirangError(str(error), where=f"hardware={hardware!r}",
                              hint=f"use one of {', '.join(DEVICE_PRESETS)}, or pass a DeviceSpec") from None
        raise XirangError(str(error), where=f"world={world!r}",
                          hint="pass world=N devices, 'NxM' (N nodes of M devices) or a World; give "
                               "hardware= only with N or 'NxM'") from None


def _precision(precision, world: World) -> str:
    if precision is None:  # half precision wherever the device has it; CPUs train in fp32
        return "fp32" if all(node.device.name == "cpu" for node in world.nodes) else "bf16"
    if precision not in PRECISIONS:
        raise XirangError(f"precision={precision!r} is not one Xirang plans for", where="precision=",
                          hint=f"use one of: {', '.join(PRECISIONS)}")
    return precision


def _seq(seq, symbols: dict) -> int:
    if seq is None:
        # models without a sequence dim have no 'seq' symbol; any value then prices the same
        return symbols.get("seq", 1)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise XirangError(f"seq={seq!r} must be a positive int", where="seq=",
                          hint="pass the sequence length to plan for, or leave it to the example inputs")
    return seq
