"""The attention core: what selective recompute drops after the forward and rebuilds in the backward
(Korthikanti et al. 2022, sec. 5: the attention scores, softmax, dropout and the weighted sum of
the values, whose saved tensors grow with seq² while everything else grows with seq).

One definition, read by two places: the planner (passes/planning/plan_splits_costs.py: the memory
selective recompute saves) and the lowering (passes/lowering/recompute.py: what it recomputes).

- Eager attention (softmax(QKᵀ)·V written out, as BERT's or GPT-2's eager path): the ops that need a
  gradient and whose output or saved-for-backward bytes are of degree >= 2 in ``seq``
  (``in_eager_core``). The weighted sum ``probs @ V`` is one of them: it saves ``probs``.
- A fused ``scaled_dot_product_attention`` (``is_fused_attention``) keeps no seq² tensor of its
  own (flash/memory-efficient kernels save their inputs, output and a log-sum-exp), so the planner
  prices selective recompute as saving nothing there; the lowering recomputes the fused op itself,
  which drops its output and log-sum-exp for one more attention forward in the backward.
"""
from __future__ import annotations

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import BYTES, REQUIRES_GRAD, TENSOR, symbol

from xirang.passes.analysis.op_tables import op_packet

aten = torch.ops.aten
FUSED_ATTENTION = frozenset({aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
                             aten._scaled_dot_product_efficient_attention,
                             aten._scaled_dot_product_flash_attention_for_cpu})


def is_fused_attention(node: Node) -> bool:
    """A fused attention op (one node holds the whole core) that takes a gradient."""
    return node.op == "call_function" and op_packet(node) in FUSED_ATTENTION and bool(REQUIRES_GRAD.get(node, False))


def in_eager_core(node: Node, *, seq_known: bool = True) -> bool:
    """An op of a written-out attention core: needs a gradient, and its output or the bytes it saves
    for the backward grow with seq² (False when the graph has no ``seq`` symbol)."""
    if not (seq_known and node.op == "call_function" and REQUIRES_GRAD.get(node, False)):
        return False
    if op_packet(node) in FUSED_ATTENTION:
        return False
    traffic = BYTES.get(node, None)
    return grows_with_seq_squared(node, traffic.saved_for_backward if traffic is not None else sympy.Integer(0))


def grows_with_seq_squared(node: Node, saved) -> bool:
    """The node's output elements or ``saved`` (bytes, sympy) are of degree >= 2 in ``seq``."""
    seq = symbol("seq")
    info = TENSOR.get(node, None)
    for expr in ([info.numel] if isinstance(info, TensorInfo) else []) + [saved]:
        try:
            if sympy.degree(sympy.expand(expr), seq) >= 2:
                return True
        except sympy.PolynomialError:  # ceiling/floor of seq: not a polynomial, not an attention score
            continue
    return False
