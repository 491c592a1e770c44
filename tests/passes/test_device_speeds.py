"""Mixed device kinds: speeds from the roofline, dp shares by pace, cuts that give faster devices more
layers. Every expected figure is worked out here from hand-made unit costs."""
from __future__ import annotations

import pytest

from xirang.ir.device import DeviceSpec, Efficiency, GiB, device_spec
from xirang.ir.errors import InvalidValue
from xirang.ir.world import NodeSpec, World, parse_world
from xirang.passes.planning.device_speeds import cut_speeds, kind_speed, mixed_kinds, shares_by_speed
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_partition import fastest_cuts
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.plan_search_space import candidates
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

EVEN = Efficiency(matmul=0.5, other=0.5, memory=0.5)
SLOW = DeviceSpec("slow", {"bf16": 1e12, "fp32": 1e12}, 8 * GiB, 1e11, efficiency=EVEN)
FAST = DeviceSpec("fast", {"bf16": 2e12, "fp32": 2e12}, 8 * GiB, 2e11, efficiency=EVEN)  # twice SLOW in both



def _pipeline(priced):
    """The priced step less the step's own collectives (batch agreement, loss: ``plan_costs.step_sync``)."""
    return priced.step_seconds - priced.breakdown["step_sync"]


def unit(name, seconds=1.0):
    return UnitCost(name, "block", forward_seconds=seconds / 3, backward_seconds=2 * seconds / 3,
                    tp_comm_forward_seconds=0.0, tp_comm_backward_seconds=0.0, params_local=0,
                    saved_bytes=0.0, selective_saved_bytes=0.0, selective_recompute_seconds=0.0,
                    input_bytes=0.0, cut_bytes_after=0.0, model_flops=0.0, model_forward_flops=0.0)


def price_units(count):
    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        return TensorSplit(tp, micro_batch, seq, [unit(f"block:{i}") for i in range(count)])
    return price


def world(*kinds) -> World:
    return World(tuple(NodeSpec(1, kind) for kind in kinds))


# --- speeds and shares ---------------------------------------------------------------------------

def test_a_kind_speed_follows_the_roofline_part_each_share_of_the_work_is_bound_by():
    """H100 vs A100 at bf16: matmul-bound work at the ratio of sustained matmul rates, memory-bound work
    at the ratio of sustained bandwidths, a mix at the ratio of the summed times."""
    a100, h100 = device_spec("a100-80g"), device_spec("h100-80g")
    mm = lambda d: d.peak("bf16") * d.efficiency.matmul  # noqa: E731
    bw = lambda d: d.memory_bandwidth * d.efficiency.memory  # noqa: E731
    all_matmul = kind_speed(h100, a100, "bf16", compute_seconds=1.0, local_flops=mm(a100))
    assert all_matmul == pytest.approx(mm(h100) / mm(a100))
    no_matmul = kind_speed(h100, a100, "bf16", compute_seconds=1.0, local_flops=0.0)
    assert no_matmul == pytest.approx(bw(h100) / bw(a100))
    half = kind_speed(h100, a100, "bf16", compute_seconds=1.0, local_flops=0.5 * mm(a100))
    assert half == pytest.approx(1.0 / (0.5 * mm(a100) / mm(h100) + 0.5 * bw(a100) / bw(h100)))
    assert kind_speed(a100, h100, "bf16", compute_seconds=1.0, local_flops=0.0) == pytest.approx(1 / no_matmul)
    assert kind_speed(a100, a100, "bf16", compute_seconds=1.0, local_flops=1e12) == 1.0


def test_shares_follow_pace_by_largest_remainder_each_replica_at_least_one():
    assert shares_by_speed((1.0, 2.0), 6) == (2, 4)
    assert shares_by_speed((1.0, 1.0, 1.0), 7) == (3, 2, 2)  # the tie goes to the lower index
    assert shares_by_speed((1.0, 100.0), 2) == (1, 1)  # nobody is left without a micro-batch
    assert sum(shares_by_speed((1.0, 1.7, 2.3, 0.4), 37)) == 37
    assert shares_by_speed((1.0, 2.0), 12, quantum=4) == (4, 8)  # interleaved: whole groups of p
    with pytest.raises(InvalidValue, match="cannot give each of 3"):
        shares_by_speed((1.0, 1.0, 1.0), 2)
    with pytest.raises(InvalidValue, match="positive"):
        shares_by_speed((1.0, 0.0), 4)


def test_cut_speeds_balance_each_pipeline_ranks_busiest_replica():
    """Replica 0 slow everywhere with 2 of 6 micro-batches, replica 1 twice as fast with 4: per unit of
    work both take the same time, so the cut sees one speed on both ranks (None: the uniform problem)."""
    assert cut_speeds(((1.0, 1.0), (2.0, 2.0)), (2, 4)) is None
    # pp rank 1 is fast on both replicas: it may take twice the layers
    assert cut_speeds(((1.0, 2.0), (1.0, 2.0)), (3, 3)) == (1.0, 2.0)


