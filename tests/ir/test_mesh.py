"""The dp x pp x tp mesh: rank layout, process groups, validation, JSON."""
import json

import pytest

from xirang.ir.mesh import AXES, Mesh

# 2 x 2 x 2, tp innermost: rank = dp*4 + pp*2 + tp, written out by hand
COORDS_222 = {
    0: {"dp": 0, "pp": 0, "tp": 0},
    1: {"dp": 0, "pp": 0, "tp": 1},
    2: {"dp": 0, "pp": 1, "tp": 0},
    3: {"dp": 0, "pp": 1, "tp": 1},
    4: {"dp": 1, "pp": 0, "tp": 0},
    5: {"dp": 1, "pp": 0, "tp": 1},
    6: {"dp": 1, "pp": 1, "tp": 0},
    7: {"dp": 1, "pp": 1, "tp": 1},
}


def test_axes_order():
    assert AXES == ("dp", "pp", "tp")


def test_size_and_axis_size():
    mesh = Mesh(dp=2, pp=3, tp=4)
    assert mesh.size == 24
    assert mesh.shape == (2, 3, 4)
    assert (mesh.axis_size("dp"), mesh.axis_size("pp"), mesh.axis_size("tp")) == (2, 3, 4)
    assert str(mesh) == "dp=2 x pp=3 x tp=4"


def test_unknown_axis_lists_valid_axes():
    with pytest.raises(ValueError, match="'cp'.*dp, pp, tp"):
        Mesh(1, 1, 1).axis_size("cp")
    with pytest.raises(ValueError, match="dp, pp, tp"):
        Mesh(1, 1, 1).groups("dim")


@pytest.mark.parametrize("kwargs", [dict(dp=0, pp=1, tp=1), dict(dp=1, pp=-2, tp=1),
                                    dict(dp=1, pp=1, tp=2.0), dict(dp=True, pp=1, tp=1)])
def test_rejects_non_positive_sizes(kwargs):
    with pytest.raises(ValueError, match="positive int"):
        Mesh(**kwargs)


def test_coords_and_rank_of_222():
    mesh = Mesh(2, 2, 2)
    for rank, coords in COORDS_222.items():
        assert mesh.coords(rank) == coords
        assert mesh.rank_of(**coords) == rank


def test_coords_uneven_mesh():
    mesh = Mesh(dp=3, pp=2, tp=4)  # rank = dp*8 + pp*4 + tp
    assert mesh.coords(13) == {"dp": 1, "pp": 1, "tp": 1}
    assert mesh.rank_of(dp=2, pp=0, tp=3) == 19
    assert [mesh.rank_of(**mesh.coords(r)) for r in range(mesh.size)] == list(range(24))


def test_groups_222():
    mesh = Mesh(2, 2, 2)
    assert mesh.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.groups("pp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.group("tp", 5) == (4, 5)
    assert mesh.group("pp", 5) == (5, 7)
    assert mesh.group("dp", 5) == (1, 5)


def test_groups_partition_ranks():
    mesh = Mesh(dp=2, pp=3, tp=4)
    for axis in AXES:
        groups = mesh.groups(axis)
        assert len(groups) == mesh.size // mesh.axis_size(axis)
        assert all(len(g) == mesh.axis_size(axis) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for rank in range(mesh.size):
            assert rank in mesh.group(axis, rank)


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
    with pytest.raises(ValueError, match=r"unknown \['ep'\]"):
        mesh.rank_of(dp=0, pp=0, tp=0, ep=0)


def test_json_round_trip():
    mesh = Mesh(dp=4, pp=2, tp=8)
    assert mesh.to_json() == {"dp": 4, "pp": 2, "tp": 8}
    assert Mesh.from_json(json.loads(json.dumps(mesh.to_json()))) == mesh


@pytest.mark.parametrize("bad", [{"dp": 1, "pp": 1}, {"dp": 1, "pp": 1, "tp": 1, "ep": 1}, [1, 1, 1]])
def test_from_json_rejects_bad_keys(bad):
    with pytest.raises(ValueError, match="exactly the keys dp, pp, tp"):
        Mesh.from_json(bad)


def test_hashable_and_frozen():
    assert len({Mesh(1, 2, 4), Mesh(1, 2, 4), Mesh(2, 1, 4)}) == 2
    with pytest.raises(AttributeError):
        Mesh(1, 1, 1).tp = 2
