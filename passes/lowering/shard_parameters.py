"""Lowering pass: how this rank holds each parameter, buffer and constant the graph binds.

A state placeholder's tp placement is the output layout the plan gave it; the runtime binds
``shard_of(full, placement, tp_rank, tp)`` and glues shards back for ``full_state_dict``
(codegen/runtime/state/shard_params.py). Data and pipeline parallelism do not shard state: dp ranks hold
copies, pp ranks hold the state of their own stages (chosen when the stages are bound). Under expert
parallelism an expert weight is first cut on its expert dim: this ep rank's ``experts / ep``
(``expert_slice``; passes/lowering/expert_parallel.py).
"""
from __future__ import annotations

from xirang.ir.facts import ParamShard
from xirang.ir.meta_keys import LAYOUT, PARAM_ALIASES, PARAM_NAME, PARAM_SHARD, ROLE
from xirang.ir.pass_spec import compiler_pass
from xirang.ir.placement import PlanReplicate
from xirang.passes.lowering.expert_parallel import expert_slice

BOUND_ROLES = ("parameter", "buffer", "constant")


@compiler_pass(requires=(LAYOUT, ROLE), provides=(PARAM_SHARD,))
def shard_parameters(gm, ctx):
    """Record on every state placeholder the shard of it this rank binds."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or ROLE.get(node, None) not in BOUND_ROLES:
            continue
        strategy = LAYOUT.get(node, None)
        placement = strategy.outputs[0].tp if strategy is not None and strategy.outputs else PlanReplicate()
        name = PARAM_NAME.get(node, node.name)
        PARAM_SHARD.set(node, ParamShard(node.name, name, tuple(PARAM_ALIASES.get(node, (name,))), ROLE.get(node),
                                         placement, tuple(int(s) for s in node.meta["val"].shape),
                                         expert_slice(node, ctx.plan.mesh, ctx.rank)))
    return gm
