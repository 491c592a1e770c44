"""Fused projections whose pieces differ in size or cannot all be split: the pieces shard
``PlanShard(dim, pieces=(n0, n1, ...), whole=(j, ...))`` (ir/placement.py).

A fused ``[q | k | v]`` is split by heads when each rank holds its heads of every piece. The chunked
shard (sharding_rules_fused) does that for k equal pieces that tp all divides. Multi-query and
grouped-query projections are not that: GPTBigCode's ``c_attn`` is ``[q (4 heads) | k (1) | v (1)]``,
read by ``split_with_sizes([64, 16, 16])``; Phi-3's ``qkv_proj`` is ``[q (4) | k (2) | v (2)]``, read by
three slices. Here each piece is split when tp divides its count of the units the picker reads (heads)
and held whole on every rank otherwise (a single kv head at tp 2): rank r's weight rows are its query
heads' rows and the kv rows, so the projection splits by query heads and the kv heads are split or
replicated as their count allows. The user's tensor is never permuted: the runtime binds each rank's
blocks of it (``codegen/ops/padding.shard_of``) and glues them back for checkpoints.

The rules:
- ``pieces_of(node, dim, tp)`` walks forward from a node's output dim through reshapes, transposes and
  copies (the carriers) to the ops that pick pieces along it: ``slice`` with static bounds, ``split``
  and ``split_with_sizes``, ``index`` with one index tensor whose values the trace knows (a constant of
  a model traced on ``meta`` has none: such an index stops the walk). Every cut they make, scaled back
  to the node's dim, bounds a piece; a piece is split when tp divides its size in every picker's units.
  It returns the pieces shard, or None when the pickers overlap, a piece cannot be placed, or the
  result is no more than a plain or chunked shard.
- A producer (column-parallel linear/matmul/addmm) offers the column row with that shard on its output
  and weight (and bias); each carrier on the way maps it through; each picker reads it and writes
  ``PlanShard(dim)`` for a split piece and R for a whole one (``pieces_follows``). A carrier whose reader
  is a product asking the shard of it (FalconLinear's ``W.T``) offers it too (``asked_pieces``).

The lowering (passes/lowering/fused_pieces.py) makes sizes and picks local, and runs a producer with
whole pieces so the gradient of its replicated input counts a whole piece once over the tp ranks.
"""
from __future__ import annotations

from fractions import Fraction

import sympy
import torch
from torch.fx import Node

from xirang.ir.meta_keys import CONSTANT_VALUE, ROLE
from xirang.ir.placement import PlanShard, pieces_local_size
from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.planning.sharding_rules_fused import SEARCH_DEPTH
from xirang.passes.planning.sharding_rules_views import (COPY_OPS, PERMUTE_OPS, RESHAPE_OPS, R, Follow, first_tensor,
                                                         info, is_tensor, norm_dim, permutation_of, remembered,
                                                         reshape_groups, shape)

aten = torch.ops.aten

_CARRIERS = frozenset(RESHAPE_OPS) | frozenset(PERMUTE_OPS) | (frozenset(COPY_OPS) - {aten.dropout})
_PRODUCTS = (aten.linear, aten.mm, aten.matmul, aten.addmm)


def _int(size) -> int | None:
    size = sympy.sympify(size)
    return int(size) if size.is_Integer else None


def carried(user: Node, value: Node, dim: int) -> tuple[int, Fraction] | None:
    """(dim of ``user``'s output holding dim ``dim`` of ``value``, output units per input unit), or None."""
    packet = op_packet(user)
    if packet not in _CARRIERS or not is_tensor(user) or first_tensor(user) is not value:
        return None
    if packet in RESHAPE_OPS:
        kept = next((o for i, o in reshape_groups(shape(value), shape(user)) or () if i == dim), None)
        n_in, n_out = _int(shape(value)[dim]), _int(shape(user)[kept]) if kept is not None else None
        return (kept, Fraction(n_out, n_in)) if n_in and n_out else None
    if packet in PERMUTE_OPS:
        perm = permutation_of(user)
        return (perm.index(dim), Fraction(1)) if dim in perm else None
    return dim, Fraction(1)


