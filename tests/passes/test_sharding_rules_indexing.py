"""Sharding rules for the ops Falcon's attention traces to: ``x @ W.T`` (numpy_T), picks along one dim
(select, index with one index tensor), ``broadcast_to``, its in-place branch sum (add_), and multi-query
attention with one kv head broadcast over the query heads. Hand-checked expectations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from tests.passes.test_sharding_rules import analysed, layouts, only

R, P = PlanReplicate(), PlanPartial("sum")


class PickHeads(nn.Module):
    """Falcon-7B's split of its fused qkv: [b, s, heads + 2, d] -> q (slice), k and v (index lists)."""

    def forward(self, x):
        qkv = x.view(2, 3, 6, 4)
        return qkv[..., :-2, :], qkv[..., [-2], :], qkv[:, :, 0]


def test_index_and_select_follow_a_shard_of_any_dim_they_do_not_pick_along():
    gm = analysed(PickHeads(), {}, x=torch.randn(2, 3, 24))
    index = only(gm, "index")  # [b, s, 6, d][..., [-2], :] -> [b, s, 1, d]
    found = layouts(index, tp=2)
    assert ((PlanShard(0), R), PlanShard(0)) in found and ((PlanShard(3), R), PlanShard(3)) in found
    assert not any(PlanShard(2) in inputs for inputs, _ in found)  # the picked dim stays whole
    assert ((P, R), P) in found  # linear in x
    select = only(gm, "select")  # [b, s, 6, d][:, :, 0] -> [b, s, d]: dims after 2 move up one
    assert layouts(select, tp=2) == {((R,), R), ((PlanShard(0),), PlanShard(0)), ((PlanShard(3),), PlanShard(2)),
                                     ((P,), P)}


class MatmulByTranspose(nn.Module):
    """FalconLinear: ``x @ self.weight.T``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return x @ self.weight.T


def test_numpy_t_moves_a_shard_to_the_reversed_dim_so_a_weight_can_be_column_parallel():
    gm = analysed(MatmulByTranspose(), {}, x=torch.randn(2, 3, 4))
    assert layouts(only(gm, "numpy_T"), tp=2) == {((R,), R), ((PlanShard(0),), PlanShard(1)),
                                                  ((PlanShard(1),), PlanShard(0)), ((P,), P)}


class InPlaceSum(nn.Module):
    def forward(self, x, y, reuse: bool = False):
        a, b = x * 2, y * 3
        a += b  # add_
        return a


class InPlaceSumReadAfter(nn.Module):
    def forward(self, x, y):
        a, b = x * 2, y * 3
        kept = a.sum()  # another reader of a: add_ must keep it replicated
        a += b
        return a, kept


def test_in_place_add_is_an_add_only_when_nobody_else_reads_its_target():
    gm = analysed(InPlaceSum(), {}, x=torch.randn(4, 6), y=torch.randn(4, 6))
    found = layouts(only(gm, "add_"), tp=2)
    assert ((PlanShard(1), PlanShard(1)), PlanShard(1)) in found and ((P, P), P) in found
    gm = analysed(InPlaceSumReadAfter(), {}, x=torch.randn(4, 6), y=torch.randn(4, 6))
    assert layouts(only(gm, "add_"), tp=2) == {((R, R), R)}


class Broadcast(nn.Module):
    def forward(self, k):
        return torch.broadcast_to(k, (2, 3, 4, 5))


def test_broadcast_to_splits_a_kept_dim_or_makes_a_broadcast_one_split_from_replicated():
    gm = analysed(Broadcast(), {}, k=torch.randn(2, 1, 4, 5))
    found = layouts(only(gm, "broadcast_to"), tp=2)
    assert ((PlanShard(0),), PlanShard(0)) in found and ((PlanShard(2),), PlanShard(2)) in found
    assert ((R,), PlanShard(1)) in found  # 3 on 2 ranks: uneven, padded (sharding_rules_padded)


class MultiQuery(nn.Module):
    def __init__(self, gqa=False):
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


def test_multi_query_attention_splits_query_heads_and_reads_the_one_kv_head_whole():
    gm = analysed(MultiQuery(), {}, q=torch.randn(2, 4, 5, 8), k=torch.randn(2, 1, 5, 8), v=torch.randn(2, 1, 5, 8))
    found = layouts(only(gm, "scaled_dot_product_attention"), tp=2)
    assert ((PlanShard(1), R, R), PlanShard(1)) in found  # heads: each rank's queries against the same kv head
    assert ((PlanShard(0),) * 3, PlanShard(0)) in found  # batch
    # two kv heads are grouped, not broadcast: a rank's query heads need their own kv head, never both
    gm = analysed(MultiQuery(gqa=True), {}, q=torch.randn(2, 4, 5, 8), k=torch.randn(2, 2, 5, 8),
                  v=torch.randn(2, 2, 5, 8))
    found = layouts(only(gm, "scaled_dot_product_attention"), tp=2)
    assert ((PlanShard(1),) * 3, PlanShard(1)) in found and ((PlanShard(1), R, R), PlanShard(1)) not in found
