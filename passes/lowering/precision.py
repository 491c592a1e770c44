"""Half-precision programs: fp32 master weights, half-precision compute, an fp32 loss.

The policy (what ``insert_precision_casts`` writes into a program when the plan's precision is
bf16 or fp16) follows Megatron-LM: every floating parameter is read through a cast to the compute
dtype, so activations, the residual stream and what crosses pipeline cuts are half precision;
autograd casts each gradient back to fp32, the dtype the optimizer updates; the loss is returned
in fp32.

Models written for autocast also cast on their own, and the trace, made in fp32, keeps those casts
as casts to float32: Llama's RMSNorm upcasts its input (and "casts back to the input's dtype",
which the fp32 trace recorded as float32 too), GPT-2 casts its position embeddings, rotary
embeddings are computed from fp32 buffers on purpose. Such an fp32 value then meets a
half-precision weight in an op that needs one dtype (a matmul, a norm) and torch refuses. Where an
op of ``ONE_DTYPE_OPS`` meets mixed floating dtypes at run time, its floating inputs are cast to the
compute dtype first (``unify_float_dtypes``), the decision autocast makes for such ops; inputs that
already agree are left alone, so an fp32 island the model keeps on purpose (the rotary angles,
computed from fp32 buffers only) stays fp32.

A norm that upcasts its input and casts its result back ("to the input's dtype") was traced as two
casts to float32; the second is a cast back, and it casts to the dtype the first one's input has at
run time (``cast_like``), as the model does in half precision: a cast to float32 whose input descends,
inside the same module, from an earlier cast to float32 is such a cast back (Llama's RMSNorm). The
upcast itself returned its input in the fp32 trace, so the graph has code outside the norm that read
the norm's input (the residual) read the upcast; those readers get the input back. Without this the
residual stream and the norms' outputs stayed fp32, and every matmul reading a norm made and saved a
half-precision copy of its own.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph

from xirang.codegen.ops.local_ops import cast_like, unify_float_dtypes
from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import INSERTED, MODULE_PATH, REQUIRES_GRAD, ROLE, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass
from xirang.passes.analysis.expert_ops import expert_calls
from xirang.passes.lowering.inserted import place_inserted

aten = torch.ops.aten
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # plan.precision
# ops whose floating tensor inputs must share one dtype (elementwise ops promote instead)
ONE_DTYPE_OPS = frozenset({
    aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
    aten.baddbmm.default, aten.addbmm.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.convolution.default, aten.scaled_dot_product_attention.default, aten.layer_norm.default,
    aten.native_layer_norm.default, aten.group_norm.default, aten.batch_norm.default, aten.rms_norm.default})


def write_precision_casts(graph: Graph, dtype: torch.dtype, *, fp32_loss: bool = True) -> None:
    """Write the module docstring's policy into ``graph`` (nothing for fp32). ``fp32_loss``: the
    graph returns ``(loss,)`` (an emitted program), to be returned in fp32."""
    if dtype == torch.float32:
        return
    _cast_parameters(graph, dtype)
    cast_back_to_input_dtype(graph)
    cast_expert_sums_back(graph)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in ONE_DTYPE_OPS:
            _unify_inputs(graph, node, dtype)
    if not fp32_loss:
        return
    output = next(n for n in graph.nodes if n.op == "output")
    (loss,) = output.args[0]
    with graph.inserting_before(output):
        loss32 = graph.call_function(aten._to_copy.default, (loss,), {"dtype": torch.float32})
    output.args = ((loss32,),)


def _cast_parameters(graph: Graph, dtype: torch.dtype) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for node in placeholders:
        val = node.meta.get("val")
        if ROLE.get(node, None) != "parameter" or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        with graph.inserting_after(anchor):
            cast = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
        anchor = cast
        node.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)


_CASTS = (aten.to.dtype, aten._to_copy.default)
_UPCAST_SEARCH = 32  # nodes looked at above a cast, within its module, for the upcast it undoes


def _casts_to_float32(node) -> bool:
    if node.op != "call_function" or node.target not in _CASTS:
        return False
    dtype = node.args[1] if node.target is aten.to.dtype and len(node.args) > 1 else node.kwargs.get("dtype")
    return dtype == torch.float32


def cast_back_to_input_dtype(graph: Graph) -> None:
    """Each cast to float32 that undoes an upcast in its module casts to that upcast's input dtype."""
    for node in list(graph.nodes):
        if not _casts_to_float32(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        upcast = _upcast_above(node)
        if upcast is None or not isinstance(upcast.args[0], torch.fx.Node):
            continue
        node.target, node.args, node.kwargs = cast_like, (node.args[0], upcast.args[0]), {}
        # The trace's upcast was a no-op that returned its input, so code outside the module that read
        # the input (the residual beside a pre-norm) reads the upcast in the graph: give it the input back.
        module = MODULE_PATH.get(upcast, "")
        for user in list(upcast.users):
            path = MODULE_PATH.get(user, "")
            if path != module and not path.startswith(module + "."):
                user.replace_input_with(upcast, upcast.args[0])


def cast_expert_sums_back(graph: Graph) -> None:
    """An experts call (passes/analysis/experts.py) returns its weighted sum in the dtype of the hidden
    states it read, which the fp32 trace recorded as a cast to float32: it casts like the rows the call's
    first matmul reads (the hidden states, expanded per expert). The router's weights are fp32 on purpose
    (a softmax or sigmoid in float), so without this the sum stayed fp32 and so did the residual stream
    after the first MoE layer: twice the activations and rows, and fp32 rows into a bf16 expert matmul."""
    for calls in expert_calls(graph).values():
        first, last = calls[0], calls[-1]
        module = MODULE_PATH.get(last, None)
        seen, frontier = set(), list(last.users)
        while frontier and len(seen) < _UPCAST_SEARCH:
            node = frontier.pop(0)
            if node in seen:
                continue
            seen.add(node)
            if _casts_to_float32(node) and MODULE_PATH.get(node, None) == module:
                node.target, node.args, node.kwargs = cast_like, (node.args[0], first.args[0]), {}
                break
            frontier.extend(node.users)


def _traced_float32(value) -> bool:
    """Whether ``value`` was float32 in the trace: a cast of it to float32 was a no-op there (an integer
    made float, Llama's position ids for the rotary angles, is a real cast and no upcast)."""
    # a collective the tp rewrite inserted has no trace value: it keeps its input's dtype
    while isinstance(value, torch.fx.Node) and "val" not in value.meta and INSERTED.get(value, None) \
            and value.all_input_nodes:
        value = value.all_input_nodes[0]
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


def _upcast_above(node):
    """The nearest cast to float32 among ``node``'s inputs' ancestors in the same module, or None."""
    module = MODULE_PATH.get(node, None)
    seen, frontier = set(), list(node.all_input_nodes)
    while frontier and len(seen) < _UPCAST_SEARCH:
        above = frontier.pop(0)
        if above in seen or MODULE_PATH.get(above, None) != module or above.op != "call_function":
            continue
        seen.add(above)
        if _casts_to_float32(above) and _traced_float32(above.args[0]):
            return above
        frontier.extend(above.all_input_nodes)
    return None


def _unify_inputs(graph: Graph, node, dtype: torch.dtype) -> None:
    """Route ``node``'s tensor-valued node arguments through one ``unify_float_dtypes`` call."""
    inputs = [arg for arg in node.args if isinstance(arg, torch.fx.Node)]
    inputs += [arg for arg in node.kwargs.values() if isinstance(arg, torch.fx.Node) and arg not in inputs]
    if len(inputs) < 2:
        return
    with graph.inserting_before(node):
        unified = graph.call_function(unify_float_dtypes, (tuple(inputs), dtype))
        replacement = {arg: graph.call_function(operator.getitem, (unified, index)) for index, arg in enumerate(inputs)}
    node.args = tuple(replacement.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args)
    node.kwargs = {k: replacement.get(v, v) if isinstance(v, torch.fx.Node) else v for k, v in node.kwargs.items()}


@compiler_pass(requires=(TENSOR, UNIT, REQUIRES_GRAD), provides=(INSERTED,))
def insert_precision_casts(gm, ctx):
    """Read fp32 master weights in the compute dtype, unify mixed inputs of one-dtype ops, return an fp32 loss."""
    dtype = COMPUTE_DTYPES[ctx.plan.precision]
    before = set(gm.graph.nodes)
    write_precision_casts(gm.graph, dtype)
    added = [node for node in gm.graph.nodes if node not in before]
    for node in added:
        _describe_cast(node)
    place_inserted(gm.graph, added, f"precision {ctx.plan.precision}")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def unified_from(value):
    """``value``, or where it has no shape facts (an item of a ``unify_float_dtypes`` call, below) the input it
    was unified from, whose shape it keeps."""
    while not TENSOR.has(value) and "val" not in value.meta and value.target is operator.getitem:
        source, position = value.args
        if not (isinstance(source, torch.fx.Node) and isinstance(source.args[0], (tuple, list))):
            break
        value = source.args[0][position]
    return value


def _describe_cast(node) -> None:
    """``TENSOR`` and ``REQUIRES_GRAD`` of a node the policy inserted: a cast has its input's shape in
    the cast's dtype; the outputs of ``unify_float_dtypes`` depend on the run and carry no ``TENSOR``
    (a pipeline cut through one is refused by the split, naming it)."""
    inputs = node.all_input_nodes
    REQUIRES_GRAD.set(node, any(REQUIRES_GRAD.get(arg, False) or ROLE.get(arg, None) == "parameter" for arg in inputs))
    info = TENSOR.get(inputs[0], None) if inputs else None
    if node.target is aten._to_copy.default and isinstance(info, TensorInfo):
        dtype = node.kwargs["dtype"]
        TENSOR.set(node, TensorInfo(info.shape, str(dtype).removeprefix("torch."), dtype.itemsize))
