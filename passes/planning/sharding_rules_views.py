"""Ops where a shard simply follows the tensor: views, reshapes, transposes, splits, casts, and the
pointwise ops, norms, softmax and reductions whose work splits with the elements they touch.

Pure placement algebra on shapes: each rule returns ``Follow`` rows, the placement every tensor
argument must have and the placement of the output. ``sharding_rules`` turns them into strategies
(a rank that reads or writes a shard does 1/tp of the work).

Conventions shared with ``sharding_rules``:
- A ``PlanShard(dim)`` is offered only on a dim whose size ``tp`` provably divides: an int, or a sympy
  size such as ``4*batch`` whose quotient is an integer for every batch. A bare ``batch`` or ``seq``
  is not shardable here (no padding: uneven shards would break reshapes and reductions). The one
  exception is the vocabulary chain, where end-padding is provably harmless: see ``padded`` and
  sharding_rules_fused.padded_follows.
- A shard follows a reshape only on the outermost dim of a group of dims whose products match, on
  both sides (``[b, s, 64] -> [b, s, 4, 16]``: S(2) -> S(2) when tp divides 4). Each rank's slice of
  the outermost factor is a contiguous block of the flattened group, which is exactly a shard of the
  other side's outermost dim; a shard of an inner factor would be strided, so it is not offered.
- ``Partial(sum)`` passes only through maps that are linear in it, since only those commute with the
  sum: views, copies, float casts, getitem, cat of Partials, add/sub of two Partials, mul by an R
  tensor or a scalar, division of a Partial, neg, sum and mean. Never through gelu, pow, dropout, an
  integer cast, or an add of a scalar (which the sum would count tp times).
- A split along a sharded dim is not followed: a contiguous shard of a fused ``[q | k | v]``
  projection does not hold a shard of each chunk. The chunked layout ``PlanShard(dim, chunks=k)`` does
  (Megatron's layout of the fused weight); ``sharding_rules_fused`` offers it where it leads to such
  a split, from the op groups named below.

Rules are pure functions of an unchanging analysed graph, and the split pricer asks the same ones
again for every tp degree and layout it builds a problem for. Within ``remembering(memo)`` (one
thread; the caller owns ``memo``, one per graph, and keeps the graph unchanged) ``remembered`` keeps
each answer, so a walk or a node's rows is derived once per plan; outside it nothing is kept.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from typing import Callable, NamedTuple

import sympy
import torch
from torch.fx import Node

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import TENSOR
from xirang.ir.placement import PlanPartial, Placement, PlanReplicate, PlanShard, shard_share

from xirang.passes.analysis.saved_storages import arg

aten = torch.ops.aten
R, SUM = PlanReplicate(), PlanPartial("sum")


class Follow(NamedTuple):
    """Placements required of tensor arguments (node, placement) and the output placement that results."""

    inputs: tuple[tuple[Node, Placement], ...]
    output: Placement | tuple[Placement, ...]


_memo = threading.local()  # .table: the memo of the innermost ``remembering`` block in this thread


@contextlib.contextmanager
def remembering(memo: dict):
    """Within the block, in this thread, ``remembered`` answers are kept in ``memo`` (see module doc)."""
    outer = getattr(_memo, "table", None)
    _memo.table = memo
    try:
        yield
    finally:
        _memo.table = outer


def remembered(key: tuple, derive: Callable[[], object]):
    """``derive()``, kept under ``key`` inside a ``remembering`` block; derived afresh outside one."""
    table = getattr(_memo, "table", None)
    if table is None:
        return derive()
    if key not in table:
        table[key] = derive()
    return table[key]


# --- shapes -----------------------------------------------------------------------------------

def info(value) -> TensorInfo | tuple | None:
    """TensorInfo (or tuple of them for multi-output ops) of a node; None for non-tensors."""
    if not isinstance(value, Node):
        return None
    found = TENSOR.get(value, None)
    if isinstance(found, TensorInfo) or (isinstance(found, tuple) and found
                                         and all(isinstance(t, TensorInfo) for t in found)):
        return found
    return None


def is_tensor(value) -> bool:
    return info(value) is not None


def shape(value) -> tuple:
    found = info(value)
    return found.shape if isinstance(found, TensorInfo) else ()


def same(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def divides(tp: int, size) -> bool:
    """True when ``size`` is a multiple of ``tp`` for every value of the batch/seq symbols."""
    return (sympy.sympify(size) / tp).is_integer is True


def padded(tp: int, size) -> bool:
    """True when ``size`` is a known int (> 1) that ``tp`` does not divide: a shard of it holds
    ceil(size / tp) per rank, end-padded (ir/placement.local_shape). The vocabulary chain offers such
    shards (sharding_rules_fused.padded_follows), and sharding_rules_padded on dims whose padding no real
    element reads (heads, an MLP's width); every other rule asks ``divides``."""
    size = sympy.sympify(size)
    return size.is_Integer is True and int(size) > 1 and int(size) % tp != 0


def shard_fraction(tp: int, size, unit: int = 1) -> float:
    """A rank's share of a dim of ``size`` split over tp: 1/tp, or ceil(n/tp)/n when it is padded
    (the last rank computes on padding, so every rank does the largest rank's work); in whole units
    of ``unit`` elements, ceil(n / (unit tp)) unit / n (ir/placement.shard_share)."""
    if padded(tp, size) or unit > 1:
        n = int(sympy.sympify(size))
        return shard_share(n, tp, unit) / n
    return 1 / tp


def shardable(dims_shape: tuple, tp: int) -> list[int]:
    """Dims of a tensor of this shape that ``tp`` ranks can each hold an equal slice of."""
    return [d for d, size in enumerate(dims_shape) if size != 1 and divides(tp, size)]


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def broadcast_input(value, out_shape: tuple, out_placement: Placement) -> Placement:
    """Placement an operand broadcast to ``out_shape`` needs for the output to be ``out_placement``:
    the matching dim (aligned from the right) keeps the shard, a broadcast size-1 or missing dim is R."""
    if not isinstance(out_placement, PlanShard):
        return out_placement
    mine = shape(value)
    d = out_placement.dim - (len(out_shape) - len(mine))
    if d < 0 or (mine[d] == 1 and out_shape[out_placement.dim] != 1):
        return R
    return PlanShard(d, out_placement.chunks)


def floating(value) -> bool:
    found = info(value)
    return isinstance(found, TensorInfo) and found.is_floating


def first_tensor(node: Node) -> Node:
    return node.args[0] if node.args else next(iter(node.kwargs.values()))


def tensor_args(node: Node) -> list[Node]:
    return [value for value in node.all_input_nodes if is_tensor(value)]


# --- rules ------------------------------------------------------------------------------------

def _identity(partial_ok: bool) -> Callable[[Node, int], list[Follow]]:
    """Same placement in and out: copies, casts, dropout (the mask is drawn per local element)."""
    def rule(node, tp):
        x = first_tensor(node)
        rows = [Follow(((x, PlanShard(d)),), PlanShard(d)) for d in shardable(shape(x), tp)]
        if partial_ok and floating(x) and floating(node):  # x -> x is linear; float -> int is not
            rows.append(Follow(((x, SUM),), SUM))
        return rows
    return rule


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[int, int]] | None:
    """(src dim, dst dim) of the outermost non-size-1 dim of each group of dims whose products
    match, e.g. [b, s, 64] -> [b*s, 4, 16] gives [(0, 0), (2, 1)]; None when no grouping is found."""
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    pairs, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        pairs.append((a[i], b[j]))
        left, right = sympy.sympify(src[a[i]]), sympy.sympify(dst[b[j]])
        i, j = i + 1, j + 1
        while not same(left, right):
            _, denominator = sympy.fraction(sympy.cancel(left / right))
            if denominator == 1:  # the dst side is a factor of the src side: take its next dim
                if j == len(b):
                    return None
                right, j = right * dst[b[j]], j + 1
            else:
                if i == len(a):
                    return None
                left, i = left * src[a[i]], i + 1
    return pairs if i == len(a) and j == len(b) else None


