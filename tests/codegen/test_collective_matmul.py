"""Collective matmuls (codegen/ops/collective_matmul.py) against the unchunked collective and linear.

One 2-rank gloo launch runs every check: each rank builds the same full tensors from one seed, runs
``gather_summing_grad -> F.linear`` and ``F.linear -> reduce_scatter_to_group`` (what the lowering
emits without overlap) and the chunked ops, forward and backward, on the same shards, and returns the
largest difference of outputs and of the gradients of input, weight and bias, plus both counters'
bytes per kind and call counts.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from xirang.codegen.ops.collective_matmul import chunk_bounds, gather_linear, gather_linears, linear_reduce_scatter
from xirang.codegen.ops.collectives import gather_summing_grad, reduce_scatter_to_group
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import InvalidValue

WORLD = 2
# (local rows along dim 1, chunks): even, uneven chunks, more chunks than rows
CASES = ((4, 2), (5, 2), (3, 4), (6, 1))


def _grads(fn, tensors, seed):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _bytes_and_calls(counter):
    return counter.by_kind(), counter.calls(), sorted({r.chunks for r in counter.records})


def _compare(plain_fn, chunked_fn, tensors, seed):
    """(worst difference, plain counter's (bytes, calls, chunks), chunked counter's) of one check."""
    plain, chunked = CommCounter(), CommCounter()
    want = _grads(lambda *t: plain_fn(*t, plain), tensors, seed)
    got = _grads(lambda *t: chunked_fn(*t, chunked), tensors, seed)
    return _worst(want, got), _bytes_and_calls(plain), _bytes_and_calls(chunked)


def _two_linears(gathered, w, v, b):
    return torch.cat([F.linear(gathered, w, b), F.linear(gathered, v)], -1)


def _rank_main(rank, world):
    group = dist.group.WORLD
    results = {}
    for rows, chunks in CASES:
        g = torch.Generator().manual_seed(rows * 10 + chunks)
        shard = torch.randn(2, rows, 6, generator=g) + rank  # this rank's sequence shard
        weight, bias = torch.randn(5, 6, generator=g), torch.randn(5, generator=g)
        results[("gather", rows, chunks)] = _compare(
            lambda x, w, b, c: F.linear(gather_summing_grad(x, group, 1, counter=c), w, b),
            lambda x, w, b, c, n=chunks: gather_linear(x, w, b, group, 1, chunks=n, counter=c),
            (shard, weight, bias), rank)
        full = torch.randn(2, rows * world, 6, generator=g) * (rank + 1)  # a row-parallel linear's input
        results[("scatter", rows, chunks)] = _compare(
            lambda x, w, b, c: reduce_scatter_to_group(F.linear(x, w, b), group, 1, counter=c),
            lambda x, w, b, c, n=chunks: linear_reduce_scatter(x, w, b, group, 1, chunks=n, counter=c),
            (full, weight, bias), rank)
    g = torch.Generator().manual_seed(7)
    shard, weights = torch.randn(2, 3, 6, generator=g) + rank, (torch.randn(5, 6, generator=g), torch.randn(4, 6))
    bias = torch.randn(5, generator=g)
    results["two linears"] = _compare(  # one gather read by two linears (q and k), the second without bias
        lambda x, w, v, b, c: _two_linears(gather_summing_grad(x, group, 1, counter=c), w, v, b),
        lambda x, w, v, b, c: torch.cat(gather_linears(x, (w, v), (b, None), group, 1, chunks=2, counter=c), -1),
        (shard, *weights, bias), rank)
    uneven = torch.randn(2, 2 * world + 1, 6)  # 5 rows on 2 ranks: padded, one reduce-scatter
    weight = torch.randn(5, 6)
    want = _grads(lambda x, w: reduce_scatter_to_group(F.linear(x, w), group, 1), (uneven, weight), 0)
    got = _grads(lambda x, w: linear_reduce_scatter(x, w, None, group, 1, chunks=3), (uneven, weight), 0)
    results["uneven"] = _worst(want, got)
    return results


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_main, WORLD, timeout_s=120, heartbeat_s=60)


@pytest.mark.parametrize("kind", ["gather", "scatter"])
@pytest.mark.parametrize("rows, chunks", CASES)
def test_chunked_equals_unchunked_forward_and_backward(ranks, kind, rows, chunks):
    for rank, result in enumerate(ranks):
        worst, (plain_bytes, plain_calls, _), (bytes_, calls, chunk_counts) = result[(kind, rows, chunks)]
        assert worst <= 1e-5, (rank, kind, rows, chunks, worst)
        assert bytes_ == plain_bytes, (rank, bytes_, plain_bytes)  # the same bytes per kind, forward + backward
        used = len(chunk_bounds(rows, chunks))
        assert calls == plain_calls * used and chunk_counts == [used], (calls, plain_calls, chunk_counts)


def test_one_gather_for_several_linears(ranks):
    for result in ranks:
        worst, (plain_bytes, plain_calls, _), (bytes_, calls, _) = result["two linears"]
        assert worst <= 1e-5 and bytes_ == plain_bytes and calls == 2 * plain_calls, result["two linears"]


def test_uneven_rows_reduce_scatter_with_zero_padding(ranks):
    assert all(result["uneven"] <= 1e-5 for result in ranks)


def test_chunk_bounds_cover_the_rows_once():
    assert chunk_bounds(5, 2) == [(0, 3), (3, 2)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 1)]
    assert chunk_bounds(0, 3) == [(0, 0)]


def test_the_contracted_dim_is_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(InvalidValue, match="not a row dim"):
        gather_linear(x, torch.zeros(4, 3), None, None, 1, chunks=2)
    with pytest.raises(InvalidValue, match="chunks"):
        linear_reduce_scatter(x, torch.zeros(4, 3), None, None, 0, chunks=0)
