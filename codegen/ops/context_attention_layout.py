"""Where each token of a sequence lives under context parallelism: the load-balanced chunk layout.

Causal attention's work grows along the sequence (token i attends i + 1 keys), so cutting a sequence into
cp contiguous pieces gives the last rank cp times the first one's work. Megatron-Core and
TransformerEngine cut it instead into 2·cp equal chunks and give rank r the chunks r and 2·cp−1−r: each
rank then holds one early and one late chunk and the causal work per rank is equal (for cp = 2:
rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2). A rank's local sequence is its two chunks
concatenated, first chunk r, then chunk 2·cp−1−r; the ring and all-to-all attention
(``context_attention_ring.py``, ``context_attention_ulysses.py``) both take q, k and v in this layout, so
the rest of the model does not depend on the method.

Positions (rotary, learned) are those of the full sequence: ``sequence_positions`` gives the global
position of each local token, which a model must use in place of ``arange(local length)``. ALiBi, a bias in
the attention mask, is not run under cp: the lowering refuses a mask that is not causal, a causal window
or padding (passes/lowering/context_parallel.py).

``group`` is a process group of the cp axis, or None for one rank (the layout is then the sequence
itself, in order).
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang.codegen.ops.collectives import gather_from_group, group_rank, group_size
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.ir.errors import InvalidValue


def chunks_of_rank(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) rank ``rank`` of a cp group holds, in local order."""
    return rank, 2 * cp - 1 - rank


def chunk_length(seq_len: int, cp: int, where: str) -> int:
    """Length of one of the 2·cp chunks of a full sequence of ``seq_len`` tokens; refuses uneven cuts."""
    if seq_len % (2 * cp):
        raise InvalidValue(f"a sequence of {seq_len} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks "
                           f"(context parallelism's load-balanced layout)", where=where,
                           hint=f"use a sequence length that is a multiple of {2 * cp} (pad it), or a cp "
                                f"degree whose 2 x cp divides {seq_len}")
    return seq_len // (2 * cp)


def _norm_dim(x: torch.Tensor, dim: int, where: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise InvalidValue(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}", where=where,
                           hint=f"pass the sequence dim, between {-x.dim()} and {x.dim() - 1}")
    return dim % x.dim()


def sequence_positions(seq_len: int, group, *, device=None) -> torch.Tensor:
    """Global positions (int64) of this rank's local tokens of a full sequence of ``seq_len`` tokens."""
    cp, rank = group_size(group), group_rank(group)
    c = chunk_length(seq_len, cp, "sequence_positions")
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of_rank(rank, cp)])


def to_sequence_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The cp ranks' local sequences concatenated in rank order along ``dim`` (what an all-gather or an
    all-to-all over the sequence gives) put in sequence order. Rank j's chunks are j and 2·cp−1−j, so the
    first halves of the ranks' sequences are chunks 0..cp−1 in order and the second halves chunks
    cp..2·cp−1 in reverse: views, a flip and a cat, which keep nothing for the backward (an index_select
    would keep its index)."""
    c = chunk_length(x.shape[dim], cp, "to_sequence_order")
    ranks = x.unflatten(dim, (cp, 2, c))
    return torch.cat([ranks.select(dim + 1, 0), ranks.select(dim + 1, 1).flip(dim)], dim=dim).flatten(dim, dim + 1)


def to_layout_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The inverse of ``to_sequence_order``: a whole sequence along ``dim`` as the ranks' local sequences
    concatenated in rank order."""
    c = chunk_length(x.shape[dim], cp, "to_layout_order")
    halves = x.unflatten(dim, (2, cp, c))
    return torch.stack([halves.select(dim, 0), halves.select(dim, 1).flip(dim)], dim=dim + 1).flatten(dim, dim + 2)


def shard_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's two chunks of the full sequence along ``dim`` (a local slice: no communication;
    its gradient is zero outside the rank's chunks, as ``scatter_to_group`` without the all-gather)."""
    dim = _norm_dim(x, dim, "shard_sequence")
    cp = group_size(group)
    if cp == 1:
        return x
    c = chunk_length(x.shape[dim], cp, f"shard_sequence (dim {dim} of shape {tuple(x.shape)})")
    first, second = chunks_of_rank(group_rank(group), cp)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def unshard_sequence(x: torch.Tensor, dim: int, group, *, counter: Optional[CommCounter] = None) -> torch.Tensor:
    """The full sequence in order from every rank's local sequence along ``dim`` (an all-gather, then
    the chunks put back in order); backward takes this rank's chunks of the gradient (``gather_from_group``)."""
    dim = _norm_dim(x, dim, "unshard_sequence")
    cp = group_size(group)
    if cp == 1:
        return x
    if x.shape[dim] % 2:
        raise InvalidValue(f"a local sequence of {x.shape[dim]} tokens is not two equal chunks",
                           where=f"unshard_sequence (dim {dim} of shape {tuple(x.shape)})",
                           hint="pass a tensor made by shard_sequence")
    gathered = gather_from_group(x, group, dim, counter=counter)  # rank order: the layout's, not the sequence's
    return to_sequence_order(gathered, dim, cp)
