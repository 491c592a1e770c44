"""A short, stable fingerprint of a traced graph, so a saved plan can tell whether it fits a model.

The fingerprint hashes what a plan depends on: every op in order, how each reads its inputs (by the
input's position in the graph, never by node name, which tracing may number differently), the
output shapes and dtypes (``xr_tensor``, symbolic in batch/seq), and the parameters' names and
shapes. It uses sha256 over text built without ``id()`` or ``hash()``, so it is the same in every
process regardless of PYTHONHASHSEED. Devices in op arguments are left out: tracing on "meta" and
compiling on "cuda" is the same model.

``model_summary`` keeps, from the same per-node texts, what a plan needs to say *what* differs when
the fingerprints do (ir/model_summary.py); ``check_plan_matches`` refuses a plan for another model
or World with that difference named first.
"""
from __future__ import annotations

import hashlib
import re

import torch

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import MODULE_PATH, PARAM_ALIASES, PARAM_NAME, ROLE, SOURCE, TENSOR
from xirang.ir.model_summary import ModelSummary

FINGERPRINT_CHARS = 16  # 64 bits of sha256: collisions between real models are not a concern
# hex digits of each node's two hashes in a ModelSummary: 12 bits each keep a 10,000-node graph's
# summary near 100 KB; a collision only hides a difference until the next node it reaches
NODE_HASH_CHARS = 3
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


def model_summary(gm) -> ModelSummary:
    """The ModelSummary of ``gm`` (needs what ``graph_fingerprint`` needs), from the same node texts."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    shape_texts: dict[int, str] = {}
    target_texts: dict = {}
    state, ties, inputs, ops, records = [], [], [], {}, []
    for node in gm.graph.nodes:
        entry = _entry(node, position, shape_texts, target_texts)
        if node.op == "placeholder":
            role, shape, dtype = ROLE.get(node, ""), *_shape_and_dtype(TENSOR.get(node, None))
            names = PARAM_ALIASES.get(node, ()) or ((PARAM_NAME.get(node),) if PARAM_NAME.has(node) else ())
            if role in ("parameter", "buffer"):
                state += [(name, role, shape, dtype) for name in names]
                if len(names) > 1:
                    ties.append(tuple(sorted(names)))
            elif role == "input":
                inputs.append((str(node.target), shape, dtype))
        op = _op_text(node, entry)
        index = ops.setdefault(op, len(ops))
        records.append(f"{index:x}:{_short(entry[-1])}{_short(repr(entry[:-1]))}")
    return ModelSummary(state=tuple(state), ties=tuple(sorted(ties)), inputs=tuple(inputs), ops=tuple(ops),
                        nodes=" ".join(records))


def describe_node(node) -> str:
    """'aten.gelu.default in module h.0.mlp (model.py:42 `x = F.gelu(x)`), output float32[batch, seq, 256]'."""
    op = _op_text(node, (node.op, _target_text(node.target)) if node.op != "placeholder" else ("placeholder",))
    text = f"{op} {node.target}" if node.op == "placeholder" else op
    path = MODULE_PATH.get(node, "")
    text += f" in module {path}" if path else " in the model's own forward" if node.op == "call_function" else ""
    source = SOURCE.get(node, None)
    if source is not None:
        text += f" ({source.file.rsplit('/', 1)[-1]}:{source.line}" + (f" `{source.code}`)" if source.code else ")")
    output = _tensor_text(TENSOR.get(node, None))
    return text + (f", output {output}" if output else "")


def check_plan_matches(plan, gm, world) -> None:
    """``plan.check_matches`` for the traced graph ``gm`` on ``world``: a plan for another model is
    refused naming the first difference its summary and this graph's show (ir/model_summary.py)."""
    fingerprint = graph_fingerprint(gm)
    if fingerprint == plan.fingerprint or plan.model_summary is None:
        plan.check_matches(fingerprint, world)
        return
    nodes = list(gm.graph.nodes)
    plan.check_matches(fingerprint, world, model=model_summary(gm), describe_node=lambda i: describe_node(nodes[i]))


def _op_text(node, entry: tuple) -> str:
    return entry[1] if node.op in ("call_function", "call_method", "call_module") else node.op


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:NODE_HASH_CHARS]


def _shape_and_dtype(facts) -> tuple[str, str]:
    """('batch, seq, 64', 'float32') of a node's output; several outputs joined by ' | '; ('', '') for none."""
    if isinstance(facts, TensorInfo):
        return ", ".join(map(str, facts.shape)), facts.dtype
    if isinstance(facts, tuple):
        each = [_shape_and_dtype(f) for f in facts]
        return " | ".join(s for s, _ in each), " | ".join(d for _, d in each)
    return "", ""


def _tensor_text(facts) -> str:
    """'float32[batch, seq, 64]'; several outputs in parentheses; '' for none."""
    if isinstance(facts, TensorInfo):
        return f"{facts.dtype}[{', '.join(map(str, facts.shape))}]"
    if isinstance(facts, tuple):
        return "(" + ", ".join(_tensor_text(f) for f in facts) + ")"
    return ""


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
