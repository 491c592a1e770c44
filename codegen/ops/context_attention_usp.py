"""USP attention: all-to-all over heads inside groups of A ranks, then a ring over the cp / A groups.

Fang & Zhao 2024 ("USP: A Unified Sequence Parallelism Approach for Long Context Generative AI"; yunchang's
``LongContextAttention``): a cp group of cp = A·R ranks is cut into R all-to-all groups of A consecutive
ranks and A ring groups of every A-th rank (ir/context_method.py ``context_subgroups``).

1. The all-to-all (``context_attention_ulysses.py``'s, over A ranks): each rank gives away its sequence
   rows of the other ranks' heads and takes theirs of its own Hq/A query heads (kv heads repeated to
   lcm(Hkv, A) first where A does not divide them), so it holds Hq/A heads of its group's 2A chunks.
2. Those chunks, put in order by ``to_sequence_order`` over A, are chunks gA..gA+A−1 and their mirror
   2·cp−1−(gA+A−1)..2·cp−1−gA: the load-balanced layout at degree R with chunks A times longer, group g
   holding "chunks" g and 2R−1−g. So the ring over R (``ring_attention``, unchanged: masks by global
   positions, causal balance, its own backward) attends them, each ring rank holding the same heads.
3. ``to_layout_order`` and the all-to-all back give each rank its own rows of every head.

Bytes per layer and rank (passes/planning/context_parallel_cost.py ``usp_attention_bytes``): the
all-to-all's four buffers of S/cp rows each way over A ranks, plus the ring's over R with Hkv'/A kv heads
and S/R tokens a rank. A = cp is Ulysses (no ring); A = 1 the ring (no all-to-all).
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang.codegen.ops.collectives import all_to_all, group_size
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.context_attention_blocks import CAUSAL, AttentionMask, default_scale
from xirang.codegen.ops.context_attention_layout import to_layout_order, to_sequence_order
from xirang.codegen.ops.context_attention_ring import check_qkv, ring_attention
from xirang.codegen.ops.context_attention_ulysses import kv_head_repeats


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a2a_group, ring_group, *,
                  mask: AttentionMask = CAUSAL, scale: Optional[float] = None,
                  counter: Optional[CommCounter] = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's sequence rows over the whole sequence of its cp group, by all-to-all over
    ``a2a_group`` and ring over ``ring_group`` (module docstring); inputs, output and the key padding mask
    ``keep`` as ``ring_attention``'s (the ring reads it by global positions, which its longer chunks keep)."""
    check_qkv(q, k, v, "usp_attention")
    scale = default_scale(q.shape[-1], scale)
    a2a = group_size(a2a_group)
    if a2a == 1:
        return ring_attention(q, k, v, ring_group, mask=mask, scale=scale, counter=counter, keep=keep)
    repeats = kv_head_repeats(q.shape[1], k.shape[1], a2a)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    # sequence-split (dim 2) -> head-split (dim 1) inside the all-to-all group: its 2·a2a chunks, in order
    q, k, v = (to_sequence_order(all_to_all(t, a2a_group, scatter_dim=1, gather_dim=2, counter=counter), 2, a2a)
               for t in (q, k, v))
    out = ring_attention(q, k, v, ring_group, mask=mask, scale=scale, counter=counter, keep=keep)
    return all_to_all(to_layout_order(out, 2, a2a), a2a_group, scatter_dim=2, gather_dim=1, counter=counter)
