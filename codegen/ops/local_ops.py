"""Small functions the per-rank programs call besides the collectives: the layout changes that are
not one collective of ``collectives.py`` (chunked shards, Replicate -> Partial) and local sizes.

They are plain module-level functions so the emitted code names them
(``xirang_codegen_local_ops_partial_from_replicate(...)``) instead of hiding closures.
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang.codegen.ops.collectives import gather_from_group, group_size, scatter_to_group
from xirang.codegen.ops.comm_counter import CommCounter


class _KeepOnFirstRank(torch.autograd.Function):
    """Forward: the tensor on tp rank 0, zeros elsewhere, so the sum over the axis is the tensor
    once. Backward: identity: the gradient of a Partial(sum) value is the same R gradient on every
    rank, and d(sum_r mask_r * x)/dx summed over the masks is that gradient exactly once."""

    @staticmethod
    def forward(ctx, x, keep):
        return x.view_as(x) if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def partial_from_replicate(x: torch.Tensor, keep: bool) -> torch.Tensor:
    """R -> Partial(sum) on the tp axis: ``keep`` is True on tp rank 0 only (a row-parallel bias is
    added once in the sum). No communication either way."""
    return _KeepOnFirstRank.apply(x, keep)


def _pieces_view(shape: tuple, dim: int, outer: int, inner: int) -> tuple:
    """``shape`` with dim ``dim`` split into (outer, inner, rest)."""
    rest = shape[dim] // (outer * inner)
    return tuple(shape[:dim]) + (outer, inner, rest) + tuple(shape[dim + 1:])


def gather_chunks(x: torch.Tensor, group, dim: int, chunks: int, *,
                  counter: Optional[CommCounter] = None) -> torch.Tensor:
    """Shard(dim, chunks) -> R: all-gather, then reorder [rank][piece] blocks to [piece][rank]
    (each rank holds its slice of every piece of a fused [q | k | v], see ir/placement.Shard)."""
    tp = group_size(group)
    full = gather_from_group(x, group, dim, counter=counter)
    if tp == 1:
        return full
    blocks = full.reshape(_pieces_view(tuple(full.shape), dim, tp, chunks))
    return blocks.transpose(dim, dim + 1).reshape(full.shape)


def scatter_chunks(x: torch.Tensor, group, dim: int, chunks: int, *,
                   counter: Optional[CommCounter] = None) -> torch.Tensor:
    """R -> Shard(dim, chunks): reorder [piece][rank] blocks to [rank][piece], keep this rank's."""
    tp = group_size(group)
    if tp == 1:
        return x
    blocks = x.reshape(_pieces_view(tuple(x.shape), dim, chunks, tp))
    return scatter_to_group(blocks.transpose(dim, dim + 1).reshape(x.shape), group, dim, counter=counter)


def local_size(full: int, tp: int) -> int:
    """One rank's share of a dim of ``full`` elements split over ``tp`` ranks (ceil, as
    ir/placement.local_shape): for sizes known only at run time (a batch or seq SymInt)."""
    return -(-full // tp)


def cast_like(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``tensor`` in ``reference``'s dtype: a model's cast back to the dtype its input had
    (passes/lowering/precision.py), a no-op when they agree."""
    return tensor.to(reference.dtype)


def unify_float_dtypes(tensors: tuple, dtype: torch.dtype) -> tuple:
    """``tensors`` unchanged if their floating members share a dtype, else each floating one cast to
    ``dtype`` (integers, booleans and non-tensors pass through: a boolean attention mask stays one)."""
    floating = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(floating) <= 1:
        return tuple(tensors)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def zero_padding(x: torch.Tensor, dim: int, real: int) -> torch.Tensor:
    """``x`` with its elements past ``real`` along ``dim`` (a padded shard's padding) zeroed: a contraction
    over the dim then adds nothing from them and sends them a zero gradient (sharding_rules_padded)."""
    tail = list(x.shape)
    tail[dim] -= real
    return torch.cat([x.narrow(dim, 0, real), x.new_zeros(tail)], dim=dim)
