"""The storages a node's tensors live in and what keeping them for the backward costs: the facts
``memory_traffic`` (bytes per node), ``traffic_rules`` (what each op saves), ``flops`` and the split
ILP's pricing read. Sizes are sympy expressions in the batch/seq symbols.

- A view is followed to the tensor it views (``storage_of``): a saved view keeps the whole storage.
- Parameters, buffers and constants are resident anyway: saving one costs nothing (``input_saved``).
- ``live_saved_bytes``: the storages a set of nodes keeps, each once.

Dtypes: the analysis holds the trace's, made in fp32. A half-precision program's run-time dtypes (node
name -> dtype, passes/lowering/compute_dtypes.py) change which casts copy: a model's upcast to float32,
an alias in the fp32 trace, copies a bf16 input at run time (Llama's RMSNorm keeps that fp32 copy for its
backward), and a norm's cast back copies the other way. ``storage_of`` and ``is_alias`` take them as
``run_dtypes`` (``RunDtypes.of``) where the caller has them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import SavedTensor, TensorInfo
from xirang.ir.meta_keys import BYTES, REQUIRES_GRAD, ROLE, TENSOR

from xirang.passes.analysis.op_tables import op_packet

aten = torch.ops.aten
ZERO = sympy.Integer(0)
STAT_BYTES = 4  # mean/rstd/logsumexp statistics are kept in float32 (the accumulation type)

# Ops whose output aliases an input's storage: nothing is read or written. ``reshape`` copies when its
# input cannot be viewed in the new shape; ``_reshape_copies`` counts the copy where it does not depend on
# the device: a broadcast input (repeat_kv's expanded kv heads) merged into another dim. A reshape after a
# transpose copies on CPU's math attention but views a GPU's fused kernel output, so it stays an alias.
ALIAS_OPS = frozenset({
    operator.getitem, aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.t,
    aten.permute, aten.expand, aten.expand_as, aten.squeeze, aten.unsqueeze, aten.slice, aten.select,
    aten.split, aten.split_with_sizes, aten.chunk, aten.tensor_split, aten.unbind, aten.flatten, aten.unflatten,
    aten.alias, aten.detach, aten.view_as, aten.narrow, aten.as_strided, aten.sym_size,
    aten.sym_numel, aten.sym_stride, aten.lift_fresh_copy,
})


@dataclass(frozen=True)
class RunDtypes:
    """A half-precision program's dtypes at run time, made by the lowering's own casts
    (passes/lowering/compute_dtypes.py) for the planner to price saved storages at.

    - ``of``: node name -> torch dtype of the tensor the node makes.
    - ``read_as``: node name -> {position in ``node.all_input_nodes``: dtype} where the program casts that
      input into a copy of its own for the op (an op that needs one dtype meeting mixed ones,
      ``precision.unify_float_dtypes``): the op keeps the copy, not the input.
    """

    of: dict = field(default_factory=dict)
    read_as: dict = field(default_factory=dict)


# --- sizes of a node's tensors ----------------------------------------------------------------

def tensors(node) -> tuple[TensorInfo, ...]:
    """The TensorInfo(s) a node produces (empty for SymInts, None, non-nodes)."""
    if not isinstance(node, Node):
        return ()
    info = TENSOR.get(node, None)
    if isinstance(info, TensorInfo):
        return (info,)
    if isinstance(info, tuple):
        return tuple(i for i in info if isinstance(i, TensorInfo))
    return ()


def nbytes(node) -> sympy.Expr:
    return sympy.Add(*(t.nbytes for t in tensors(node)))


def arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` (positional) or ``name`` (keyword) of a call."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def needs_grad(value) -> bool:
    return isinstance(value, Node) and REQUIRES_GRAD.get(value, False)


def is_persistent(value) -> bool:
    """A parameter, buffer or constant, or a view of one: memory that is resident anyway."""
    while isinstance(value, Node):
        if value.op == "get_attr":
            return True
        if value.op == "placeholder":
            return ROLE.get(value, "input") in ("parameter", "buffer", "constant")
        if op_packet(value) not in ALIAS_OPS or not value.args:
            return False
        value = value.args[0]
    return False


def activation_bytes(value) -> sympy.Expr:
    return ZERO if is_persistent(value) else nbytes(value)


# --- ops that return their input under some arguments --------------------------------------------

def dropout_active(node) -> bool:
    """Whether an aten.dropout node drops anything (p > 0 in training): else it returns its input."""
    p, train = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    return not (isinstance(p, (int, float)) and p == 0) and train is not False


def _same_dtype(node, run_dtypes=None) -> bool:
    """aten.to to the dtype a tensor already has returns the tensor itself (at run time where
    ``run_dtypes`` knows both ends, else as traced)."""
    source = node.args[0]
    if run_dtypes is not None and isinstance(source, Node) and source.name in run_dtypes and node.name in run_dtypes:
        return run_dtypes[source.name] == run_dtypes[node.name]
    source, result = tensors(source), tensors(node)
    return bool(source and result) and source[0].dtype == result[0].dtype


def _dropout_alias(node, run_dtypes=None) -> bool:
    return not dropout_active(node)  # p == 0 or eval: aten.dropout returns its input


# an op that is an alias only for some arguments: its predicate (the others in ALIAS_OPS always are)
ALIAS_WHEN = {aten.to: _same_dtype, aten.dropout: _dropout_alias}


# --- storages: what a saved tensor keeps alive ------------------------------------------------

def _reshape_copies(node: Node) -> bool:
    """Does this ``aten.reshape`` copy on every device: its traced input broadcasts a dim (stride 0, size
    not 1) and cannot be viewed in the output's shape? (Grouped-query attention's repeat_kv: k and v expanded
    to the query heads, then reshaped; the copy is what attention keeps for its backward.)"""
    source, result = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None, node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    broadcast = any(isinstance(stride, int) and stride == 0 and not (isinstance(size, int) and size == 1)
                    for size, stride in zip(source.shape, source.stride()))
    if not broadcast:
        return False
    try:
        source.view(result.shape)
    except (RuntimeError, ValueError):
        return True
    return False


def is_alias(node: Node, run_dtypes=None) -> bool:
    """Does ``node``'s output share its input's storage (a view, or an op that returns its input)?
    ``run_dtypes``: a half-precision program's dtypes at run time (module docstring), else the trace's."""
    packet = op_packet(node)
    if packet in ALIAS_OPS:
        return not (packet is aten.reshape and _reshape_copies(node))
    when = ALIAS_WHEN.get(packet)
    return when is not None and when(node, run_dtypes)


def storage_of(value: Node, run_dtypes=None) -> Node:
    """The node whose output owns the storage ``value`` reads: views and aliases followed to the
    tensor they view. An element of a multi-output op that is not a view (a norm's output, mean, rstd)
    owns its storage; the pieces of a split or chunk share their input's. ``run_dtypes``: as ``is_alias``."""
    while (isinstance(value, Node) and value.op == "call_function" and value.args
           and isinstance(value.args[0], Node) and is_alias(value, run_dtypes)):
        if value.target is operator.getitem and not is_alias(value.args[0], run_dtypes):
            break  # an element of a real multi-output op
        value = value.args[0]
    return value


def _floating(node) -> bool:
    found = tensors(node)
    return bool(found) and found[0].is_floating


def input_saved(node: Node, value) -> tuple[SavedTensor, ...]:
    """``node`` keeps input ``value``: the storage it views, whole (nothing for a parameter, buffer or
    constant, or a non-tensor)."""
    if not isinstance(value, Node) or is_persistent(value) or not tensors(value):
        return ()
    base = storage_of(value)
    return (SavedTensor(base.name, nbytes(base), _floating(base), node.all_input_nodes.index(value)),)


def own_saved(node: Node, what: str | None = None, size=None, floating: bool | None = None,
              like: int | None = None) -> tuple[SavedTensor, ...]:
    """``node`` keeps its own output (``what`` None) or an intermediate of its own named ``what``;
    ``like``: the position in ``node.all_input_nodes`` of the input whose tp layout that intermediate
    has (a cross-entropy's log-probabilities are sharded as its logits), else the output's."""
    if what is None:
        (out, *_) = tensors(node)
        return (SavedTensor(node.name, out.nbytes, out.is_floating),)
    return (SavedTensor(f"{node.name}:{what}", sympy.sympify(size), bool(floating), like),)


def distinct(items) -> tuple[SavedTensor, ...]:
    """Saved storages, each once (the first item naming it)."""
    found: dict[str, SavedTensor] = {}
    for item in items:
        found.setdefault(item.storage, item)
    return tuple(found.values())


def live_saved_bytes(nodes) -> sympy.Expr:
    """Bytes the ops ``nodes`` keep for the backward together: the union of their saved storages,
    each once, at the traced dtype."""
    items = distinct(item for n in nodes if BYTES.has(n) for item in BYTES.get(n).saved)
    return sympy.Add(*(item.nbytes for item in items))
