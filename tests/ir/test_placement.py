"""Placements on one mesh axis: validation, printing, JSON, local shapes."""
import json

import pytest
import sympy

from xirang.ir.placement import (PlanPartial, PlanReplicate, PlanShard, held_fraction, local_shape,
                                 placement_from_json)


def test_str():
    assert str(PlanShard(0)) == "S(0)"
    assert str(PlanShard(2)) == "S(2)"
    assert str(PlanReplicate()) == "R"
    assert str(PlanPartial()) == "P(sum)"
    assert str(PlanPartial("max")) == "P(max)"


def test_equal_and_hashable():
    assert PlanShard(1) == PlanShard(dim=1) and PlanShard(1) != PlanShard(0)
    assert PlanReplicate() == PlanReplicate()
    assert PlanPartial() == PlanPartial("sum") != PlanPartial("avg")
    assert len({PlanShard(0), PlanShard(0), PlanReplicate(), PlanReplicate(), PlanPartial(), PlanPartial("min")}) == 4
    assert PlanShard(0) != PlanReplicate()


@pytest.mark.parametrize("dim", [-1, 1.0, "0", True, None])
def test_shard_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="non-negative int"):
        PlanShard(dim)


def test_partial_rejects_bad_op():
    with pytest.raises(ValueError, match="'mean'.*sum, avg, max, min"):
        PlanPartial("mean")


def test_frozen():
    with pytest.raises(AttributeError):
        PlanShard(0).dim = 1


@pytest.mark.parametrize("placement, expected", [
    (PlanShard(0), {"shard": 0}),
    (PlanShard(3), {"shard": 3}),
    (PlanReplicate(), "replicate"),
    (PlanPartial(), {"partial": "sum"}),
    (PlanPartial("avg"), {"partial": "avg"}),
])
def test_json_round_trip(placement, expected):
    assert placement.to_json() == expected
    text = json.dumps(placement.to_json())
    assert placement_from_json(json.loads(text)) == placement


@pytest.mark.parametrize("bad", ["shard", "Replicate", {"shard": 0, "partial": "sum"}, {"split": 1},
                                 None, 3, []])
def test_from_json_names_bad_value(bad):
    with pytest.raises(ValueError, match="bad placement"):
        placement_from_json(bad)


def test_from_json_bad_inner_values():
    with pytest.raises(ValueError, match="non-negative int"):
        placement_from_json({"shard": -2})
    with pytest.raises(ValueError, match="'prod'"):
        placement_from_json({"partial": "prod"})


def test_local_shape_even_split():
    assert local_shape((8, 6), PlanShard(0), 4) == (2, 6)
    assert local_shape((8, 6), PlanShard(1), 3) == (8, 2)
    assert local_shape([8, 6], PlanShard(1), 1) == (8, 6)


def test_local_shape_uneven_split_pads_up():
    # 5 rows on 4 ranks: each holds ceil(5/4) = 2; the padded dim is 8 (ranks hold 2, 2, 1+1, 0+2)
    assert local_shape((5, 3), PlanShard(0), 4) == (2, 3)
    assert local_shape((10,), PlanShard(0), 4) == (3,)
    assert local_shape((3,), PlanShard(0), 8) == (1,)


def test_local_shape_replicate_and_partial_keep_shape():
    assert local_shape((5, 3), PlanReplicate(), 4) == (5, 3)
    assert local_shape((5, 3), PlanPartial("avg"), 4) == (5, 3)
    assert local_shape((), PlanReplicate(), 2) == ()


def test_local_shape_symbolic():
    batch = sympy.Symbol("batch", integer=True, positive=True)
    (local, hidden) = local_shape((batch, 16), PlanShard(0), 4)
    assert hidden == 16
    assert local.subs(batch, 8) == 2 and local.subs(batch, 9) == 3
    assert local_shape((batch, 16), PlanShard(1), 4) == (batch, 4)