def test_a_mixed_world_is_told_from_a_uniform_one():
    assert mixed_kinds(world(SLOW, FAST)) and not mixed_kinds(world(SLOW, SLOW))
    mixed = parse_world("2x8:a100-80g+1x4:h100-80g")
    assert mixed.size == 20 and mixed.device_of(15).name == "a100-80g" and mixed.device_of(16).name == "h100-80g"
    assert parse_world("1x8:h100-80g").device_of(0).name == "h100-80g"


@pytest.mark.parametrize("spec, says", [("2x8:b300+1x8", "unknown device"), ("2x8:a100-80g+", "is not 'NxM'"),
                                        ("0x8:h100-80g+1x8", "must be > 0")])
def test_a_bad_mixed_world_string_says_which_group(spec, says):
    with pytest.raises(InvalidValue) as error:
        parse_world(spec)
    assert says in str(error.value).lower() or says in str(error.value)


# --- the search on mixed worlds -------------------------------------------------------------------

def test_the_faster_pipeline_rank_gets_more_layers():
    """Six 1 s units on a slow rank 0 and a twice-as-fast rank 1: 2 | 4 units, 2 s per stage either
    way; 1F1B with m = 2: (m + p - 1) x 2 s = 6 s. All-slow planning cuts 3 | 3: 9 s."""
    pins = dict(global_batch=2, seq=8, tp=1, pp=2, micro_batch=1, schedule="1f1b", recompute="none")
    best = search_plan(price_units(6), world(SLOW, FAST), **pins).best
    assert best.bounds == ((0, 2), (2, 6))
    assert _pipeline(best) == pytest.approx(6.0)
    slow = search_plan(price_units(6), world(SLOW, SLOW), **pins).best
    assert slow.bounds == ((0, 3), (3, 6)) and _pipeline(slow) == pytest.approx(9.0)


def test_the_faster_replica_gets_more_micro_batches():
    """Two 1 s units, dp 2 on a slow and a twice-as-fast device, 6 micro-batches: shares (2, 4), each
    replica busy 4 s; even shares would leave the slow one 6 s."""
    pins = dict(global_batch=6, seq=8, tp=1, pp=1, dp=2, micro_batch=1, schedule="1f1b", recompute="none")
    best = search_plan(price_units(2), world(SLOW, FAST), **pins).best
    assert best.micro_batch_shares == (2, 4)
    assert _pipeline(best) == pytest.approx(4.0)
    even = search_plan(price_units(2), world(SLOW, SLOW), **pins).best
    assert even.micro_batch_shares == () and _pipeline(even) == pytest.approx(6.0)


def test_a_fast_reference_device_slows_the_ranks_of_a_slower_kind():
    """Rank 0, the reference the units are priced on, is the fast one: rank 1 runs at speed 1/2 (a unit
    takes it 2 s) and gets the fewer layers, 4 | 2: 4 s on each rank; 1F1B m = 2: 3 x 4 s = 12 s."""
    pins = dict(global_batch=2, seq=8, tp=1, pp=2, micro_batch=1, schedule="1f1b", recompute="none")
    best = search_plan(price_units(6), world(FAST, SLOW), **pins).best
    assert best.bounds == ((0, 4), (4, 6))
    assert _pipeline(best) == pytest.approx(12.0)


def test_the_lower_bound_that_prunes_candidates_holds_on_a_mixed_world():
    """The search skips a candidate whose lower bound passes the best found, so on a mixed World the
    bound must divide by the fastest device's speed: checked on every candidate against its price."""
    mixed = world(SLOW, SLOW, FAST, FAST)
    split = {(1, b): price_units(8)(1, (0,), b, 8) for b in (1, 2, 4, 8)}
    pricer = CandidatePricer(split, mixed, global_batch=8)
    todo = [c for c in candidates(mixed, 8, 8, has_blocks=True, pins={"tp": 1}) if c.offload == "none"]
    assert len(todo) > 20
    for c in todo:
        bounds = fastest_cuts(pricer.table(c), c.stages, pricer.cut_speeds(c))
        assert pricer.lower_bound(c) <= pricer.price(c, bounds).step_seconds * (1 + 1e-9), c.label()
    best = search_plan(price_units(8), mixed, global_batch=8, seq=8, tp=1).best
    as_if_slow = search_plan(price_units(8), world(SLOW, SLOW, SLOW, SLOW), global_batch=8, seq=8, tp=1).best
    assert best.step_seconds < as_if_slow.step_seconds
