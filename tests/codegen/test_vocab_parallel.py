"""Vocabulary-parallel embedding and cross-entropy against single-process torch; padding helpers.

One 4-rank gloo launch runs every distributed check (spawning ranks costs seconds): the world as
one tp group of 4 and, from a dp=2 x tp=2 mesh, two tp groups of 2. Each check builds the full
tensors on every rank from one seed, computes the torch reference on them, and compares this
rank's result with the reference (its slice, for gradients). Padding rows and columns of the local
tensors are filled with large values first, so a kernel that reads them fails loudly.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.ops.padding import pad_dim, shard_of, unshard
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.codegen.ops.vocab_parallel import (vocab_parallel_cross_entropy, vocab_parallel_embedding,
                                               vocab_parallel_embedding_reduced, vocab_shard_range)
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard

WORLD = 4
POISON = 1e4


def _err(a, b) -> float:
    """Largest error, absolute below 1 and relative above: a summed loss near 20 is only held to
    one fp32 ulp, 1.9e-6, and the order in which the rows are summed differs from torch's."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs() / b.abs().clamp(min=1)).max().item() if a.numel() else 0.0


def _poisoned_shard(full, dim, vocab, group, k, r):
    """This rank's Shard(dim) slice of ``full`` with its padding (beyond ``vocab``) poisoned."""
    start, rows = vocab_shard_range(vocab, group)
    local = shard_of(full, PlanShard(dim), r, k)
    real = max(0, min(rows, vocab - start))  # rows (or columns) this rank holds before padding
    local.narrow(dim, real, rows - real).fill_(POISON)
    return local.requires_grad_(), start


def _embedding(group, k, r, vocab, padding_idx=None):
    g = torch.Generator().manual_seed(vocab * 10 + k)
    W = torch.randn(vocab, 6, generator=g)
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (2 * vocab,), generator=g)])
    ids = ids.reshape(3, vocab)  # every row at least once, many twice: gradients accumulate
    C = torch.randn(3, vocab, 6, generator=g)
    w_ref = W.clone().requires_grad_()
    ref = F.embedding(ids, w_ref, padding_idx=padding_idx)
    (ref * C).sum().backward()

    local, start = _poisoned_shard(W, 0, vocab, group, k, r)
    counter = CommCounter()
    args = dict(vocab_start=start, vocab_size=vocab, group=group, counter=counter,
                padding_idx=padding_idx)
    partial = vocab_parallel_embedding(ids, local.detach(), **args)
    mine = ((ids >= start) & (ids < start + local.shape[0])).unsqueeze(-1)
    reduced = vocab_parallel_embedding_reduced(ids, local, **args)
    (reduced * C).sum().backward()
    records = [(c.kind, c.nbytes, c.group_size, c.label) for c in counter.records]
    return {"partial": _err(partial, torch.where(mine, ref, 0.0).detach()),
            "forward": _err(reduced, ref.detach()),
            "grad": _err(local.grad, shard_of(w_ref.grad, PlanShard(0), r, k)),
            "records": records}


def _cross_entropy(group, k, r, vocab, reduction, *, shape=(7,), ignore_index=-100, ignored=2):
    """``shape`` is the target's; logits are [shape[0], vocab, *shape[1:]]."""
    g = torch.Generator().manual_seed(vocab * 100 + k * 10 + len(shape) + ignore_index)
    X = torch.randn(shape[0], vocab, *shape[1:], generator=g) * 3
    T = torch.randint(0, vocab, shape, generator=g)
    T.view(-1)[:ignored] = ignore_index
    x_ref = X.clone().requires_grad_()
    ref = F.cross_entropy(x_ref, T, ignore_index=ignore_index, reduction=reduction)
    W = torch.randn(ref.shape, generator=g)
    (ref * W).sum().backward()

    local, start = _poisoned_shard(X, 1, vocab, group, k, r)
    counter = CommCounter()
    loss = vocab_parallel_cross_entropy(local, T, vocab_start=start, vocab_size=vocab, group=group,
                                        ignore_index=ignore_index, reduction=reduction,
                                        counter=counter)
    (loss * W).sum().backward()
    grad_ref = shard_of(x_ref.grad, PlanShard(1), r, k)
    if T.numel() == ignored:  # every row ignored: mean is 0 / 0 = nan, the gradient zero
        return {"nan": (bool(loss.isnan()), bool(ref.isnan())),
                "grad": _err(local.grad, grad_ref)}
    return {"forward": _err(loss, ref.detach()), "grad": _err(local.grad, grad_ref),
            "records": [(c.kind, c.nbytes, c.group_size, c.label) for c in counter.records]}


