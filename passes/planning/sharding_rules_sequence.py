"""Sequence-parallel rows (Korthikanti et al. 2022): the residual stream split along the sequence on tp.

Between the tensor-parallel regions of a transformer (after a row-parallel projection, before the
next column-parallel one) the adds, norms and dropouts run on whole activations on every tp rank.
These rows let each rank run them on its 1/tp of the tokens instead: an op whose output has one
sequence dim may take ``PlanShard(seq dim)``, its operands the matching shard (R where broadcast), a
norm's weight and bias R. The split then prices the transitions the layout needs like any other:
Partial(sum) -> S(seq) is a reduce-scatter, S(seq) -> R an all-gather (their backward the dual), so
"all-reduce" and "reduce-scatter + all-gather" are two solutions of the same ILP, priced against
each other with the compute and the saved activations of the split ops.

A dim is a sequence dim when its size is ``k·seq`` for an integer k (the traced ``seq`` symbol); such a
dim is shardable only because the plan says so (``sequence_parallel``): the program is built for one
sequence length, and the lowering refuses one that tp does not divide. Ops whose output has two
sequence dims (attention scores, masks) are left to the other rules.
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
from torch.fx import Node

from xirang.passes.analysis.saved_storages import arg
from xirang.passes.planning.sharding_rules_views import (COPY_OPS, LINEAR_ELEMENTWISE, POINTWISE_OPS, R, Follow,
                                                         broadcast_input, first_tensor, norm_dim, shape, tensor_args)
from xirang.ir.placement import PlanShard

aten = torch.ops.aten
SEQ = "seq"


def sequence_dims(dims_shape: tuple) -> list[int]:
    """Dims whose size is an integer multiple of the ``seq`` symbol (and of nothing else)."""
    found = []
    for d, size in enumerate(dims_shape):
        size = sympy.sympify(size)
        if [s.name for s in size.free_symbols] != [SEQ]:
            continue
        ratio = sympy.simplify(size / next(iter(size.free_symbols)))
        if ratio.is_Integer and int(ratio) >= 1:
            found.append(d)
    return found


def _one_sequence_dim(node: Node) -> int | None:
    dims = sequence_dims(shape(node))
    return dims[0] if len(dims) == 1 else None


def _pointwise(node: Node, tp: int) -> list[Follow]:
    d = _one_sequence_dim(node)
    if d is None:
        return []
    out = shape(node)
    operands = tensor_args(node) if node.target.overloadpacket not in COPY_OPS else [first_tensor(node)]
    return [Follow(tuple((x, broadcast_input(x, out, PlanShard(d))) for x in operands), PlanShard(d))]


def _norm(node: Node, tp: int) -> list[Follow]:
    x = node.args[0]
    d = _one_sequence_dim(node)
    if d is None or d >= len(shape(x)) - len(node.args[1]):
        return []
    return [Follow(((x, PlanShard(d)),) + tuple((p, R) for p in tensor_args(node) if p is not x), PlanShard(d))]


def _reduction(node: Node, tp: int) -> list[Follow]:
    """mean / sum over other dims (RMSNorm's mean of squares): the sequence shard survives."""
    x = node.args[0]
    ndim = len(shape(x))
    dims = arg(node, 1, "dim") if node.target._overloadname != "default" else None
    dims = [dims] if isinstance(dims, int) else dims
    reduced = set(range(ndim)) if not dims else {norm_dim(d, ndim) for d in dims}
    seq = sequence_dims(shape(x))
    if len(seq) != 1 or seq[0] in reduced:
        return []
    keepdim = bool(arg(node, 2, "keepdim", False))
    kept = seq[0] if keepdim else seq[0] - sum(1 for r in reduced if r < seq[0])
    return [Follow(((x, PlanShard(seq[0])),), PlanShard(kept))]


SEQUENCE_RULES: dict[object, Callable[[Node, int], list[Follow]]] = {
    **{op: _pointwise for op in (*LINEAR_ELEMENTWISE, *POINTWISE_OPS, *COPY_OPS)},
    aten.layer_norm: _norm, aten.rms_norm: _norm,
    aten.mean: _reduction, aten.sum: _reduction,
}


def stream_dim(node: Node) -> int | None:
    """The dim a residual-stream tensor is split along where it crosses a block's edge under sequence
    parallelism (``TpProblem.boundary``): its one sequence dim; None with none or several."""
    return _one_sequence_dim(node)


def sequence_follows(node: Node, tp: int) -> list[Follow]:
    """The sequence-sharded rows of ``node`` (empty for an op the residual stream does not use)."""
    rule = SEQUENCE_RULES.get(getattr(node.target, "overloadpacket", None))
    return rule(node, tp) if rule is not None and tp > 1 else []
