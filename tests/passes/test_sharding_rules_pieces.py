"""The pieces shard's rules (passes/planning/sharding_rules_pieces.py), hand-checked on small fused
projections: GPTBigCode's multi-query ``split_with_sizes``, Phi-3's three slices, Falcon-7B's view and
index lists, and the readers that defeat the layout."""
from __future__ import annotations

import torch
from torch import nn

from xirang.ir.placement import PlanReplicate, PlanShard
from xirang.passes.planning.sharding_rules import strategies_for
from tests.passes.test_sharding_rules import analysed, layouts, only

R = PlanReplicate()


def pieces(sizes, whole=()):
    return PlanShard(2, pieces=sizes, whole=whole)


class SplitMultiQuery(nn.Module):
    """GPTBigCode: one linear makes [q (4 heads of 16) | k (1) | v (1)], split by sizes."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(64, 96)

    def forward(self, x):
        q, k, v = self.c_attn(x).split((64, 16, 16), dim=2)
        return q.sum() + k.sum() * v.sum()


def test_a_multi_query_split_offers_the_query_heads_split_and_the_kv_head_whole():
    gm = analysed(SplitMultiQuery(), {}, x=torch.randn(2, 3, 64))
    linear = only(gm, "linear")
    offered = {s.output for s in strategies_for(linear, tp=2) if s.name == "column (pieces)"}
    assert pieces((64, 16, 16), (1, 2)) in offered and pieces((64, 16, 16)) in offered
    row = next(s for s in strategies_for(linear, tp=2) if s.output == pieces((64, 16, 16), (1, 2)))
    weight = PlanShard(0, pieces=(64, 16, 16), whole=(1, 2))
    assert row.inputs == (R, weight, weight) and row.compute_fraction == (32 + 16 + 16) / 96
    split = only(gm, "split_with_sizes")
    assert ((pieces((64, 16, 16), (1, 2)),), (PlanShard(2), R, R)) in layouts(split, tp=2)
    # the split reads elements, not heads: a 16-wide kv piece may be split on 2 or 4 ranks, or held whole
    assert pieces((64, 16, 16), (1, 2)) in {s.output for s in strategies_for(linear, tp=4)}
    assert {s.output for s in strategies_for(linear, tp=32) if s.name == "column (pieces)"} == {  # 64 on 32 only
        pieces((64, 16, 16), (1, 2))}


class SlicedGroupedQuery(nn.Module):
    """Phi-3: [q (64) | k (32) | v (32)] read by three slices."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(64, 128, bias=False)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        return qkv[..., :64].sum() + qkv[..., 64:96].sum() * qkv[..., 96:].sum()


def test_unequal_slices_are_pieces_all_split_when_tp_divides_each():
    gm = analysed(SlicedGroupedQuery(), {}, x=torch.randn(2, 3, 64))
    offered = {s.output for s in strategies_for(only(gm, "linear"), tp=2) if s.name == "column (pieces)"}
    assert pieces((64, 32, 32)) in offered


class Overlapping(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 12, bias=False)

    def forward(self, x):
        y = self.proj(x)
        return y[..., :8].sum() + y[..., 4:].sum()  # [0, 8) and [4, 12) overlap


def test_overlapping_picks_get_no_pieces_shard():
    gm = analysed(Overlapping(), {}, x=torch.randn(2, 3, 8))
    assert not any(s.name == "column (pieces)" for s in strategies_for(only(gm, "linear"), tp=2))


class HeadsByIndex(nn.Module):
    """Falcon-7B: view to heads + 2, then q by a slice, k and v by index lists."""

    def __init__(self):
        super().__init__()
        self.query_key_value = nn.Linear(64, 96, bias=False)

    def forward(self, x):
        qkv = self.query_key_value(x).view(2, 3, 6, 16)
        return qkv[..., :-2, :].sum() + qkv[..., [-2], :].sum() * qkv[..., [-1], :].sum()


def test_index_lists_with_known_values_pick_whole_pieces_and_unknown_ones_give_no_pieces_shard():
    gm = analysed(HeadsByIndex(), {}, x=torch.randn(2, 3, 64))
    offered = {s.output for s in strategies_for(only(gm, "linear"), tp=2) if s.name == "column (pieces)"}
    assert offered == {pieces((64, 16, 16), (1, 2))}  # one head of k, one of v: not splittable at tp 2
    with torch.device("meta"):
        model = HeadsByIndex()
    gm = analysed(model, {}, x=torch.randn(2, 3, 64, device="meta"))  # a meta trace: index values unknown
    assert not any(s.name == "column (pieces)" for s in strategies_for(only(gm, "linear"), tp=2))
