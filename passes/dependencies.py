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
from xirang.ir.meta_keys import BLOCK, BLOCK_GRAPH, DEPENDENCIES, PARAM_COUNT, ROLE, TENSOR
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(BLOCK, TENSOR, ROLE, PARAM_COUNT), provides=(DEPENDENCIES, BLOCK_GRAPH))
def build_dependencies(gm, ctx):
    """Build the op-level dependency DiGraph and its condensation to blocks and segments."""
    deps = nx.DiGraph()
    unit_of: dict = {}
    units: list[str] = []
    segment = 0
    for node in gm.graph.nodes:
        deps.add_node(node.name, op=str(node.target) if node.op == "call_function" else node.op)
        for arg in node.all_input_nodes:
            deps.add_edge(arg.name, node.name)
        unit_of[node] = _unit(node, units, segment)
        if unit_of[node].startswith("block:"):
            segment = len([u for u in units if u.startswith("block:")])
    DEPENDENCIES.set(gm, deps)
    BLOCK_GRAPH.set(gm, _condense(gm, unit_of, units))
    return gm


def _unit(node, units: list[str], segment: int) -> str:
    """Parameters and inputs live where they are first used; they are placed later, in _condense."""
    block = BLOCK.get(node, None)
    name = f"block:{block.path}" if block is not None else f"segment:{segment}"
    if node.op != "placeholder" and name not in units:
        units.append(name)
    return name


def _condense(gm, unit_of: dict, units: list[str]) -> nx.DiGraph:
    condensed = nx.DiGraph()
    for order, unit in enumerate(units):
        condensed.add_node(unit, order=order, params=0, kind=unit.split(":", 1)[0])
    crossing: dict[tuple[str, str], dict] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            # A placeholder belongs to the first unit that reads it (a tied weight to the first).
            readers = [unit_of[user] for user in node.users if unit_of[user] in condensed]
            if ROLE.get(node) == "parameter" and readers:
                first = min(readers, key=lambda u: condensed.nodes[u]["order"])
                condensed.nodes[first]["params"] += PARAM_COUNT.get(node)
            continue
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
