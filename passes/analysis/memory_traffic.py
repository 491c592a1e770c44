"""Count the bytes each node reads, writes, and keeps alive for the backward pass.

Each op has a row in ``TRAFFIC_RULES``: which storages autograd saves for its backward, and, where
the default is wrong, what it reads and writes. The defaults: an op reads every tensor input in full
and writes its outputs. Views and aliases (``ALIAS_OPS``) move no bytes. All sizes are sympy
expressions in the batch/seq symbols.

What "saved" counts, and why:
- Storages, not tensors: each saved tensor is named by the storage it keeps alive (``SavedTensor``),
  a view followed to the tensor it views (``storage_of``), which it keeps alive whole: k and v read
  as views of one fused qkv projection keep the one qkv storage. So memory is liveness: the storages
  a set of ops saves, each once (``live_saved_bytes``), not a sum per op, which counted a tensor two
  ops keep (a LayerNorm output fed to separate q, k and v Linears) at each.
- Only activations. A saved parameter, buffer or constant (or a view of one) costs nothing extra:
  it is resident anyway, so it is left out.
- Only what the gradients actually needed require: ``mm(a, b)`` keeps ``b`` to compute ``da`` and
  ``a`` to compute ``db`` (the autograd formulas in torch's derivatives.yaml), and nothing when the
  output needs no gradient.
- An op's own intermediates are storages of their own: a dropout's mask (one byte per element), a
  norm's float32 statistics, a cross-entropy's log-probabilities, a fused attention's logsumexp.
- Attention is priced as the fused (flash / memory-efficient) kernels save it: q, k, v, the output
  and the float32 logsumexp, never the (seq x seq) score matrix.
Ops with no row: the default read/write, and saved = every activation input when the output needs a
gradient (an over-estimate, the safe side for memory); ``ops_without_traffic_rule`` lists them.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from typing import Callable

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import ByteCount, SavedTensor, TensorInfo
from xirang.ir.meta_keys import BYTES, REQUIRES_GRAD, ROLE, TENSOR, TORCH_SYMBOLS, symbol
from xirang.ir.pass_spec import compiler_pass

from xirang.passes.analysis.op_tables import in_any, op_packet, ops_missing_from

aten = torch.ops.aten
log = logging.getLogger(__name__)
ZERO = sympy.Integer(0)
STAT_BYTES = 4  # mean/rstd/logsumexp statistics are kept in float32 (the accumulation type)

# Ops whose output aliases an input's storage: nothing is read or written. ``reshape`` copies when
# its input is not contiguous (e.g. after a transpose); that copy is not priced here.
ALIAS_OPS = frozenset({
    operator.getitem, aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.t,
    aten.permute, aten.expand, aten.expand_as, aten.squeeze, aten.unsqueeze, aten.slice, aten.select,
    aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.flatten, aten.unflatten,
    aten.alias, aten.detach, aten.view_as, aten.narrow, aten.as_strided, aten.sym_size,
    aten.sym_numel, aten.sym_stride, aten.lift_fresh_copy,
})


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


# --- storages: what a saved tensor keeps alive ------------------------------------------------

def is_alias(node: Node) -> bool:
    """Does ``node``'s output share its input's storage (a view, or an op that returns its input)?"""
    packet = op_packet(node)
    if packet in ALIAS_OPS:
        return True
    rule = TRAFFIC_RULES.get(packet)
    return rule is not None and rule.is_alias is not None and rule.is_alias(node)


def storage_of(value: Node) -> Node:
    """The node whose output owns the storage ``value`` reads: views and aliases followed to the
    tensor they view. An element of a multi-output op that is not a view (a norm's output, mean, rstd)
    owns its storage; the pieces of a split or chunk share their input's."""
    while (isinstance(value, Node) and value.op == "call_function" and value.args
           and isinstance(value.args[0], Node) and is_alias(value)):
        if value.target is operator.getitem and not is_alias(value.args[0]):
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


# --- what each op saves for its backward ------------------------------------------------------

def _nothing(node):
    return ()


def _saves_inputs(*indices) -> Callable:
    """The op keeps these inputs (when its output needs a gradient): gelu, silu, log, ..."""
    def saved(node):
        if not REQUIRES_GRAD.get(node, False):
            return ()
        return tuple(item for i in indices if i < len(node.args) for item in input_saved(node, node.args[i]))
    return saved


def _saves_output(node):
    """The op keeps its own result: sigmoid, tanh, relu, exp, softmax, ..."""
    return own_saved(node) if REQUIRES_GRAD.get(node, False) else ()


def _saves_for_each_other(a: int, b: int) -> Callable:
    """Products keep each operand for the other's gradient: d(a@b)/da needs b, d/db needs a."""
    def saved(node):
        x, y = arg(node, a, ""), arg(node, b, "")
        return (input_saved(node, x) if needs_grad(y) else ()) + (input_saved(node, y) if needs_grad(x) else ())
    return saved


def _at_point(size, names: dict, batch_one: bool) -> int:
    """A size of a traced tensor as an int: a symbolic one at the example inputs' values, or with the
    batch at 1 (``batch_one``: a compiled program runs one micro-batch, often of 1)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    env = size.node.shape_env
    known = getattr(env, "backed_var_to_val", None) or env.var_to_val
    return int(expr.xreplace({sym: 1 if batch_one and names.get(str(sym)) == "batch" else known[sym]
                              for sym in expr.free_symbols}))


def _folds_to_view(value: Node, out: Node, batch_one: bool) -> bool:
    """Does ``value`` (>= 3 dims) reshape to (batch, rows, cols), batch the product of ``out``'s batch
    dims, as a view of its storage? Read from the traced tensors' strides at the example sizes (or the
    batch at 1); unknown: no (a copy, the common case for the transposed q, k, v of attention)."""
    val, result = value.meta.get("val"), out.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    owner = value.graph.owning_module
    names = TORCH_SYMBOLS.get(owner, {}) if owner is not None else {}
    try:
        sizes = [_at_point(x, names, batch_one) for x in val.shape]
        strides = [_at_point(x, names, batch_one) for x in val.stride()]
        batch = 1
        for x in result.shape[:-2]:
            batch *= _at_point(x, names, batch_one)
        torch.empty_strided(sizes, strides, device="meta").view(batch, sizes[-2], sizes[-1])
        return True
    except Exception:  # not viewable (RuntimeError), or sizes without a value
        return False


def _matmul_saves(node):
    """``a @ b`` keeps each operand for the other's gradient. With batch dims on both sides (attention's
    q·kᵀ and probs·v) ATen folds each operand to (batch, rows, cols) for a bmm and keeps the folded
    tensor: a view of the operand's storage where its strides allow, else a copy of its own (the
    transposed heads of a fused qkv projection are copied, so the qkv storage is not what is kept).
    Whether they allow can depend on the batch: at a micro-batch of 1 the heads of q, k and v fold as
    views of the qkv storage; both cases are kept, each weighted by [batch = 1] or [batch != 1]."""
    x, y = arg(node, 0, "self"), arg(node, 1, "other")
    (ax, *_), (ay, *_) = tensors(x) or (None,), tensors(y) or (None,)
    if ax is None or ay is None or len(ax.shape) < 3 or len(ay.shape) < 3:
        return _saves_for_each_other(0, 1)(node)
    (out, *_) = tensors(node)
    one = sympy.Piecewise((1, sympy.Eq(symbol("batch"), 1)), (0, True))
    items = []
    for k, (value, info, other) in enumerate(((x, ax, y), (y, ay, x))):
        if not needs_grad(other) or is_persistent(value):
            continue
        folded = sympy.Mul(*out.shape[:-2]) * sympy.Mul(*info.shape[-2:])
        same = sympy.expand(folded - info.numel) == 0  # no broadcast of batch dims
        copy = own_saved(node, f"operand{k}", folded * info.itemsize, info.is_floating)
        views = [same and _folds_to_view(value, node, batch_one) for batch_one in (False, True)]
        if views[0] == views[1]:
            items += input_saved(node, value) if views[0] else copy
            continue
        for view, weight in zip(views, (1 - one, one)):
            chosen = input_saved(node, value) if view else copy
            items += [replace(item, nbytes=item.nbytes * weight) for item in chosen]
    return tuple(items)


def _saves_divisor(node):
    """a / b: da needs b; db needs a and b."""
    x, y = node.args[0], node.args[1]
    if not (needs_grad(x) or needs_grad(y)):
        return ()
    return input_saved(node, y) + (input_saved(node, x) if needs_grad(y) else ())


def _norm_rows(node) -> sympy.Expr:
    normalized = arg(node, 1, "normalized_shape", ())
    (out, *_) = tensors(node)
    return out.numel / sympy.Mul(*normalized) if normalized else out.numel


def _layer_norm_saves(node):
    """Input, plus a float32 mean and rstd per normalized row."""
    if not REQUIRES_GRAD.get(node, False):
        return ()
    return input_saved(node, node.args[0]) + own_saved(node, "stats", 2 * STAT_BYTES * _norm_rows(node), False)


def _rms_norm_saves(node):
    """Input, plus a float32 rstd per normalized row."""
    if not REQUIRES_GRAD.get(node, False):
        return ()
    return input_saved(node, node.args[0]) + own_saved(node, "stats", STAT_BYTES * _norm_rows(node), False)


def _logsumexp_bytes(node) -> sympy.Expr:
    query = tensors(node.args[0])[0]
    return STAT_BYTES * query.numel / query.shape[-1]  # one per (batch, head, query position)


def _attention_saves(node):
    """Fused attention keeps q, k, v, the output, the logsumexp and any mask (and a tiny RNG state)."""
    if not REQUIRES_GRAD.get(node, False):
        return ()
    mask = arg(node, 3, "attn_mask") if node.target.overloadpacket is aten.scaled_dot_product_attention \
        else node.kwargs.get("attn_mask")
    operands = tuple(item for i in range(3) for item in input_saved(node, node.args[i]))
    return (operands + own_saved(node) + own_saved(node, "logsumexp", _logsumexp_bytes(node), False)
            + input_saved(node, mask))


def _dropout_active(node) -> bool:
    p, train = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    return not (isinstance(p, (int, float)) and p == 0) and train is not False


def _mask_bytes(node) -> sympy.Expr:
    return tensors(node)[0].numel if _dropout_active(node) else ZERO  # one byte (bool) per element


def _dropout_saves(node):
    if not REQUIRES_GRAD.get(node, False) or not _dropout_active(node):
        return ()
    return own_saved(node, "mask", _mask_bytes(node), False)


def _dropout_alias(node) -> bool:
    return not _dropout_active(node)  # p == 0 or eval: aten.dropout returns its input


def _cross_entropy_saves(node):
    """The log-probabilities (logits-sized, made here) and the integer targets."""
    if not REQUIRES_GRAD.get(node, False):
        return ()
    logits, like = tensors(node.args[0])[0], node.all_input_nodes.index(node.args[0])
    return (own_saved(node, "log_probs", logits.nbytes, logits.is_floating, like=like)
            + input_saved(node, node.args[1]))


def _cross_entropy_log_probs(node):
    return nbytes(node.args[0])  # log_softmax writes a logits-sized intermediate


def _embedding_saves(node):
    """The indices, to scatter the output gradient into the table rows."""
    return input_saved(node, node.args[1]) if needs_grad(node.args[0]) else ()


def _embedding_reads(node):
    """The indices and only the rows they select, not the whole table."""
    return nbytes(node.args[1]) + nbytes(node)


def _index_saves(node):
    """aten.index(self, [index tensors]) keeps the index tensors."""
    if not REQUIRES_GRAD.get(node, False):
        return ()
    return tuple(item for i in node.args[1] if isinstance(i, Node) for item in input_saved(node, i))


def _same_dtype(node) -> bool:
    """aten.to to the dtype a tensor already has returns the tensor itself."""
    source, result = tensors(node.args[0]), tensors(node)
    return bool(source and result) and source[0].dtype == result[0].dtype


def _saves_indices(index: int) -> Callable:
    def saved(node):
        return input_saved(node, node.args[index]) if REQUIRES_GRAD.get(node, False) else ()
    return saved


@dataclass(frozen=True)
class TrafficRule:
    """Bytes one op moves; a field left None takes the default (all inputs read, outputs written)."""

    saved: Callable[[Node], tuple[SavedTensor, ...]] = _nothing
    read: Callable[[Node], sympy.Expr] | None = None
    extra_written: Callable[[Node], sympy.Expr] | None = None  # intermediates besides the outputs
    is_alias: Callable[[Node], bool] | None = None  # when true the node moves nothing


_PRODUCT = TrafficRule(saved=_saves_for_each_other(0, 1))
_BIASED_PRODUCT = TrafficRule(saved=_saves_for_each_other(1, 2))  # addmm/baddbmm(bias, a, b)
_MOVE = TrafficRule()  # reads and writes, saves nothing: add, cat, clone, casts, ...
_INPUT = TrafficRule(saved=_saves_inputs(0))
_OUTPUT = TrafficRule(saved=_saves_output)
_ATTENTION = TrafficRule(saved=_attention_saves, extra_written=_logsumexp_bytes)

TRAFFIC_RULES: dict[object, TrafficRule] = {
    # products
    aten.linear: _PRODUCT, aten.mm: _PRODUCT, aten.bmm: _PRODUCT, aten.matmul: TrafficRule(saved=_matmul_saves),
    aten.addmm: _BIASED_PRODUCT, aten.baddbmm: _BIASED_PRODUCT,
    aten.conv1d: _PRODUCT, aten.conv2d: _PRODUCT, aten.conv3d: _PRODUCT, aten.convolution: _PRODUCT,
    aten.conv_transpose1d: _PRODUCT, aten.conv_transpose2d: _PRODUCT, aten.conv_transpose3d: _PRODUCT,
    aten.mul: _PRODUCT,
    aten.div: TrafficRule(saved=_saves_divisor),
    # attention (fused kernels)
    aten.scaled_dot_product_attention: _ATTENTION,
    aten._scaled_dot_product_flash_attention: _ATTENTION,
    aten._scaled_dot_product_efficient_attention: _ATTENTION,
    aten._scaled_dot_product_flash_attention_for_cpu: _ATTENTION,
    # normalisation
    aten.layer_norm: TrafficRule(saved=_layer_norm_saves),
    aten.native_layer_norm: TrafficRule(saved=_layer_norm_saves),
    aten.rms_norm: TrafficRule(saved=_rms_norm_saves),
    # activations that keep their input
    aten.gelu: _INPUT, aten.silu: _INPUT, aten.log: _INPUT, aten.pow: _INPUT, aten.square: _INPUT,
    aten.sin: _INPUT, aten.cos: _INPUT, aten.abs: _INPUT, aten.erf: _INPUT,
    aten.clamp: _INPUT, aten.hardtanh: _INPUT, aten.leaky_relu: _INPUT,
    # ... and those that keep their output
    aten.relu: _OUTPUT, aten.sigmoid: _OUTPUT, aten.tanh: _OUTPUT, aten.exp: _OUTPUT,
    aten.sqrt: _OUTPUT, aten.rsqrt: _OUTPUT, aten.reciprocal: _OUTPUT,
    aten.softmax: _OUTPUT, aten._softmax: _OUTPUT, aten.log_softmax: _OUTPUT,
    aten._log_softmax: _OUTPUT,
    # no saved state
    aten.add: _MOVE, aten.sub: _MOVE, aten.rsub: _MOVE, aten.neg: _MOVE, aten.sum: _MOVE,
    aten.mean: _MOVE, aten.cat: _MOVE, aten.stack: _MOVE, aten.clone: _MOVE, aten.contiguous: _MOVE,
    aten.to: TrafficRule(is_alias=_same_dtype), aten._to_copy: _MOVE, aten.copy: _MOVE, aten.type_as: _MOVE,
    aten.arange: _MOVE, aten.zeros: _MOVE, aten.ones: _MOVE, aten.full: _MOVE, aten.empty: _MOVE,
    aten.zeros_like: _MOVE, aten.ones_like: _MOVE, aten.full_like: _MOVE, aten.empty_like: _MOVE,
    aten.scalar_tensor: _MOVE, aten.eq: _MOVE, aten.ne: _MOVE, aten.lt: _MOVE, aten.gt: _MOVE,
    aten.le: _MOVE, aten.ge: _MOVE, aten.tril: _MOVE, aten.triu: _MOVE, aten.new_ones: _MOVE,
    aten.new_zeros: _MOVE, aten.new_full: _MOVE, aten.new_empty: _MOVE, aten.pad: _MOVE,
    aten.constant_pad_nd: _MOVE, aten.cumsum: _MOVE, aten.diff: _MOVE, aten.bitwise_and: _MOVE,
    aten.bitwise_or: _MOVE, aten.bitwise_not: _MOVE, aten.logical_and: _MOVE, aten.logical_or: _MOVE,
    aten.logical_not: _MOVE, aten.__and__: _MOVE, aten.__or__: _MOVE,
    aten._assert_tensor_metadata: TrafficRule(read=lambda node: ZERO),  # a check: touches no data
    # masks and indices
    aten.dropout: TrafficRule(saved=_dropout_saves, extra_written=_mask_bytes, is_alias=_dropout_alias),
    aten.where: TrafficRule(saved=_saves_indices(0)),
    aten.masked_fill: TrafficRule(saved=_saves_indices(1)),
    aten.embedding: TrafficRule(saved=_embedding_saves, read=_embedding_reads),
    aten.index_select: TrafficRule(saved=_saves_indices(2)),
    aten.gather: TrafficRule(saved=_saves_indices(2)),
    aten.index: TrafficRule(saved=_index_saves),
    # loss
    aten.cross_entropy_loss: TrafficRule(saved=_cross_entropy_saves, extra_written=_cross_entropy_log_probs),
}


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD, ROLE), provides=(BYTES,))
def count_bytes(gm, ctx):
    """Record the bytes each node reads, writes and saves for backward, as sympy expressions."""
    for node in gm.graph.nodes:
        BYTES.set(node, node_bytes(node))
    unknown = ops_without_traffic_rule(gm)
    if unknown:
        log.warning("count_bytes: no rule for %s; priced as read-all, write-all, save-all-inputs",
                    ", ".join(f"{op} (x{len(names)})" for op, names in unknown.items()))
    return gm


def node_bytes(node: Node) -> ByteCount:
    """Bytes read, written and saved for backward by one node."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return ByteCount(read=ZERO, written=ZERO, saved_for_backward=ZERO)
    packet = op_packet(node)
    rule = TRAFFIC_RULES.get(packet)
    if packet in ALIAS_OPS or (rule is not None and rule.is_alias is not None and rule.is_alias(node)):
        return ByteCount(read=ZERO, written=ZERO, saved_for_backward=ZERO)
    read = sympy.Add(*(nbytes(i) for i in node.all_input_nodes))
    written = nbytes(node)
    if rule is None:  # unknown op: assume every activation input is kept (see module docstring)
        saved = tuple(item for i in node.all_input_nodes for item in input_saved(node, i)) \
            if REQUIRES_GRAD.get(node, False) else ()
    else:
        if rule.read is not None:
            read = rule.read(node)
        if rule.extra_written is not None:
            written = written + rule.extra_written(node)
        saved = rule.saved(node)
    saved = distinct(saved)
    return ByteCount(read=read, written=written, saved_for_backward=sympy.Add(*(t.nbytes for t in saved)),
                     saved=saved)


def ops_without_traffic_rule(gm) -> dict[str, list[str]]:
    """Op name -> names of the nodes that call an op ``TRAFFIC_RULES`` has no row for."""
    return ops_missing_from(gm, in_any(ALIAS_OPS, TRAFFIC_RULES))


def total_bytes(gm) -> ByteCount:
    """Sum of every node's bytes read and written; saved: the storages the whole graph keeps for the
    backward, each once (``live_saved_bytes``)."""
    nodes = [n for n in gm.graph.nodes if BYTES.has(n)]
    counts = [BYTES.get(n) for n in nodes]
    return ByteCount(read=sympy.Add(*(c.read for c in counts)),
                     written=sympy.Add(*(c.written for c in counts)),
                     saved_for_backward=live_saved_bytes(nodes))
