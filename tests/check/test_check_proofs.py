"""The proofs on hand-written logs: what each backend's ordering makes a deadlock, and the class moves."""
from __future__ import annotations

from xirang.codegen.check.deadlock import Orbits, call_graph, closed_axes
from xirang.codegen.check.proofs import (ClassLog, Move, move_between, prove_collectives, prove_no_deadlock,
                                         prove_sends)
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
    nccl = prove_no_deadlock(PIPE, classes, ordered_pairs=True)
    assert len(nccl) == 1 and nccl[0].proof == "deadlock" and set(nccl[0].ranks) == {0, 1}
    assert "NCCL" in nccl[0].what and "batch_isend_irecv" in nccl[0].hint
    assert prove_no_deadlock(PIPE, classes, ordered_pairs=False) == []  # gloo: tags


def test_the_same_messages_in_a_consistent_order_pass_under_nccl():
    assert prove_no_deadlock(PIPE, _crossing("send"), ordered_pairs=True) == []


def test_a_blocking_collective_between_crossing_calls_deadlocks_on_any_backend():
    """Each rank waits in an all-reduce of the world before posting the message the other waits for."""
    world = {"kind": "all_reduce", "group": (0, 1), "dtype": "float32", "count": 1, "op": "SUM", "blocking": True}
    rank0 = [_message("recv", 0, 1, 1) | {"kind": "recv"}, world, _message("send", 0, 1, 2)]
    rank1 = [_message("recv", 1, 0, 2), world, _message("send", 1, 0, 1)]
    rank0[0]["blocking"] = True  # a receive waited on at once
    rank1[0]["blocking"] = True
    classes = [ClassLog(_log(0, rank0), (0,)), ClassLog(_log(1, rank1), (1,))]
    assert prove_no_deadlock(PIPE, classes, ordered_pairs=False)


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


def _pipeline_classes(mesh, crossing_at=None):
    """Every rank of a dp x pp=2 x tp mesh: an all-reduce on its tp group, then a message to or from its
    pipeline peer (rank at pp 0 sends, pp 1 receives); ``crossing_at``: that rank at pp 1 sends before it
    receives instead, its peer receiving first too, so the two wait on each other under NCCL. Classes:
    one per pipeline rank, and the crossing pair's two ranks each a class of its own."""
    def calls(rank):
        peer = mesh.rank_of(**{**mesh.coords(rank), "pp": 1 - mesh.coords(rank)["pp"]})
        tp = {"kind": "all_reduce", "group": mesh.group("tp", rank), "dtype": "float32", "count": 8, "op": "SUM"}
        first, second = (_message("send", rank, peer, 1), _message("recv", rank, peer, 2)) \
            if mesh.coords(rank)["pp"] == 0 else (_message("recv", rank, peer, 1), _message("send", rank, peer, 2))
        if crossing_at is not None and crossing_at in (rank, peer):
            first, second = (_message("recv", rank, peer, 2), _message("send", rank, peer, 1)) \
                if mesh.coords(rank)["pp"] == 0 else (_message("recv", rank, peer, 1), _message("send", rank, peer, 2))
        return [tp, first, second]

    own = set()
    if crossing_at is not None:
        own = {crossing_at, mesh.rank_of(**{**mesh.coords(crossing_at), "pp": 0})}
    by_pp: dict = {}
    for rank in range(mesh.size):
        by_pp.setdefault(("own", rank) if rank in own else mesh.coords(rank)["pp"], []).append(rank)
    return [ClassLog(RankLog(members[0], mesh.coords(members[0]),
                             [Call(index=i, **fields) for i, fields in enumerate(calls(members[0]))]), tuple(members))
            for members in by_pp.values()]


