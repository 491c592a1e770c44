"""The pieces shard ``PlanShard(dim, pieces, whole)`` of a fused projection: each tp rank's blocks of
the user's tensor and back (so checkpoints and ``full_state_dict`` hold the unpermuted tensor), the
blocks a checkpoint declares, the gradient-norm share, ``pieces_product``'s gradients over two simulated
tp ranks against the unsharded product (one process), and the conversions to and from R on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from xirang.codegen.ops.fused_pieces import pieces_product, shift_index
from xirang.codegen.ops.padding import shard_of, unshard
from xirang.codegen.runtime.checkpoint.layout import pieces_of
from xirang.codegen.runtime.data_parallel.grad_norm import real_elements
from xirang.ir.errors import InvalidValue, XirangError
from xirang.ir.placement import PlanShard, local_shape, piece_blocks, placement_from_json

MQA = PlanShard(0, pieces=(4, 1, 1), whole=(1, 2))  # Falcon-7B's [q (4 heads) | k | v] in heads


def test_a_rank_holds_its_query_heads_and_the_whole_kv_head_and_the_glue_returns_the_users_tensor():
    full = torch.arange(12.0).reshape(6, 2)
    locals_ = [shard_of(full, MQA, rank, 2) for rank in range(2)]
    assert locals_[0][:, 0].tolist() == [0, 2, 8, 10] and locals_[1][:, 0].tolist() == [4, 6, 8, 10]
    assert local_shape((6, 2), MQA, 2) == (4, 2)
    assert torch.equal(unshard(locals_, MQA, 6), full)
    assert placement_from_json(MQA.to_json()) == MQA and str(MQA) == "S(0, pieces 4|1 whole|1 whole)"


def test_pieces_that_do_not_lay_out_the_dim_are_refused_with_the_placement_named():
    with pytest.raises(XirangError, match="pieces sum to 6"):
        shard_of(torch.zeros(8, 2), MQA, 0, 2)
    with pytest.raises(InvalidValue, match="every piece is whole"):
        PlanShard(0, pieces=(4, 2), whole=(0, 1))


def test_a_checkpoint_declares_each_block_once_per_rank_and_the_norm_counts_a_whole_piece_once():
    full = torch.arange(12.0).reshape(6, 2)
    for rank in range(2):
        local = shard_of(full, MQA, rank, 2)
        declared = pieces_of(local, MQA, (6, 2), rank, 2, "qkv")
        for piece in declared.pieces:
            assert torch.equal(declared.view(piece.global_offsets), full[piece.global_offsets[0]:][:piece.sizes[0]])
    shard = type("Shard", (), {"placement": MQA, "full_shape": (6, 2)})()
    counted = [real_elements(shard_of(full, MQA, rank, 2), shard, rank, 2) for rank in range(2)]
    assert sorted(torch.cat(counted)[:, 0].tolist()) == list(range(0, 12, 2))  # every row exactly once


def test_pieces_product_counts_a_whole_pieces_gradient_once_in_the_replicated_input():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    grad_out = torch.randn(3, 6)
    torch.nn.functional.linear(x, weight).backward(grad_out)
    grad_x = torch.zeros_like(x)
    for rank in range(2):
        blocks = piece_blocks(MQA, 2, rank)
        rows = torch.cat([weight.detach()[start:start + length] for start, length, _, _ in blocks]).requires_grad_()
        mine = x.detach().clone().requires_grad_(True)
        out = pieces_product("aten.linear.default", (mine, rows), {}, 1, MQA.pieces, MQA.whole, (0,), rank, 2)
        local_grad = torch.cat([grad_out[:, start:start + length] for start, length, _, _ in blocks], dim=1)
        out.backward(local_grad)
        grad_x += mine.grad  # Megatron's f: the replicated input's gradient summed over the tp ranks
        assert torch.allclose(rows.grad[2:], weight.grad[4:], atol=1e-6)  # the whole kv rows: full on every rank
    assert torch.allclose(grad_x, x.grad, atol=1e-6)


def test_shift_index_points_into_the_local_block_of_the_piece():
    # full heads [q0 q1 q2 q3 | k | v]; rank-local [q_r q_r' | k | v]: k is at -2 of 6 globally, 2 of 4 locally
    assert shift_index(torch.tensor([-2]), 6, 2 - 4).tolist() == [2]


def _conversions(rank, world):
    """On each of 2 gloo ranks: S(pieces) -> R and R -> S(pieces), values and gradients."""
    from xirang.codegen.ops.fused_pieces import gather_pieces, scatter_pieces
    from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
    from xirang.ir.mesh import Mesh
    group = build_mesh_groups(Mesh(dp=1, pp=1, tp=2)).tp
    torch.manual_seed(0)
    full, weight = torch.randn(6, 3), torch.randn(6, 3)  # the same on both ranks
    local = shard_of(full, MQA, rank, 2).requires_grad_()
    gathered = gather_pieces(local, group, 0, MQA.pieces, MQA.whole)
    (gathered * weight).sum().backward()  # the gradient of an R value: whole, the same on every rank
    whole = full.clone().requires_grad_()
    scattered = scatter_pieces(whole, group, 0, MQA.pieces, MQA.whole)
    (scattered * shard_of(weight, MQA, rank, 2)).sum().backward()  # the pieces shard's gradient back to R
    mine = shard_of(weight, MQA, rank, 2)
    return {"gathered": torch.equal(gathered, full), "gather_grad": torch.equal(local.grad, mine),
            "scattered": torch.equal(scattered, shard_of(full, MQA, rank, 2)), "scatter_grad": whole.grad}


def test_conversions_to_and_from_replicated_keep_the_whole_pieces_and_their_gradients_whole():
    from xirang.codegen.runtime.launch.launcher import launch
    results = launch(_conversions, 2, timeout_s=120)
    torch.manual_seed(0)
    _, weight = torch.randn(6, 3), torch.randn(6, 3)
    for found in results:
        assert found["gathered"] and found["gather_grad"] and found["scattered"]
        assert torch.allclose(found["scatter_grad"], weight)  # split rows all-gathered, whole rows this rank's own
