"""Trace three of a run of identical layers and replicate the third, instead of tracing all of them.

Tracing costs ~0.1-0.25 s per transformer layer, so an 80-layer model would spend most of its planning
time re-tracing the same Python 80 times. A run of structurally identical children of an
nn.ModuleList / nn.Sequential (same class, parameter shapes, repr and plain attributes, up to an
attribute that equals the layer's position such as ``layer_idx``) is temporarily cut to its first three
layers. The run may start after a few layers that differ (DeepSeek-V3's three dense layers before 58 MoE
ones): the run is then the list's longest alike tail, and the list is cut after the run's third layer.
After tracing, the nodes of the run's layer 2 are checked to relate to its layer 1 exactly as layer 1's
relate to layer 0 (same ops, same constants, inputs from the previous layer at the same positions, the
same shared inputs); the run's later layers are then stamped out from layer 2's nodes. If any check
fails the caller traces the full model, so folding only ever changes speed, never the graph: the test
suite compares folded and full traces node by node.
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
    start: int = 0  # the run's first layer; the layers before it (traced whole) differ from it


class CannotFold(Exception):
    """The traced layers do not follow one repeating pattern; trace the full model instead."""


def find_layer_runs(model: torch.nn.Module) -> list[LayerRun]:
    runs: list[LayerRun] = []
    for prefix, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if len(module) <= TRACED_LAYERS or any(prefix.startswith(r.prefix + ".") for r in runs):
            continue
        start = _alike_tail(list(module))
        if start is None:
            continue
        parent_name, _, attribute = prefix.rpartition(".")
        runs.append(LayerRun(model.get_submodule(parent_name), attribute, module, prefix, len(module), start))
    return runs


def _alike_tail(layers: list[torch.nn.Module]) -> int | None:
    """The first layer of the longest tail of more than three alike layers (None if there is none). Alike:
    same class, tensors, repr and plain attributes; an attribute equal to the layer's position in every
    layer of the tail (layer_idx) is a label, and the trace comparison checks it changes nothing."""
    texts: dict[int, str] = {}  # id(value) -> repr: the layers share objects (an HF config prints ~700 chars)
    attributes = [_plain_attributes(layer, texts) for layer in layers]
    shapes = [(type(layer), _tensors(layer), repr(layer)) for layer in layers]
    for start in range(len(layers) - TRACED_LAYERS):
        tail = range(start, len(layers))
        if any(shapes[i] != shapes[start] for i in tail):
            continue
        positional = {key for key in attributes[start] if all(attributes[i].get(key) == repr(i) for i in tail)}
        signatures = {tuple(sorted((k, v) for k, v in attributes[i].items() if k not in positional)) for i in tail}
        if len(signatures) == 1:
            return start
    return None


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
    """Within the block, every foldable run of layers in ``model`` holds only its first three (and the
    differing layers before it)."""
    runs = find_layer_runs(model) if enabled else []
    for run in runs:
        first = list(run.container)[:run.start + TRACED_LAYERS]
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
    template = run.start + TRACED_LAYERS - 1  # the traced layer stamped out (layer 2 of the run)

    def run_layer(node):  # the layer's place in the run; the layers before the run are outside it
        layer = _layer_of(node, run.prefix)
        return layer - run.start if layer is not None and layer >= run.start else None
    layer_of = {node: run_layer(node) for node in nodes}
    # Export computes a size expression once (batch * seq in an experts call) and the later layers reuse
    # it: it belongs to no layer, so it is outside the run wherever the first layer put it.
    floating = set()
    for node in nodes:
        if layer_of[node] is not None and node.op == "call_function" and \
                isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float)) and \
                all(layer_of[a] is None for a in node.all_input_nodes):
            layer_of[node] = None
            floating.add(node)
    ops = [[n for n in nodes if layer_of[n] == i and n.op != "placeholder"] for i in range(TRACED_LAYERS)]
    params = [[n for n in nodes if layer_of[n] == i and n.op == "placeholder"] for i in range(TRACED_LAYERS)]
    if len({len(o) for o in ops}) != 1 or len({len(p) for p in params}) != 1 or not ops[0]:
        raise CannotFold(f"{run.prefix}: traced layers differ in size")
    position = {n: (i, j) for i in range(TRACED_LAYERS) for j, n in enumerate(ops[i])}
    param_position = {n: (i, j) for i in range(TRACED_LAYERS) for j, n in enumerate(params[i])}
    _check_contiguous([n for n in nodes if n not in floating], ops)
    for j, (middle, last) in enumerate(zip(ops[1], ops[2])):
        if middle.target != last.target or _pattern(middle, 1, position, param_position) != \
                _pattern(last, 2, position, param_position):
            raise CannotFold(f"{run.prefix}: op {j} of layer 2 ({last.name}) is not wired like layer 1's")
    last_layer_nodes = set(ops[2])
    outside = [n for n in nodes if layer_of[n] is None and n.op != "placeholder"]
    for node in outside:
        if any(a in position and position[a][0] != 2 for a in node.all_input_nodes):
                raise CannotFold(f"{run.prefix}: {node.name} reads a layer other than the last")

    for read in params[2] if run.length > template + 1 else ():  # each copy must name a model tensor
        name = PARAM_NAME.get(read, None)
        if name is None or aliases_of(_rename(name, run.prefix, template, template + 1)) is None:
            raise CannotFold(f"{run.prefix}: layer {template} reads {name or read.name}, a tensor the model does not "
                             f"hold per layer (made inside forward), so its copies in later layers have no name")
    previous_ops = ops[2]
    anchor_op = ops[2][-1]
    # export lists every parameter before every buffer: a layer's copies go after the template's last of each
    anchor_param = {ROLE.get(n, None): n for n in params[2]}
    for index in range(template + 1, run.length):
        renamed: dict[str, str] = {}  # a layer's nodes share most module-stack entries: rename each once

        def rename(text, _renamed=renamed, _index=index):
            if text not in _renamed:
                _renamed[text] = _rename(text, run.prefix, template, _index)
            return _renamed[text]
        new_params = []
        for template_param in params[2]:
            fqn = _rename(PARAM_NAME.get(template_param), run.prefix, template, index)
            with graph.inserting_after(anchor_param[ROLE.get(template_param, None)]):
                node = graph.placeholder("p_" + fqn.replace(".", "_") if ROLE.get(template_param) == "parameter"
                                         else "b_" + fqn.replace(".", "_"))
            node.meta = dict(template_param.meta)
            PARAM_NAME.set(node, fqn)
            PARAM_ALIASES.set(node, tuple(aliases_of(fqn)))
            anchor_param[ROLE.get(template_param, None)] = node
            new_params.append(node)
        new_ops: list = []

        def remap(arg, _new_ops=new_ops, _new_params=new_params, _prev=previous_ops):
            if arg in position:
                layer, j = position[arg]
                return _new_ops[j] if layer == 2 else _prev[j]
            if arg in param_position:
                return _new_params[param_position[arg][1]]
            return arg

        for template_op in ops[2]:
            with graph.inserting_after(anchor_op):
                node = _copy_node(graph, template_op, remap)
            NN_MODULE_STACK.set(node, {rename(k): (rename(fqn), cls)
                                       for k, (fqn, cls) in NN_MODULE_STACK.get(template_op).items()})
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


def _rename(text: str, prefix: str, template: int, index: int) -> str:
    """'model.layers.<template>.mlp' -> 'model.layers.<index>.mlp' (also inside torch's module-stack keys)."""
    for dot, sep in ((prefix + ".", "."), (prefix.replace(".", "_") + "_", "_")):
        lead = f"{dot}{template}{sep}"
        if lead in text:
            return text.replace(lead, f"{dot}{index}{sep}", 1)
        if text.endswith(f"{dot}{template}"):
            return text[: len(text) - len(str(template))] + str(index)
    return text
