"""The mesh of named axes: rank layout (pp, dp, cp, tp), ep folded over dp x cp, groups, validation, JSON."""
import json

import pytest

from xirang.ir.errors import XirangError
from xirang.ir.mesh import AXES, RANK_AXES, Mesh

# dp=2, pp=2, tp=2, pp outermost, tp innermost: rank = pp*4 + dp*2 + tp, written out by hand
COORDS_222 = {
    0: {"pp": 0, "dp": 0, "cp": 0, "tp": 0},
    1: {"pp": 0, "dp": 0, "cp": 0, "tp": 1},
    2: {"pp": 0, "dp": 1, "cp": 0, "tp": 0},
    3: {"pp": 0, "dp": 1, "cp": 0, "tp": 1},
    4: {"pp": 1, "dp": 0, "cp": 0, "tp": 0},
    5: {"pp": 1, "dp": 0, "cp": 0, "tp": 1},
    6: {"pp": 1, "dp": 1, "cp": 0, "tp": 0},
    7: {"pp": 1, "dp": 1, "cp": 0, "tp": 1},
}


def test_axes_order_is_megatron_tp_cp_ep_dp_pp_read_outermost_first():
    assert RANK_AXES == ("pp", "dp", "cp", "tp")
    assert AXES == ("pp", "dp", "cp", "tp", "edp", "ep")


def test_size_and_axis_size():
    mesh = Mesh(dp=2, pp=3, tp=4)
    assert (mesh.size, mesh.cp, mesh.ep, mesh.edp) == (24, 1, 1, 2)
    assert mesh.shape == (3, 2, 1, 4)
    assert [mesh.axis_size(axis) for axis in AXES] == [3, 2, 1, 4, 2, 1]
    assert str(mesh) == "dp=2 x pp=3 x tp=4"  # cp and ep only where over 1
    assert str(Mesh(dp=2, pp=1, tp=2, cp=2, ep=4)) == "dp=2 x pp=1 x cp=2 x tp=2, ep=4"
    assert Mesh(dp=2, pp=1, tp=2, cp=2, ep=4).describe() == (
        "pp=1 x dp=2 x cp=2 x tp=2 (ranks laid out pp outermost, tp innermost); ep=4 folded over dp x cp, edp=1")


def test_unknown_axis_lists_valid_axes():
    with pytest.raises(ValueError, match="'sp'.*pp, dp, cp, tp, edp, ep"):
        Mesh(1, 1, 1).axis_size("sp")
    with pytest.raises(ValueError, match="pp, dp, cp, tp, edp, ep"):
        Mesh(1, 1, 1).groups("dim")


@pytest.mark.parametrize("kwargs,axis", [(dict(dp=0, pp=1, tp=1), "dp"), (dict(dp=1, pp=-2, tp=1), "pp"),
                                         (dict(dp=1, pp=1, tp=2.0), "tp"), (dict(dp=True, pp=1, tp=1), "dp"),
                                         (dict(dp=1, pp=1, tp=1, cp=0), "cp"), (dict(dp=1, pp=1, tp=1, ep=-1), "ep")])
def test_rejects_non_positive_sizes_naming_the_axis(kwargs, axis):
    with pytest.raises(XirangError, match=f"Mesh {axis} .*positive int") as error:
        Mesh(**kwargs)
    assert error.value.where == f"Mesh({axis}=...)" and "1 or more" in error.value.hint


def test_ep_must_divide_dp_times_cp_and_the_error_says_which_values_do():
    with pytest.raises(XirangError, match=r"ep=3 does not divide dp x cp = 2 x 2 = 4") as error:
        Mesh(dp=2, pp=1, tp=1, cp=2, ep=3)
    assert "1, 2, 4" in error.value.hint
    assert Mesh(dp=2, pp=1, tp=1, cp=2, ep=4).edp == 1


def test_cp_and_ep_are_keyword_only():
    with pytest.raises(TypeError):
        Mesh(1, 1, 1, 2)


