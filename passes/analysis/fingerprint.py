"""A short, stable fingerprint of a traced graph, so a saved plan can tell whether it fits a model.

The fingerprint hashes what a plan depends on: every op in order, how each reads its inputs (by the
input's position in the graph, never by node name, which tracing may number differently), the
output shapes and dtypes (``xr_tensor``, symbolic in batch/seq), and the parameters' names and
shapes. It uses sha256 over text built without ``id()`` or ``hash()``, so it is the same in every
process regardless of PYTHONHASHSEED. Devices in op arguments are left out: tracing on "meta" and
compiling on "cuda" is the same model.
"""
from __future__ import annotations

import hashlib
import re

import torch

from xirang.ir.meta_keys import PARAM_ALIASES, PARAM_NAME, ROLE, TENSOR

FINGERPRINT_CHARS = 16  # 64 bits of sha256: collisions between real models are not a concern
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def graph_fingerprint(gm) -> str:
    """Hex digest of ``gm``'s structure (needs ``xr_tensor``; ``xr_role``/``xr_param_name`` if set)."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    shape_texts: dict[int, str] = {}  # id(facts) -> repr: stamped layers share their template's facts
    target_texts: dict = {}  # target -> its text: a few dozen ops name thousands of nodes
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        digest.update(repr(_entry(node, position, shape_texts, target_texts)).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def _entry(node, position: dict, shape_texts: dict[int, str], target_texts: dict) -> tuple:
    facts = TENSOR.get(node, None)  # held by the node for the whole call, so its id stays its own
    shape = shape_texts.get(id(facts))
    if shape is None:
        shape = shape_texts[id(facts)] = repr(facts)
    if node.op == "placeholder":
        # parameters by FQN (tied weights by all their names); user inputs by argument name
        name = PARAM_NAME.get(node, None) or str(node.target)
        return ("placeholder", ROLE.get(node, ""), name, PARAM_ALIASES.get(node, ()), shape)
    try:
        target = target_texts.get(node.target)
        if target is None:
            target = target_texts[node.target] = _target_text(node.target)
    except TypeError:  # an unhashable callable: its text each time
        target = _target_text(node.target)
    return (node.op, target, _wiring((node.args, node.kwargs), position), shape)


def _target_text(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # "aten.addmm.default"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else _ADDRESS.sub("", repr(target))


_PLAIN = (bool, int, float, str, type(None))  # written as their repr


def _wiring(value, position: dict):
    kind = type(value)  # the common exact types first, one lookup each (~6,000 nodes, ~30,000 values)
    if kind is torch.fx.Node:
        return ("%", position[value])
    if kind is tuple:
        return tuple([_wiring(v, position) for v in value])
    if kind in _PLAIN:
        return repr(value)
    if isinstance(value, torch.fx.Node):
        return ("%", position[value])
    if isinstance(value, (list, tuple)):
        return tuple([_wiring(v, position) for v in value])
    if isinstance(value, dict):  # every node's kwargs, nearly always empty
        if not value:
            return ()
        return tuple((str(k), _wiring(v, position)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, torch.device):
        return "<device>"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"<{type(value).__name__}>"  # torch's symbol names ("s72") vary between traces
    if isinstance(value, _PLAIN):
        return repr(value)
    if callable(value):
        return _target_text(value)
    return _ADDRESS.sub("", f"{type(value).__name__}:{value!r}")
