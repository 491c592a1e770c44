"""The dtype every node of a traced graph has at run time when the program computes in half precision.

The analysis meta (``TENSOR``) holds the dtypes of the trace, made in fp32. A bf16/fp16 program
follows passes/lowering/precision.py (parameters read through casts, mixed inputs of one-dtype ops
unified), and the half-precision values then flow through the graph by torch's type promotion:
the hidden state becomes bf16, while a tensor computed from fp32 buffers only (Llama's rotary
cos/sin) or upcast on purpose stays fp32. A pipeline cut allocates its receive buffers from these
dtypes before the step, so it needs the run-time ones, not the traced ones.

The lowering pass ``plan_run_dtypes`` records them as each node's ``RUN_DTYPE`` before the graph
is rewritten (nothing in fp32, where the traced dtypes hold); ``run_dtypes(gm, dtype)`` writes
the same casts into a copy of the graph, runs it on fake tensors (no memory, no FLOPs) and returns
node name -> dtype for each node of ``gm`` producing a tensor, and the inputs an op reads through a
copy the casts make for it (``saved_storages.RunDtypes``; ``compute_dtypes`` returns the former). The
planner prices saved activations at these (passes/planning/plan_splits_costs.py). The dtypes do not
depend on sizes, so the example's symbol values do.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from xirang.ir.errors import XirangError
from xirang.ir.facts import TensorInfo, evaluate
from xirang.ir.meta_keys import RUN_DTYPE, SYMBOLS, TENSOR
from xirang.ir.pass_spec import compiler_pass
from xirang.codegen.ops.local_ops import unify_float_dtypes
from xirang.passes.analysis.saved_storages import RunDtypes
from xirang.passes.lowering.trace_device import on_device
from xirang.passes.lowering.precision import COMPUTE_DTYPES, write_precision_casts


_CHECKS_ONLY = (torch.ops.aten._assert_tensor_metadata.default,)


class _DtypeInterpreter(fx.Interpreter):
    """Runs the graph on fake tensors and records each tensor-producing node's dtype."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.found: dict[str, torch.dtype] = {}
        self.by_node: dict = {}  # every node's dtype, the inserted casts' too

    def run_node(self, node):
        if node.op == "call_function" and node.target in _CHECKS_ONLY:
            return None  # checks the traced (fp32) dtype; the emitted program runs it on its own values
        try:
            value = super().run_node(node)
        except Exception as error:  # noqa: BLE001 - any op can refuse; name the node it was
            raise XirangError(f"cannot tell the run-time dtype of {node.name} ({node.target}) in half precision: "
                              f"{type(error).__name__}: {error}", where=f"node {node.name}",
                              hint="plan with precision='fp32' for this model") from error
        if isinstance(value, torch.Tensor):
            self.found[node.name] = self.by_node[node] = value.dtype
        elif isinstance(value, (tuple, list)):
            self.by_node[node] = tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in value)
        return value

    def call_function(self, target, args, kwargs):
        # a graph traced on meta makes or moves tensors onto meta inside forward: run it on CPU fakes
        cpu = torch.device("cpu")
        return super().call_function(target, on_device(args, cpu), on_device(kwargs, cpu))

    def fetch_attr(self, target: str):
        # A buffer or lifted constant of a model built on meta is a meta tensor; the inputs are CPU fakes.
        # Only dtypes are asked for, so every held tensor is read as an empty CPU one of its dtype.
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return value


def compute_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Node name -> dtype at run time when floating parameters are read in ``dtype`` (module docstring)."""
    return run_dtypes(gm, dtype).of


def run_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> RunDtypes:
    """The dtypes of ``gm``'s tensors at run time in ``dtype``, and the inputs its ops read through a copy
    made for them (module docstring)."""
    symbols = SYMBOLS.get(gm, {})
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node names and meta kept
    write_precision_casts(graph, dtype, fp32_loss=False)  # the traced graph returns every output
    interpreter = _DtypeInterpreter(fx.GraphModule(gm, graph))
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [_fake_input(node, symbols) for node in gm.graph.nodes if node.op == "placeholder"]
        interpreter.run(*inputs)
    names = {node.name for node in gm.graph.nodes}
    return RunDtypes({name: found for name, found in interpreter.found.items() if name in names},
                     _copies_read(graph, gm, interpreter.by_node))


def _copies_read(graph: fx.Graph, gm: fx.GraphModule, dtypes: dict) -> dict:
    """node name -> {position among the traced node's inputs: dtype} of each input the casts route through
    ``unify_float_dtypes`` into a copy (its dtype changed) for that node."""
    traced = {node.name: node for node in gm.graph.nodes}
    found: dict = {}
    for node in graph.nodes:
        if node.name not in traced:
            continue
        for value in node.all_input_nodes:
            unified = value.args[0] if value.target is operator.getitem and value.args else None
            if not isinstance(unified, fx.Node) or unified.target is not unify_float_dtypes:
                continue
            source = unified.args[0][value.args[1]]
            was, now = dtypes.get(source), dtypes.get(unified, ())[value.args[1]] if dtypes.get(unified) else None
            original = traced[node.name].all_input_nodes
            if isinstance(source, fx.Node) and now is not None and was != now and source.name in traced \
                    and traced[source.name] in original:
                found.setdefault(node.name, {})[original.index(traced[source.name])] = now
    return found


def _fake_input(node, symbols: dict):
    val = node.meta.get("val")
    info = TENSOR.get(node, None)
    if not isinstance(val, torch.Tensor) or not isinstance(info, TensorInfo):
        return val  # a non-tensor input (an int, None) is passed as traced
    shape = tuple(evaluate(size, symbols) for size in info.shape)
    return torch.empty(shape, dtype=val.dtype)  # fp32 master weights: the graph's casts do the rest


@compiler_pass(requires=(TENSOR,), provides=(RUN_DTYPE,))
def plan_run_dtypes(gm, ctx):
    """Record the run-time dtype of every tensor in half precision (nothing in fp32)."""
    dtype = COMPUTE_DTYPES[ctx.plan.precision]
    if dtype == torch.float32:
        return gm
    shared = ctx.shared if ctx.shared is not None else {}
    found = shared.get(("run_dtypes", dtype))  # rank-independent: one graph, one precision
    if found is None:
        found = shared[("run_dtypes", dtype)] = compute_dtypes(gm, dtype)
    for node in gm.graph.nodes:
        if node.name in found:
            RUN_DTYPE.set(node, str(found[node.name]).removeprefix("torch."))
    return gm