def test_coords_and_rank_of_222():
    mesh = Mesh(2, 2, 2)
    for rank, coords in COORDS_222.items():
        assert mesh.coords(rank) == coords
        assert mesh.rank_of(**coords) == rank
        assert mesh.rank_of(**{k: v for k, v in coords.items() if k != "cp"}) == rank  # size-1 axes may be left out


def test_coords_uneven_mesh_with_cp():
    mesh = Mesh(dp=3, pp=2, tp=4, cp=2)  # rank = pp*24 + dp*8 + cp*4 + tp
    assert mesh.coords(13) == {"pp": 0, "dp": 1, "cp": 1, "tp": 1}
    assert mesh.rank_of(pp=1, dp=2, cp=0, tp=3) == 43
    assert [mesh.rank_of(**mesh.coords(r)) for r in range(mesh.size)] == list(range(48))


def test_groups_222():
    mesh = Mesh(2, 2, 2)
    assert mesh.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.groups("cp") == tuple((r,) for r in range(8))
    assert (mesh.group("tp", 5), mesh.group("dp", 5), mesh.group("pp", 5)) == ((4, 5), (5, 7), (1, 5))
    assert mesh.groups("edp") == mesh.groups("dp") and mesh.groups("ep") == mesh.groups("cp")  # ep = 1


