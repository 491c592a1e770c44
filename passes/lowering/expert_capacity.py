"""Lowering pass ``drop_over_capacity``: with a capacity factor (``Plan.capacity_factor``), each
captured experts call computes at most ``capacity`` rows per expert and drops the rest.

Each group of ``xirang::expert_linear`` calls sharing one ids node (passes/analysis/expert_ops.py) is
rewritten into

    rows', ids', kept = drop_over_capacity(rows, ids, experts, factor)    (before the first call)
    expert_linear(rows', ids', ...) ... gate ... expert_linear(..., ids', ...)
    restore_dropped(last call, kept, rows)                                (read where the last call was)

(codegen/ops/expert_capacity.py: the rule, Megatron-Core's capacity with its "position" drop policy).
It runs before ``dispatch_experts``, so under ep > 1 only the kept rows are exchanged: the all-to-all a
rank receives is at most ``factor`` times the balanced one. The rows are those of the rank's own
micro-batch, whatever ep, tp or pp: tp ranks hold the same tokens and drop the same rows.
"""
from __future__ import annotations

import operator

from xirang.ir.meta_keys import REQUIRES_GRAD, TENSOR
from xirang.ir.pass_spec import compiler_pass
from xirang.codegen.ops.expert_capacity import drop_over_capacity as drop_rows
from xirang.codegen.ops.expert_capacity import restore_dropped
from xirang.passes.analysis.expert_ops import expert_calls
from xirang.passes.lowering.inserted import place_inserted, read_through


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD), provides=())
def drop_over_capacity(gm, ctx):
    """Keep at most the plan's capacity of rows per expert in every captured experts call."""
    factor = ctx.plan.capacity_factor
    calls = expert_calls(gm.graph)
    if factor is None or not calls:
        return gm
    graph, inserted = gm.graph, []
    for ids, linears in calls.items():
        first, last = linears[0], linears[-1]
        rows = first.args[0]
        experts = int(first.args[2].meta["val"].shape[0])
        with graph.inserting_before(first):
            dropped = graph.call_function(drop_rows, (rows, ids, experts, float(factor)))
            kept_rows = graph.call_function(operator.getitem, (dropped, 0))
            kept_ids = graph.call_function(operator.getitem, (dropped, 1))
            kept = graph.call_function(operator.getitem, (dropped, 2))
        for node, source in ((kept_rows, rows), (kept_ids, ids)):
            if TENSOR.has(source):
                TENSOR.set(node, TENSOR.get(source))  # nothing dropped: the balanced routing's count
            REQUIRES_GRAD.set(node, bool(REQUIRES_GRAD.get(source, False)))
        REQUIRES_GRAD.set(dropped, bool(REQUIRES_GRAD.get(rows, False)))
        REQUIRES_GRAD.set(kept, False)
        first.args = (kept_rows,) + tuple(first.args[1:])
        for node in linears:
            node.args = (node.args[0], kept_ids) + tuple(node.args[2:])
        restored = read_through(graph, last, restore_dropped, kept, rows)
        inserted += [dropped, kept_rows, kept_ids, kept, restored]
    place_inserted(graph, inserted, f"experts: rows over capacity dropped (capacity factor {factor:g})")
    gm.recompile()
    return gm
