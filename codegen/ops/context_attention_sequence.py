"""What a context-parallel program calls outside the attention kernels (issue 36): the ops the lowering pass
``split_sequence`` (passes/lowering/context_parallel.py) puts where the model's own ops would read across
the load-balanced chunks of ``context_attention_layout.py``.

- ``ring_attention_call`` / ``ulysses_attention_call`` / ``usp_attention_call``: a traced
  ``scaled_dot_product_attention`` as ring, all-to-all or USP (all-to-all x ring) attention, the mask
  given as plain values (``causal``, ``window``) so the emitted code prints and pickles like any aten call,
  and a padding mask as the model's own input (``key_keep`` gathers its bits over cp);
- ``sequence_arange``: ``arange`` over the sequence (HF's ``cache_position`` and ``position_ids``, GPT-2's
  learned positions) as the global positions of this rank's tokens;
- ``shift_sequence_left``: HF's label shift (``pad(labels, (0, 1), value=ignore_index)[..., 1:]``) on
  the whole sequence: a local chunk's last label is the first of the next global chunk, which another rank
  may hold, so every rank's chunk heads are all-gathered (2 tokens per rank and sample);
- ``token_mean``: the cross-entropy mean over the tokens of the whole sequence. Each rank's loss op is
  made to sum its tokens' losses (aten's or the vocabulary-parallel one), and it counts its labels; one
  all-reduce over cp of (sum, count) gives every rank the global mean. Its backward is the identity
  (Megatron's "g": ``reduce_from_group``), so rank r back-propagates its own sum / global count, and the
  parameters' gradients summed over cp (with dp: over dp x cp, divided by dp) are the global mean's. A
  mean of per-rank means would weigh the ranks' tokens unequally wherever the labels' ignored positions
  fall unevenly (the last label is ignored, and it lies on cp rank 0).

``group`` is the cp process group (None: one rank, each op is the model's own).
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang.codegen.ops.collectives import gather_from_group, group_rank, group_size, reduce_from_group
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.context_attention_blocks import AttentionMask
from xirang.codegen.ops.context_attention_layout import chunks_of_rank, sequence_positions, unshard_sequence
from xirang.codegen.ops.context_attention_ring import ring_attention
from xirang.codegen.ops.context_attention_ulysses import ulysses_attention
from xirang.codegen.ops.context_attention_usp import usp_attention
from xirang.ir.errors import InvalidValue


def key_keep(padding: Optional[torch.Tensor], group, counter: Optional[CommCounter] = None) -> Optional[torch.Tensor]:
    """The key padding mask of the whole sequence, (B, S) bool in sequence order, from this rank's chunks of the
    model's padding input (B, S/cp; nonzero: a real token), or None without one: one all-gather over cp of
    B·S/cp bytes per attention call (the bits are every key's, whichever rank's block or head split reads
    them; far fewer bytes than passing them beside each key/value block)."""
    if padding is None:
        return None
    bits = (padding != 0).to(torch.uint8)  # gloo gathers no bool
    return unshard_sequence(bits, padding.dim() - 1, group, counter=counter).bool()


def ring_attention_call(q, k, v, group, counter: Optional[CommCounter], causal: bool, window: Optional[int],
                        scale: Optional[float], padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ring_attention`` with its mask as plain values and the model's padding input (module docstring)."""
    return ring_attention(q, k, v, group, mask=AttentionMask(causal=causal, window=window), scale=scale,
                          counter=counter, keep=key_keep(padding, group, counter))


def ulysses_attention_call(q, k, v, group, counter: Optional[CommCounter], causal: bool, window: Optional[int],
                           scale: Optional[float], padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ulysses_attention`` with its mask as plain values and the model's padding input (module docstring)."""
    return ulysses_attention(q, k, v, group, mask=AttentionMask(causal=causal, window=window), scale=scale,
                             counter=counter, keep=key_keep(padding, group, counter))


def usp_attention_call(q, k, v, a2a_group, ring_group, counter: Optional[CommCounter], causal: bool,
                       window: Optional[int], scale: Optional[float], padding: Optional[torch.Tensor] = None,
                       group=None) -> torch.Tensor:
    """``usp_attention`` (all-to-all over ``a2a_group``, ring over ``ring_group``) with its mask as plain values
    and the model's padding input, gathered over the whole cp ``group``."""
    return usp_attention(q, k, v, a2a_group, ring_group, mask=AttentionMask(causal=causal, window=window),
                         scale=scale, counter=counter, keep=key_keep(padding, group, counter))


def sequence_arange(local_length: int, start: int, group, *, dtype=None, device=None, **_ignored) -> torch.Tensor:
    """``arange(start, start + local_length)`` of a model run on the whole sequence, as the global positions
    (plus ``start``) of this rank's ``local_length`` tokens; ``_ignored``: arange's ``layout``/``pin_memory``."""
    positions = sequence_positions(local_length * group_size(group), group, device=device) + start
    return positions if dtype is None else positions.to(dtype)


def shift_sequence_left(x: torch.Tensor, dim: int, fill, group, counter: Optional[CommCounter] = None) -> torch.Tensor:
    """``x`` shifted one position left along its sequence ``dim`` over the WHOLE sequence, the last global
    position taking ``fill``: what ``pad(x, (0, 1), value=fill)`` sliced from 1 gives on one device, for this
    rank's two chunks (module docstring)."""
    dim = dim % x.dim()
    cp = group_size(group)
    length = x.shape[dim]
    if cp == 1:
        return torch.cat([x.narrow(dim, 1, length - 1), torch.full_like(x.narrow(dim, 0, 1), fill)], dim=dim)
    if length % 2:
        raise InvalidValue(f"a local sequence of {length} tokens is not two equal chunks",
                           where=f"shift_sequence_left (dim {dim} of shape {tuple(x.shape)})",
                           hint="cut the sequence with shard_sequence: its length must be a multiple of 2 x cp")
    c = length // 2
    heads = torch.stack([x.narrow(dim, 0, 1), x.narrow(dim, c, 1)])  # (2, ...): the first token of each chunk
    gathered = gather_from_group(heads.detach(), group, 0, counter=counter)  # (2cp, ...): rank j's, in rank order
    first_of = {}
    for j in range(cp):
        for a, chunk in enumerate(chunks_of_rank(j, cp)):
            first_of[chunk] = gathered[2 * j + a]
    pieces = []
    for a, chunk in enumerate(chunks_of_rank(group_rank(group), cp)):
        following = first_of[chunk + 1] if chunk + 1 < 2 * cp else torch.full_like(heads[0], fill)
        pieces += [x.narrow(dim, a * c + 1, c - 1), following]
    return torch.cat(pieces, dim=dim)


def token_mean(total: torch.Tensor, target: torch.Tensor, ignore_index: int, group,
               counter: Optional[CommCounter] = None) -> torch.Tensor:
    """The mean over every token of the cp group's whole sequences of a loss whose sum over this rank's
    tokens is ``total`` (module docstring): the same value on every cp rank, its gradient this rank's share."""
    count = (target != ignore_index).sum().to(total.dtype)
    both = reduce_from_group(torch.stack([total, count]), group, counter=counter)  # forward sum, backward identity
    return both[0] / both[1]