def _rank_checks(rank, world):
    tp2 = build_mesh_groups(Mesh(dp=2, pp=1, tp=2))
    tp4 = build_mesh_groups(Mesh(dp=1, pp=1, tp=4))
    groups = {"tp2": (tp2.tp, 2, tp2.axis_index("tp")), "tp4": (tp4.tp, 4, rank)}
    results = {"ranges": {name: vocab_shard_range(10, group) for name, (group, _, _) in
                          groups.items()}}
    # vocab 10: 5 rows each on 2 ranks; 3 rows each on 4, the last holding 1 row + 2 padding.
    # vocab 5 on 4 ranks: 2, 2, 1 + 1 padding, 0 + 2 padding (a rank of padding only).
    for name, (group, k, r) in groups.items():
        for vocab in (10, 5, 7):
            results[f"emb {name} v{vocab}"] = _embedding(group, k, r, vocab)
            for reduction in ("mean", "sum", "none"):
                results[f"ce {name} v{vocab} {reduction}"] = _cross_entropy(group, k, r, vocab,
                                                                            reduction)
        results[f"emb {name} padding_idx"] = _embedding(group, k, r, 10, padding_idx=4)
        for reduction in ("mean", "none"):
            results[f"ce {name} class dim 1 {reduction}"] = _cross_entropy(
                group, k, r, 10, reduction, shape=(2, 3))
            results[f"ce {name} ignore_index=3 {reduction}"] = _cross_entropy(
                group, k, r, 10, reduction, ignore_index=3)
        results[f"ce {name} all ignored"] = _cross_entropy(group, k, r, 10, "mean", shape=(3,),
                                                           ignored=3)
    return results


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_checks, WORLD, timeout_s=120)


def _cases(prefix):
    return [f"{prefix} {name} {rest}" for name in ("tp2", "tp4") for rest in
            (["v10", "v5", "v7", "padding_idx"] if prefix == "emb" else
             [f"v{v} {red}" for v in (10, 5, 7) for red in ("mean", "sum", "none")]
             + [f"{what} {red}" for what in ("class dim 1", "ignore_index=3")
                for red in ("mean", "none")])]


def test_vocab_shard_range(ranks):
    for rank, result in enumerate(ranks):
        assert result["ranges"] == {"tp2": (5 * (rank % 2), 5), "tp4": (3 * rank, 3)}


@pytest.mark.parametrize("case", _cases("emb"))
def test_embedding_matches_torch(ranks, case):
    for rank, result in enumerate(ranks):
        errors = {key: result[case][key] for key in ("partial", "forward", "grad")}
        assert max(errors.values()) < 1e-6, f"rank {rank} {case}: {errors}"


@pytest.mark.parametrize("case", _cases("ce"))
def test_cross_entropy_matches_torch(ranks, case):
    for rank, result in enumerate(ranks):
        errors = {key: result[case][key] for key in ("forward", "grad")}
        assert max(errors.values()) < 1e-6, f"rank {rank} {case}: {errors}"


@pytest.mark.parametrize("name", ["tp2", "tp4"])
def test_cross_entropy_all_ignored_is_nan_with_zero_gradient(ranks, name):
    for result in ranks:
        assert result[f"ce {name} all ignored"]["nan"] == (True, True)
        assert result[f"ce {name} all ignored"]["grad"] == 0.0


@pytest.mark.parametrize("name,k", [("tp2", 2), ("tp4", 4)])
def test_counter_bytes_by_hand(ranks, name, k):
    label = "vocab_parallel_cross_entropy."
    for result in ranks:
        # Cross-entropy: an all-reduce of one fp32 per row (max), one of two (target logit and sum
        # of exp, coalesced), nothing in backward. 7 rows = 28 bytes; logits [2, C, 3] are 6 rows.
        for case, rows in ((f"ce {name} v10 mean", 7), (f"ce {name} v7 none", 7),
                           (f"ce {name} class dim 1 none", 6)):
            assert result[case]["records"] == [("all_reduce", 4 * rows, k, label + "row_max"),
                                               ("all_reduce", 8 * rows, k, label + "target_logit_and_sum_exp")]
        # Embedding: the Partial part sends nothing; completing it is one all-reduce of the
        # [3, 10, 6] fp32 output (720 bytes); the backward sends nothing.
        assert result[f"emb {name} v10"]["records"] == [
            ("all_reduce", 720, k, "reduce_from_group.forward")]


