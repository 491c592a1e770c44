"""The run-time side of the pieces shard ``PlanShard(dim, pieces, whole)`` (ir/placement.py): a fused
projection of which each rank holds its slice of every split piece and all of every whole piece.

A whole piece is replicated, value and gradient: every tp rank holds it and its full gradient. Two
things follow, and these functions do them:

- converting to and from R moves only the split pieces (``gather_pieces``, ``scatter_pieces``); a
  whole piece is this rank's own copy, so its gradient flows back to it whole;
- the product that makes a pieces-sharded output from a replicated input (``x @ W_r.T``, W_r this
  rank's rows) must not hand each rank's whole-piece gradient to ``x``: summed over the tp ranks by
  Megatron's f, it would count tp times. ``pieces_product`` runs the product as usual and, for the
  replicated inputs' gradient only, keeps the whole pieces of the output gradient on tp rank 0 (the
  weight's whole rows still get their full gradient on every rank, so they stay equal).
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang.codegen.ops.collectives import gather_from_group, group_rank, group_size, scatter_to_group
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.ir.placement import PlanShard, piece_blocks


def gather_pieces(x: torch.Tensor, group, dim: int, pieces: tuple, whole: tuple, *,
                  counter: Optional[CommCounter] = None) -> torch.Tensor:
    """S(dim, pieces) -> R: every rank's slices of the split pieces, this rank's own whole pieces."""
    tp, placement = group_size(group), PlanShard(dim, pieces=tuple(pieces), whole=tuple(whole))
    gathered = gather_from_group(x, group, dim, counter=counter)  # [rank 0's local | rank 1's | ...]
    local, parts = x.shape[dim], []
    for _, length, at, is_whole in piece_blocks(placement, tp, group_rank(group)):
        if is_whole:
            parts.append(x.narrow(dim, at, length))  # its gradient arrives whole, as a replicated value's
        else:
            parts += [gathered.narrow(dim, r * local + at, length) for r in range(tp)]
    return torch.cat(parts, dim=dim)


def scatter_pieces(x: torch.Tensor, group, dim: int, pieces: tuple, whole: tuple, *,
                   counter: Optional[CommCounter] = None) -> torch.Tensor:
    """R -> S(dim, pieces): this rank's slice of each split piece (its gradient all-gathered back), each
    whole piece as it is."""
    parts, start = [], 0
    for j, n in enumerate(pieces):
        piece = x.narrow(dim, start, n)
        parts.append(piece if j in whole else scatter_to_group(piece, group, dim, counter=counter))
        start += n
    return torch.cat(parts, dim=dim)


def shift_index(index: torch.Tensor, full_size: int, shift: int) -> torch.Tensor:
    """An index into a dim of ``full_size`` as an index into this rank's pieces-sharded local dim: the
    picked piece starts ``shift`` elements earlier locally than in the full tensor."""
    return index % full_size + shift


class _PiecesProduct(torch.autograd.Function):
    """Forward: ``op(*args)``. Backward: the usual gradients, except that the replicated inputs' come
    from the output gradient with its whole pieces zeroed on every tp rank but 0 (module docstring)."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        op, template, kwargs, dim, blocks, replicated, keep = spec
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors]
            out = op(*_filled(template, leaves), **kwargs)
        ctx.out, ctx.leaves, ctx.dim, ctx.blocks, ctx.replicated, ctx.keep = out, leaves, dim, blocks, replicated, keep
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf.requires_grad and ctx.needs_input_grad[1 + i]]
        plain = [i for i in wanted if i not in ctx.replicated]
        masked = [i for i in wanted if i in ctx.replicated]
        grads = [None] * len(ctx.leaves)
        if plain:
            found = torch.autograd.grad(ctx.out, [ctx.leaves[i] for i in plain], grad, retain_graph=bool(masked))
            grads = _placed(grads, plain, found)
        if masked:
            once = grad
            if not ctx.keep:
                once = grad.clone()
                for at, length in ctx.blocks:
                    once.narrow(ctx.dim, at, length).zero_()
            grads = _placed(grads, masked, torch.autograd.grad(ctx.out, [ctx.leaves[i] for i in masked], once))
        ctx.out = ctx.leaves = None
        return (None, *grads)


def _placed(grads: list, positions: list, found) -> list:
    for i, g in zip(positions, found):
        grads[i] = g
    return grads


_SLOT = object()


def _filled(template: tuple, tensors: list) -> tuple:
    it = iter(tensors)
    return tuple(next(it) if a is _SLOT else a for a in template)


def pieces_product(op_name: str, args: tuple, kwargs: dict, dim: int, pieces: tuple, whole: tuple,
                   replicated: tuple, tp_rank: int, tp: int) -> torch.Tensor:
    """``op(*args, **kwargs)`` (``op_name`` such as "aten.linear.default") whose output is ``PlanShard(dim,
    pieces, whole)``; ``replicated``: positions in ``args`` of the inputs read whole (their gradient counts
    each whole piece once over the tp ranks)."""
    namespace, name, overload = op_name.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    placement = PlanShard(dim, pieces=tuple(pieces), whole=tuple(whole))
    blocks = tuple((at, length) for _, length, at, is_whole in piece_blocks(placement, tp, tp_rank) if is_whole)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    template = tuple(_SLOT if isinstance(a, torch.Tensor) else a for a in args)
    spec = (op, template, dict(kwargs), dim, blocks, tuple(slots.index(i) for i in replicated if i in slots),
            tp_rank == 0)
    return _PiecesProduct.apply(spec, *tensors)
