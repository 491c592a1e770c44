"""Constant sizes in a rank's program: a view to ``[b, s, 4, 16]`` of a tensor whose heads dim is
split over tp = 2 must ask for ``[b, s, 2, 16]`` on every rank.

The traced graph spells sizes as ints or as ``sym_size`` nodes; a rank runs on local tensors, so
every size of a dim its output (or, for splits, its input) holds sharded is replaced by the local
size ``ceil(n / tp)`` (ir/placement.local_shape), in whole units where the shard keeps units (heads) whole
(``shard_share``: 96 = 6 heads of 16 on tp 4 is 32 a rank). Sizes read from a tensor at run time
(``sym_size`` of a replicated input) are wrapped in ``local_size`` when they size a sharded dim.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Node

from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard, pieces_local_size, shard_share

aten = torch.ops.aten

# op -> position of its size list, read against the output's placement
SIZE_LIST_ARG = {aten.view: 1, aten._unsafe_view: 1, aten.reshape: 1, aten.expand: 1, aten.broadcast_to: 1,
                 aten.new_zeros: 1, aten.new_ones: 1, aten.new_empty: 1, aten.new_full: 1,
                 aten.zeros: 0, aten.ones: 0, aten.empty: 0, aten.full: 0}
SPLIT_OPS = (aten.split, aten.split_with_sizes)
UNBOUNDED = 2**63 - 1  # slice(x, dim, 0, UNBOUNDED): the whole dim


def _packet(node: Node):
    return getattr(node.target, "overloadpacket", None)


def localise_sizes(node: Node, args: tuple, output: object, first_input: object, tp: int,
                   sym_local: Callable[[Node], Node]) -> tuple:
    """``args`` of ``node`` with every size on a sharded dim made local.

    ``output`` / ``first_input`` are the tp placements of the node's output (first element for a
    multi-output op) and of its first tensor argument; ``sym_local(n)`` returns a graph node
    computing ``local_size(n, tp)`` for a run-time size ``n``.
    """
    if tp == 1:
        return args
    packet = _packet(node)
    if packet in SIZE_LIST_ARG and isinstance(output, PlanShard):
        position = SIZE_LIST_ARG[packet]
        sizes = list(args[position])
        if output.pieces:  # a fused projection's pieces: this rank's slices and whole pieces
            sizes[output.dim] = sizes[output.dim] if sizes[output.dim] == -1 else pieces_local_size(output, tp)
        else:
            sizes[output.dim] = _local(sizes[output.dim], tp, sym_local, node, output.unit)
        return args[:position] + (sizes,) + args[position + 1:]
    if packet in SPLIT_OPS and isinstance(first_input, PlanShard):
        dim = args[2] if len(args) > 2 else 0
        if dim % len(_full_shape(node.args[0])) == first_input.dim:
            sizes = args[1]
            local = ([_local(s, tp, sym_local, node) for s in sizes] if isinstance(sizes, (list, tuple))
                     else _local(sizes, tp, sym_local, node))
            return args[:1] + (local,) + args[2:]
    if packet is aten.conv1d and isinstance(output, PlanShard) and output.dim == 1 and len(args) > 6 and args[6] != 1:
        return args[:6] + (_local(args[6], tp, sym_local, node),) + args[7:]  # depthwise: groups = local channels
    if packet is aten.slice and isinstance(first_input, PlanShard):
        dim = args[1] if len(args) > 1 else 0
        if dim % len(_full_shape(node.args[0])) == first_input.dim:
            return _local_full_slice(node, args, tp)
    return args


def _local(size, tp: int, sym_local, node: Node, unit: int = 1):
    if size == -1:
        return size  # inferred from the (already local) element count
    if isinstance(size, Node):
        return sym_local(size)
    if isinstance(size, int):
        return shard_share(size, tp, unit)  # whole units (heads) where the split keeps them whole
    raise XirangError(f"cannot make the size {size!r} of {node.name} local to a tp rank",
                      where=f"node {node.name} ({node.target})",
                      hint="report this op; as a workaround pin tp=1 or keep this op replicated")


def _full_shape(value) -> tuple:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _local_full_slice(node: Node, args: tuple, tp: int) -> tuple:
    """A slice of a sharded dim is offered only when it keeps the whole dim (sharding_rules_views):
    its end becomes unbounded so it keeps the whole local dim."""
    start = args[2] if len(args) > 2 else 0
    if start not in (0, None):
        raise XirangError(f"{node.name} slices a dim that is split over tp from {start}",
                          where=f"node {node.name} ({node.target})",
                          hint="re-plan: the plan should keep this slice on an unsplit dim")
    return args[:2] + (0, UNBOUNDED) + args[4:]


def output_placement(outputs: tuple) -> Optional[object]:
    """The placement that sizes a node's output: its first output's (all elements of a split agree)."""
    return outputs[0].tp if outputs else None
