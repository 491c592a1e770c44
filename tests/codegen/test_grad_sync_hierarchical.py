"""The plan's buckets with the hierarchical all-reduce: reduce-scatter in the node, all-reduce across
nodes, all-gather in the node, on the two-level sub-groups of a 2 x 2 World, equal to the flat
all-reduce and recorded as the one collective the plan lists."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.data_parallel.grad_sync import GradientBuckets, PlannedBucket
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_two_level_groups
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.ir.world import World

WORLD = 4  # two "nodes" of two CPU ranks


def _model():
    torch.manual_seed(0)
    # 6x5 + 5 = 35 elements (odd: padded to two equal shards) and 5x3 + 3 = 18
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(rank: int, algorithm: str, reduce_dtype=None):
    model = _model()
    params = list(model.parameters())
    hierarchy = build_two_level_groups(Mesh(dp=WORLD, pp=1, tp=1), World.uniform(2, 2, "cpu"), "dp", rank)
    counter = CommCounter()
    planned = [PlannedBucket(tuple(params[2:]), algorithm, "bucket:0"),
               PlannedBucket(tuple(params[:2]), algorithm, "bucket:1")]
    buckets = GradientBuckets(params, dist.group.WORLD, buckets=planned, hierarchy=hierarchy, counter=counter,
                              reduce_dtype=reduce_dtype)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    buckets.wait()
    records = [(r.kind, r.nbytes, r.group_size, r.label, r.algorithm) for r in counter.records]
    return [p.grad.clone() for p in params], records, (hierarchy.ranks_per_node, hierarchy.nodes)


def _rank(rank: int, world: int):
    flat, flat_records, shape = _grads(rank, "flat")
    hierarchical, records, _ = _grads(rank, "hierarchical")
    half, half_records, _ = _grads(rank, "hierarchical", torch.bfloat16)
    return {"diff": max((a - b).abs().max().item() for a, b in zip(flat, hierarchical)),
            "half_diff": max((a - b).abs().max().item() for a, b in zip(flat, half)),
            "half_dtypes": {g.dtype for g in half}, "half_records": half_records,
            "records": records, "flat_records": flat_records, "shape": shape}


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank, WORLD, timeout_s=90)


def test_hierarchical_equals_flat_all_reduce(ranks):
    for result in ranks:
        assert result["shape"] == (2, 2)
        assert result["diff"] < 1e-6  # another summation order: rounding only


def test_counter_records_one_hierarchical_call_per_bucket_with_padding(ranks):
    # bucket 0: 18 floats; bucket 1: 35 floats padded to 36 (the pad is sent, so it is counted)
    for result in ranks:
        assert result["records"] == [("all_reduce", 18 * 4, 4, "bucket:0", "hierarchical"),
                                     ("all_reduce", 36 * 4, 4, "bucket:1", "hierarchical")]
        assert [r[1:] for r in result["flat_records"]] == [(18 * 4, 4, "bucket:0", "flat"),
                                                            (35 * 4, 4, "bucket:1", "flat")]


def test_half_precision_reduction_sends_half_the_bytes(ranks):
    # the plan's grad_reduce_dtype bf16: two bytes per element on the wire, fp32 gradients after
    for result in ranks:
        assert [r[1] for r in result["half_records"]] == [18 * 2, 36 * 2]
        assert result["half_dtypes"] == {torch.float32}
        assert result["half_diff"] < 1e-2  # bf16 keeps 8 bits of mantissa: rounding of ~0.4%


def test_planned_buckets_must_cover_every_parameter():
    model = _model()
    params = list(model.parameters())
    with pytest.raises(XirangError, match="2 trainable parameter.s. are in no bucket"):
        GradientBuckets(params, None, buckets=[PlannedBucket(tuple(params[2:]))])
    with pytest.raises(XirangError, match="in buckets 0 and 1"):
        GradientBuckets(params, None, buckets=[PlannedBucket(tuple(params)), PlannedBucket(tuple(params[:1]))])
    with pytest.raises(ValueError, match="algorithm 'tree'"):
        GradientBuckets(params, None, buckets=[PlannedBucket(tuple(params), "tree")])


def test_single_rank_hierarchical_bucket_is_identity():
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, None, buckets=[PlannedBucket(tuple(params), "hierarchical")])
    torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    before = [p.grad.clone() for p in params]
    buckets.wait()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