def _reshape(node, tp):
    """view / reshape / flatten / unsqueeze / squeeze: the element order is unchanged, so a shard of
    a group's outermost dim is a shard of the other side's outermost dim (see module docstring)."""
    x = first_tensor(node)
    groups = reshape_groups(shape(x), shape(node)) or []
    rows = [Follow(((x, PlanShard(i)),), PlanShard(o)) for i, o in groups
            if divides(tp, shape(x)[i]) and divides(tp, shape(node)[o])]
    return rows + [Follow(((x, SUM),), SUM)] if floating(x) else rows


def permutation_of(node) -> list[int]:
    """Output dim k holds input dim perm[k]."""
    ndim = len(shape(node))
    packet = node.target.overloadpacket
    if packet is aten.permute:
        return [norm_dim(d, ndim) for d in node.args[1]]
    perm = list(range(ndim))
    if packet is aten.transpose:
        d0, d1 = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:  # aten.t, aten.numpy_T
        perm.reverse()
    return perm


def _permute(node, tp):
    """transpose / t / permute / numpy_T: a shard moves with its dim (transpose(1, 2) maps S(2) to S(1))."""
    x = first_tensor(node)
    perm = permutation_of(node)
    rows = [Follow(((x, PlanShard(perm[k])),), PlanShard(k)) for k in range(len(perm))
            if perm[k] in shardable(shape(x), tp)]
    return rows + [Follow(((x, SUM),), SUM)] if floating(x) else rows


