"""Fused projections: the chunked shard ``PlanShard(dim, chunks=k)`` where a column-parallel output is later
split into k equal pieces (GPT-2's ``c_attn`` and the in-repo GPT's ``qkv``: one matmul makes
``[q | k | v]``, then ``split`` along the last dim).

A contiguous shard of ``[q | k | v]`` gives rank 0 all of q, not a head of each, so the split cannot
follow it. Megatron instead lays the fused weight out so that each rank holds its slice of every
piece (Shoeybi et al. 2019, sec. 3); that is the chunked shard. The rules here offer it only where
it leads somewhere:

- ``fused_chunks(node, dim, tp)`` walks forward from a node's output dim through ops that carry a
  shard of that dim unchanged (views and reshapes, transposes, copies, elementwise ops) and returns
  the piece counts k of the equal splits of that dim it reaches, where tp divides every piece.
- A producer (column-parallel linear/addmm/mm, see ``sharding_rules``) and every carrying op on the
  way offer their plain shard rows again with ``chunks=k`` (``chunked_follows``): for these ops a
  chunked shard maps exactly as a plain one does once tp·k divides each sharded dim (a rank's slice
  of piece c is then a contiguous run inside piece c on both sides of a reshape).
- The split itself turns ``PlanShard(dim, chunks=k)`` into ``PlanShard(dim)`` on each of its k pieces
  (``split_follows``). It is not offered when the split reads a placeholder: a parameter or input
  is only ever offered plain shards, so the row could never be chosen.

The vocabulary chain reuses the forward walk for end-padded shards (a vocabulary of 50257 on tp=8):
``reaches_vocab_loss`` says whether a dim flows, through ops that keep it a whole dim, into the
class dim of a cross-entropy, and ``padded_follows`` offers those ops the padded shard (below).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from xirang.ir.placement import PlanShard

from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.planning.sharding_rules_views import (COPY_OPS, LINEAR_ELEMENTWISE, PERMUTE_OPS, POINTWISE_OPS,
                                                         RESHAPE_OPS, SPLIT_OPS, Follow, R, divides, first_tensor,
                                                         info, is_tensor, norm_dim, padded, permutation_of,
                                                         remembered, reshape_groups, same, shape)

aten = torch.ops.aten

SEARCH_DEPTH = 6  # ops between a fused projection and its split (GPT-2: addmm -> view -> split)
_ELEMENTWISE = frozenset(LINEAR_ELEMENTWISE) | frozenset(POINTWISE_OPS)
_CARRIERS = frozenset(RESHAPE_OPS) | frozenset(PERMUTE_OPS) | frozenset(COPY_OPS) | _ELEMENTWISE


def _split_dim(node: Node) -> int:
    x = first_tensor(node)
    return norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(shape(x)))


def equal_pieces(node: Node, tp: int) -> int | None:
    """k when ``node`` splits its input into k > 1 equal pieces that tp divides, else None."""
    found = _pieces(node)
    return found[0] if found is not None and divides(tp, found[1]) else None


def _pieces(node: Node) -> tuple[int, object] | None:
    """(k, size of a piece) when ``node`` splits its input into k > 1 equal pieces, else None."""
    if op_packet(node) not in SPLIT_OPS or not isinstance(info(node), tuple):
        return None
    dim = _split_dim(node)
    sizes = {piece.shape[dim] for piece in info(node)}
    count = len(info(node))
    if count < 2 or len(sizes) != 1:
        return None
    return count, next(iter(sizes))


def carried_dim(user: Node, value: Node, dim: int) -> int | None:
    """The dim of ``user``'s output that holds dim ``dim`` of its input ``value`` unchanged, or None."""
    packet = op_packet(user)
    if packet not in _CARRIERS or not is_tensor(user):
        return None
    if packet in RESHAPE_OPS:
        return next((o for i, o in reshape_groups(shape(value), shape(user)) or () if i == dim), None)
    if packet in PERMUTE_OPS:
        perm = permutation_of(user)
        return perm.index(dim) if dim in perm else None
    if packet not in _ELEMENTWISE:  # copies, casts, dropout: same tensor
        return dim if first_tensor(user) is value else None
    out, mine = shape(user), shape(value)
    kept = dim + len(out) - len(mine)  # broadcasting aligns dims from the right
    if kept < 0 or (mine[dim] == 1 and out[kept] != 1):
        return None
    return kept


def fused_chunks(node: Node, dim: int, tp: int) -> tuple[int, ...]:
    """Piece counts k of the equal splits that dim ``dim`` of ``node``'s output reaches through
    carrying ops (at most ``SEARCH_DEPTH`` of them), in increasing order, where tp divides a piece."""
    return tuple(sorted({count for count, size in _reached_splits(node, dim) if divides(tp, size)}))


def _reached_splits(node: Node, dim: int) -> tuple[tuple[int, object], ...]:
    """(k, piece size) of every equal split along the dim that dim ``dim`` of ``node``'s output
    reaches (a split is no carrier, so the walk stops there whatever tp is): the same walk for
    every tp, so the split pricer's problems share it (``remembered``)."""
    def walk():
        found, frontier = [], [(node, dim)]
        for _ in range(SEARCH_DEPTH):
            reached = []
            for value, d in frontier:
                for user in value.users:
                    pieces = _pieces(user)
                    if pieces is not None and first_tensor(user) is value and _split_dim(user) == d:
                        found.append(pieces)
                        continue
                    kept = carried_dim(user, value, d)
                    if kept is not None:
                        reached.append((user, kept))
            if not reached:
                break
            frontier = reached
        return tuple(found)
    return remembered(("reached splits", node, dim), walk)


