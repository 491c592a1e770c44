"""Context parallelism's attention: each rank of a cp group holds a slice of every sequence (issue 36).

- ``context_attention_layout.py``: the load-balanced layout (2·cp chunks, rank r holding r and 2·cp−1−r),
  ``shard_sequence``, ``unshard_sequence`` and the global ``sequence_positions`` of a rank's tokens;
- ``context_attention_blocks.py``: the mask (``AttentionMask``: causal, sliding window, none), one block's
  attention with its log-sum-exp and its backward, the fp32 merge;
- ``context_attention_ring.py``: ``ring_attention``, key/value blocks passed around the ring by point to point;
- ``context_attention_ulysses.py``: ``ulysses_attention``, all-to-all from a sequence split to a head split and back.

Both attention functions take q, k, v as SDPA does, (batch, heads, local sequence, head dim), in the
layout of ``shard_sequence``, and give this rank's output rows; ``group`` None is one rank (plain
attention). Their costs: ``xirang.passes.planning.context_parallel_cost``.
"""
from xirang.codegen.ops.context_attention_blocks import CAUSAL, NO_MASK, AttentionMask
from xirang.codegen.ops.context_attention_layout import (chunks_of_rank, sequence_positions, shard_sequence,
                                                         unshard_sequence)
from xirang.codegen.ops.context_attention_ring import ring_attention
from xirang.codegen.ops.context_attention_ulysses import kv_head_repeats, ulysses_attention

__all__ = ["AttentionMask", "CAUSAL", "NO_MASK", "chunks_of_rank", "kv_head_repeats", "ring_attention",
           "sequence_positions", "shard_sequence", "ulysses_attention", "unshard_sequence"]
