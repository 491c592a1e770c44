"""The proofs on hand-written logs: what each backend's ordering makes a deadlock, and the class moves."""
from __future__ import annotations

from xirang.codegen.check.proofs import ClassLog, Move, prove_collectives, prove_no_deadlock, prove_sends
from xirang.codegen.check.records import Call, RankLog
from xirang.ir.mesh import Mesh

PIPE = Mesh(dp=1, pp=2, tp=1)


def _log(rank, calls):
    return RankLog(rank=rank, coords=PIPE.coords(rank),
                   calls=[Call(index=i, **fields) for i, fields in enumerate(calls)])


def _message(kind, me, peer, tag):
    return {"kind": kind, "group": (me, peer), "dtype": "float32", "count": 4, "peer": peer, "tag": tag,
            "shape": (4,)}


def _crossing(first_on_1):
    """Rank 0 receives (tag 1) then sends (tag 2); rank 1 does the same in the order given."""
    rank0 = [_message("recv", 0, 1, 1), _message("send", 0, 1, 2)]
    rank1 = [_message("recv", 1, 0, 2), _message("send", 1, 0, 1)] if first_on_1 == "recv" else \
        [_message("send", 1, 0, 1), _message("recv", 1, 0, 2)]
    return [ClassLog(_log(0, rank0), (0,)), ClassLog(_log(1, rank1), (1,))]


def test_a_receive_before_a_send_on_both_sides_deadlocks_under_nccl_only():
    classes = _crossing("recv")
    assert prove_sends(PIPE, classes) == []  # every message meets its receive, in order
    nccl = prove_no_deadlock(PIPE, classes, symmetric_dp=False, ordered_pairs=True)
    assert len(nccl) == 1 and nccl[0].proof == "deadlock" and set(nccl[0].ranks) == {0, 1}
    assert "NCCL" in nccl[0].what and "batch_isend_irecv" in nccl[0].hint
    assert prove_no_deadlock(PIPE, classes, symmetric_dp=False, ordered_pairs=False) == []  # gloo: tags


def test_the_same_messages_in_a_consistent_order_pass_under_nccl():
    assert prove_no_deadlock(PIPE, _crossing("send"), symmetric_dp=False, ordered_pairs=True) == []


def test_a_blocking_collective_between_crossing_calls_deadlocks_on_any_backend():
    """Each rank waits in an all-reduce of the world before posting the message the other waits for."""
    world = {"kind": "all_reduce", "group": (0, 1), "dtype": "float32", "count": 1, "op": "SUM", "blocking": True}
    rank0 = [_message("recv", 0, 1, 1) | {"kind": "recv"}, world, _message("send", 0, 1, 2)]
    rank1 = [_message("recv", 1, 0, 2), world, _message("send", 1, 0, 1)]
    rank0[0]["blocking"] = True  # a receive waited on at once
    rank1[0]["blocking"] = True
    classes = [ClassLog(_log(0, rank0), (0,)), ClassLog(_log(1, rank1), (1,))]
    assert prove_no_deadlock(PIPE, classes, symmetric_dp=False, ordered_pairs=False)


def test_collectives_disagreeing_in_count_are_named_with_the_group():
    mesh = Mesh(dp=2, pp=1, tp=1)
    a = {"kind": "all_reduce", "group": (0, 1), "dtype": "float32", "count": 8, "op": "SUM"}
    b = dict(a, count=9)
    classes = [ClassLog(RankLog(0, mesh.coords(0), [Call(0, **a)]), (0,)),
               ClassLog(RankLog(1, mesh.coords(1), [Call(0, **b)]), (1,))]
    found = prove_collectives(mesh, classes)
    assert len(found) == 1 and found[0].group == (0, 1) and "x8" in found[0].calls[0] and "x9" in found[0].calls[1]


def test_a_class_move_keeps_groups_along_their_axis():
    mesh = Mesh(dp=4, pp=2, tp=2)
    rep, member = mesh.rank_of(dp=0, pp=1, tp=0), mesh.rank_of(dp=3, pp=1, tp=1)
    move = Move(mesh, {a: mesh.coords(member)[a] - mesh.coords(rep)[a] for a in ("dp", "pp", "tp")})
    assert move(rep) == member
    dp_group = mesh.group("dp", rep)
    assert move.group(dp_group) == tuple(sorted(mesh.group("dp", member)))  # wraps along dp, shifts along tp
    assert move.group(mesh.group("pp", rep)) == tuple(sorted(mesh.group("pp", member)))
