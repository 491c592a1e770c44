"""Uneven splits: a dim that tp does not divide is split anyway, its end padded to a multiple of the
degree (issue 39): heads and kv heads (6 heads on tp 4: 2 a rank, the last rank all padding), an MLP's
width (110 on tp 4: 28 a rank, 2 padding rows on the last), and the flat projection outputs heads are
viewed from, split in whole heads (96 = 6 heads of 16 on tp 4: ``PlanShard(2, unit=16)``, 32 a rank).

The invariant that makes padding safe where these rules offer it: **padded elements hold finite values
that no real element reads, and receive a zero gradient.**

- It starts finite: a padded parameter's padding is zero (``codegen/ops/padding.shard_of``), so a
  column-parallel product's padded outputs are ``x @ 0 + 0``.
- Ops that carry it treat the padded dim as a batch dim: views that keep it the outermost dim of its
  group (in whole units, below), transposes, copies and casts, elementwise ops with broadcasting
  (except those infinite at 0 in value or derivative: log, sqrt, rsqrt, reciprocal, a padded divisor,
  pow below 1; and masked_fill and where, which may write -inf into it), norms and softmax over other
  dims, reductions of other dims, slices, splits and cats of other dims, attention split by heads
  (``padded_heads``). Each real output element reads real
  input elements only, and a padded one is a finite function of finite values.
- It ends at a contraction or a gather. A row-parallel linear over the padded dim zeroes its input's
  padding first (``passes/lowering/padded_shards.py``), so the padding adds nothing whatever it holds,
  the padded weight columns get a zero gradient (and stay zero under AdamW), and the padding upstream
  gets a zero gradient back; a gather strips it (``collectives.gather_from_group``).

A dim is offered its padded shards only where the split is uneven (an even one is the plain rules'):
the smallest unit with the same share (``padded_shard``), so a layout has one spelling. Units come
from the views the dim meets (``padded_shards``): walking forward to a view that splits it (``[.., 96]``
to ``[.., 6, 16]``: whole heads of 16) or back to the view that made it, plus single elements.

Not yet: the chunked and pieces shards of fused projections padded (their pieces must be split evenly),
the ``matmul``/``mm``/``addmm`` products (only ``linear`` pads), grouped-query attention that reads
fewer kv heads than query heads without ``repeat_kv``, and the activations and collectives of padded shards
priced at 1/tp of the tensor (their compute and parameters are priced at the padded share).
"""
from __future__ import annotations

import numbers
from dataclasses import replace

import torch
from torch.fx import Node

from xirang.ir.placement import PlanShard, shard_share
from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.analysis.saved_storages import arg
from xirang.passes.planning.sharding_rules_fused import SEARCH_DEPTH, carried_dim
from xirang.passes.planning.sharding_rules_views import (COPY_OPS, LINEAR_ELEMENTWISE, PERMUTE_OPS, POINTWISE_OPS,
                                                         RESHAPE_OPS, SPLIT_OPS, Follow, R, SUM, first_tensor, info,
                                                         is_tensor, norm_dim, permutation_of, remembered,
                                                         reshape_groups, shape, surviving_dims, tensor_args)

aten = torch.ops.aten

# infinite at 0, in value or derivative: padding through them could turn a zero gradient into NaN; and the
# selects, which may write -inf into the padding (a mask made from it), which a softmax turns into NaN
_UNSAFE = frozenset({aten.log, aten.sqrt, aten.rsqrt, aten.reciprocal, aten.masked_fill, aten.where})
_ELEMENTWISE = (frozenset(LINEAR_ELEMENTWISE) | frozenset(POINTWISE_OPS)) - _UNSAFE
_COPIES = frozenset(COPY_OPS) - {aten.dropout}  # dropout's streams are drawn per even shard (random_ops)


def _int(size) -> int | None:
    try:
        return int(size)
    except TypeError:
        return None