# --- one process: padding helpers and group None ("this rank alone") ---------------------------

def test_pad_dim_pads_the_end_with_zeros():
    assert pad_dim(torch.arange(1, 6), 0, 4).tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert pad_dim(torch.ones(2, 3), -1, 2).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    x = torch.ones(4, 3)
    assert pad_dim(x, 0, 2) is x
    with pytest.raises(XirangError, match="multiple must be a positive int"):
        pad_dim(x, 0, 0)
    with pytest.raises(XirangError, match=r"dim 2 is out of range for a tensor of shape \(4, 3\)"):
        pad_dim(x, 2, 2)


def test_gpt2_vocab_on_8_ranks():
    # ceil(50257 / 8) = 6283 rows per rank; 8 * 6283 = 50264, so the last rank has 7 padding rows.
    full = torch.arange(1, 50258).unsqueeze(1) * torch.tensor([1, -1])  # row i: [i+1, -(i+1)]
    locals_ = [shard_of(full, PlanShard(0), r, 8) for r in range(8)]
    assert {tuple(t.shape) for t in locals_} == {(6283, 2)}
    assert locals_[1][0].tolist() == [6284, -6284]
    last = locals_[7]
    assert last[0].tolist() == [7 * 6283 + 1, -(7 * 6283 + 1)]
    assert last[6275].tolist() == [50257, -50257] and not last[6276:].any()
    assert torch.equal(unshard(locals_, PlanShard(0), 50257), full)


def test_vocab_10_on_4_ranks_by_hand():
    locals_ = [shard_of(torch.arange(1, 11), PlanShard(0), r, 4).tolist() for r in range(4)]
    assert locals_ == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 0]]
    assert unshard([torch.tensor(t) for t in locals_], PlanShard(0), 10).tolist() == list(range(1, 11))


def test_chunks_pad_each_piece():
    # [q | k | v] of 3 each on 2 ranks: each piece split 2 + (1 + 1 padding), padding per piece.
    full = torch.arange(1, 10)
    locals_ = [shard_of(full, PlanShard(0, 3), r, 2) for r in range(2)]
    assert [t.tolist() for t in locals_] == [[1, 2, 4, 5, 7, 8], [3, 0, 6, 0, 9, 0]]
    assert torch.equal(unshard(locals_, PlanShard(0, 3), 9), full)
    # Even pieces on dim 1 of a fused weight: rank r holds its columns of q, of k and of v.
    fused = torch.arange(24).reshape(2, 12)
    locals_ = [shard_of(fused, PlanShard(1, 3), r, 2) for r in range(2)]
    assert locals_[1][0].tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(unshard(locals_, PlanShard(1, 3), 12), fused)


def test_shard_of_copies_and_handles_replicate_and_partial():
    full = torch.arange(6.0).reshape(2, 3)
    local = shard_of(full, PlanShard(0), 0, 1)
    local.zero_()
    assert full.sum() == 15  # the local is a copy, writing it leaves the full tensor alone
    assert shard_of(full, PlanReplicate(), 1, 2) is full
    sums = [shard_of(full, PlanPartial("sum"), r, 3) for r in range(3)]
    assert torch.equal(unshard(sums, PlanPartial("sum")), full) and not sums[2].any()
    for op in ("avg", "max", "min"):
        assert torch.equal(unshard([shard_of(full, PlanPartial(op), r, 2) for r in range(2)],
                                   PlanPartial(op)), full)
    assert unshard([full, full], PlanReplicate()) is full


