"""Data dependencies as a networkx graph, and the same graph condensed to blocks and segments.

The condensed graph is what pipeline cutting reads: its nodes are the repeated blocks and the
stretches of ops between them ("segment:0" before the first block, "segment:k" between block k-1 and
block k, ...), in execution order, each with the parameter elements it owns; its edges carry the bytes
that would cross a cut there (every distinct tensor produced on one side and read on the other).
"""
from __future__ import annotations

import networkx as nx
import sympy

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import BLOCK, BLOCK_GRAPH, DEPENDENCIES, PARAM_COUNT, ROLE, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(BLOCK, TENSOR, ROLE, PARAM_COUNT), provides=(DEPENDENCIES, BLOCK_GRAPH, UNIT))
def build_dependencies(gm, ctx):
    """Build the op-level dependency DiGraph and its condensation to blocks and segments."""
    deps = nx.DiGraph()
    unit_of: dict = {}
    units: list[str] = []
    unit_order: dict[str, int] = {}
    blocks_seen = 0
    for node in gm.graph.nodes:
        deps.add_node(node.name, op=str(node.target) if node.op == "call_function" else node.op)
        for arg in node.all_input_nodes:
            deps.add_edge(arg.name, node.name)
        block = BLOCK.get(node, None)
        unit = f"block:{block.path}" if block is not None else f"segment:{blocks_seen}"
        unit_of[node] = unit
        if node.op != "placeholder" and unit not in unit_order:
            # Parameters and inputs are placed later, in their first reader's unit.
            unit_order[unit] = len(units)
            units.append(unit)
            blocks_seen += unit.startswith("block:")
    DEPENDENCIES.set(gm, deps)
    BLOCK_GRAPH.set(gm, _condense(gm, unit_of, units))
    return gm


def _condense(gm, unit_of: dict, units: list[str]) -> nx.DiGraph:
    condensed = nx.DiGraph()
    for order, unit in enumerate(units):
        condensed.add_node(unit, order=order, params=0, kind=unit.split(":", 1)[0])
    crossing: dict[tuple[str, str], dict] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            # A placeholder belongs to the first unit that reads it (a tied weight to the first).
            readers = [unit_of[user] for user in node.users if unit_of[user] in condensed]
            first = min(readers, key=lambda u: condensed.nodes[u]["order"]) if readers else units[0]
            UNIT.set(node, first)
            if ROLE.get(node) == "parameter":
                condensed.nodes[first]["params"] += PARAM_COUNT.get(node)
            continue
        UNIT.set(node, unit_of[node])
        source = unit_of[node]
        for user in node.users:
            target = unit_of[user]
            if target != source and target in condensed:
                crossing.setdefault((source, target), {})[node.name] = _nbytes(node)
    for (source, target), tensors in crossing.items():
        condensed.add_edge(source, target, bytes=sympy.Add(*tensors.values()), tensors=tuple(tensors))
    return condensed


def _nbytes(node) -> sympy.Expr:
    info = TENSOR.get(node, None)
    if isinstance(info, TensorInfo):
        return info.nbytes
    if isinstance(info, tuple):
        return sympy.Add(*[i.nbytes for i in info if isinstance(i, TensorInfo)])
    return sympy.Integer(0)
