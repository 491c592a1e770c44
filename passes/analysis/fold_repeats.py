"""Trace three of a run of identical layers and replicate the third, instead of tracing all of them.

Tracing costs ~0.1-0.25 s per transformer layer, so an 80-layer model would spend most of its planning
time re-tracing the same Python 80 times. A run of structurally identical children of an
nn.ModuleList / nn.Sequential (same class, parameter shapes, repr and plain attributes, up to an
attribute that equals the layer's position such as ``layer_idx``) is temporarily cut to its first three
layers. After tracing, the nodes of layer 2 are checked to relate to layer 1 exactly as layer 1's relate
to layer 0 (same ops, same constants, inputs from the previous layer at the same positions, the same
shared inputs); layers 3..n-1 are then stamped out from layer 2's nodes. If any check fails the
caller traces the full model, so folding only ever changes speed, never the graph: the test suite
compares folded and full traces node by node.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from xirang.ir.meta_keys import NN_MODULE_STACK, PARAM_ALIASES, PARAM_NAME, ROLE

TRACED_LAYERS = 3  # layer 0 may differ; 1 -> 2 is checked against 0 -> 1 before replicating 2


@dataclass
class LayerRun:
    parent: torch.nn.Module
    attribute: str
    container: torch.nn.Module
    prefix: str  # FQN of the container, e.g. "model.layers"
    length: int


class CannotFold(Exception):
    """The traced layers do not follow one repeating pattern; trace the full model instead."""


def find_layer_runs(model: torch.nn.Module) -> list[LayerRun]:
    runs: list[LayerRun] = []
    for prefix, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if len(module) <= TRACED_LAYERS or any(prefix.startswith(r.prefix + ".") for r in runs):
            continue
        if not _all_alike(list(module)):
            continue
        parent_name, _, attribute = prefix.rpartition(".")
        runs.append(LayerRun(model.get_submodule(parent_name), attribute, module, prefix, len(module)))
    return runs


def _all_alike(layers: list[torch.nn.Module]) -> bool:
    """Same class, tensors, repr and plain attributes; an attribute equal to the layer's position in
    every layer (layer_idx) is a label, and the trace comparison checks it changes nothing."""
    texts: dict[int, str] = {}  # id(value) -> repr: the layers share objects (an HF config prints ~700 chars)
    attributes = [_plain_attributes(layer, texts) for layer in layers]
    positional = {key for key in attributes[0]
                  if all(attrs.get(key) == repr(i) for i, attrs in enumerate(attributes))}
    signatures = {(type(layer), _tensors(layer), repr(layer),
                   tuple(sorted((k, v) for k, v in attrs.items() if k not in positional)))
                  for layer, attrs in zip(layers, attributes)}
    return len(signatures) == 1


def _tensors(layer: torch.nn.Module):
    return tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                 for name, t in list(layer.named_parameters()) + list(layer.named_buffers()))


def _plain_attributes(layer: torch.nn.Module, texts: dict[int, str]) -> dict:
    attributes = {}
    for name, module in layer.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or attr == "training" or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            text = texts.get(id(value))  # the module holds value for the whole check, so its id is its own
            if text is None:
                text = texts[id(value)] = repr(value)
            attributes[(name, attr)] = text
    return attributes


class Folding:
    def __init__(self, runs: list[LayerRun]):
        self.runs = runs

    def expand(self, gm, aliases_of) -> dict:
        """Replicate layer 2 of every folded run up to the run's full length. Returns a summary.
        The graph is changed in place and not recompiled: the caller's next step (``canonical_graph``
        in ``trace_model``) replaces it; its code is generated once, when first asked for."""
        summary = {}
        for run in self.runs:
            _expand_run(gm, run, aliases_of)
            summary[run.prefix] = run.length
        gm.graph.lint()
        return summary


@contextlib.contextmanager
def folded_repeats(model: torch.nn.Module, enabled: bool = True):
    """Within the block, every foldable run of layers in ``model`` holds only its first three."""
    runs = find_layer_runs(model) if enabled else []
    for run in runs:
        first = list(run.container)[:TRACED_LAYERS]
        shortened = torch.nn.ModuleList(first) if isinstance(run.container, torch.nn.ModuleList) \
            else torch.nn.Sequential(*first)
        setattr(run.parent, run.attribute, shortened)
    try:
        yield Folding(runs)
    finally:
        for run in runs:
            setattr(run.parent, run.attribute, run.container)


def _layer_of(node, prefix: str) -> int | None:
    if node.op == "placeholder":
        name = PARAM_NAME.get(node, "")
        if name.startswith(prefix + "."):
            head = name[len(prefix) + 1:].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        return None
    for fqn, _ in (NN_MODULE_STACK.get(node, None) or {}).values():
        if isinstance(fqn, str) and fqn.startswith(prefix + "."):
            head = fqn[len(prefix) + 1:].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _expand_run(gm, run: LayerRun, aliases_of) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    layer_of = {node: _layer_of(node, run.prefix) for node in nodes}
    ops = [[n for n in nodes if layer_of[n] == i and n.op != "placeholder"] for i in range(TRACED_LAYERS)]
    params = [[n for n in nodes if layer_of[n] == i and n.op == "placeholder"] for i in range(TRACED_LAYERS)]
    if len({len(o) for o in ops}) != 1 or len({len(p) for p in params}) != 1 or not ops[0]:
        raise CannotFold(f"{run.prefix}: traced layers differ in size")
    position = {n: (i, j) for i in range(TRACED_LAYERS) for j, n in enumerate(ops[i])}
    param_position = {n: (i, j) for i in range(TRACED_LAYERS) for j, n in enumerate(params[i])}
    _check_contiguous(nodes, ops)
    for j, (middle, last) in enumerate(zip(ops[1], ops[2])):
        if middle.target != last.target or _pattern(middle, 1, position, param_position) != \
                _pattern(last, 2, position, param_position):
            raise CannotFold(f"{run.prefix}: op {j} of layer 2 ({last.name}) is not wired like layer 1's")
    last_layer_nodes = set(ops[2])
    outside = [n for n in nodes if layer_of[n] is None and n.op != "placeholder"]
    for node in outside:
        if any(a in position and position[a][0] != 2 for a in node.all_input_nodes):
                raise CannotFold(f"{run.prefix}: {node.name} reads a layer other than the last")

    for template in params[2] if run.length > TRACED_LAYERS else ():  # each copy must name a model tensor
        name = PARAM_NAME.get(template, None)
        if name is None or aliases_of(_rename(name, run.prefix, TRACED_LAYERS)) is None:
            raise CannotFold(f"{run.prefix}: layer 2 reads {name or template.name}, a tensor the model does not "
                             f"hold per layer (made inside forward), so its copies in later layers have no name")
    previous_ops = ops[2]
    anchor_op, anchor_param = ops[2][-1], params[2][-1] if params[2] else None
    for index in range(TRACED_LAYERS, run.length):
        renamed: dict[str, str] = {}  # a layer's nodes share most module-stack entries: rename each once

        def rename(text, _renamed=renamed, _index=index):
            if text not in _renamed:
                _renamed[text] = _rename(text, run.prefix, _index)
            return _renamed[text]
        new_params = []
        for template in params[2]:
            fqn = _rename(PARAM_NAME.get(template), run.prefix, index)
            with graph.inserting_after(anchor_param):
                node = graph.placeholder("p_" + fqn.replace(".", "_") if ROLE.get(template) == "parameter"
                                         else "b_" + fqn.replace(".", "_"))
            node.meta = dict(template.meta)
            PARAM_NAME.set(node, fqn)
            PARAM_ALIASES.set(node, tuple(aliases_of(fqn)))
            anchor_param = node
            new_params.append(node)
        new_ops: list = []

        def remap(arg, _new_ops=new_ops, _new_params=new_params, _prev=previous_ops):
            if arg in position:
                layer, j = position[arg]
                return _new_ops[j] if layer == 2 else _prev[j]
            if arg in param_position:
                return _new_params[param_position[arg][1]]
            return arg

        for template in ops[2]:
            with graph.inserting_after(anchor_op):
                node = _copy_node(graph, template, remap)
            NN_MODULE_STACK.set(node, {rename(k): (rename(fqn), cls)
                                       for k, (fqn, cls) in NN_MODULE_STACK.get(template).items()})
            anchor_op = node
            new_ops.append(node)
        previous_ops = new_ops
    # Consumers after the run read the last layer, which is now the one stamped out last.
    final = dict(zip(ops[2], previous_ops))
    for node in outside:
        if any(a in last_layer_nodes for a in node.all_input_nodes):
            node.args, node.kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda a: final.get(a, a))


def _copy_node(graph, template, remap):
    """``graph.node_copy(template, remap)`` with its own copy of the meta dict, without the check
    ``create_node`` makes of new arguments for raw SymInts (a pytree walk of every argument, ~60% of
    stamping 77 layers): these arguments are the template's, already in the graph, with nodes swapped
    for nodes. Arguments set after creation are recorded (uses, users) exactly as at creation."""
    node = graph.create_node(template.op, template.target, name=template.name, type_expr=template.type)
    node.args = torch.fx.map_arg(template.args, remap)
    node.kwargs = torch.fx.map_arg(template.kwargs, remap)
    node.meta = dict(template.meta)
    return node


def _pattern(node, layer: int, position, param_position):
    """How a node's inputs relate to its layer: same layer / previous layer / own parameter / shared."""
    def describe(arg):
        if isinstance(arg, torch.fx.Node):
            if arg in position:
                arg_layer, j = position[arg]
                return ("same" if arg_layer == layer else "prev" if arg_layer == layer - 1 else "far", j)
            if arg in param_position:
                arg_layer, j = param_position[arg]
                return ("param" if arg_layer == layer else "other-param", j)
            return ("shared", arg.name)
        if isinstance(arg, (list, tuple)):
            return tuple(describe(a) for a in arg)
        if isinstance(arg, dict):
            return tuple((k, describe(v)) for k, v in arg.items())
        return ("const", repr(arg))
    return describe(node.args), describe(node.kwargs)


def _check_contiguous(nodes, ops) -> None:
    order = {n: i for i, n in enumerate(nodes)}
    span = [order[o] for layer in ops for o in layer]
    if span != list(range(span[0], span[0] + len(span))):
        raise CannotFold("other ops run between the traced layers")


def _rename(text: str, prefix: str, index: int) -> str:
    """'model.layers.2.mlp' -> 'model.layers.<index>.mlp' (also inside torch's module-stack keys)."""
    for lead in (prefix + ".2.", prefix.replace(".", "_") + "_2_"):
        if lead in text:
            return text.replace(lead, lead[:-2] + f"{index}" + lead[-1], 1)
    for tail in (prefix + ".2", prefix.replace(".", "_") + "_2"):
        if text.endswith(tail):
            return text[: -1] + str(index)
    return text
