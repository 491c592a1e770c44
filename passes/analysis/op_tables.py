"""Shared by the rule tables (FLOPs, memory traffic, sharding): how a node names its op, and which
ops of a graph a table has no row for."""
from __future__ import annotations

from typing import Callable, Container

import torch
from torch.fx import Node


def op_packet(node: Node):
    """The overload packet (aten.linear) of a node's target (aten.linear.default): tables key on it."""
    return getattr(node.target, "overloadpacket", node.target)


def ops_missing_from(gm, known: Callable[[object], bool],
                     applies: Callable[[Node], bool] = lambda node: True) -> dict[str, list[str]]:
    """Op name -> names of the call nodes (for which ``applies``) whose op ``known`` rejects."""
    missing: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and applies(node) and makes_tensor(node) and not known(op_packet(node)):
            missing.setdefault(str(op_packet(node)), []).append(node.name)
    return missing


def makes_tensor(node: Node) -> bool:
    """False for size arithmetic (``operator.sub``, ``sym_min`` on SymInts): it moves no bytes and does no
    tensor work, so no table needs a row for it. True where the trace recorded no value (unknown)."""
    value = node.meta.get("val")
    return value is None or not isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def in_any(*tables: Container) -> Callable[[object], bool]:
    return lambda packet: any(packet in table for table in tables)
