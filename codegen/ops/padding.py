"""Cut a full tensor into one rank's local tensor under a placement, and glue the locals back.

These are the single-process halves of a sharded layout: ``shard_of`` is what loading a full
checkpoint into a rank does, ``unshard`` what ``full_state_dict`` does with every rank's local
tensor once gathered. Neither communicates.

Uneven dims follow ``xirang.ir.placement.local_shape``: a dim of n elements on k ranks is held as
ceil(n / k) per rank, zero-padded at its end, so every rank has the same shape (static shapes for
collectives and send/recv). The vocabulary is the usual case: GPT-2's 50257 rows on 8 ranks are
6283 per rank, the last rank holding 6276 real rows and 7 padding rows.

``PlanShard(dim, chunks)`` with chunks > 1 is Megatron's fused ``[q | k | v]`` layout (Shoeybi et al.
2019, sec. 3): the dim is ``chunks`` equal pieces, each split across the ranks, and a rank holds
its slice of every piece, concatenated. Padding applies per piece, so an uneven piece keeps its
padding next to its own rows instead of pushing the next piece's rows onto the wrong rank.

``PlanShard(dim, unit=u)`` splits in whole units of u elements (heads): ``ir/placement.shard_share``
elements a rank, rank r holding ``[r * share, (r + 1) * share)`` of the end-padded dim.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanPartial, Placement, PlanReplicate, PlanShard, piece_blocks, shard_share


def pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad dim ``dim`` of ``t`` at its end up to a multiple of ``multiple`` (``t`` if none)."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise XirangError(f"pad_dim: multiple must be a positive int, got {multiple!r}",
                          where=f"pad_dim(shape {tuple(t.shape)}, dim {dim})",
                          hint="pass the number of ranks (or ranks x chunks) the dim is split into")
    dim = _norm_dim(t, dim, "pad_dim")
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]  # F.pad lists dims last-first
    return F.pad(t, pad)


def shard_of(full: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    """The local tensor rank ``rank`` of ``size`` ranks holds when ``full`` is laid out so.

    Shard: this rank's padded slice of every piece, concatenated (a copy, contiguous).
    Replicate: ``full`` itself. Partial: a set of locals whose reduction is ``full`` — for
    "sum" rank 0 holds ``full`` and the others zeros; for "avg", "max" and "min" every rank
    holds ``full``.
    """
    _check_rank(rank, size, "shard_of")
    if isinstance(placement, PlanReplicate):
        return full
    if isinstance(placement, PlanPartial):
        if placement.op == "sum" and rank != 0:
            return torch.zeros_like(full)
        return full
    dim = _shard_dim(full, placement, "shard_of")
    if placement.pieces:  # a fused projection's pieces: this rank's slice of each split one, each whole one
        _check_sized(full.shape[dim], placement, size, f"shard_of(shape {tuple(full.shape)}, {placement})")
        blocks = piece_blocks(placement, size, rank)
        return torch.cat([full.narrow(dim, start, length) for start, length, _, _ in blocks], dim=dim)
    _check_pieces(full.shape[dim], placement, f"shard_of(shape {tuple(full.shape)}, {placement})")
    piece_size = full.shape[dim] // placement.chunks
    per_rank = shard_share(piece_size, size, placement.unit)  # ceiling split of one piece, as local_shape does
    local = []
    for j in range(placement.chunks):  # this rank's rows of each piece, padded alone (never the whole piece)
        start, stop = (min(piece_size, r * per_rank) for r in (rank, rank + 1))
        part = full.narrow(dim, j * piece_size + start, stop - start)
        if stop - start < per_rank:
            part = F.pad(part, [0, 0] * (full.dim() - 1 - dim) + [0, per_rank - (stop - start)])
        local.append(part)
    return torch.cat(local, dim=dim)  # cat copies even one piece: no aliasing of ``full``


def unshard(locals_: Sequence[torch.Tensor], placement: Placement,
            full_size: Optional[int] = None) -> torch.Tensor:
    """The full tensor from every rank's local tensor, in rank order; inverse of ``shard_of``.

    ``full_size`` is the true length of the sharded dim (padding is stripped to it); it is
    required for Shard and ignored otherwise. Partial locals are reduced with the placement's op.
    """
    where = f"unshard({len(locals_)} locals, {placement})"
    if not locals_:
        raise XirangError("unshard: no local tensors were given", where=where,
                          hint="pass every rank's local tensor, in rank order")
    shapes = {tuple(t.shape) for t in locals_}
    if len(shapes) != 1:
        raise XirangError(f"unshard: the locals have different shapes {sorted(shapes)}",
                          where=where, hint="every rank of a mesh axis holds the same local "
                                            "shape (uneven dims are padded); pass them unchanged")
    if isinstance(placement, PlanReplicate):
        return locals_[0]
    if isinstance(placement, PlanPartial):
        return _reduce(list(locals_), placement.op)
    size, first = len(locals_), locals_[0]
    dim = _shard_dim(first, placement, "unshard")
    if isinstance(full_size, bool) or not isinstance(full_size, int) or full_size < 0:
        raise XirangError(f"unshard: full_size must be the true length of dim {dim}, got "
                          f"{full_size!r}", where=where,
                          hint="pass the unpadded size of the sharded dim (e.g. the vocabulary)")
    if placement.pieces:  # each split piece from every rank in rank order, each whole piece from rank 0
        _check_sized(full_size, placement, size, where)
        parts = []
        for _, length, local, whole in piece_blocks(placement, size, 0):  # local offsets agree on every rank
            parts += [t.narrow(dim, local, length) for t in (locals_[:1] if whole else locals_)]
        return torch.cat(parts, dim=dim)
    _check_pieces(full_size, placement, where)
    piece_size = full_size // placement.chunks
    per_rank = shard_share(piece_size, size, placement.unit)  # ceiling split of one piece, as local_shape does
    if first.shape[dim] != placement.chunks * per_rank:
        raise XirangError(
            f"unshard: a dim of {full_size} in {placement.chunks} piece(s) on {size} ranks is "
            f"held as {placement.chunks} x ceil({piece_size}/{size}){_units(placement)} = "
            f"{placement.chunks * per_rank} per rank, but the locals have {first.shape[dim]} "
            f"along dim {dim}", where=where,
            hint="pass the full size of the sharded dim and every rank's local tensor")
    # Piece j of the full tensor is piece j of every rank's local, in rank order, unpadded.
    per_local = [t.split(per_rank, dim=dim) for t in locals_]
    pieces = [torch.cat([parts[j] for parts in per_local], dim=dim).narrow(dim, 0, piece_size)
              for j in range(placement.chunks)]
    return torch.cat(pieces, dim=dim)


def _units(placement: PlanShard) -> str:
    return f" units of {placement.unit}" if placement.unit > 1 else ""


def _reduce(tensors: list, op: str) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _norm_dim(t: torch.Tensor, dim: int, name: str) -> int:
    if not -t.dim() <= dim < t.dim():
        raise XirangError(f"{name}: dim {dim} is out of range for a tensor of shape "
                          f"{tuple(t.shape)}", where=name,
                          hint=f"use a dim in {-t.dim()}..{t.dim() - 1}; a 0-dim tensor cannot "
                               f"be split, reshape it to 1-d")
    return dim % t.dim()


def _shard_dim(t: torch.Tensor, placement: Placement, name: str) -> int:
    if not isinstance(placement, PlanShard):
        raise XirangError(f"{name}: not a placement: {placement!r}", where=name,
                          hint="pass PlanShard(dim[, chunks]), PlanReplicate() or PlanPartial(op)")
    if placement.dim >= t.dim():
        raise XirangError(f"{name}: {placement} is out of range for a tensor of shape "
                          f"{tuple(t.shape)}", where=name,
                          hint="use the placement planned for this tensor (dims count from 0)")
    return placement.dim


def _check_pieces(n: int, placement: PlanShard, where: str) -> None:
    if n % placement.chunks:
        raise XirangError(f"a dim of {n} elements cannot be cut into {placement.chunks} equal "
                          f"pieces for {placement}", where=where,
                          hint="chunks is the number of fused pieces (3 for [q | k | v]); the "
                               "dim must be a multiple of it")


def _check_rank(rank: int, size: int, name: str) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise XirangError(f"{name}: size must be a positive int, got {size!r}", where=name,
                          hint="pass the number of ranks on the mesh axis")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise XirangError(f"{name}: rank {rank!r} is not in 0..{size - 1}", where=name,
                          hint="pass this rank's index along the mesh axis (axis_index), not its "
                               "global rank")


def _check_sized(full_size: int, placement: PlanShard, size: int, where: str) -> None:
    """A pieces layout covers the whole dim and splits each of its split pieces evenly (no padding)."""
    split = [n for j, n in enumerate(placement.pieces) if j not in placement.whole]
    if sum(placement.pieces) != full_size or any(n % size for n in split):
        raise XirangError(f"{placement} does not lay out a dim of {full_size} on {size} ranks: its pieces sum to "
                          f"{sum(placement.pieces)} and each split piece must be a multiple of {size}",
                          where=where, hint="re-plan this model: the plan was made for another shape or tp")