def test_ep_is_folded_over_dp_and_cp_with_ep_innermost():
    # dp=2, cp=2, tp=2: the (dp, cp) places of tp rank 0 are ranks 0, 2, 4, 6 (f = dp*2 + cp)
    mesh = Mesh(dp=2, pp=1, tp=2, cp=2, ep=2)
    assert mesh.groups("cp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))  # f = 0,1 and f = 2,3: consecutive places
    assert mesh.groups("edp") == ((0, 4), (1, 5), (2, 6), (3, 7))  # the same expert: f = 0,2 and f = 1,3
    assert [mesh.index("ep", r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [mesh.index("edp", r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    folded = Mesh(dp=4, pp=2, tp=1, ep=4)  # every dp rank of a stage holds other experts: edp = 1
    assert folded.groups("ep") == ((0, 1, 2, 3), (4, 5, 6, 7)) and folded.groups("edp") == tuple((r,) for r in range(8))


@pytest.mark.parametrize("order", [("pp", "dp", "cp", "tp"), ("dp", "pp", "cp", "tp")])
def test_groups_partition_ranks_on_every_axis(order):
    mesh = Mesh(dp=2, pp=3, tp=2, cp=2, ep=2, order=order)
    for axis in AXES:
        groups = mesh.groups(axis)
        assert len(groups) == mesh.size // mesh.axis_size(axis)
        assert all(len(g) == mesh.axis_size(axis) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for rank in range(mesh.size):
            assert rank in mesh.group(axis, rank) and mesh.group(axis, rank).index(rank) == mesh.index(axis, rank)
            kept = [a for a in RANK_AXES if a != axis and not (axis in ("ep", "edp") and a in ("dp", "cp"))]
            # the definition: a group's members share every rank coordinate but its axis (ep and edp: pp and tp)
            assert all(mesh.index(a, member) == mesh.index(a, rank) for member in mesh.group(axis, rank)
                       for a in kept), (axis, rank)
            other = "edp" if axis == "ep" else "ep" if axis == "edp" else None
            if other:  # and an expert group keeps the other expert axis's index
                assert {mesh.index(other, member) for member in mesh.group(axis, rank)} == {mesh.index(other, rank)}


def test_dp_outermost_order_numbers_ranks_dp_first():
    # Megatron-Core's tp-cp-ep-pp-dp: rank = dp*4 + pp*2 + tp, the layout before the mesh was named
    mesh = Mesh(dp=2, pp=2, tp=2, order=["dp", "pp", "cp", "tp"])
    assert mesh.order == ("dp", "pp", "cp", "tp") and mesh.shape == (2, 2, 1, 2)
    assert [mesh.rank_of(dp=d, pp=p, tp=t) for d in range(2) for p in range(2) for t in range(2)] == list(range(8))
    assert mesh.groups("pp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert str(mesh) == "dp=2 x pp=2 x tp=2 (dp outermost)" and mesh.describe().startswith("dp=2 x pp=2 x cp=1 x tp=2")
    experts = Mesh(dp=2, pp=2, tp=1, cp=2, ep=2, order=("dp", "pp", "cp", "tp"))  # rank = dp*4 + pp*2 + cp
    assert experts.group("ep", 0) == (0, 1) and experts.group("edp", 0) == (0, 4)  # f = dp*2 + cp, as pp-outermost


def test_an_order_xirang_does_not_lay_out_is_refused_with_the_ones_it_does():
    for bad in (("tp", "cp", "dp", "pp"), ("pp", "dp", "tp", "cp"), ("pp", "dp", "tp"), "pp-dp-cp-tp"):
        with pytest.raises(XirangError, match="not a rank order") as error:
            Mesh(dp=1, pp=1, tp=1, order=bad)
        assert error.value.where == "Mesh(order=...)" and "('dp', 'pp', 'cp', 'tp')" in error.value.hint


def test_tp_groups_are_contiguous():
    mesh = Mesh(dp=2, pp=2, tp=4)
    assert mesh.groups("tp") == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))


def test_trivial_axis_groups_are_singletons():
    assert Mesh(1, 1, 4).groups("dp") == ((0,), (1,), (2,), (3,))
    assert Mesh(1, 1, 1).groups("tp") == ((0,),)


def test_rank_errors_state_valid_range():
    mesh = Mesh(2, 2, 2)
    for bad in (8, -1, 1.0):
        with pytest.raises(ValueError, match=r"valid ranks 0\.\.7"):
            mesh.coords(bad)
    with pytest.raises(ValueError, match=r"valid ranks 0\.\.7"):
        mesh.group("tp", 8)
    with pytest.raises(ValueError, match=r"tp=2 is out of range.*0\.\.1"):
        mesh.rank_of(dp=0, pp=0, tp=2)
    with pytest.raises(ValueError, match=r"missing \['tp'\]"):
        mesh.rank_of(dp=0, pp=0)
    with pytest.raises(ValueError, match=r"unknown \['ep'\].*group\('ep', rank\)"):
        mesh.rank_of(dp=0, pp=0, tp=0, ep=0)


def test_json_names_every_axis_and_round_trips():
    mesh = Mesh(dp=4, pp=2, tp=8)
    assert mesh.to_json() == {"pp": 2, "dp": 4, "cp": 1, "tp": 8, "ep": 1, "order": ["pp", "dp", "cp", "tp"]}
    assert Mesh.from_json(json.loads(json.dumps(mesh.to_json()))) == mesh
    named = Mesh(dp=4, pp=1, tp=1, cp=2, ep=8)
    assert Mesh.from_json(named.to_json()) == named
    dp_outer = Mesh(dp=2, pp=2, tp=2, order=("dp", "pp", "cp", "tp"))
    assert Mesh.from_json(json.loads(json.dumps(dp_outer.to_json()))) == dp_outer != Mesh(2, 2, 2)


def test_from_json_refuses_the_old_three_axis_mesh_saying_to_replan():
    with pytest.raises(XirangError, match="older Xirang.*dp outermost") as error:
        Mesh.from_json({"dp": 1, "pp": 1, "tp": 1})
    assert "re-plan" in error.value.hint


@pytest.mark.parametrize("bad", [{"dp": 1, "pp": 1}, {"dp": 1, "pp": 1, "tp": 1, "ep": 1}, [1, 1, 1]])
def test_from_json_rejects_bad_keys(bad):
    with pytest.raises(ValueError, match="exactly the keys pp, dp, cp, tp, ep .* and order"):
        Mesh.from_json(bad)


def test_hashable_and_frozen():
    assert len({Mesh(1, 2, 4), Mesh(1, 2, 4), Mesh(2, 1, 4), Mesh(1, 2, 4, ep=1), Mesh(2, 1, 4, ep=2)}) == 3
    with pytest.raises(AttributeError):
        Mesh(1, 1, 1).tp = 2
