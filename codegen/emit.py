"""Emission: a lowered graph as the ``Program`` one rank runs.

The lowering passes (xirang_compile/pipeline.py: ``LOWERING_PASSES``) leave on the graph everything a
rank needs: the stage modules (``STAGE_MODULES``, each a GraphModule whose Python source is
deterministic, byte-identical across runs and processes, so golden files catch every unintended
change) and on each state placeholder the shard this rank binds (``PARAM_SHARD``). ``emit_program``
collects them into a picklable ``Program``: a rank built elsewhere can be sent to launched ranks.

The process group and communication counter are module attributes of every stage
(``self.tp_group``, ``self.comm_counter``), ``None`` until ``attach`` points them at this process's:
the same source runs with any group object, and ``code(rank)`` can be printed for ranks this
process does not run. Data parallelism adds nothing to a program: dp ranks run the same program on
their share of the batch, and their gradients are averaged by the runtime (codegen/runtime).
Random ops read a third attribute, ``self.rng``: the runtime's streams, which know the dp rank,
step and micro-batch (codegen/ops/random_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import (PARAM_ALIASES, PARAM_NAME, PARAM_SHARD, RANDOM_SITES, ROLE, STAGE_MODULES,
                                 SYMBOL_DIMS, SYMBOLS)
from xirang.passes.planning.context_parallel_cost import context_parallel_conflicts
from xirang.passes.lowering.precision import COMPUTE_DTYPES
from xirang.passes.lowering.regions import region_source
from xirang.passes.lowering.split_stages import tied_parameters


@dataclass(frozen=True)
class Program:
    """Everything a rank runs, picklable: its stage modules and how to bind and feed them."""

    stages: tuple  # StageModule per plan stage (passes/lowering/split_stages.py)
    symbols: dict  # size symbol -> value of one micro-batch's inputs (seq: the whole sequence, which cp cuts)
    batch_dims: dict  # user input name -> {dim: symbol}
    inputs: tuple  # user input names the stages read
    aliases: dict  # FQN -> every FQN bound to that tensor (tied weights)
    trainable: frozenset  # FQNs of parameters (buffers and constants are bound but not trained)
    shards: dict = field(default_factory=dict)  # FQN -> ParamShard (this rank's tp placement)
    random_sites: tuple = ()  # RandomSite of every random op (passes/lowering/random_streams.py)


# mesh axes a plan may size that no program enacts yet: (what it is, what a program would get wrong, issue)
NOT_ENACTED: dict = {}  # cp runs since issue 36 (passes/lowering/context_parallel.py), ep since issue 35


def check_enacted_axes(mesh, where: str = "plan.mesh") -> None:
    """Refuse a mesh that sizes an axis ``NOT_ENACTED`` names (none now): run, it would train wrong."""
    for axis, (name, why, issue) in NOT_ENACTED.items():
        size = mesh.axis_size(axis)
        if size > 1:
            raise XirangError(f"{name} ({axis}={size}) is planned but not yet enacted by the runtime: {why} "
                              f"({issue})", where=where,
                              hint=f"re-plan with xirang.plan(...), which keeps {axis}=1 until {issue} lands")


def check_expert_parallel(plan) -> None:
    """Refuse what expert parallelism does not run with yet (ep > 1), naming the other choice."""
    ep = plan.mesh.ep
    if ep == 1:
        return
    if plan.zero_stage:
        raise XirangError(f"expert parallelism (ep={ep}) with ZeRO-{plan.zero_stage} is not run yet: ZeRO shards "
                          f"the optimizer state over the dp group, and expert weights are reduced over their "
                          f"expert-data-parallel group instead", where="plan.zero_stage",
                          hint="plan with zero_stage=0 beside ep > 1, or with ep=1")
    if len(set(plan.dp_shares)) > 1:
        raise XirangError(f"expert parallelism (ep={ep}) with uneven dp shares {list(plan.dp_shares)}: every rank "
                          f"of an ep group must run as many micro-batches, since each experts layer exchanges "
                          f"rows with all of them", where="plan.dp_shares",
                          hint="plan with even dp shares (a World of one device kind), or with ep=1")


def check_context_parallel(plan) -> None:
    """Refuse what context parallelism (cp > 1, passes/lowering/context_parallel.py) does not run with yet,
    naming the other choice."""
    cp = plan.mesh.cp
    # the planner lists no candidate with these either (the same predicate: context_parallel_cost.py)
    for what, where, why in context_parallel_conflicts(cp=cp, ep=plan.mesh.ep, zero_stage=plan.zero_stage,
                                                       dp_shares=plan.dp_shares,
                                                       sequence_parallel=plan.sequence_parallel):
        raise XirangError(f"context parallelism (cp={cp}) with {what} is not run yet: {why}", where=where,
                          hint=f"plan with cp={cp} beside dp and pp only, or with cp=1")


def check_context_parallel_program(program: "Program", plan) -> None:
    """Refuse a cp > 1 program with random ops (their streams are drawn per dp and tp rank, so the cp ranks
    of a sequence would draw alike, and exact mode's whole-tensor draw is cut by batch, not by chunk), or
    whose weights are tied across pipeline ranks (their gradient sums are built per (dp, tp) place:
    codegen/runtime/state/pipeline_state.py ``tied_groups``, not yet per cp rank)."""
    if plan.mesh.cp == 1:
        return
    if program.random_sites:
        ops = sorted({f"{site.node} ({site.op})" for site in program.random_sites})
        raise XirangError(f"context parallelism (cp={plan.mesh.cp}) with random ops ({', '.join(ops[:4])}"
                          f"{', ...' if len(ops) > 4 else ''}) is not run yet: their draws are not split by "
                          f"sequence chunk", where="the model's dropout",
                          hint="set the model's dropout probabilities to 0, or plan with cp=1")
    if plan.mesh.pp == 1:
        return
    pp = plan.mesh.pp
    tied = sorted(fqn for fqn, stages in tied_parameters(program.stages).items()
                  if len({stage % pp for stage in stages}) > 1)
    if tied:
        raise XirangError(f"context parallelism (cp={plan.mesh.cp}) with pp={pp} and weights tied across pipeline "
                          f"ranks ({', '.join(tied)}) is not run yet: their gradients are summed per dp and tp "
                          f"place, not per cp rank", where="plan.mesh",
                          hint="plan with pp=1 beside cp, untie the weights, or plan with cp=1")


def check_emittable(plan) -> None:
    """Refuse what no program is emitted for, before any rank builds anything."""
    check_enacted_axes(plan.mesh)
    check_expert_parallel(plan)
    check_context_parallel(plan)
    if plan.precision not in COMPUTE_DTYPES:
        raise XirangError(f"the plan computes in {plan.precision!r}, which no program is emitted for",
                          where="plan.precision", hint=f"re-plan with precision in {sorted(COMPUTE_DTYPES)}")


def emit_program(gm, plan) -> Program:
    """The ``Program`` of a graph the lowering passes ran on (see the module docstring)."""
    stages = STAGE_MODULES.get(gm)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    shards = {PARAM_SHARD.get(n).name: PARAM_SHARD.get(n) for n in placeholders if PARAM_SHARD.has(n)}
    symbols = {**SYMBOLS.get(gm, {}), "batch": plan.micro_batch}
    if plan.mesh.cp > 1 and "seq" in symbols:  # the stages hold seq / cp tokens (split_sequence); inputs the whole
        symbols["seq"] *= plan.mesh.cp
    return Program(
        stages=stages, symbols=symbols,
        batch_dims={name: dict(dims) for name, dims in SYMBOL_DIMS.get(gm, {}).items()},
        inputs=tuple(dict.fromkeys(name for stage in stages for name in stage.user_inputs)),
        aliases={PARAM_NAME.get(n): tuple(PARAM_ALIASES.get(n, (PARAM_NAME.get(n),)))
                 for n in placeholders if PARAM_NAME.get(n, None) is not None},
        trainable=frozenset(PARAM_NAME.get(n) for n in placeholders if ROLE.get(n, None) == "parameter"),
        shards=shards, random_sites=tuple(RANDOM_SITES.get(gm, ())))


def attach(program: Program, *, tp_group=None, counter: Optional[object] = None, rng=None,
           ep_group=None, cp_group=None, context_groups=None) -> Program:
    """Point every stage module at this process's live tp group (and ep group: expert parallelism's
    dispatch, passes/lowering/expert_parallel.py; cp group: context parallelism's attention, positions and
    loss, passes/lowering/context_parallel.py; ``context_groups``: USP attention's sub-groups of it,
    codegen/runtime/launch/process_groups.py ``ContextGroups``) and communication counter, and (when given) the
    runtime's RNG streams (``codegen/ops/random_ops.RngContext``)."""
    for stage in program.stages:
        stage.module.tp_group, stage.module.comm_counter = tp_group, counter
        stage.module.ep_group, stage.module.cp_group = ep_group, cp_group
        if context_groups is not None:
            stage.module.cp_a2a_group, stage.module.cp_ring_group = context_groups.a2a, context_groups.ring
        if rng is not None:
            stage.module.rng = rng
    return program


def program_source(program: Program, plan, rank: int, stages: tuple[int, ...]) -> str:
    """Python source of the stage modules ``stages`` of ``program``, headed by the rank's mesh place;
    each stage's recompute and offload regions follow it (none: nothing added)."""
    coords = plan.mesh.coords(rank)
    parts = [f"# Xirang program of rank {rank}: mesh {plan.mesh}, dp {coords['dp']} pp {coords['pp']} "
             f"tp {coords['tp']}, precision {plan.precision}, schedule {plan.schedule}\n"]
    for index in stages:
        stage = program.stages[index]
        code, regions = stage.module.code.lstrip("\n"), region_source(stage.module)
        parts.append(f"# stage {index}: receives {[c.name for c in stage.crossing_in]}, sends "
                     f"{[c.name for c in stage.crossing_out] or ['the loss']}\n"
                     + (code.rstrip() + "\n\n" + regions if regions else code))
    return "\n".join(parts)
