"""The ops a state-space layer (Mamba's mixer, in Hugging Face's sequential path) traces to beside
products and pointwise ops: its depthwise convolution, the scan's initial state and the stacking of
its per-step outputs. Each channel of a Mamba mixer is independent from ``in_proj`` to ``out_proj``
(Gu & Dao 2023, sec. 3: the selective scan runs per channel, B and C shared), so the mixer splits by
channel as attention splits by head: ``in_proj`` column-parallel (its ``[x | z]`` chunked), the
convolution and the scan on each rank's channels, ``x_proj`` row-parallel (B, C and dt's rank summed
once), ``dt_proj`` column-parallel, ``out_proj`` row-parallel.

- ``conv1d(x[b, c, s], w[c_out, c/groups, k], bias, stride, padding, dilation, groups)``: depthwise
  (groups = c = c_out): each channel its own filter, so x S(1), w S(0), bias S(0) -> out S(1); the
  lowering makes ``groups`` local (passes/lowering/local_sizes.py). Any convolution splits its batch.
- ``stack(tensors, dim)``: every input sharded on the same dim; that dim moves past the new one.
- ``zeros(size)``: a tensor of zeros is every layout at once, so it may be
  made already split on any dim tp divides (the scan's initial state, split by channel).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from xirang.ir.placement import PlanShard
from xirang.passes.analysis.saved_storages import arg
from xirang.passes.planning.sharding_rules_views import (R, SUM, Follow, floating, is_tensor, norm_dim, shape,
                                                         shardable)

aten = torch.ops.aten


def _conv1d(node: Node, tp: int) -> list[Follow]:
    """conv1d: the batch split always; the channel split when depthwise (module docstring)."""
    x, w = node.args[0], node.args[1]
    bias = arg(node, 2, "bias")
    bias = bias if is_tensor(bias) else None
    groups = arg(node, 6, "groups", 1)
    rows = []
    if shardable(shape(x)[:1], tp):
        rows.append(Follow(((x, PlanShard(0)), (w, R)) + (((bias, R),) if bias is not None else ()), PlanShard(0)))
    channels, out_channels = shape(x)[1], shape(w)[0]
    if groups == channels == out_channels and shardable((channels,), tp):
        rows.append(Follow(((x, PlanShard(1)), (w, PlanShard(0))) + (((bias, PlanShard(0)),) if bias is not None
                                                                     else ()), PlanShard(1)))
    return rows


def _stack(node: Node, tp: int) -> list[Follow]:
    """stack: the inputs share a split dim d; the output holds it at d, or d + 1 past the new dim."""
    parts = [t for t in node.args[0] if is_tensor(t)]
    if not parts or len(parts) != len(node.args[0]):
        return []
    ndim = len(shape(parts[0]))
    dim = norm_dim(arg(node, 1, "dim", 0), ndim + 1)
    rows = [Follow(tuple((t, PlanShard(d)) for t in parts), PlanShard(d if d < dim else d + 1))
            for d in shardable(shape(parts[0]), tp)]
    return rows + [Follow(tuple((t, SUM) for t in parts), SUM)] if floating(node) else rows


def _zeros(node: Node, tp: int) -> list[Follow]:
    """zeros: made split on any dim tp divides; it reads no tensor."""
    return [Follow((), PlanShard(d)) for d in shardable(shape(node), tp)]


STATE_SPACE_RULES: dict[object, Callable[[Node, int], list[Follow]]] = {
    aten.conv1d: _conv1d,
    aten.stack: _stack,
    aten.zeros: _zeros,
}
