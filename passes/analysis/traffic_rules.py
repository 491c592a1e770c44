"""What each op keeps alive for its backward (``TRAFFIC_RULES``), and where the default read/write
count is wrong, what it reads and writes: per-op rules as data, read by ``memory_traffic.count_bytes``.
Whether an op returns its input instead (``aten.to`` its own dtype, an inactive dropout) is a fact of
storages (``saved_storages.ALIAS_WHEN``).
Each rule follows the op's autograd formula in torch's derivatives.yaml (module doc of
``memory_traffic``: storages, not tensors; only activations; only what the gradients need).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import SavedTensor
from xirang.ir.meta_keys import REQUIRES_GRAD, TORCH_SYMBOLS, symbol

from xirang.passes.analysis import expert_ops  # noqa: F401  (registers torch.ops.xirang.expert_linear)
from xirang.passes.analysis.saved_storages import (STAT_BYTES, ZERO, arg, dropout_active, input_saved, is_persistent,
                                                    nbytes, needs_grad, own_saved, tensors)

aten = torch.ops.aten


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


def _expert_linear_saves(node):
    """``xirang.expert_linear`` keeps its rows, their expert ids and the weight whenever its output
    needs a gradient (passes/analysis/expert_ops.py ``_setup_context``)."""
    return _saves_inputs(0, 1, 2)(node)


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


def _mask_bytes(node) -> sympy.Expr:
    return tensors(node)[0].numel if dropout_active(node) else ZERO  # one byte (bool) per element


def _dropout_saves(node):
    if not REQUIRES_GRAD.get(node, False) or not dropout_active(node):
        return ()
    return own_saved(node, "mask", _mask_bytes(node), False)


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
    torch.ops.xirang.expert_linear: TrafficRule(saved=_expert_linear_saves),
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
    aten.gelu: _INPUT, aten.silu: _INPUT, aten.softplus: _INPUT, aten.log: _INPUT, aten.pow: _INPUT,
    aten.square: _INPUT, aten.sin: _INPUT, aten.cos: _INPUT, aten.abs: _INPUT, aten.erf: _INPUT,
    aten.clamp: _INPUT, aten.hardtanh: _INPUT, aten.leaky_relu: _INPUT,
    # ... and those that keep their output
    aten.relu: _OUTPUT, aten.sigmoid: _OUTPUT, aten.tanh: _OUTPUT, aten.exp: _OUTPUT,
    aten.sqrt: _OUTPUT, aten.rsqrt: _OUTPUT, aten.reciprocal: _OUTPUT,
    aten.softmax: _OUTPUT, aten._softmax: _OUTPUT, aten.log_softmax: _OUTPUT,
    aten._log_softmax: _OUTPUT,
    # no saved state
    aten.add: _MOVE, aten.sub: _MOVE, aten.rsub: _MOVE, aten.neg: _MOVE, aten.sum: _MOVE,
    aten.mean: _MOVE, aten.cat: _MOVE, aten.stack: _MOVE, aten.clone: _MOVE, aten.contiguous: _MOVE,
    aten.to: _MOVE, aten._to_copy: _MOVE, aten.copy: _MOVE, aten.type_as: _MOVE,
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
    aten.dropout: TrafficRule(saved=_dropout_saves, extra_written=_mask_bytes),
    aten.where: TrafficRule(saved=_saves_indices(0)),
    aten.masked_fill: TrafficRule(saved=_saves_indices(1)),
    aten.embedding: TrafficRule(saved=_embedding_saves, read=_embedding_reads),
    aten.index_select: TrafficRule(saved=_saves_indices(2)),
    aten.gather: TrafficRule(saved=_saves_indices(2)),
    aten.index: TrafficRule(saved=_index_saves),
    # loss
    aten.cross_entropy_loss: TrafficRule(saved=_cross_entropy_saves, extra_written=_cross_entropy_log_probs),
}
