"""Count each node's forward and backward FLOPs as sympy expressions in the batch/seq symbols.

``FLOP_RULES`` maps an aten op to a function of the node that returns its FlopCount; adding an op
is adding a row. One multiply-add is two FLOPs (Narayanan et al., SC'21), so a GPT's matmuls give
the paper's 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) for forward plus backward.

Conventions:
- Products (linear, mm, bmm, matmul, addmm, baddbmm, convolution): forward 2·(output elements)·K
  for the contracted size K, plus one add per output element for a bias. Backward repeats the
  product once per operand that needs a gradient (dX = dY·Wᵀ, dW = Xᵀ·dY), plus one add per output
  element for a bias gradient (the reduction of dY).
- Expert matmuls (``xirang.expert_linear``, passes/analysis/expert_ops.py): a product of each row
  with its own expert's weight, so the same count as a linear of the rows.
- Attention: QKᵀ and AV, 2·BH·Sq·Sk·(d + dv) — 4·B·heads·s²·d — with heads the *query* heads
  (grouped-query attention shares k/v heads but not the work). Causal attention is counted in full,
  as Megatron does; the softmax (≈5 FLOPs per score, under 2% at head dim ≥ 64) is left out, as is
  the QKᵀ recompute of fused backward kernels. Backward: dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K,
  dK = dSᵀ·Q, each counted when the gradient it serves is needed: 2× forward for self-attention.
- Pointwise ops and norms: a small constant per output element (``PER_ELEMENT`` below); reductions
  per input element. Backward ≈ forward when the output needs a gradient, else 0.
- Embedding: 0 forward; backward scatter-adds one value per output element into the table.
- Cross-entropy: 5 per logit element (the log-softmax: max, subtract, exp, sum, log); the per-row
  pick and mean are left out. Backward ≈ forward.
- Views, copies, casts, creation and indexing ops: 0.
Ops with no row count 0 and are listed by ``ops_without_flop_rule`` (and logged by the pass).
"""
from __future__ import annotations

import logging
from typing import Callable

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import FlopCount
from xirang.ir.meta_keys import FLOPS, REQUIRES_GRAD, TENSOR, UNPRICED_OPS
from xirang.ir.pass_spec import compiler_pass
from xirang.ir.run_log import once_per_run

from xirang.passes.analysis import expert_ops  # noqa: F401  (registers torch.ops.xirang.expert_linear)
from xirang.passes.analysis.saved_storages import ALIAS_OPS, arg, needs_grad, tensors
from xirang.passes.analysis.op_tables import in_any, op_packet, ops_missing_from

aten = torch.ops.aten
log = once_per_run(logging.getLogger(__name__))  # a warning about the model: once per run, rank 0
ZERO = sympy.Integer(0)
NO_FLOPS = FlopCount(forward=ZERO, backward=ZERO)


def _shape(value) -> tuple:
    return tensors(value)[0].shape


def _numel(value) -> sympy.Expr:
    return tensors(value)[0].numel


# --- products ---------------------------------------------------------------------------------

def _product(a: int, b: int, bias: int | None = None) -> Callable[[Node], FlopCount]:
    """out = a @ b (+ bias), contracting a's last dim: linear, mm, bmm, matmul, addmm, baddbmm."""
    def count(node):
        out = _numel(node)
        one_product = 2 * out * _shape(node.args[a])[-1]
        bias_node = arg(node, bias, "bias") if bias is not None else None
        has_bias = isinstance(bias_node, Node)
        forward = one_product + (out if has_bias else ZERO)
        backward = one_product * (int(needs_grad(node.args[a])) + int(needs_grad(node.args[b]))) + \
            (out if needs_grad(bias_node) else ZERO)
        return FlopCount(forward=forward, backward=backward)
    return count


def _convolution(node):
    """2 FLOPs per (output element × input channel per group × kernel element); transposed
    convolutions run the same products from the input's side."""
    weight = node.args[1]
    transposed = node.target.overloadpacket in (aten.conv_transpose1d, aten.conv_transpose2d,
                                                aten.conv_transpose3d) or \
        (node.target.overloadpacket is aten.convolution and bool(arg(node, 6, "transposed", False)))
    spatial = _numel(node.args[0]) if transposed else _numel(node)
    one_product = 2 * spatial * sympy.Mul(*_shape(weight)[1:])
    bias = arg(node, 2, "bias")
    out = _numel(node)
    forward = one_product + (out if isinstance(bias, Node) else ZERO)
    backward = one_product * (int(needs_grad(node.args[0])) + int(needs_grad(weight))) + \
        (out if needs_grad(bias) else ZERO)
    return FlopCount(forward=forward, backward=backward)