def test_padding_helpers_say_what_is_wrong():
    with pytest.raises(XirangError, match="cannot be cut into 3 equal pieces"):
        shard_of(torch.zeros(10), PlanShard(0, 3), 0, 2)
    with pytest.raises(XirangError, match=r"rank 2 is not in 0\.\.1"):
        shard_of(torch.zeros(10), PlanShard(0), 2, 2)
    with pytest.raises(XirangError, match=r"ceil\(10/4\) = 3 per rank, but the locals have 2"):
        unshard([torch.zeros(2)] * 4, PlanShard(0), 10)
    with pytest.raises(XirangError, match="different shapes"):
        unshard([torch.zeros(2), torch.zeros(3)], PlanShard(0), 5)
    with pytest.raises(XirangError, match="full_size must be the true length of dim 0"):
        unshard([torch.zeros(2)] * 2, PlanShard(0))


def test_group_none_is_plain_torch_and_sends_nothing():
    g = torch.Generator().manual_seed(0)
    W, ids = torch.randn(10, 4, generator=g), torch.randint(0, 10, (3, 5), generator=g)
    w, w_ref = W.clone().requires_grad_(), W.clone().requires_grad_()
    counter = CommCounter()
    out = vocab_parallel_embedding_reduced(ids, w, vocab_start=0, vocab_size=10, group=None,
                                           counter=counter, padding_idx=ids[0, 0].item())
    out.sum().backward()
    F.embedding(ids, w_ref, padding_idx=ids[0, 0].item()).sum().backward()
    assert _err(out, F.embedding(ids, W)) == 0 and _err(w.grad, w_ref.grad) == 0
    for logits_shape, target_shape in (((7, 10), (7,)), ((2, 10, 3), (2, 3)), ((10,), ())):
        for reduction in ("mean", "sum", "none"):
            X, T = torch.randn(logits_shape, generator=g), torch.randint(0, 10, target_shape,
                                                                          generator=g)
            x, x_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(x, T, vocab_start=0, vocab_size=10, group=None,
                                                reduction=reduction, counter=counter)
            ref = F.cross_entropy(x_ref, T, reduction=reduction)
            loss.sum().backward()
            ref.sum().backward()
            assert _err(loss, ref.detach()) < 1e-6 and _err(x.grad, x_ref.grad) < 1e-6
    assert counter.records == []


def test_cross_entropy_keeps_half_precision_dtype():
    X, T = torch.randn(4, 6, dtype=torch.bfloat16), torch.tensor([0, 5, 2, -100])
    x = X.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, T, vocab_start=0, vocab_size=6, group=None)
    loss.backward()
    assert loss.dtype == x.grad.dtype == torch.bfloat16
    # Statistics in fp32: the loss is the fp32 loss of the bf16 logits, rounded once to bf16
    # (8 bits of mantissa: within 2^-8 relative).
    ref = F.cross_entropy(X.float(), T).item()
    assert math.isfinite(ref) and abs(loss.item() - ref) <= 2 ** -8 * abs(ref)


def test_refusals_say_what_to_do():
    ids, w = torch.zeros(2, dtype=torch.long), torch.zeros(10, 4)
    common = dict(vocab_start=0, vocab_size=10, group=None)
    with pytest.raises(XirangError, match="scale_grad_by_freq=True is not supported"):
        vocab_parallel_embedding(ids, w, scale_grad_by_freq=True, **common)
    with pytest.raises(XirangError, match="sparse=True is not supported"):
        vocab_parallel_embedding(ids, w, sparse=True, **common)
    with pytest.raises(XirangError, match="padding_idx -2 is not a row"):
        vocab_parallel_embedding(ids, w, padding_idx=-2, **common)
    with pytest.raises(XirangError, match=r"each rank must hold ceil\(12/1\) = 12 rows"):
        vocab_parallel_embedding(ids, w, vocab_start=0, vocab_size=12, group=None)
    with pytest.raises(XirangError, match="target must hold class indices"):
        vocab_parallel_cross_entropy(torch.zeros(2, 10), torch.zeros(2, 10), **common)
    with pytest.raises(XirangError, match=r"target shape \(3,\) does not match logits"):
        vocab_parallel_cross_entropy(torch.zeros(2, 10), torch.zeros(3, dtype=torch.long),
                                     **common)
    with pytest.raises(XirangError, match="reduction 'avg' is not one of"):
        vocab_parallel_cross_entropy(torch.zeros(2, 10), ids, reduction="avg", **common)