def _picked(user: Node, value: Node, dim: int) -> list[tuple[int, int]] | None:
    """The intervals [start, stop) of dim ``dim`` of ``value`` that ``user`` picks (one per output), or
    None when ``user`` picks nothing along it; [] when it reads the dim in a way no pieces shard serves."""
    packet, n = op_packet(user), _int(shape(value)[dim])
    if n is None or first_tensor(user) is not value:
        return None
    if packet is aten.slice:
        sliced = norm_dim(user.args[1] if len(user.args) > 1 else 0, len(shape(value)))
        if sliced != dim:
            return None
        start, stop = (user.args[2] if len(user.args) > 2 else 0), (user.args[3] if len(user.args) > 3 else n)
        step = user.args[4] if len(user.args) > 4 else 1
        if not all(isinstance(b, int) for b in (start, stop)) or step != 1:
            return []
        start, stop = (max(0, min(n, b + n if b < 0 else b)) for b in (start, stop))
        return [(start, stop)] if start < stop else []
    if packet in (aten.split, aten.split_with_sizes) and isinstance(info(user), tuple):
        if norm_dim(user.args[2] if len(user.args) > 2 else 0, len(shape(value))) != dim:
            return None
        sizes = [_int(t.shape[dim]) for t in info(user)]
        if None in sizes:
            return []
        bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        return list(zip(bounds[:-1], bounds[1:]))
    if packet is aten.index:
        indices = list(user.args[1])
        if len(indices) <= dim or indices[dim] is None:
            return None
        if sum(i is not None for i in indices) != 1:
            return []
        known = CONSTANT_VALUE.get(indices[dim], None) if isinstance(indices[dim], Node) else None
        if not isinstance(known, torch.Tensor) or known.is_meta or known.dim() != 1 or not len(known):
            return []  # values unknown (a model traced on meta): no pieces shard
        picks = [int(i) % n for i in known.tolist()]
        if picks != list(range(picks[0], picks[0] + len(picks))):
            return []
        return [(picks[0], picks[-1] + 1)]
    return None


def _walk(node: Node, dim: int) -> tuple[tuple[Fraction, Fraction, Fraction], ...] | None:
    """(start, stop, units per element of ``node``'s dim) of every interval the pickers reached from
    dim ``dim`` of ``node``'s output take, in ``node``'s units; None when a reader defeats the layout."""
    found, frontier = [], [(node, dim, Fraction(1))]
    for _ in range(SEARCH_DEPTH):
        reached = []
        for value, d, scale in frontier:
            for user in value.users:
                picks = _picked(user, value, d)
                if picks == []:
                    return None
                if picks is not None:
                    found += [(Fraction(a) / scale, Fraction(b) / scale, scale) for a, b in picks]
                    continue
                step = carried(user, value, d)
                if step is not None:
                    reached.append((user, step[0], scale * step[1]))
        if not reached:
            break
        frontier = reached
    return tuple(found)


MAX_CHOICES = 4  # pieces up to which every choice of which splittable pieces to hold whole is offered


def pieces_of(node: Node, dim: int, tp: int) -> tuple[PlanShard, ...]:
    """The pieces shards of dim ``dim`` of ``node``'s output that its pickers can read (module docstring):
    each piece split where tp divides it in every picker's units, or held whole. A picker's units are not
    always a head (GPTBigCode's split reads elements, so its one 16-wide kv head divides by 2), so whether
    to hold a splittable piece smaller than the largest (a kv piece, never the queries) whole is left to
    the ILP: every choice is offered up to ``MAX_CHOICES`` pieces, the most split one beyond."""
    def derive():
        n = _int(shape(node)[dim]) if is_tensor(node) and not isinstance(info(node), tuple) else None
        intervals = _walk(node, dim) if n else None
        if not intervals:
            return ()
        cuts = sorted({0, n} | {c for a, b, _ in intervals for c in (a, b)})
        if any(c.denominator != 1 for c in cuts):
            return ()
        sizes = [int(b - a) for a, b in zip(cuts, cuts[1:])]
        pieces = list(zip(cuts, cuts[1:]))
        if any(sum(1 for p in pieces if a <= p[0] and p[1] <= b) != 1 for a, b, _ in intervals):
            return ()  # a picker spans several pieces: it would read a split piece beside a whole one
        must = {j for j, (a, b) in enumerate(pieces)
                if any((b - a) * scale % tp for s, e, scale in intervals if (s, e) == (a, b))
                or not any((s, e) == (a, b) for s, e, _ in intervals)}
        free = [j for j in range(len(sizes)) if j not in must and sizes[j] < max(sizes)]  # kv, never the queries
        choices = [set()] if len(sizes) > MAX_CHOICES else \
            [{j for k, j in enumerate(free) if mask >> k & 1} for mask in range(2 ** len(free))]
        found = []
        for held in choices:
            whole = tuple(sorted(must | held))
            if len(whole) == len(sizes) or (not whole and len(set(sizes)) == 1):
                continue  # nothing split, or the chunked shard already is this layout
            found.append(PlanShard(dim, pieces=tuple(sizes), whole=whole))
        return tuple(found)
    return remembered(("pieces of", node, dim, tp), derive)


