"""Lowering pass ``dispatch_experts``: under expert parallelism (mesh ep > 1), each captured experts
module sends its rows to the ranks holding their experts and takes the results back.

The trace captures an experts module as rows, their expert ids and two ``xirang::expert_linear``
calls that share the ids, with the row-local gate between them (passes/analysis/experts.py). On a
rank of an ep group of size ep, the expert weights (the ``weight`` and ``bias`` arguments of those
calls) hold this rank's ``experts / ep`` consecutive experts (``expert_slice``, recorded by
``shard_parameters``), and this pass rewrites each group of calls sharing one ids node into

    rows', ids', route = dispatch_rows(rows, ids, experts, ep_group)     (before the first call)
    expert_linear(rows', ids', ...) ... gate ... expert_linear(..., ids', ...)
    combine_rows(last call, route)                                      (read where the last call was)

(codegen/ops/expert_dispatch.py). The ep group is a module attribute like the tp group, attached by
the runtime; tensor parallelism keeps its own layout of everything else (insert_collectives runs
first). The router, the weighting by the router's scores and the sum over the top k stay on the
rank that routed the token, as the trace has them.
"""
from __future__ import annotations

import operator


from xirang.ir.meta_keys import REQUIRES_GRAD, TENSOR
from xirang.ir.pass_spec import compiler_pass
from xirang.codegen.ops.collectives import UNATTACHED
from xirang.codegen.ops.expert_dispatch import combine_rows, dispatch_rows
from xirang.passes.analysis.expert_ops import expert_calls, is_expert_weight
from xirang.passes.lowering.inserted import place_inserted, read_through

def expert_slice(node, mesh, rank: int) -> tuple:
    """``(first, count)`` of the experts this rank holds of expert weight ``node`` (dim 0), or ``()``:
    not an expert weight, or ep = 1."""
    if mesh.ep == 1 or node.op != "placeholder" or not is_expert_weight(node):
        return ()
    experts = int(node.meta["val"].shape[0])
    count = experts // mesh.ep
    return (mesh.index("ep", rank) * count, count)


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD), provides=())
def dispatch_experts(gm, ctx):
    """Route every captured experts call's rows to the ep rank holding their expert (ep > 1)."""
    calls = expert_calls(gm.graph)
    if ctx.plan.mesh.ep == 1 or not calls:
        return gm
    graph, inserted = gm.graph, []
    gm.ep_group = UNATTACHED  # this process's ep group and counter are attached by the runtime (codegen/emit.attach)
    if not hasattr(gm, "comm_counter"):  # a GraphModule keeps only the attributes its graph read when built
        gm.comm_counter = UNATTACHED
    for ids, linears in calls.items():
        first, last = linears[0], linears[-1]
        experts = int(first.args[2].meta["val"].shape[0])
        with graph.inserting_before(first):
            group = graph.create_node("get_attr", "ep_group")  # not a module or parameter: no get_attr check
            counter = graph.create_node("get_attr", "comm_counter")
            dispatch = graph.call_function(dispatch_rows, (first.args[0], ids, experts, group), {"counter": counter})
            rows = graph.call_function(operator.getitem, (dispatch, 0))
            local_ids = graph.call_function(operator.getitem, (dispatch, 1))
            route = graph.call_function(operator.getitem, (dispatch, 2))
        for node, source in ((rows, first.args[0]), (local_ids, ids)):
            if TENSOR.has(source):
                TENSOR.set(node, TENSOR.get(source))  # the balanced count: as many rows as were sent
            REQUIRES_GRAD.set(node, bool(REQUIRES_GRAD.get(source, False)))
        REQUIRES_GRAD.set(dispatch, bool(REQUIRES_GRAD.get(first.args[0], False)))
        REQUIRES_GRAD.set(route, False)
        first.args = (rows,) + tuple(first.args[1:])
        for node in linears:
            node.args = (node.args[0], local_ids) + tuple(node.args[2:])
        combined = read_through(graph, last, combine_rows, route)
        inserted += [dispatch, rows, local_ids, route, combined]
    place_inserted(graph, inserted, f"ep: rows to and from the experts' ranks (ep={ctx.plan.mesh.ep})")
    gm.recompile()
    return gm
