"""Process groups and autograd-aware collectives against the single-process computation.

One 4-rank gloo launch runs every distributed check (spawning ranks costs seconds each); each rank
returns ``{check name: value}`` and the tests below read them. Every check builds the full tensors
on every rank from one seed, computes the reference with autograd on the full tensors in this
process, and compares the sharded result. With several ranks contributing, the reference loss is
the sum of every rank's local loss, computed in one process.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from xirang.codegen.ops.collectives import (all_to_all, copy_to_group, gather_from_group,
                                            reduce_from_group, reduce_scatter_to_group,
                                            scatter_to_group)
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanShard, local_shape

WORLD = 4


def _slice(full, dim, k, r):
    """Reference local shard: pad dim to a multiple of k at its end, take chunk r."""
    extra = -full.shape[dim] % k
    pad = [0, 0] * (full.dim() - 1 - dim) + [0, extra]
    return F.pad(full, pad).chunk(k, dim=dim)[r]


def _err(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _megatron_mlp(group, k, r):
    """f / g (copy_to_group, reduce_from_group) in a column- then row-parallel MLP."""
    g = torch.Generator().manual_seed(1)
    X, W1, W2, C = (torch.randn(s, generator=g) for s in ((4, 6), (6, 8), (8, 6), (4, 6)))
    Xr, W1r, W2r = (t.clone().requires_grad_() for t in (X, W1, W2))
    ((torch.relu(Xr @ W1r) @ W2r) * C).sum().backward()

    x, w1, w2 = (t.clone().requires_grad_() for t in (X, _slice(W1, 1, k, r), _slice(W2, 0, k, r)))
    y = reduce_from_group(torch.relu(copy_to_group(x, group) @ w1) @ w2, group)
    (y * C).sum().backward()
    return max(_err(y, torch.relu(X @ W1) @ W2), _err(x.grad, Xr.grad),
               _err(w1.grad, _slice(W1r.grad, 1, k, r)), _err(w2.grad, _slice(W2r.grad, 0, k, r)))


def _uneven_checks(group, k, r, n):
    """gather / scatter / reduce-scatter / all-to-all on a dim of n rows (uneven when k ∤ n)."""
    g = torch.Generator().manual_seed(2 + n)
    T = torch.randn(n, 7, generator=g)
    C = [torch.randn(local_shape((n, 7), PlanShard(0), k), generator=g) for _ in range(k)]
    Cfull = torch.randn(n, 7, generator=g)
    P = [torch.randn(n, 7, generator=g) for _ in range(k)]
    out = {}

    # gather_from_group: local padded shards -> full; backward takes the local slice
    x = _slice(T, 0, k, r).clone().requires_grad_()
    full = gather_from_group(x, group, 0, full_size=n)
    (full * Cfull).sum().backward()
    out["gather"] = max(_err(full, T), _err(x.grad, _slice(Cfull, 0, k, r)))
    out["local_shape"] = tuple(x.shape) == local_shape((n, 7), PlanShard(0), k)

    # scatter_to_group: every rank's loss uses its own slice; the reference sums them
    ref = T.clone().requires_grad_()
    sum((_slice(ref, 0, k, i) * C[i]).sum() for i in range(k)).backward()
    t = T.clone().requires_grad_()
    local = scatter_to_group(t, group, 0)
    (local * C[r]).sum().backward()
    out["scatter"] = max(_err(local, _slice(T, 0, k, r)), _err(t.grad, ref.grad))

    # reduce_scatter_to_group: partial sums P[i] -> this rank's slice of their sum
    refs = [p.clone().requires_grad_() for p in P]
    total = sum(refs)
    sum((_slice(total, 0, k, i) * C[i]).sum() for i in range(k)).backward()
    p = P[r].clone().requires_grad_()
    local = reduce_scatter_to_group(p, group, 0)
    (local * C[r]).sum().backward()
    out["reduce_scatter"] = max(_err(local, _slice(total.detach(), 0, k, r)),
                                _err(p.grad, refs[r].grad))

    # all_to_all: Shard(0) (n rows, uneven) -> Shard(1) (7 columns, uneven for k = 2 and 4)
    Ca = [torch.randn(local_shape((n, 7), PlanShard(1), k), generator=g) for _ in range(k)]
    ref = T.clone().requires_grad_()
    sum((_slice(ref, 1, k, i) * Ca[i]).sum() for i in range(k)).backward()
    x = _slice(T, 0, k, r).clone().requires_grad_()
    y = all_to_all(x, group, scatter_dim=1, gather_dim=0, gather_size=n)
    (y * Ca[r]).sum().backward()
    out["all_to_all"] = max(_err(y, _slice(T, 1, k, r)), _err(x.grad, _slice(ref.grad, 0, k, r)))
    return out


def _counted(group, k):
    """A fixed sequence of collectives with a counter; bytes are checked by hand in the test."""
    counter = CommCounter()
    x = torch.ones(4, 6, requires_grad=True)                   # 24 fp32 = 96 bytes
    y = reduce_from_group(copy_to_group(x, group, counter=counter), group, counter=counter)
    y.sum().backward()                                        # f backward: one all-reduce
    s = torch.ones(5, 3, requires_grad=True)                   # 5 rows -> 3 per rank on k=2
    gather_from_group(scatter_to_group(s, group, 0, counter=counter), group, 0, full_size=5,
                      counter=counter).sum().backward()
    reduce_scatter_to_group(torch.ones(5, 3, dtype=torch.bfloat16), group, 0, counter=counter)
    all_to_all(torch.ones(3, 4), group, scatter_dim=1, gather_dim=0, counter=counter)
    return [(c.kind, c.nbytes, c.group_size, c.label) for c in counter.records]


def _rank_checks(rank, world):
    results = {}
    mesh = Mesh(dp=2, pp=1, tp=2)
    groups = build_mesh_groups(mesh)
    # Each axis reduced over its own group: the sum of member ranks says who is in it.
    sums = {}
    for axis in ("dp", "tp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups.group(axis))
        sums[axis] = t.item()
    results["groups"] = (groups.coords, groups.dp_ranks, groups.tp_ranks, groups.pp_ranks,
                         groups.pp is None, sums)
    pp_groups = build_mesh_groups(Mesh(dp=1, pp=2, tp=2))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pp_groups.pp)
    results["pp_groups"] = (pp_groups.pp_ranks, t.item(), pp_groups.dp is None)
    try:
        build_mesh_groups(Mesh(dp=2, pp=1, tp=1))
    except XirangError as exc:
        results["wrong_world"] = str(exc)
    world_groups = build_mesh_groups(Mesh(dp=1, pp=1, tp=4))
    # the context and expert axes: each reduced over its own group, as dp and tp above
    for label, mesh in (("cp_ep4", Mesh(dp=2, pp=1, tp=1, cp=2, ep=4)), ("ep2", Mesh(dp=4, pp=1, tp=1, ep=2))):
        named = build_mesh_groups(mesh)
        sums = {}
        for axis in ("dp", "cp", "ep", "edp"):
            t = torch.tensor([float(rank)])
            if named.group(axis) is not None:
                dist.all_reduce(t, group=named.group(axis))
            sums[axis] = t.item()
        results[label] = (sums, {axis: named.ranks(axis) for axis in ("dp", "cp", "ep", "edp")},
                          named.group("edp") is named.group("dp"), named.group("ep") is named.group("cp"))

    tp, k2, r2 = groups.tp, 2, groups.axis_index("tp")
    results["mlp_tp2"] = _megatron_mlp(tp, k2, r2)
    results["mlp_tp4"] = _megatron_mlp(world_groups.tp, world, rank)
    for n in (4, 5):  # even and uneven on 2 ranks
        results[f"tp2_n{n}"] = _uneven_checks(tp, k2, r2, n)
    for n in (5, 8):  # n=5 on 4 ranks: 2, 2, 1 + 1 pad, 0 + 2 pad
        results[f"tp4_n{n}"] = _uneven_checks(world_groups.tp, world, rank, n)
    results["counted"] = _counted(tp, k2)
    return results


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_checks, WORLD, timeout_s=120)


def test_mesh_groups_members_and_coords(ranks):
    mesh = Mesh(dp=2, pp=1, tp=2)
    for rank, result in enumerate(ranks):
        coords, dp_ranks, tp_ranks, pp_ranks, pp_is_none, sums = result["groups"]
        assert coords == mesh.coords(rank)
        assert (dp_ranks, tp_ranks, pp_ranks) == (mesh.group("dp", rank), mesh.group("tp", rank),
                                                  (rank,))
        assert pp_is_none  # size-1 axis: no process group, collectives are identity
        assert sums == {"dp": float(sum(dp_ranks)), "tp": float(sum(tp_ranks))}
        pp_ranks, pp_sum, dp_is_none = result["pp_groups"]
        assert pp_ranks == Mesh(1, 2, 2).group("pp", rank) and pp_sum == sum(pp_ranks)
        assert dp_is_none


def test_mesh_groups_of_the_context_and_expert_axes(ranks):
    """cp, ep and edp groups are created from the mesh like dp's; an axis whose groups are an earlier
    axis's shares its handle (no second communicator for the same ranks)."""
    for rank, result in enumerate(ranks):
        for label, mesh in (("cp_ep4", Mesh(dp=2, pp=1, tp=1, cp=2, ep=4)), ("ep2", Mesh(dp=4, pp=1, tp=1, ep=2))):
            sums, members, edp_is_dp, ep_is_cp = result[label]
            assert members == {axis: mesh.group(axis, rank) for axis in ("dp", "cp", "ep", "edp")}, (label, rank)
            assert sums == {axis: float(sum(members[axis])) for axis in members}, (label, rank)
        assert result["cp_ep4"][1]["ep"] == (0, 1, 2, 3) and result["cp_ep4"][1]["edp"] == (rank,)
        assert result["ep2"][1]["ep"] == ((0, 1) if rank < 2 else (2, 3))  # ep innermost over the dp ranks
        assert result["ep2"][1]["edp"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert not result["ep2"][2] and not result["ep2"][3]  # distinct groups, each its own handle


def test_mesh_groups_refuse_wrong_world_size(ranks):
    assert "needs 2 ranks but the process group has 4" in ranks[0]["wrong_world"]


@pytest.mark.parametrize("key", ["mlp_tp2", "mlp_tp4"])
def test_copy_and_reduce_match_unsharded_mlp(ranks, key):
    for rank, result in enumerate(ranks):
        assert result[key] < 1e-5, f"rank {rank}: max error {result[key]}"


@pytest.mark.parametrize("case", ["tp2_n4", "tp2_n5", "tp4_n5", "tp4_n8"])
@pytest.mark.parametrize("op", ["gather", "scatter", "reduce_scatter", "all_to_all"])
def test_collective_forward_and_backward_match_reference(ranks, case, op):
    for rank, result in enumerate(ranks):
        assert result[case]["local_shape"]
        assert result[case][op] < 1e-5, f"rank {rank} {case} {op}: max error {result[case][op]}"


def test_counter_bytes_by_hand(ranks):
    # tp group of 2. fp32 = 4 bytes, bf16 = 2; nbytes is one rank's full buffer (cost model).
    expected = [
        ("all_reduce", 96, 2, "reduce_from_group.forward"),       # 4x6 fp32
        ("all_reduce", 96, 2, "copy_to_group.backward"),          # its gradient
        ("all_gather", 72, 2, "gather_from_group.forward"),       # 2 ranks x 3x3 (1 pad row)
        ("all_gather", 72, 2, "scatter_to_group.backward"),       # gradient, same padded size
        ("reduce_scatter", 36, 2, "reduce_scatter_to_group.forward"),  # 6x3 bf16 (padded)
        ("all_to_all", 48, 2, "all_to_all.forward"),              # 3x4 fp32 send buffer
    ]
    for rank, result in enumerate(ranks):
        assert result["counted"] == expected, f"rank {rank}"


# --- one rank, no process group: group=None means "this rank alone", every collective is identity

def test_world_one_mesh_groups_need_no_process_group():
    groups = build_mesh_groups(Mesh(1, 1, 1))
    assert (groups.rank, groups.coords) == (0, {"pp": 0, "dp": 0, "cp": 0, "tp": 0})
    assert groups.group("cp") is groups.group("ep") is groups.group("edp") is None
    assert groups.group("dp") is groups.group("pp") is groups.group("tp") is None
    assert groups.ranks("tp") == (0,)


def test_world_one_mesh_of_several_ranks_says_how_to_launch():
    with pytest.raises(XirangError,
                       match="mesh dp=2 x pp=1 x tp=2 has 4 ranks but torch.distributed is not"):
        build_mesh_groups(Mesh(2, 1, 2))


def test_world_one_collectives_are_identity_and_count_nothing():
    counter = CommCounter()
    x = torch.randn(5, 3, requires_grad=True)
    outs = [copy_to_group(x, None, counter=counter), reduce_from_group(x, None, counter=counter),
            gather_from_group(x, None, 0, counter=counter),
            scatter_to_group(x, None, -1, counter=counter),
            reduce_scatter_to_group(x, None, 1, counter=counter),
            all_to_all(x, None, scatter_dim=1, gather_dim=0, counter=counter)]
    sum(o.sum() for o in outs).backward()
    assert all(torch.equal(o, x) for o in outs)
    assert torch.equal(x.grad, torch.full((5, 3), 6.0))
    assert counter.records == []
    assert gather_from_group(x, None, 0, full_size=5) is x  # one rank: nothing was padded


def test_bad_dims_say_what_is_valid():
    with pytest.raises(IndexError, match=r"dim 2 is out of range for a tensor of shape \(5, 3\)"):
        scatter_to_group(torch.zeros(5, 3), None, 2)
    with pytest.raises(IndexError, match="0-dim tensor cannot be sharded"):
        gather_from_group(torch.tensor(1.0), None, 0)
    with pytest.raises(ValueError, match=r"a dim of 9 elements on 1 ranks is held as ceil\(9/1\) = 9"):
        gather_from_group(torch.zeros(5, 3), None, 0, full_size=9)
    with pytest.raises(ValueError, match="scatter_dim and gather_dim are both 1"):
        all_to_all(torch.zeros(5, 3), None, scatter_dim=1, gather_dim=-1)