def _attention(node):
    """Scaled dot-product attention over q (…, Sq, d), k (…, Sk, d), v (…, Sk, dv)."""
    query, key, value = node.args[0], node.args[1], node.args[2]
    q_shape, k_shape, v_shape = _shape(query), _shape(key), _shape(value)
    scores = _numel(query) / q_shape[-1] * k_shape[-2]  # batch·query heads·Sq·Sk
    scores_product = 2 * scores * q_shape[-1]  # Q·Kᵀ
    values_product = 2 * scores * v_shape[-1]  # P·V
    backward = (values_product * int(needs_grad(value))  # dV = Pᵀ·dO
                + values_product * int(needs_grad(query) or needs_grad(key))  # dP = dO·Vᵀ
                + scores_product * int(needs_grad(query))  # dQ = dS·K
                + scores_product * int(needs_grad(key)))  # dK = dSᵀ·Q
    return FlopCount(forward=scores_product + values_product, backward=backward)


# --- pointwise, norms, reductions, loss ---------------------------------------------------------

def _pointwise(per_element: int) -> Callable[[Node], FlopCount]:
    """``per_element`` FLOPs per output element forward; the same again backward if needed."""
    def count(node):
        forward = per_element * _numel(node)
        return FlopCount(forward=forward, backward=forward if REQUIRES_GRAD.get(node, False) else ZERO)
    return count


def _reduction(per_element: int) -> Callable[[Node], FlopCount]:
    """``per_element`` FLOPs per *input* element (sum, mean, ...)."""
    def count(node):
        forward = per_element * _numel(node.args[0])
        return FlopCount(forward=forward, backward=forward if REQUIRES_GRAD.get(node, False) else ZERO)
    return count


def _gelu(node):
    tanh = arg(node, 1, "approximate", "none") == "tanh"
    return _pointwise(PER_ELEMENT["gelu_tanh" if tanh else "gelu"])(node)


def _dropout(node):
    p, train = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    if train is False or (isinstance(p, (int, float)) and p == 0):
        return NO_FLOPS  # aten.dropout returns its input unchanged
    return _pointwise(PER_ELEMENT["dropout"])(node)


def _cross_entropy(node):
    forward = PER_ELEMENT["cross_entropy"] * _numel(node.args[0])
    return FlopCount(forward=forward, backward=forward if REQUIRES_GRAD.get(node, False) else ZERO)


def _embedding(node):
    return FlopCount(forward=ZERO, backward=_numel(node) if needs_grad(node.args[0]) else ZERO)


def _free(node):
    return NO_FLOPS


# FLOPs per element; approximations in the usual counting, stated so they can be argued with.
PER_ELEMENT = {
    "arithmetic": 1,  # add, sub, mul, div, neg, comparisons, where, clamp, relu, exp, log, sqrt, ...
    "sigmoid": 4,  # neg, exp, add, divide
    "silu": 5,  # x · sigmoid(x)
    "softplus": 4,  # log1p(exp(x)) with its threshold compare: exp, add, log, compare
    "gelu": 5,  # the erf form 0.5·x·(1 + erf(x/√2))
    "gelu_tanh": 9,  # 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    "softmax": 5,  # max, subtract, exp, sum, divide (or log for log_softmax)
    "layer_norm": 7,  # mean, subtract, square, sum, scale by rstd, affine multiply and add
    "rms_norm": 5,  # square, sum, scale by rstd, multiply by weight, (rsqrt per row ≈ free)
    "dropout": 2,  # compare with a random number, scale
    "cross_entropy": 5,  # log-softmax over the logits
}

_ONE = _pointwise(PER_ELEMENT["arithmetic"])
_PRODUCT = _product(0, 1)