def fraction(placement: PlanShard, tp: int) -> float:
    """A rank's share of the work on a pieces-sharded dim: its elements over the dim's."""
    return pieces_local_size(placement, tp) / sum(placement.pieces)


def scaled(placement: PlanShard, dim: int, factor: Fraction) -> PlanShard | None:
    """``placement``'s pieces on dim ``dim`` of a tensor whose units are ``factor`` of its own (a reshape)."""
    sizes = [Fraction(n) / factor for n in placement.pieces]
    if any(s.denominator != 1 for s in sizes):
        return None
    return PlanShard(dim, pieces=tuple(int(s) for s in sizes), whole=placement.whole)


def product_pieces(node: Node, tp: int) -> tuple[PlanShard, ...]:
    """The pieces shards a column-parallel product's output may take (on its last dim)."""
    if op_packet(node) not in _PRODUCTS or not is_tensor(node):
        return ()
    return pieces_of(node, len(shape(node)) - 1, tp)


def pieces_follows(node: Node, tp: int) -> list[Follow]:
    """Rows of a carrier or picker that read a pieces shard (module docstring). Not of a model input: the
    runtime binds parameters' pieces (codegen/ops/padding.shard_of), inputs only as plain shards."""
    x = first_tensor(node) if node.args else None
    if not isinstance(x, Node) or not is_tensor(x) or isinstance(info(x), tuple) or _is_input(x):
        return []
    rows = []
    for d in range(len(shape(x))):
        step = carried(node, x, d)
        if step is not None:
            for out in pieces_of(node, step[0], tp):
                mine = scaled(out, d, step[1])
                if mine is not None:
                    rows.append(Follow(((x, mine),), out))
            continue
        picks = _picked(node, x, d)
        for have in pieces_of(x, d, tp) if picks else ():
            rows += _picker_rows(node, x, d, have, picks)
    return rows


def _is_input(value: Node) -> bool:
    return value.op in ("placeholder", "get_attr") and ROLE.get(value, None) != "parameter"


def _picker_rows(node: Node, x: Node, d: int, have: PlanShard, picks: list) -> list[Follow]:
    """A picker reading ``have``: each picked piece ``PlanShard(d)`` if split, R if whole."""
    starts = [sum(have.pieces[:j]) for j in range(len(have.pieces) + 1)]
    outputs = []
    for a, b in picks:  # the pieces are in x's units, as the picks are
        j = next((j for j in range(len(have.pieces)) if (starts[j], starts[j + 1]) == (a, b)), None)
        if j is None:
            return []
        outputs.append(R if j in have.whole else PlanShard(d))
    if op_packet(node) is aten.index:
        return [Follow(((x, have), (node.args[1][d], R)), outputs[0])]
    return [Follow(((x, have),), tuple(outputs) if isinstance(info(node), tuple) else outputs[0])]


def asked_pieces(node: Node, tp: int, asked_of) -> list[Follow]:
    """For a carrier (``W.T``): the pieces shards its readers ask of its output (``asked_of(node, tp)``),
    mapped to its input."""
    x = first_tensor(node) if node.args else None
    if not isinstance(x, Node) or op_packet(node) not in _CARRIERS:
        return []
    rows = []
    for out in asked_of(node, tp):
        for d in range(len(shape(x))):
            step = carried(node, x, d)
            if step is not None and step[0] == out.dim:
                mine = scaled(out, d, step[1])
                if mine is not None:
                    rows.append(Follow(((x, mine),), out))
    return rows