def test_local_shape_errors():
    with pytest.raises(ValueError, match=r"S\(2\) is out of range.*\(4, 4\).*0\.\.1"):
        local_shape((4, 4), PlanShard(2), 2)
    with pytest.raises(ValueError, match="0-dim"):
        local_shape((), PlanShard(0), 2)
    with pytest.raises(ValueError, match="axis_size"):
        local_shape((4,), PlanShard(0), 0)
    with pytest.raises(TypeError, match="not a placement"):
        local_shape((4,), "S(0)", 2)


def test_chunked_shard_prints_round_trips_and_keeps_the_local_shape():
    fused = PlanShard(2, chunks=3)  # Megatron's layout of a fused [q | k | v] projection
    assert str(fused) == "S(2, 3 chunks)" and fused != PlanShard(2) and PlanShard(2, chunks=1) == PlanShard(2)
    assert fused.to_json() == {"shard": 2, "chunks": 3} and PlanShard(2).to_json() == {"shard": 2}
    assert placement_from_json(json.loads(json.dumps(fused.to_json()))) == fused
    assert placement_from_json({"shard": 2, "chunks": 1}) == PlanShard(2)
    assert local_shape((4, 6, 192), fused, 2) == local_shape((4, 6, 192), PlanShard(2), 2) == (4, 6, 96)


@pytest.mark.parametrize("chunks", [0, -3, 1.5, True, "3"])
def test_chunked_shard_rejects_bad_chunks(chunks):
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        PlanShard(1, chunks=chunks)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        placement_from_json({"shard": 1, "chunks": chunks})


def test_shard_in_whole_units_holds_whole_heads_and_round_trips():
    """6 heads of 16 (a dim of 96) on 4 ranks in units of 16: 2 heads a rank, the last rank all padding,
    where unit 1 would give 24 elements (a head and a half); shard_of and unshard agree with it."""
    import torch
    from xirang.codegen.ops.padding import shard_of, unshard
    from xirang.ir.placement import local_shape, real_share, shard_share
    heads = PlanShard(0, unit=16)
    assert str(heads) == "S(0, units of 16)" and placement_from_json(heads.to_json()) == heads
    assert local_shape((96, 8), heads, 4) == (32, 8) and local_shape((96, 8), PlanShard(0), 4) == (24, 8)
    assert [real_share(96, 4, r, 16) for r in range(4)] == [32, 32, 32, 0] and shard_share(110, 4) == 28
    full = torch.arange(96 * 2.0).reshape(96, 2)
    locals_ = [shard_of(full, heads, r, 4) for r in range(4)]
    assert torch.equal(locals_[1], full[32:64]) and not locals_[3].any()
    assert torch.equal(unshard(locals_, heads, 96), full)
    with pytest.raises(ValueError):
        PlanShard(0, chunks=3, unit=16)  # units on a fused layout: not offered


@pytest.mark.parametrize("placement, shape, axis_size", [
    (PlanShard(2, unit=16), (2, 256, 96), 4),  # 6 heads of 16 on 4 ranks: 2 heads a rank, a third
    (PlanShard(2, unit=8), (2, 256, 48), 4),  # 3 kv heads: a head (two units of 8) a rank
    (PlanShard(2), (2, 256, 110), 4),  # an MLP of 110: 28 a rank
    (PlanShard(0), (128, 64), 4),  # even
    (PlanShard(0, pieces=(64, 16, 16), whole=(1, 2)), (96, 64), 2),  # multi-query [q | k | v]: k and v whole
    (PlanReplicate(), (8, 8), 4), (PlanPartial("sum"), (8, 8), 4)])
def test_held_fraction_is_the_local_shapes_share_of_the_whole(placement, shape, axis_size):
    local = local_shape(shape, placement, axis_size)
    whole = sympy.prod(shape)
    assert held_fraction(placement, axis_size, shape[placement.dim] if isinstance(placement, PlanShard) else None) \
        == pytest.approx(float(sympy.prod(local) / whole))


def test_held_fraction_of_a_size_not_known_is_an_even_share():
    assert held_fraction(PlanShard(1), 4, sympy.Symbol("seq")) == 0.25 and held_fraction(PlanShard(1), 4) == 0.25
