"""First lowering pass: a copy of the analysed graph with the plan's per-node decisions on it.

Lowering rewrites the graph rank by rank; the analysed graph stays as it was (the plan was made for
it, ``code(rank)`` lowers it again for another rank). The plan's sharding rule of each node
(``plan.placements``) becomes the node's ``LAYOUT``, so every later pass reads decisions and facts
from one place, node.meta.
"""
from __future__ import annotations

from torch import fx

from xirang.ir.errors import PlanError
from xirang.ir.meta_keys import LAYOUT, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass


def copy_graph_module(gm: fx.GraphModule, root=None, class_name: str = "GraphModule") -> fx.GraphModule:
    """``gm``'s graph copied node by node (names and node meta kept) under ``root``, with its graph meta."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(root if root is not None else gm, graph, class_name=class_name)
    copy.meta.update(gm.meta)
    return copy


@compiler_pass(requires=(TENSOR, UNIT), provides=(LAYOUT,))
def apply_plan(gm, ctx):
    """Copy the analysed graph and stamp the plan's layout of every node on it."""
    copy = copy_graph_module(gm)
    placements = ctx.plan.placements
    for node in copy.graph.nodes:
        strategy = placements.get(node.name)
        if strategy is not None:
            LAYOUT.set(node, strategy)
        elif node.op == "call_function" and node.meta.get("val") is not None and UNIT.has(node):
            raise PlanError(f"the plan has no layout for node {node.name} ({node.target})",
                            where=f"plan.placements[{node.name!r}]",
                            hint="re-plan this model (xirang.plan); a plan lists every computing node")
    return copy