FLOP_RULES: dict[object, Callable[[Node], FlopCount]] = {
    # products
    aten.linear: _product(0, 1, bias=2),
    aten.mm: _PRODUCT, aten.bmm: _PRODUCT, aten.matmul: _PRODUCT,
    aten.addmm: _product(1, 2, bias=0), aten.baddbmm: _product(1, 2, bias=0),
    torch.ops.xirang.expert_linear: _product(0, 2, bias=3),
    aten.conv1d: _convolution, aten.conv2d: _convolution, aten.conv3d: _convolution,
    aten.convolution: _convolution, aten.conv_transpose1d: _convolution,
    aten.conv_transpose2d: _convolution, aten.conv_transpose3d: _convolution,
    # attention
    aten.scaled_dot_product_attention: _attention,
    aten._scaled_dot_product_flash_attention: _attention,
    aten._scaled_dot_product_efficient_attention: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    # norms, activations, softmax
    aten.layer_norm: _pointwise(PER_ELEMENT["layer_norm"]),
    aten.native_layer_norm: _pointwise(PER_ELEMENT["layer_norm"]),
    aten.rms_norm: _pointwise(PER_ELEMENT["rms_norm"]),
    aten.gelu: _gelu, aten.silu: _pointwise(PER_ELEMENT["silu"]),
    aten.softplus: _pointwise(PER_ELEMENT["softplus"]),
    aten.sigmoid: _pointwise(PER_ELEMENT["sigmoid"]),
    aten.softmax: _pointwise(PER_ELEMENT["softmax"]), aten._softmax: _pointwise(PER_ELEMENT["softmax"]),
    aten.log_softmax: _pointwise(PER_ELEMENT["softmax"]),
    aten._log_softmax: _pointwise(PER_ELEMENT["softmax"]),
    aten.dropout: _dropout,
    # one FLOP per element
    aten.add: _ONE, aten.sub: _ONE, aten.rsub: _ONE, aten.mul: _ONE, aten.div: _ONE, aten.neg: _ONE,
    aten.pow: _ONE, aten.square: _ONE, aten.sqrt: _ONE, aten.rsqrt: _ONE, aten.reciprocal: _ONE,
    aten.exp: _ONE, aten.log: _ONE, aten.tanh: _ONE, aten.erf: _ONE, aten.sin: _ONE, aten.cos: _ONE,
    aten.abs: _ONE, aten.relu: _ONE, aten.clamp: _ONE, aten.hardtanh: _ONE, aten.leaky_relu: _ONE,
    aten.maximum: _ONE, aten.minimum: _ONE, aten.where: _ONE, aten.masked_fill: _ONE,
    aten.eq: _ONE, aten.ne: _ONE, aten.lt: _ONE, aten.gt: _ONE, aten.le: _ONE, aten.ge: _ONE,
    aten.cumsum: _ONE, aten.diff: _ONE, aten.bitwise_and: _ONE, aten.bitwise_or: _ONE,
    aten.bitwise_not: _ONE, aten.logical_and: _ONE, aten.logical_or: _ONE, aten.logical_not: _ONE,
    aten.__and__: _ONE, aten.__or__: _ONE,
    # reductions
    aten.sum: _reduction(1), aten.mean: _reduction(1), aten.amax: _reduction(1),
    # embedding and loss
    aten.embedding: _embedding,
    aten.cross_entropy_loss: _cross_entropy,
    # data movement and creation: no arithmetic
    **{op: _free for op in (
        aten.cat, aten.stack, aten.clone, aten.contiguous, aten.to, aten._to_copy, aten.copy,
        aten.type_as, aten.arange, aten.zeros, aten.ones, aten.full, aten.empty, aten.zeros_like,
        aten.ones_like, aten.full_like, aten.empty_like, aten.scalar_tensor, aten.tril, aten.triu,
        aten.index_select, aten.gather, aten.index, aten.new_ones, aten.new_zeros, aten.new_full,
        aten.new_empty, aten.pad, aten.constant_pad_nd, aten._assert_tensor_metadata)},
}


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD), provides=(FLOPS, UNPRICED_OPS))
def count_flops(gm, ctx):
    """Record each node's forward and backward FLOPs as sympy expressions in batch/seq."""
    for node in gm.graph.nodes:
        FLOPS.set(node, node_flops(node))
    unknown = ops_without_flop_rule(gm)
    UNPRICED_OPS.set(gm, tuple(sorted(unknown)))
    if unknown:
        log.warning("count_flops: no rule for %s; counted as 0 FLOPs",
                    ", ".join(f"{op} (x{len(names)})" for op, names in unknown.items()))
    return gm


def node_flops(node: Node) -> FlopCount:
    """FLOPs of one node (0 for placeholders, outputs, views and ops without a rule)."""
    if node.op != "call_function":
        return NO_FLOPS
    rule = FLOP_RULES.get(op_packet(node))
    if rule is None or not tensors(node):
        return NO_FLOPS
    return rule(node)


def ops_without_flop_rule(gm) -> dict[str, list[str]]:
    """Op name -> names of the nodes calling an op that is neither a view nor in ``FLOP_RULES``."""
    return ops_missing_from(gm, in_any(ALIAS_OPS, FLOP_RULES))


def total_flops(gm) -> FlopCount:
    """Sum of every node's FlopCount."""
    counts = [FLOPS.get(n) for n in gm.graph.nodes if FLOPS.has(n)]
    return FlopCount(forward=sympy.Add(*(c.forward for c in counts)),
                     backward=sympy.Add(*(c.backward for c in counts)))