def test_the_quotient_by_the_closed_axes_finds_what_the_whole_world_finds():
    mesh = Mesh(dp=4, pp=2, tp=2)
    healthy = _pipeline_classes(mesh)
    class_of = {member: index for index, klass in enumerate(healthy) for member in klass.members}
    assert closed_axes(mesh, class_of) == ("dp", "tp")  # each pipeline rank one class
    parties, *_ = call_graph(mesh, healthy, move_between, ordered_pairs=True)
    whole, *_ = call_graph(mesh, healthy, move_between, ordered_pairs=True, quotient=False)
    # the world: 8 tp all-reduces, 8 pipeline pairs' 2 messages; the quotient: one per orbit (a tp group is
    # its own image under a tp shift, so its orbit holds 4 groups, a message's 8)
    assert (len(whole), len(parties)) == (8 + 16, 2 + 2)
    assert prove_no_deadlock(mesh, healthy, ordered_pairs=True) == []
    faulty = _pipeline_classes(mesh, crossing_at=mesh.rank_of(dp=2, pp=1, tp=1))
    class_of = {member: index for index, klass in enumerate(faulty) for member in klass.members}
    assert closed_axes(mesh, class_of) == ()  # the crossing pair's classes hold one rank each
    for quotient in (True, False):
        found = prove_no_deadlock(mesh, faulty, ordered_pairs=True, quotient=quotient)
        assert len(found) == 1 and set(found[0].ranks) == {mesh.rank_of(dp=2, pp=0, tp=1),
                                                           mesh.rank_of(dp=2, pp=1, tp=1)}


def test_a_group_orbit_has_one_canonical_member():
    mesh = Mesh(dp=4, pp=2, tp=2)
    orbits = Orbits(mesh, ("dp", "tp"))
    for axis, orbits_of_axis in (("dp", 2), ("tp", 2), ("pp", 1)):  # one orbit per pipeline rank, one of pp
        named = {orbits.group(tuple(sorted(mesh.group(axis, rank)))) for rank in range(mesh.size)}
        assert len(named) == orbits_of_axis
    pair = {orbits.message(rank, mesh.rank_of(**{**mesh.coords(rank), "pp": 1})) for rank in range(mesh.size)
            if mesh.coords(rank)["pp"] == 0}
    assert pair == {(0, mesh.rank_of(dp=0, pp=1, tp=0))}  # ... and the pipeline messages into one
    odd = (mesh.rank_of(dp=0, pp=0, tp=0), mesh.rank_of(dp=2, pp=0, tp=0))  # a group of every second dp rank
    assert orbits.group(odd) == orbits.group((mesh.rank_of(dp=1, pp=0, tp=1), mesh.rank_of(dp=3, pp=0, tp=1)))
    assert orbits.group(odd) != orbits.group((mesh.rank_of(dp=0, pp=0, tp=0), mesh.rank_of(dp=1, pp=0, tp=0)))


def test_a_move_by_arithmetic_is_the_move_by_coordinates():
    """Move shifts ranks by strides (the proofs move hundreds of thousands); it must equal shifting mesh.coords
    modulo each axis, on either rank order and with cp, for single ranks and for large groups alike."""
    for mesh in (Mesh(dp=4, pp=3, tp=2, cp=2), Mesh(dp=4, pp=3, tp=2, order=("dp", "pp", "cp", "tp"))):
        delta = {"dp": 3, "pp": -1, "tp": 1, "cp": 1 if mesh.cp > 1 else 0}
        move = Move(mesh, delta)
        def by_coordinates(rank, mesh=mesh, delta=delta):
            coords = mesh.coords(rank)
            return mesh.rank_of(**{axis: (coords[axis] + delta[axis]) % mesh.axis_size(axis) for axis in coords})
        assert [move(rank) for rank in range(mesh.size)] == [by_coordinates(rank) for rank in range(mesh.size)]
        world = tuple(range(mesh.size))  # over 64 ranks: moved as an array
        assert move.group(world) == world
        assert move.group(world[:65]) == tuple(sorted(by_coordinates(rank) for rank in world[:65]))
        source, target = 5, mesh.size - 3
        assert move_between(mesh, source, target)(source) == target