def _expand(node, tp):
    """expand: a shard of a kept dim stays; a broadcast dim can be produced sharded from R."""
    x, out = first_tensor(node), shape(node)
    rows = [Follow(((x, broadcast_input(x, out, PlanShard(d))),), PlanShard(d)) for d in shardable(out, tp)]
    return rows + [Follow(((x, SUM),), SUM)] if floating(x) else rows


def _slice(node, tp):
    """slice: any dim but the sliced one; a full slice (same size) is the identity on every dim."""
    x = first_tensor(node)
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape(x)))
    full = same(shape(x)[dim], shape(node)[dim])
    rows = [Follow(((x, PlanShard(d)),), PlanShard(d)) for d in shardable(shape(node), tp) if full or d != dim]
    return rows + [Follow(((x, SUM),), SUM)] if floating(x) else rows


def _split(node, tp):
    """split / split_with_sizes / chunk: every chunk keeps a shard on any dim but the split dim."""
    x = first_tensor(node)
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(shape(x)))
    count = len(info(node)) if isinstance(info(node), tuple) else 1
    rows = [Follow(((x, PlanShard(d)),), (PlanShard(d),) * count) for d in shardable(shape(x), tp) if d != dim]
    return rows + [Follow(((x, SUM),), (SUM,) * count)] if floating(x) else rows


def _getitem(node, tp):
    """getitem of a multi-output op: its input placement is that of the element it picks."""
    source = node.args[0]
    if not isinstance(info(source), tuple):
        return []
    element = info(source)[node.args[1]]
    rows = [Follow(((source, PlanShard(d)),), PlanShard(d)) for d in shardable(element.shape, tp)]
    return rows + [Follow(((source, SUM),), SUM)] if element.is_floating else rows


def _cat(node, tp):
    """cat: every input sharded on the same non-concatenated dim; or all Partial."""
    parts = [t for t in node.args[0] if is_tensor(t) and len(shape(t)) == len(shape(node))]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape(node)))
    if len(parts) != len([t for t in node.args[0] if is_tensor(t)]):
        return []  # legacy empty 1-D inputs: keep it replicated
    rows = [Follow(tuple((t, PlanShard(d)) for t in parts), PlanShard(d))
            for d in shardable(shape(node), tp) if d != dim]
    return rows + [Follow(tuple((t, SUM) for t in parts), SUM)] if floating(node) else rows


# --- pointwise, norms, softmax, reductions -------------------------------------------------------

def _elementwise(linear: str | None = None) -> Callable[[Node, int], list[Follow]]:
    """Pointwise ops with broadcasting: an output shard maps to the matching dim of each operand and
    to R where the operand is broadcast. ``linear`` says how a Partial(sum) passes: 'additive' (both
    operands Partial), 'scaling' (one Partial, the other R or a scalar), 'dividend' (the numerator),
    'negation'; None for nonlinear ops, which it never passes."""
    def rule(node, tp):
        out, operands = shape(node), tensor_args(node)
        rows = [Follow(tuple((x, broadcast_input(x, out, PlanShard(d))) for x in operands), PlanShard(d))
                for d in shardable(out, tp)]
        if linear is None or not floating(node):
            return rows
        # positional operands, so mul(x, x) asks x for two placements and the row is dropped
        first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
        tensors = [x for x in (first, second) if is_tensor(x)]
        if linear == "negation" or (linear == "additive" and len(tensors) == 2):
            rows.append(Follow(tuple((x, SUM) for x in tensors), SUM))
        elif linear == "scaling":
            rows += [Follow(tuple((x, SUM if i == chosen else R) for i, x in enumerate(tensors)), SUM)
                     for chosen in range(len(tensors))]
        elif linear == "dividend" and is_tensor(first) and arg(node, 2, "rounding_mode") is None:
            rows.append(Follow(tuple((x, SUM if i == 0 else R) for i, x in enumerate(tensors)), SUM))
        return rows
    return rule


def _norm(node, tp):
    """layer_norm / rms_norm: split only dims before the normalised ones; weight and bias R."""
    x, kept = node.args[0], len(shape(node.args[0])) - len(node.args[1])
    params = tuple((p, R) for p in tensor_args(node) if p is not x)
    return [Follow(((x, PlanShard(d)),) + params, PlanShard(d)) for d in shardable(shape(x), tp) if d < kept]