def padded_shard(dim: int, n: int, unit: int, tp: int) -> PlanShard | None:
    """The shard of a dim of ``n`` split over tp in whole units of ``unit`` elements, written with the
    smallest unit that gives the same share; None when a rank would hold the whole dim or the unit does
    not divide it."""
    if n <= 1 or unit < 1 or n % unit:
        return None
    share = shard_share(n, tp, unit)
    if share >= n:
        return None
    smallest = next(u for u in range(1, unit + 1) if n % u == 0 and shard_share(n, tp, u) == share)
    return PlanShard(dim, unit=smallest)


def padded_shards(node: Node, dim: int, tp: int) -> tuple[PlanShard, ...]:
    """The padded shards dim ``dim`` of ``node``'s output may take: in single elements and in the units
    the views it meets read it in (module docstring); only uneven ones."""
    n = _int(shape(node)[dim]) if is_tensor(node) and not isinstance(info(node), tuple) and \
        dim < len(shape(node)) else None
    if n is None or n <= 1:
        return ()
    found = {padded_shard(dim, n, u, tp) for u in {1} | set(_units(node, dim))}
    return tuple(sorted((p for p in found if p is not None and shard_share(n, tp, p.unit) * tp != n),
                        key=lambda p: p.unit))


def _units(node: Node, dim: int) -> tuple[int, ...]:
    """Elements of dim ``dim`` of ``node`` per unit of every view that splits it (forward) or made it
    (back), through ops that keep its size."""
    def walk():
        found = set()
        frontier = [(node, dim)]
        for _ in range(SEARCH_DEPTH):  # forward: to a view splitting the dim into [units, ...]
            reached = []
            for value, d in frontier:
                n = _int(shape(value)[d])
                for user in value.users:
                    kept = carried_dim(user, value, d)
                    if kept is None or n is None:
                        continue
                    m = _int(shape(user)[kept])
                    if m == n:
                        reached.append((user, kept))
                    elif m and op_packet(user) in RESHAPE_OPS and m < n and n % m == 0:
                        found.add(n // m)
            frontier = reached
        value, d = node, dim
        for _ in range(SEARCH_DEPTH):  # back: to the view that made the dim from [units, ...]
            source = first_tensor(value) if value.op == "call_function" and value.args else None
            if not isinstance(source, Node) or not is_tensor(source):
                break
            back = next((i for i in range(len(shape(source))) if carried_dim(value, source, i) == d), None)
            if back is None:
                break
            n, m = _int(shape(value)[d]), _int(shape(source)[back])
            if n and m and op_packet(value) in RESHAPE_OPS and m < n and n % m == 0:
                found.add(n // m)
                break
            if n is None or n != m:
                break
            value, d = source, back
        return tuple(sorted(found))
    return remembered(("padded units", node, dim), walk)


def _same_layout(placement: PlanShard, dim: int) -> PlanShard:
    return replace(placement, dim=dim)


# --- follow rows -------------------------------------------------------------------------------

def _copies(node, tp):
    x = first_tensor(node)
    return [Follow(((x, p),), p) for d in range(len(shape(node))) for p in padded_shards(node, d, tp)]


def _permute(node, tp):
    x, perm = first_tensor(node), permutation_of(node)
    return [Follow(((x, _same_layout(p, perm[k])),), p) for k in range(len(perm)) for p in padded_shards(node, k, tp)]


def _group_inner(dims: tuple, outers: list[int], at: int) -> int | None:
    """Product of the dims after ``at`` up to the next group's outermost dim (a reshape group's inner dims)."""
    following = [o for o in outers if o > at]
    inner = 1
    for size in dims[at + 1:following[0] if following else len(dims)]:
        if _int(size) is None:
            return None
        inner *= _int(size)
    return inner


def _reshape(node, tp):
    """A padded shard of a group's outermost dim on both sides, where one rank's elements of the group
    are the same run: (unit x inner dims) elements on each side."""
    x = first_tensor(node)
    groups = reshape_groups(shape(x), shape(node)) or []
    rows = []
    for i, o in groups:
        n_in, n_out = _int(shape(x)[i]), _int(shape(node)[o])
        inner_in = _group_inner(shape(x), [a for a, _ in groups], i)
        inner_out = _group_inner(shape(node), [b for _, b in groups], o)
        if None in (n_in, n_out, inner_in, inner_out):
            continue
        pairs = set()
        for p in padded_shards(node, o, tp):
            block = p.unit * inner_out
            if block % inner_in == 0:
                pairs.add((padded_shard(i, n_in, block // inner_in, tp), p))
        for p in padded_shards(x, i, tp):
            block = p.unit * inner_in
            if block % inner_out == 0:
                pairs.add((p, padded_shard(o, n_out, block // inner_out, tp)))
        rows += [Follow(((x, a),), b) for a, b in sorted(pairs, key=str) if a is not None and b is not None
                 and shard_share(n_in, tp, a.unit) * inner_in == shard_share(n_out, tp, b.unit) * inner_out]
    return rows


def _operand(value, out_shape: tuple, placement: PlanShard):
    """An elementwise operand's placement for an output padded as ``placement``: the same on its aligned
    dim of equal size, R where it is broadcast."""
    mine = shape(value)
    d = placement.dim - (len(out_shape) - len(mine))
    if d < 0 or (mine[d] == 1 and out_shape[placement.dim] != 1):
        return R
    return _same_layout(placement, d)


def _elementwise(node, tp):
    packet = op_packet(node)
    second = node.args[1] if len(node.args) > 1 else None
    if packet is aten.pow and not (isinstance(second, numbers.Number) and second >= 1):
        return []  # x ** 0.5 or x ** -1: infinite derivative at 0
    out, operands = shape(node), tensor_args(node)
    rows = []
    for d in range(len(out)):
        for p in padded_shards(node, d, tp):
            reads = tuple((x, _operand(x, out, p)) for x in operands)
            if packet is aten.div and isinstance(second, Node) and dict(reads).get(second) != R:
                continue  # a padded divisor divides by its zero padding
            rows.append(Follow(reads, p))
    return rows


def _expand(node, tp):
    x, out = first_tensor(node), shape(node)
    return [Follow(((x, _operand(x, out, p)),), p) for d in range(len(out)) for p in padded_shards(node, d, tp)]


def _other_dims(dim_of):
    """Rows on dims other than the one the op reads across (``dim_of(node) -> dims it mixes``)."""
    def rule(node, tp):
        x = first_tensor(node)
        mixed = dim_of(node)
        return [Follow(((x, p),), p) for d in range(len(shape(x))) if d not in mixed
                for p in padded_shards(node, d, tp)]
    return rule


def _sliced(node):
    x = first_tensor(node)
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape(x)))
    return set() if shape(x)[d] == shape(node)[d] else {d}


def _norm(node, tp):
    x, kept = node.args[0], len(shape(node.args[0])) - len(node.args[1])
    params = tuple((p, R) for p in tensor_args(node) if p is not x)
    return [Follow(((x, p),) + params, p) for d in range(kept) for p in padded_shards(node, d, tp)]


def _softmax_dims(node):
    return {norm_dim(arg(node, 1, "dim"), len(shape(node.args[0])))}


def _reduction(node, tp):
    """Padded dims that survive a sum or mean (a reduced padded dim would sum the padding)."""
    x = node.args[0]
    rows = []
    for d, kept in surviving_dims(node).items():
        rows += [Follow(((x, _same_layout(p, d)),), p) for p in padded_shards(node, kept, tp)]
    return rows


def _split(node, tp):
    x = first_tensor(node)
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(shape(x)))
    count = len(info(node)) if isinstance(info(node), tuple) else 1
    return [Follow(((x, p),), (p,) * count) for d in range(len(shape(x))) if d != dim
            for p in padded_shards(x, d, tp)]


def _getitem(node, tp):
    source = node.args[0]
    if not isinstance(info(source), tuple):
        return []
    return [Follow(((source, p),), p) for d in range(len(shape(node))) for p in padded_shards(node, d, tp)]


def _cat(node, tp):
    parts = [t for t in node.args[0] if is_tensor(t)]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape(node)))
    if any(len(shape(t)) != len(shape(node)) for t in parts):
        return []
    return [Follow(tuple((t, p) for t in parts), p) for d in range(len(shape(node))) if d != dim
            for p in padded_shards(node, d, tp)]


UNEVEN_RULES = {
    **{op: _copies for op in _COPIES},
    **{op: _permute for op in PERMUTE_OPS},
    **{op: _reshape for op in RESHAPE_OPS},
    **{op: _elementwise for op in _ELEMENTWISE},
    aten.expand: _expand, aten.broadcast_to: _expand,
    aten.slice: _other_dims(_sliced),
    **{op: _split for op in SPLIT_OPS}, aten.tensor_split: _split,
    aten.cat: _cat,
    aten.layer_norm: _norm, aten.rms_norm: _norm,
    **{op: _other_dims(_softmax_dims) for op in (aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)},
    aten.sum: _reduction, aten.mean: _reduction,
}


def uneven_follows(node: Node, tp: int) -> list[Follow]:
    """Rows of an op that carries a padded shard (module docstring); none for other ops."""
    import operator
    rule = _getitem if node.target is operator.getitem else UNEVEN_RULES.get(op_packet(node))
    if rule is None or not is_tensor(node) or not (node.args or node.kwargs):
        return []
    return rule(node, tp)


# --- products and attention ----------------------------------------------------------------------

def share_fraction(placement: PlanShard, n: int, tp: int) -> float:
    """A rank's work on a padded dim: its share (padding included) over the dim."""
    return shard_share(n, tp, placement.unit) / n


def uneven_linear(node: Node, tp: int) -> list[tuple]:
    """``linear(x, w[out, in], b)`` split where tp does not divide: column with padded out-features (w and
    b zero-padded, in whole heads where a view splits the output into heads), row with a padded
    contraction (x's padding zeroed by the lowering, w's padded columns zero). (name, pairs, output,
    fraction) for ``sharding_rules.make``."""
    x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
    bias = b if is_tensor(b) else None
    last = len(shape(x)) - 1
    out_features, in_features = (_int(n) for n in shape(w))
    rows = []
    for p in padded_shards(node, len(shape(node)) - 1, tp):
        on = _same_layout(p, 0)
        pairs = [(x, R), (w, on)] + ([(bias, on)] if bias is not None else [])
        rows.append(("column (padded)", pairs, p, share_fraction(p, out_features, tp)))
    for p in padded_shards(x, last, tp):
        pairs = [(x, p), (w, _same_layout(p, 1))] + ([(bias, SUM)] if bias is not None else [])
        rows.append(("row (padded)", pairs, SUM, share_fraction(p, in_features, tp)))
    return rows


def padded_heads(node: Node, tp: int) -> list[tuple]:
    """Attention split by padded heads: q, k and v of one head count padded alike (HF's ``repeat_kv``
    makes kv that count), or k and v of one head read whole; padded heads attend over zeros or finite
    values and their output is padding. (name, pairs, output, fraction) for ``sharding_rules.make``."""
    from xirang.passes.planning.sharding_rules_views import broadcast_input
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    mask = mask if is_tensor(mask) else None
    scores = shape(q)[:-1] + (shape(k)[-2],)
    rows = []
    for d in range(len(shape(q)) - 2):
        for p in padded_shards(q, d, tp):
            reads = [(t, p if shape(t)[d] == shape(q)[d] else R if shape(t)[d] == 1 else None) for t in (k, v)]
            if any(placement is None for _, placement in reads):
                continue
            pairs = [(q, p)] + reads
            if mask is not None:
                placed = broadcast_input(mask, scores, PlanShard(d))
                pairs.append((mask, R if placed == R else _same_layout(p, placed.dim)))
            rows.append(("heads (padded)", pairs, p, share_fraction(p, _int(shape(q)[d]), tp)))
    return rows
