"""Lowering of padded shards (planned by passes/planning/sharding_rules_padded.py) at the contraction
that ends them: a row-parallel ``linear`` whose contracted dim is padded on this tp rank reads its input
through ``zero_padding``, so the padding adds nothing to the partial sum whatever it holds, the padded
weight columns get a zero gradient (they stay zero), and the padding upstream gets a zero gradient back.

Ranks with no padding in that dim read the input as it is, so an even split's program is unchanged. Sizes
on padded dims are made local by ``local_sizes`` and conversions by ``rewrite_tp`` (``unit``).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from xirang.codegen.ops import local_ops
from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import INSERTED, REQUIRES_GRAD, TENSOR
from xirang.ir.placement import PlanShard, real_share, shard_share

aten = torch.ops.aten


def zero_contracted_padding(rewriter, node: Node, args: tuple, strategy) -> tuple:
    """``args`` of ``node``, its input read through ``zero_padding`` where it is a linear contracting a
    dim padded on this rank."""
    if node.target is not aten.linear.default or rewriter.tp_size == 1:
        return args
    x = node.args[0]
    have = dict(zip(node.all_input_nodes, (layout.tp for layout in strategy.inputs))).get(x)
    ndim = len(x.meta["val"].shape)
    if not isinstance(have, PlanShard) or not have.plain_cut or have.dim != ndim - 1:
        return args
    n = int(x.meta["val"].shape[have.dim])
    real = real_share(n, rewriter.tp_size, rewriter.tp_rank, have.unit)
    if real == shard_share(n, rewriter.tp_size, have.unit):
        return args
    masked = rewriter.call(local_ops.zero_padding, (args[0], have.dim, real))
    info = TENSOR.get(args[0], None)
    if isinstance(info, TensorInfo):
        TENSOR.set(masked, info)
    REQUIRES_GRAD.set(masked, bool(REQUIRES_GRAD.get(x, False)))
    INSERTED.set(masked, f"tp: {x.name}'s padding zeroed before {node.name} sums over it")
    return (masked,) + tuple(args[1:])
