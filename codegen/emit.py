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
from xirang.passes.lowering.precision import COMPUTE_DTYPES
from xirang.passes.lowering.regions import region_source


@dataclass(frozen=True)
class Program:
    """Everything a rank runs, picklable: its stage modules and how to bind and feed them."""

    stages: tuple  # StageModule per plan stage (passes/lowering/split_stages.py)
    symbols: dict  # size symbol -> value the stages were built for (batch = one micro-batch)
    batch_dims: dict  # user input name -> {dim: symbol}
    inputs: tuple  # user input names the stages read
    aliases: dict  # FQN -> every FQN bound to that tensor (tied weights)
    trainable: frozenset  # FQNs of parameters (buffers and constants are bound but not trained)
    shards: dict = field(default_factory=dict)  # FQN -> ParamShard (this rank's tp placement)
    random_sites: tuple = ()  # RandomSite of every random op (passes/lowering/random_streams.py)


# mesh axes a plan may size that no program enacts yet: (what it is, what a program would get wrong, issue)
NOT_ENACTED = {
    "cp": ("context parallelism", "no program splits attention's sequence over a cp group, so every cp rank "
                                  "would train on the whole sequence as a copy of the others", "issue 36"),
    "ep": ("expert parallelism", "no program dispatches tokens to experts held on other ranks, so every rank "
                                 "would keep every expert and the ep groups would go unused", "issue 35"),
}


def check_enacted_axes(mesh, where: str = "plan.mesh") -> None:
    """Refuse a mesh with cp > 1 or ep > 1 until their runtimes land: run, it would train wrong."""
    for axis, (name, why, issue) in NOT_ENACTED.items():
        size = mesh.axis_size(axis)
        if size > 1:
            raise XirangError(f"{name} ({axis}={size}) is planned but not yet enacted by the runtime: {why} "
                              f"({issue})", where=where,
                              hint=f"re-plan with xirang.plan(...), which keeps {axis}=1 until {issue} lands")


def check_emittable(plan) -> None:
    """Refuse what no program is emitted for, before any rank builds anything."""
    check_enacted_axes(plan.mesh)
    if plan.precision not in COMPUTE_DTYPES:
        raise XirangError(f"the plan computes in {plan.precision!r}, which no program is emitted for",
                          where="plan.precision", hint=f"re-plan with precision in {sorted(COMPUTE_DTYPES)}")


def emit_program(gm, plan) -> Program:
    """The ``Program`` of a graph the lowering passes ran on (see the module docstring)."""
    stages = STAGE_MODULES.get(gm)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    shards = {PARAM_SHARD.get(n).name: PARAM_SHARD.get(n) for n in placeholders if PARAM_SHARD.has(n)}
    return Program(
        stages=stages, symbols={**SYMBOLS.get(gm, {}), "batch": plan.micro_batch},
        batch_dims={name: dict(dims) for name, dims in SYMBOL_DIMS.get(gm, {}).items()},
        inputs=tuple(dict.fromkeys(name for stage in stages for name in stage.user_inputs)),
        aliases={PARAM_NAME.get(n): tuple(PARAM_ALIASES.get(n, (PARAM_NAME.get(n),)))
                 for n in placeholders if PARAM_NAME.get(n, None) is not None},
        trainable=frozenset(PARAM_NAME.get(n) for n in placeholders if ROLE.get(n, None) == "parameter"),
        shards=shards, random_sites=tuple(RANDOM_SITES.get(gm, ())))


def attach(program: Program, *, tp_group=None, counter: Optional[object] = None, rng=None) -> Program:
    """Point every stage module at this process's live tp group and communication counter, and (when
    given) the runtime's RNG streams (``codegen/ops/random_ops.RngContext``)."""
    for stage in program.stages:
        stage.module.tp_group, stage.module.comm_counter = tp_group, counter
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
