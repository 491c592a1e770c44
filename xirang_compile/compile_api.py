"""``xirang.compile``: the model as one rank's training program under a plan.

    # under torchrun, or inside xirang.codegen.runtime.launch.launch(fn, nprocs) ranks
    compiled = xirang.compile(model, world=8, example_kwargs=batch, global_batch=64, tp=2)
    optimizer = torch.optim.AdamW(compiled.parameters())
    loss = compiled.train_step(**batch); optimizer.step(); optimizer.zero_grad()

Every rank calls it with the same arguments. Without ``plan`` it plans (``xirang.plan``, every
rank deterministically reaching the same plan); with one, the plan is checked against this model's
traced graph and World first, so a stale plan is refused. With pp > 1 the rank's program is cut
into its pipeline stages (codegen/compose_3d.py) and the result, a ``PipelinedModel``, has the
same API as ``CompiledModel``.
"""
from __future__ import annotations

from typing import Optional, Union

from xirang.codegen.runtime.compose_3d import PipelinedModel
from xirang.codegen.emit import check_emittable
from xirang.codegen.runtime.launch import ensure_distributed
from xirang.codegen.runtime.process_groups import build_mesh_groups
from xirang.codegen.runtime.runtime import CompiledModel
from xirang.ir.plan import Plan
from xirang.ir.world import World
from xirang.passes.analysis.fingerprint import graph_fingerprint

from xirang.analyze import analyze
from xirang.ir.errors import XirangError
from xirang.plan_api import _world, plan as make_plan


def compile(model, *, world: Union[int, str, World], example_inputs=(), example_kwargs=None,  # noqa: A001
            plan: Optional[Plan] = None, global_batch: Optional[int] = None, device=None,
            runtime_device="cpu", bucket_bytes: Optional[int] = None, counter=None,
            event_log: Optional[list] = None, **plan_pins) -> Union[CompiledModel, PipelinedModel]:
    """This rank's ``CompiledModel`` of ``model`` on ``world`` (see the module docstring).

    ``device`` names the device preset the planner prices (as in ``xirang.plan``);
    ``runtime_device`` is where this rank's tensors live. ``plan_pins`` (tp=, pp=, dp=,
    micro_batch=, seq=, precision=, ...) go to ``xirang.plan`` when no plan is given.
    ``bucket_bytes``: size of the dp gradient buckets (default 25 MiB); ``counter`` (a
    ``CommCounter``) records every collective; ``event_log`` receives the buckets' launch/wait
    events.
    """
    if plan is not None:
        check_emittable(plan)  # before asking for a launch the program could not use
    if plan is not None and device is None and not isinstance(world, World):
        parsed = _world(world, plan.world.nodes[0].device)  # a bare count: the plan's devices
    else:
        parsed = _world(world, device)
    report = analyze(model, example_inputs, example_kwargs)
    gm = report.graph_module
    if plan is not None:  # a stale plan is the user's first problem, before how to launch
        if plan_pins:
            raise XirangError(f"compile got both a plan and plan choices {sorted(plan_pins)}",
                              where="xirang.compile",
                              hint="pin choices when planning (xirang.plan(..., tp=2)), or drop them here")
        plan.check_matches(graph_fingerprint(gm), parsed)
    ensure_distributed(parsed.size)
    if plan is None:
        if global_batch is None:
            raise XirangError("compile needs global_batch= to plan (samples per optimizer step)",
                              where="xirang.compile", hint="pass global_batch=, or a plan made by xirang.plan")
        plan = make_plan(model, world=parsed, example_inputs=example_inputs, example_kwargs=example_kwargs,
                         global_batch=global_batch, **plan_pins)
        check_emittable(plan)
    groups = build_mesh_groups(plan.mesh)
    built = PipelinedModel if plan.mesh.pp > 1 else CompiledModel
    return built(model, gm, plan, groups, device=runtime_device, bucket_bytes=bucket_bytes,
                         counter=counter, event_log=event_log)