def _softmax(node, tp):
    """softmax / log_softmax: any dim but the one normalised over."""
    x = node.args[0]
    dim = norm_dim(arg(node, 1, "dim"), len(shape(x)))
    return [Follow(((x, PlanShard(d)),), PlanShard(d)) for d in shardable(shape(x), tp) if d != dim]


def surviving_dims(node: Node) -> dict[int, int]:
    """A sum's or mean's input dims that survive it -> their dim in its output (all reduced when no dim
    is given; the others move down past each reduced one unless keepdim)."""
    ndim = len(shape(node.args[0]))
    dims = arg(node, 1, "dim") if node.target._overloadname != "default" else None
    dims = [dims] if isinstance(dims, int) else dims
    reduced = set(range(ndim)) if not dims else {norm_dim(d, ndim) for d in dims}
    keepdim = bool(arg(node, 2, "keepdim", False))
    return {d: d if keepdim else d - sum(1 for r in reduced if r < d) for d in range(ndim) if d not in reduced}


def _reduction(partial_when_reduced: bool) -> Callable[[Node, int], list[Follow]]:
    """sum / mean: a split dim that survives stays split; summing over a split dim leaves a
    Partial(sum) (a mean would need Partial(avg): not offered). Partial in, Partial out."""
    def rule(node, tp):
        x = node.args[0]
        surviving = surviving_dims(node)
        rows = []
        for d in shardable(shape(x), tp):
            if d in surviving:
                rows.append(Follow(((x, PlanShard(d)),), PlanShard(surviving[d])))
            elif partial_when_reduced:
                rows.append(Follow(((x, PlanShard(d)),), SUM))
        if floating(x) and floating(node):
            rows.append(Follow(((x, SUM),), SUM))
        return rows
    return rule


_POINTWISE = _elementwise()

# Op groups, named so sharding_rules_fused can tell which ops carry a shard of a dim unchanged.
RESHAPE_OPS = (aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.unflatten, aten.unsqueeze,
               aten.squeeze)
PERMUTE_OPS = (aten.transpose, aten.t, aten.permute, aten.numpy_T)  # numpy_T: x.T, all dims reversed (FalconLinear)
SPLIT_OPS = (aten.split, aten.split_with_sizes, aten.chunk)
COPY_OPS = (aten.contiguous, aten.clone, aten.alias, aten.detach, aten.lift_fresh_copy, aten.to, aten._to_copy,
            aten.dropout)
LINEAR_ELEMENTWISE = {aten.add: "additive", aten.sub: "additive", aten.mul: "scaling", aten.div: "dividend",
                      aten.neg: "negation"}
POINTWISE_OPS = (
    aten.gelu, aten.silu, aten.softplus, aten.relu, aten.sigmoid, aten.tanh, aten.exp, aten.log, aten.sqrt, aten.rsqrt,
    aten.pow, aten.square, aten.reciprocal, aten.sin, aten.cos, aten.erf, aten.abs, aten.clamp,
    aten.hardtanh, aten.leaky_relu, aten.rsub, aten.maximum, aten.minimum, aten.where, aten.masked_fill,
    aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.__and__, aten.__or__, aten.bitwise_and,
    aten.bitwise_or, aten.bitwise_not, aten.logical_and, aten.logical_or, aten.logical_not)

FOLLOW_RULES: dict[object, Callable[[Node, int], list[Follow]]] = {
    **{op: _reshape for op in RESHAPE_OPS},
    **{op: _permute for op in PERMUTE_OPS},
    aten.expand: _expand, aten.broadcast_to: _expand,
    aten.slice: _slice,
    **{op: _split for op in SPLIT_OPS},
    aten.tensor_split: _split,  # split at indices (Mamba's scan, transformers >= 5.25); not a SPLIT_OPS: its
    # indices are positions, which local_sizes does not localise, so only dims other than the split dim shard
    operator.getitem: _getitem,
    aten.cat: _cat,
    **{op: _identity(partial_ok=True) for op in COPY_OPS if op is not aten.dropout},
    aten.dropout: _identity(partial_ok=False),  # a Partial would need the same mask on every rank
    aten.layer_norm: _norm, aten.rms_norm: _norm,
    aten.softmax: _softmax, aten._softmax: _softmax, aten.log_softmax: _softmax, aten._log_softmax: _softmax,
    aten.sum: _reduction(partial_when_reduced=True), aten.mean: _reduction(partial_when_reduced=False),
    **{op: _elementwise(linear) for op, linear in LINEAR_ELEMENTWISE.items()},
    **{op: _POINTWISE for op in POINTWISE_OPS},
}