def _plain_shard(placement) -> bool:
    return isinstance(placement, PlanShard) and placement.chunks == 1


def chunked_follows(node: Node, tp: int, rows: list[Follow]) -> list[Follow]:
    """For a carrying op: each plain row whose output is ``PlanShard(d)`` again with ``chunks=k``, for the
    k that ``fused_chunks(node, d, tp)`` reaches, where tp·k divides every sharded dim."""
    if op_packet(node) not in _CARRIERS or isinstance(info(node), tuple):
        return []
    extra = []
    for row in rows:
        out = row.output
        if not _plain_shard(out) or not all(p == R or _plain_shard(p) for _, p in row.inputs):
            continue  # Partial rows, and rows already chunked
        for k in fused_chunks(node, out.dim, tp):
            sizes = [shape(v)[p.dim] for v, p in row.inputs if isinstance(p, PlanShard)] + [shape(node)[out.dim]]
            if all(divides(tp * k, n) for n in sizes):
                inputs = tuple((v, PlanShard(p.dim, k) if isinstance(p, PlanShard) else p) for v, p in row.inputs)
                extra.append(Follow(inputs, PlanShard(out.dim, k)))
    return extra


def split_follows(node: Node, tp: int) -> list[Follow]:
    """A split of a dim held as ``PlanShard(dim, chunks=k)`` into its k equal pieces: each piece ``PlanShard(dim)``."""
    pieces = equal_pieces(node, tp)
    x = first_tensor(node)
    if pieces is None or not isinstance(x, Node) or x.op in ("placeholder", "get_attr"):
        return []
    dim = _split_dim(node)
    return [Follow(((x, PlanShard(dim, pieces)),), (PlanShard(dim),) * pieces)]


# --- the vocabulary chain: end-padded shards ---------------------------------------------------------
#
# Padding is harmless only from the vocabulary's producer to its loss: a padded row of the embedding
# table is never looked up (its id is out of range), a padded row of the LM head weight is zero (shard_of
# pads with zeros, and its gradient stays zero), so the padded logit columns are zero, and the
# vocabulary-parallel cross-entropy counts them as -inf. In between, only ops that move whole class
# dims are allowed: views keeping the dim whole, transposes, copies and casts, slices of other dims.
# A softmax, norm, sum or elementwise op over the padded dim would read the padding, so their rules
# (which ask ``divides``) never accept it; a reshard off a padded shard strips or re-adds the padding.

_VOCAB_COPIES = frozenset(COPY_OPS) - {aten.dropout}  # dropout rescales: padded zeros stay, but keep it out


def vocab_carried_dim(user: Node, value: Node, dim: int) -> int | None:
    """The dim of ``user``'s output that holds dim ``dim`` of ``value`` as a whole dim, or None."""
    packet = op_packet(user)
    if not is_tensor(user) or isinstance(info(user), tuple) or first_tensor(user) is not value:
        return None
    if packet in RESHAPE_OPS:
        kept = next((o for i, o in reshape_groups(shape(value), shape(user)) or () if i == dim), None)
        return kept if kept is not None and same(shape(value)[dim], shape(user)[kept]) else None
    if packet in PERMUTE_OPS:
        perm = permutation_of(user)
        return perm.index(dim) if dim in perm else None
    if packet is aten.slice:
        sliced = norm_dim(user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0), len(shape(value)))
        return dim if sliced != dim or same(shape(value)[dim], shape(user)[dim]) else None
    return dim if packet in _VOCAB_COPIES else None


def _class_dim_of(user: Node, value: Node) -> int | None:
    """The class dim of a cross-entropy reading ``value`` as its logits, else None."""
    if op_packet(user) is not aten.cross_entropy_loss or not user.args or user.args[0] is not value:
        return None
    return 1 if len(shape(value)) >= 2 else 0


def reaches_vocab_loss(node: Node, dim: int, tp: int) -> bool:
    """True when dim ``dim`` of ``node``'s output reaches the class dim of a cross-entropy through
    ``vocab_carried_dim`` ops only (at most ``SEARCH_DEPTH`` of them, GPT-2: linear -> to -> view)."""
    frontier = [(node, dim)]
    for _ in range(SEARCH_DEPTH + 1):
        reached = []
        for value, d in frontier:
            for user in value.users:
                if _class_dim_of(user, value) == d:
                    return True
                kept = vocab_carried_dim(user, value, d)
                if kept is not None:
                    reached.append((user, kept))
        if not reached:
            return False
        frontier = reached
    return False


def padded_follows(node: Node, tp: int) -> list[Follow]:
    """For a vocabulary-carrying op: a padded shard of an input dim that tp does not divide, onto the
    output dim that holds it whole, where that dim reaches a cross-entropy's class dim."""
    x = first_tensor(node) if node.args or node.kwargs else None
    if not isinstance(x, Node) or not is_tensor(x) or isinstance(info(x), tuple):
        return []
    rows = []
    for d, size in enumerate(shape(x)):
        if not padded(tp, size):
            continue
        kept = vocab_carried_dim(node, x, d)
        if kept is not None and reaches_vocab_loss(node, kept, tp):
            rows.append(Follow(((x, PlanShard(d)),), PlanShard(kept)))
    return rows
