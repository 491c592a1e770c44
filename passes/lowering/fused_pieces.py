"""Lowering of the pieces shard ``PlanShard(dim, pieces, whole)`` (planned by
passes/planning/sharding_rules_pieces.py, run by codegen/ops/fused_pieces.py) in a tp rank's program:

- a pick along a pieces-sharded dim reads this rank's block of the piece it picks: a ``slice``'s bounds
  and a ``split_with_sizes``' sizes become local, an ``index`` reads through ``shift_index``;
- a product whose output is pieces-sharded with whole pieces runs as ``pieces_product``, so its
  replicated input's gradient counts a whole piece once over the tp ranks;
- a conversion to or from R is ``gather_pieces`` / ``scatter_pieces``; any other goes through R.

A view's size on a pieces-sharded dim is made local by ``local_sizes`` (``pieces_local_size``).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from xirang.codegen.ops import fused_pieces
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate, PlanShard, piece_blocks
from xirang.passes.analysis.op_tables import op_packet

aten = torch.ops.aten
R = PlanReplicate()


def _has_pieces(placement) -> bool:
    return isinstance(placement, PlanShard) and bool(placement.pieces)


def _block_of(node: Node, placement: PlanShard, start: int, stop: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """(local start, length) of the piece that is exactly [start, stop) of the full dim."""
    bounds = [sum(placement.pieces[:j]) for j in range(len(placement.pieces) + 1)]
    for j, (_, length, at, _) in enumerate(piece_blocks(placement, tp, tp_rank)):
        if (bounds[j], bounds[j + 1]) == (start, stop):
            return at, length
    raise XirangError(f"{node.name} picks [{start}, {stop}) of a dim held as {placement}, which is not one of its "
                      f"pieces", where=f"node {node.name} ({node.target})",
                      hint="re-plan this model: the plan was made for another graph")


def _dim(value: int, ndim: int) -> int:
    return value % ndim if ndim else 0


def pieces_call(rewriter, node: Node, args: tuple, kwargs: dict, strategy) -> Node | None:
    """The rank's node for ``node`` when it picks along, or makes, a pieces-sharded dim; None otherwise."""
    tp, tp_rank = rewriter.tp_size, rewriter.tp_rank
    if tp == 1:
        return None
    layouts = dict(zip(node.all_input_nodes, (layout.tp for layout in strategy.inputs)))
    first = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    have = layouts.get(first)
    packet = op_packet(node)
    if _has_pieces(have):
        ndim = len(first.meta["val"].shape)
        full = sum(have.pieces)
        if packet is aten.slice and _dim(args[1], ndim) == have.dim:
            start, stop = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else full)
            start, stop = (max(0, min(full, b + full if b < 0 else b)) for b in (start, stop))
            at, length = _block_of(node, have, start, stop, tp, tp_rank)
            return _same(rewriter, node, args[:2] + (at, at + length) + args[4:], kwargs)
        if packet is aten.split_with_sizes and _dim(args[2] if len(args) > 2 else 0, ndim) == have.dim:
            bounds = [sum(args[1][:k]) for k in range(len(args[1]) + 1)]
            lengths = [_block_of(node, have, a, b, tp, tp_rank)[1] for a, b in zip(bounds, bounds[1:])]
            return _same(rewriter, node, (args[0], lengths) + args[2:], kwargs)
        if packet is aten.index and len(args[1]) > have.dim and args[1][have.dim] is not None:
            picked = node.args[1][have.dim].meta["val"]
            known = _constant(node.args[1][have.dim])
            start = int(known[0]) % full
            at, _ = _block_of(node, have, start, start + picked.shape[0], tp, tp_rank)
            shifted = rewriter.call(fused_pieces.shift_index, (args[1][have.dim], full, at - start))
            indices = list(args[1])
            indices[have.dim] = shifted
            return _same(rewriter, node, (args[0], indices) + args[2:], kwargs)
    out = strategy.outputs[0].tp if strategy.outputs else R
    if _has_pieces(out) and out.whole and packet in (aten.linear, aten.mm, aten.matmul, aten.addmm):
        replicated = tuple(i for i, a in enumerate(node.args) if isinstance(a, Node) and layouts.get(a) == R)
        return rewriter.graph.create_node(
            "call_function", fused_pieces.pieces_product,
            (str(node.target), args, kwargs, out.dim, out.pieces, out.whole, replicated, tp_rank, tp), {},
            name=node.name)
    return None


def _constant(index: Node):
    from xirang.ir.meta_keys import CONSTANT_VALUE
    value = CONSTANT_VALUE.get(index, None)
    if not isinstance(value, torch.Tensor) or value.is_meta:
        raise XirangError(f"{index.name} indexes a pieces-sharded dim with values this trace does not know",
                          where=f"node {index.name}", hint="plan this model from a trace with real constants "
                                                           "(built on cpu), or re-plan it")
    return value


def _same(rewriter, node: Node, args: tuple, kwargs: dict) -> Node:
    return rewriter.graph.create_node("call_function", node.target, args, kwargs, name=node.name)


def convert_pieces(rewriter, value: Node, x: Node, have, wanted) -> Node:
    """``x`` (``value`` held as ``have``) as ``wanted`` when either is a pieces shard."""
    group = rewriter.attr("tp_group")
    if _has_pieces(have) and wanted == R:
        return rewriter.call(fused_pieces.gather_pieces, (x, group, have.dim, have.pieces, have.whole), rewriter.comm())
    if have == R and _has_pieces(wanted):
        return rewriter.call(fused_pieces.scatter_pieces, (x, group, wanted.dim, wanted.pieces, wanted.whole),
                             rewriter.comm())
    return rewriter._convert(value, rewriter.reshard(value, R), R, wanted)  # through R
