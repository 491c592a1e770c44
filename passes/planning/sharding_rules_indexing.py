"""Ops that pick along one dim and leave the others whole, and in-place adds a model leaves in its trace:
a shard of an untouched dim follows them (placement algebra on shapes, as in ``sharding_rules_views``).

- ``select(x, dim, i)`` drops ``dim``: a shard of any other dim follows, renumbered past it.
- ``index(x, [None, ..., idx])``: one index tensor at position k (Falcon's ``qkv[..., [-2], :]``), the
  dims before it untouched; the result holds idx's dims in place of dim k. A shard of any other dim
  follows; the index tensor is read whole. Several index tensors (advanced indexing that broadcasts
  them together and may move the result's dims to the front) are left replicated.
- ``add_(a, b)``: Falcon's parallel block sums its branches in place (``mlp_output += attention_output``).
  It is an ``add`` when nobody else reads ``a``, since then no one sees ``a`` change; otherwise it is
  left replicated, so a reader of the old value never gets a resharded copy that missed the update.

Index and select are linear in ``x``, so a Partial(sum) passes them; the indices themselves stay whole.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from xirang.ir.placement import PlanShard
from xirang.passes.planning.sharding_rules_views import (FOLLOW_RULES, R, SUM, Follow, floating, norm_dim, shape,
                                                         shardable)

aten = torch.ops.aten

_ADD = FOLLOW_RULES[aten.add]  # add_ is add where it applies


def _select(node: Node, tp: int) -> list[Follow]:
    """select(x, dim, index): any dim but ``dim``; the output has one dim fewer."""
    x = node.args[0]
    dim = norm_dim(node.args[1], len(shape(x)))
    rows = [Follow(((x, PlanShard(d)),), PlanShard(d if d < dim else d - 1))
            for d in shardable(shape(x), tp) if d != dim]
    return rows + [Follow(((x, SUM),), SUM)] if floating(x) and floating(node) else rows


def _index(node: Node, tp: int) -> list[Follow]:
    """index(x, indices) with one index tensor at position k (module docstring)."""
    x, indices = node.args[0], list(node.args[1])
    picked = [k for k, idx in enumerate(indices) if idx is not None]
    if len(picked) != 1 or not isinstance(indices[picked[0]], Node):
        return []
    k, idx = picked[0], indices[picked[0]]
    grown = len(shape(idx)) - 1  # dims the index tensor puts in place of dim k, less the one it replaces
    rows = [Follow(((x, PlanShard(d)), (idx, R)), PlanShard(d if d < k else d + grown))
            for d in shardable(shape(x), tp) if d != k]
    return rows + [Follow(((x, SUM), (idx, R)), SUM)] if floating(x) and floating(node) else rows


def _add_in_place(node: Node, tp: int) -> list[Follow]:
    """add_(a, b) as add(a, b) when this op is the only reader of ``a`` (module docstring)."""
    target = node.args[0]
    if not isinstance(target, Node) or len(target.users) != 1:
        return []
    return _ADD(node, tp)


INDEXING_RULES: dict[object, Callable[[Node, int], list[Follow]]] = {
    aten.select: _select,
    aten.index: _index,
    aten.add_: _add_in_place,
}
