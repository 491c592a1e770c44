"""``xirang.compile``: the model as one rank's training program under a plan.

    # under torchrun, or inside xirang.launch(fn, world) ranks
    compiled = xirang.compile(model, world=8, example_kwargs=batch, global_batch=64, tp=2)
    # grouped options (xirang_compile/options.py): choices=PlanChoices(...), runtime=RuntimeOptions(seed=0),
    # debug=DebugHooks(dump_dir="dump")
    optimizer = torch.optim.AdamW(compiled.parameters())
    loss = compiled.train_step(**batch); optimizer.step(); optimizer.zero_grad()

Every rank calls it with the same arguments. Without ``plan`` it plans (``xirang.plan``, every
rank deterministically reaching the same plan); with one, the plan is checked against this model's
traced graph and World first, so a stale plan is refused. A plan whose predicted memory is more than
this rank's device holds (a plan for 80 GB devices on a smaller one) is refused before anything is
built (``memory_probe.check_plan_fits``). The model is traced once; the lowering
passes (xirang_compile/pipeline.py) turn the analysed graph into this rank's program, its pipeline
stages (one when pp = 1), which the one runtime (codegen/runtime/compiled_model.py) runs.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from xirang.codegen.emit import check_emittable
from xirang.codegen.ops.random_ops import MODES as RNG_MODES
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.devices import resolve_runtime_device
from xirang.codegen.runtime.data_parallel.dp_balance import DpRebalancer
from xirang.codegen.runtime.executor.injection import AdaptiveInjection
from xirang.codegen.runtime.launch.launcher import ensure_distributed
from xirang.codegen.runtime.memory.memory_probe import check_plan_fits
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.device import DEVICE_PRESETS, DeviceSpec
from xirang.ir.errors import XirangError
from xirang.ir.plan import Plan
from xirang.ir.renamed import renamed_error, renamed_keywords
from xirang.ir.run_log import on_rank_zero
from xirang.ir.world import World
from xirang.passes.analysis.fingerprint import check_plan_matches

from .analyze import analyze
from .lower import lower, rank_source
from .options import DebugHooks, PlanChoices, RuntimeOptions, checked_option, merged_choices
from .model_checks import check_placements, check_plan_batch_split, check_trainable
from .plan_api import as_world, plan as make_plan


def check_plan_for_graph(plan: Plan, gm, world: World) -> None:
    """Everything a plan must match in the traced graph before a rank builds from it: the model and
    World it was made for, placements this graph can run, and no batch split of batch statistics."""
    if not isinstance(plan, Plan):
        raise XirangError(f"plan= must be a xirang Plan, got {type(plan).__name__}", where="xirang.compile(plan=)",
                          hint="pass xirang.plan(...) or Plan.load('plan.json')")
    check_plan_matches(plan, gm, world)  # a plan for another model names what differs first
    check_placements(plan, gm)
    check_plan_batch_split(gm, plan.mesh.dp, plan.num_micro_batches, "plan.mesh.dp, plan.num_micro_batches")


@renamed_keywords(runtime_device="device=", **{name: f"runtime=xirang.RuntimeOptions({name}=...)" for name in (
    "seed", "rng", "bucket_bytes", "dp_shares", "rebalance_every", "inject_every")},
    **{name: f"debug=xirang.DebugHooks({name}=...)" for name in ("counter", "event_log", "dump_dir")})
def compile(model, *, world: Union[int, str, World], example_inputs=(), example_kwargs=None,  # noqa: A001
            plan: Optional[Plan] = None, global_batch: Optional[int] = None, seq: Optional[int] = None,
            hardware: Union[str, DeviceSpec, None] = None, device=None, choices: Optional[PlanChoices] = None,
            runtime: Optional[RuntimeOptions] = None, debug: Optional[DebugHooks] = None,
            **pins) -> CompiledModel:
    """This rank's ``CompiledModel`` of ``model`` on ``world`` (see the module docstring).

    ``seq``: the sequence length to plan for (as in ``xirang.plan``; default: the example inputs').
    ``hardware`` names the device preset the planner prices (as in ``xirang.plan``; default: the
    plan's when one is given, "cpu" when ``device`` is a CPU device, else "a100-80g").
    ``device`` is the torch device this rank's tensors live on: by default it follows the launcher and
    the process group (codegen/runtime/launch/devices.py): ``cuda:LOCAL_RANK`` under NCCL (without
    ``LOCAL_RANK`` refused, not guessed from the rank), the CPU under gloo or with no process group (a
    one-rank program); ``compiled.device`` says which, and the batches go there. An explicit value
    wins, but one the backend cannot move (NCCL with a CPU device, a CUDA device where torch.cuda is
    unavailable) is refused before anything is built. ``choices`` (a ``PlanChoices``) and planning
    choices given directly (``tp=2``, ``micro_batch=``, ``precision=`` ...) go to ``xirang.plan``
    when no plan is given; with a plan only ``zero_stage`` is taken (``Plan.with_zero_stage``).
    ``runtime`` (a ``RuntimeOptions``) says how the program runs and ``debug`` (a ``DebugHooks``) what
    it records (xirang_compile/options.py).

    Randomness (dropout, ``torch.rand`` in forward) draws on streams the runtime owns
    (codegen/ops/random_ops.py): ``runtime.seed`` (default: rank 0's ``torch.initial_seed()``, given to
    every rank) and the step fix every draw; ``rng="streams"`` draws independently per dp rank,
    micro-batch and tp shard and identically where tp replicates; ``rng="exact"`` (verification)
    draws what one device would for the global batch and keeps this rank's piece, so the program
    equals the eager model under ``ExactReference(seed)``.

    Uneven data parallelism: ``runtime.dp_shares`` (samples per step of each dp rank, whole
    micro-batches, summing to the global batch) overrides the plan's even split
    (``Plan.with_dp_shares``); ``runtime.rebalance_every=N`` moves micro-batches from slow dp ranks to
    fast ones every N steps from their measured compute times (codegen/runtime/data_parallel/dp_balance.py).
    Either way the loss and the gradients are weighted by share, so training stays equal to one device.

    ``zero_stage=1``: ZeRO-1, the optimizer state sharded over dp (codegen/runtime/data_parallel/dist_optimizer.py;
    ``parameters()`` are then the shard parameters); ``zero_stage=3`` also shards the parameters at rest
    (codegen/runtime/data_parallel/param_shards.py: gathered per bucket at first use in a step, freed after it; read
    them between steps inside ``compiled.parameters_resident()``): a planning choice, and on a given plan
    ``Plan.with_zero_stage``.

    Adaptive micro-batch injection: ``runtime.inject_every=N`` (1F1B, pp >= 2) re-chooses every N steps
    how many extra forwards each pipeline rank runs in its warm-up, from the stages' measured times and
    within the memory the plan leaves (codegen/runtime/executor/injection.py); the numbers are unchanged.
    """
    choices = merged_choices(choices, pins, "xirang.compile")
    runtime = checked_option(runtime, RuntimeOptions, "runtime", "xirang.compile")
    debug = checked_option(debug, DebugHooks, "debug", "xirang.compile")
    check_torch_device(device)
    zero_stage, dump_dir, rng = choices.zero_stage, debug.dump_dir, runtime.rng
    plan_pins = {name: value for name, value in choices.pinned().items() if name != "zero_stage"}
    if not isinstance(model, torch.nn.Module):
        raise XirangError(f"xirang.compile needs the model as a torch.nn.Module, got {type(model).__name__}",
                          where="xirang.compile(model=)",
                          hint="pass the module itself (the object whose forward returns the loss), not a function, "
                               "a state dict or a path")
    if rng not in RNG_MODES:
        raise XirangError(f"unknown rng mode {rng!r}", where="xirang.compile(runtime=RuntimeOptions(rng=...))",
                          hint=f"use one of {', '.join(RNG_MODES)}")
    if plan is not None and not isinstance(plan, Plan):
        check_plan_for_graph(plan, None, None)  # names the wrong type before any trace
    if plan is not None:
        check_emittable(plan)  # before asking for a launch the program could not use
    if plan is not None and hardware is None and not isinstance(world, World):
        parsed = as_world(world, plan.world.nodes[0].device)  # a bare count: the plan's devices
    elif hardware is None and _on_cpu(device) and not isinstance(world, World):
        parsed = as_world(world, "cpu")  # tensors the user put on the CPU: priced as CPU ranks
    else:
        parsed = as_world(world, hardware)
    analysis_dump = f"{dump_dir}/analysis" if dump_dir is not None and on_rank_zero() else None
    # the one trace: planning and lowering read it
    report = analyze(model, example_inputs, example_kwargs, dump_dir=analysis_dump)
    gm = report.graph_module
    check_trainable(gm)  # no scalar loss, or positions past the table: refused before any rank trains
    if plan is not None:  # a stale plan is the user's first problem, before how to launch
        if plan_pins or seq is not None:
            given = sorted(plan_pins) + (["seq"] if seq is not None else [])
            raise XirangError(f"compile got both a plan and plan choices {given}",
                              where="xirang.compile",
                              hint="pin choices when planning (xirang.plan(..., tp=2)), or drop them here "
                                   "(zero_stage= alone applies to a given plan)")
        check_plan_for_graph(plan, gm, parsed)
    ensure_distributed(parsed.size)
    runtime_device = resolve_runtime_device(device)  # the world is joined: its backend decides
    if plan is None:
        if global_batch is None:
            raise XirangError("compile needs global_batch= to plan (samples per optimizer step)",
                              where="xirang.compile", hint="pass global_batch=, or a plan made by xirang.plan")
        plan = make_plan(model, world=parsed, example_inputs=example_inputs, example_kwargs=example_kwargs,
                         global_batch=global_batch, seq=seq, analysed=report, choices=choices)
        check_emittable(plan)
        check_plan_for_graph(plan, gm, parsed)
    if zero_stage is not None and zero_stage != plan.zero_stage:
        try:
            plan = plan.with_zero_stage(zero_stage)
        except XirangError as error:
            raise XirangError(error.what, where=f"xirang.compile(zero_stage={zero_stage!r})", hint=error.hint) from None
    if runtime.dp_shares is not None:
        try:
            plan = plan.with_dp_shares(runtime.dp_shares)
        except XirangError as error:
            raise XirangError(error.what, where=f"xirang.compile(runtime=RuntimeOptions(dp_shares="
                                                f"{runtime.dp_shares!r}))", hint=error.hint) from None
    groups = build_mesh_groups(plan.mesh)
    check_plan_fits(plan, groups.rank, runtime_device)  # before building: a plan for a bigger device is refused
    dump = None if dump_dir is None else f"{dump_dir}/rank{groups.rank}"
    program = lower(gm, plan, rank=groups.rank, device=runtime_device, dump_dir=dump).program
    compiled = CompiledModel(model, plan, program, groups=groups, device=runtime_device,
                             bucket_bytes=runtime.bucket_bytes, counter=debug.counter, event_log=debug.event_log,
                             seed=runtime.seed, rng=rng,
                             source_of=lambda rank: rank_source(gm, plan, rank, runtime_device))
    if runtime.rebalance_every is not None:
        compiled.rebalancer = DpRebalancer(compiled, runtime.rebalance_every)
    if runtime.inject_every is not None:
        compiled.injection = AdaptiveInjection(compiled, runtime.inject_every)
    return compiled


def check_torch_device(device) -> None:
    """``device`` is the torch device since issue 34 renamed the preset ``hardware=``: a preset name or
    DeviceSpec there is the old spelling, refused naming the new one rather than read as a device."""
    if isinstance(device, DeviceSpec) or (isinstance(device, str) and device in DEVICE_PRESETS and device != "cpu"):
        error = renamed_error("xirang.compile", "device", "hardware=")
        raise XirangError(f"{error.what} (device= is now the torch device this rank's tensors live on, "
                          f"and {device if isinstance(device, str) else 'a DeviceSpec'!r} is a hardware preset)",
                          where=error.where, hint=f"write hardware={device!r}" if isinstance(device, str)
                          else "write hardware=<the DeviceSpec>")


def _on_cpu(device) -> bool:
    """Whether an explicit ``device`` is the CPU (one torch cannot parse is left to resolve_runtime_device,
    which refuses it naming the backend)."""
    try:
        return device is not None and torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False
