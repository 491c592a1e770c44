"""All-to-all (Ulysses) attention: swap the sequence split for a head split, attend whole sequences, swap back.

DeepSpeed-Ulysses (Jacobs et al. 2023): q, k and v arrive split along the sequence (this rank's two
chunks, ``context_attention_layout.py``); an all-to-all over the cp group gives each rank the whole
sequence for Hq/cp query heads (and the kv heads they read), attention runs on it as on one device, and
an all-to-all sends each rank its sequence rows of every head back. The gathered sequence comes in the
layout's order (rank 0's chunks, then rank 1's, ...), so it is put in sequence order for the attention and
back after it: a causal or sliding-window attention then runs as SDPA runs it.

Heads. The query heads must divide by cp (refused otherwise, naming the numbers). Key/value heads
(grouped-query attention): where cp divides them each rank takes Hkv/cp of them, exactly those its query
heads read. Where it does not, they are repeated first, each m = cp / gcd(Hkv, cp) times, to lcm(Hkv, cp)
heads, the fewest that split evenly and keep every query head's kv head on its rank (Llama 3 70B's 8 kv
heads at cp = 16 travel as 16). This never fails once cp divides the query heads, since lcm(Hkv, cp)
divides Hq. The gradient of the repeat sums the copies (autograd).

Traffic per attention, recorded by the all-to-alls (``collectives.all_to_all``; CommCounter convention:
each rank's send buffer): forward q, k, v and the output, backward their gradients, the same sizes.
``passes/planning/context_parallel_cost.py`` states the totals.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from xirang.codegen.ops.collectives import all_to_all, group_size
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.context_attention_blocks import CAUSAL, AttentionMask, default_scale, full_attention
from xirang.codegen.ops.context_attention_layout import to_layout_order, to_sequence_order
from xirang.codegen.ops.context_attention_ring import check_qkv
from xirang.ir.errors import InvalidValue


def kv_head_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated before the all-to-all (module docstring); refuses query
    heads cp does not divide. The cost model's ``ulysses_kv_heads`` is the same rule (a test holds them equal)."""
    if q_heads % cp:
        raise InvalidValue(f"all-to-all attention splits the heads over cp, but cp = {cp} does not divide the "
                           f"{q_heads} query heads", where="ulysses_attention",
                           hint=f"use ring attention, or a cp among the divisors of {q_heads}")
    return cp // math.gcd(kv_heads, cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, mask: AttentionMask = CAUSAL,
                      scale: Optional[float] = None, counter: Optional[CommCounter] = None,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's sequence rows over the whole sequence by all-to-all over heads (module
    docstring); inputs, output and the key padding mask ``keep`` as ``ring_attention``'s (every rank holds
    every sample's whole sequence after the exchange, so ``keep`` applies as it is)."""
    check_qkv(q, k, v, "ulysses_attention")
    scale = default_scale(q.shape[-1], scale)
    cp = group_size(group)
    if cp == 1:
        return full_attention(q, k, v, mask, scale, keep)
    repeats = kv_head_repeats(q.shape[1], k.shape[1], cp)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    # sequence-split (dim 2) -> head-split (dim 1): the whole sequence, in the layout's order
    q, k, v = (all_to_all(t, group, scatter_dim=1, gather_dim=2, counter=counter) for t in (q, k, v))
    q, k, v = (to_sequence_order(t, 2, cp) for t in (q, k, v))
    out = to_layout_order(full_attention(q, k, v, mask, scale, keep), 2, cp)
    return all_to_all(out, group, scatter_dim=2, gather_dim=1, counter=counter)
