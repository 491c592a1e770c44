"""Degree search on hand-made unit costs: every expected step, cut and choice is worked out here."""
from __future__ import annotations

import math

import pytest

from xirang.ir.errors import XirangError
from xirang.ir.device import GiB, DeviceSpec
from xirang.ir.world import World, parse_world
from xirang.passes.planning.cost_model import SCHEDULES
from xirang.passes.planning.plan_partition import UnitTable, fit_stages, least_memory_cuts
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.plan_search_space import Candidate, candidates, in_flight_by_rank
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost



def _pipeline(priced):
    """The priced step less the step's own collectives (batch agreement, loss: ``plan_costs.step_sync``)."""
    return priced.step_seconds - priced.breakdown["step_sync"]


def unit(name, seconds=1.0, *, params=0, saved=0.0, selective=None, inputs=0.0, cut=0.0, flops=0.0):
    """A unit whose forward is 40% of ``seconds`` and backward 60%, no tp collectives; selective
    recompute adds 10% of ``seconds``."""
    return UnitCost(name, name.split(":")[0], forward_seconds=0.4 * seconds, backward_seconds=0.6 * seconds,
                    tp_comm_forward_seconds=0.0, tp_comm_backward_seconds=0.0, params_local=params,
                    saved_bytes=saved, selective_saved_bytes=saved if selective is None else selective,
                    selective_recompute_seconds=0.1 * seconds, input_bytes=inputs, cut_bytes_after=cut,
                    model_flops=flops, model_forward_flops=flops / 3)


def pricer(make_units):
    """A price callable from ``make_units(tp, micro_batch) -> [UnitCost]``, counting its calls."""
    calls = []

    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        assert tp_group == tuple(range(tp))
        calls.append((tp, micro_batch))
        return TensorSplit(tp, micro_batch, seq, make_units(tp, micro_batch))
    price.calls = calls
    return price


def tiny_device(memory_bytes: int) -> DeviceSpec:
    return DeviceSpec("tiny", {"bf16": 1e12, "fp32": 1e12}, memory_bytes, 1e9)


# --- cuts, bubble, recompute --------------------------------------------------------------------

def test_two_identical_units_on_two_stages_take_one_each():
    """1F1B, p=2, m=2, 1 s per stage: step = (m + p - 1) * 1 s = 3 s; the bubble is 1 s."""
    price = pricer(lambda tp, b: [unit("block:a"), unit("block:b")])
    best = search_plan(price, parse_world(2), global_batch=2, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="none", schedule="1f1b").best
    assert best.bounds == ((0, 1), (1, 2))
    assert _pipeline(best) == pytest.approx(3.0)
    assert dict(best.breakdown) == pytest.approx({"compute": 2.0, "tp_comm": 0.0, "ep_comm": 0.0, "cp_comm": 0.0,
                                                  "pp_bubble": 1.0,
                                                  "pp_p2p": 0.0, "dp_exposed": 0.0, "offload": 0.0,
                                                  "step_sync": best.breakdown["step_sync"]})
    assert best.breakdown["step_sync"] > 0  # the batch agreement and the loss's broadcast over pp
    assert price.calls == [(1, 1)]  # one split for the one (tp, micro-batch) pinned


def test_heterogeneous_units_cut_where_the_bottleneck_is_least():
    """Units of 1, 1 and 2 s on two stages: {1, 1} | {2} gives a 2 s bottleneck; m = 4 -> 5 x 2 s."""
    price = pricer(lambda tp, b: [unit("segment:0"), unit("block:a"), unit("segment:1", 2.0)])
    best = search_plan(price, parse_world(2), global_batch=4, seq=8, pp=2, micro_batch=1, schedule="1f1b").best
    assert best.bounds == ((0, 2), (2, 3))
    assert _pipeline(best) == pytest.approx(10.0)
    assert best.exact  # the winner was re-cut by solve_stage_cuts


def test_the_bubble_makes_more_micro_batches_win():
    """Unit time grows with b (1 s per sample per stage), so a 1F1B step is (8/b + 1) * b = 8 + b s on
    pp=2: b=1 (m=8) takes 9 s, b=2 10 s, b=4 12 s, b=8 16 s. ZB-H1 leaves only the (p - 1)·T_F ramp
    (T_F = 0.4 b s): 8.4 s at b=1, and wins."""
    price = pricer(lambda tp, b: [unit("block:a", float(b)), unit("block:b", float(b))])
    result = search_plan(price, parse_world(2), global_batch=8, seq=8, tp=1, pp=2, recompute="none")
    assert (result.best.candidate.micro_batch, result.best.candidate.num_micro_batches) == (1, 8)
    assert (result.best.candidate.schedule, _pipeline(result.best)) == ("zb-h1", pytest.approx(8.4))
    one_f_one_b = next(a for a in result.alternatives if a.candidate.schedule == "1f1b")
    assert _pipeline(one_f_one_b) == pytest.approx(9.0)
    assert sorted(price.calls) == [(1, 1), (1, 2), (1, 4), (1, 8)]


def test_interleaving_shrinks_the_bubble():
    """Four 1 s units, pp=2, m=2. 1F1B: 2 s per stage, (2 + 1) x 2 = 6 s. Interleaved v=2: chunks of
    1 s, a device does 2 s per micro-batch, (m + (p-1)/v) x 2 = (2 + 0.5) x 2 = 5 s. ZB-H1 does
    better still: 2 x 2 s + (p - 1)·T_F = 4 + 0.8 = 4.8 s."""
    price = pricer(lambda tp, b: [unit(f"block:{i}") for i in range(4)])
    result = search_plan(price, parse_world(2), global_batch=2, seq=8, tp=1, pp=2, micro_batch=1,
                         recompute="none")
    assert (result.best.candidate.schedule, _pipeline(result.best)) == ("zb-h1", pytest.approx(4.8))
    interleaved = next(a for a in result.alternatives if a.candidate.schedule == "interleaved")
    assert interleaved.candidate.virtual_stages == 2
    assert interleaved.bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert _pipeline(interleaved) == pytest.approx(5.0)
    assert interleaved.breakdown["pp_bubble"] == pytest.approx(1.0)
    assert {(a.candidate.schedule, round(_pipeline(a), 9)) for a in result.alternatives} >= {("1f1b", 6.0)}


def test_a_memory_limit_forces_full_recompute():
    """Four blocks each keeping 100 B (80 B with selective, 10 B input under full), one micro-batch in
    flight, a 300 B device of which 270 B is usable. Every mode's working set has the 100 B of
    gradients a block's backward makes from what it saved. none: 400 + 100 B; selective: 4 x 80 + 20 B
    rebuilt + 100 B = 440 B; full: 4 x 10 + 90 + 100 B = 230 B. Only full fits: 4 x (1 + 0.4) s = 5.6 s."""
    price = pricer(lambda tp, b: [unit(f"block:{i}", saved=100, selective=80, inputs=10) for i in range(4)])
    world = World.uniform(1, 1, tiny_device(300))
    result = search_plan(price, world, global_batch=1, seq=8)
    best = result.best
    assert best.candidate.recompute == "full"
    assert _pipeline(best) == pytest.approx(5.6)
    assert best.memory_per_rank == (pytest.approx(230.0),) and best.usable_per_rank == (pytest.approx(270.0),)
    rejected = {a.candidate.recompute: a.memory_per_rank[0] for a in result.alternatives if not a.fits}
    assert rejected == {"none": pytest.approx(500.0), "selective": pytest.approx(440.0)}


@pytest.mark.parametrize("link, expected", [(1000.0, ("none", "blocks", 8.0, 300.0)),
                                             (10.0, ("full", "none", 11.2, 270.0))])
def test_offload_is_chosen_where_it_beats_recompute_and_fits(link, expected):
    """Eight blocks of 1 s (forward 0.4, backward 0.6) each keeping 100 B (80 B selective, 10 B input),
    one micro-batch, 450 B usable, every mode with 100 B of a backward's gradients. none (900 B) and
    selective (760 B) do not fit; full fits (8 x 10 + 90 + 100 B) at 8 x 1.4 = 11.2 s. Offload keeps two
    blocks on the device (200 + 100 B) and copies 100 B per
    block each way: over a 1000 B/s link 0.1 s, hidden behind the 0.4 s forward and 0.6 s backward,
    so 8 s wins; over 10 B/s, 10 s per copy leaves 9.6 + 9.4 s exposed per block, and full wins."""
    price = pricer(lambda tp, b: [unit(f"block:{i}", saved=100, selective=80, inputs=10) for i in range(8)])
    device = DeviceSpec("tiny", {"bf16": 1e12, "fp32": 1e12}, 500, 1e9, host_link_bytes_per_s=link)
    result = search_plan(price, World.uniform(1, 1, device), global_batch=1, seq=8)
    best = result.best
    assert (best.candidate.recompute, best.candidate.offload) == expected[:2]
    assert _pipeline(best) == pytest.approx(expected[2]) and best.memory_per_rank == (pytest.approx(expected[3]),)
    if link == 10.0:
        slow = search_plan(price, World.uniform(1, 1, device), global_batch=1, seq=8, offload="blocks",
                           recompute="none").best
        assert slow.breakdown["offload"] == pytest.approx(8 * (9.6 + 9.4))
        assert _pipeline(slow) == pytest.approx(8 + 8 * 19.0)


def test_offload_is_not_offered_without_a_host_link_or_on_cpus():
    price = pricer(lambda tp, b: [unit(f"block:{i}", saved=100) for i in range(2)])
    result = search_plan(price, World.uniform(1, 1, tiny_device(10**6)), global_batch=1, seq=8, alternatives=50)
    assert {a.candidate.offload for a in result.alternatives} | {result.best.candidate.offload} == {"none"}
    with pytest.raises(XirangError, match="host link"):
        search_plan(price, World.uniform(1, 1, tiny_device(10**6)), global_batch=1, seq=8, offload="blocks")
    assert not DeviceSpec("cpu", {"fp32": 1e12}, 10**9, 1e9, host_link_bytes_per_s=1e9).offload_frees_memory
    cpu = search_plan(price, parse_world(1, "cpu"), global_batch=1, seq=8, offload="blocks").best  # pinned: runs
    assert cpu.candidate.offload == "blocks"


def test_segments_keep_their_activations_under_recompute():
    """Recompute touches blocks only: the segment's 1000 B stay whatever the mode (and its backward makes
    1000 B of gradients from them, the largest unit's)."""
    price = pricer(lambda tp, b: [unit("segment:0", saved=1000), unit("block:a", saved=100, inputs=10)])
    best = search_plan(price, parse_world(1), global_batch=1, seq=8, recompute="full").best
    assert best.memory_per_rank == (pytest.approx(1000 + 10 + 90 + 1000),)
    assert _pipeline(best) == pytest.approx(1.0 + 1.4)


def test_exposed_gradient_all_reduce_and_tflops():
    """dp=2 on one node, one bucket of 1e6 bf16 gradients (2 MB): the ring all-reduce on 2 ranks
    takes 2 x (5 us + 1 MB / 230 GB/s), all of it after the backward; before it, the 2 MB are staged
    into the bucket (read and written once at the device's memory bandwidth, counted as compute).
    1e12 FLOPs per micro-batch, 2 micro-batches in all over 2 devices: TFLOP/s per device = 1 / step."""
    price = pricer(lambda tp, b: [unit("block:a", params=1_000_000, flops=1e12)])
    world = parse_world(2)
    best = search_plan(price, world, global_batch=2, seq=8, dp=2, recompute="none").best
    ring = 2 * (5e-6 + 1e6 / 230e9)
    device = world.nodes[0].device
    staging = 2 * 2e6 / (device.memory_bandwidth * device.efficiency.memory)
    assert best.breakdown["dp_exposed"] == pytest.approx(ring)
    assert best.breakdown["compute"] == pytest.approx(1.0 + staging)
    assert _pipeline(best) == pytest.approx(1.0 + staging + ring)
    assert best.tflops_per_device == pytest.approx(1.0 / best.step_seconds)
    assert math.fsum(best.breakdown.values()) == pytest.approx(best.step_seconds)


def test_pruning_by_lower_bound_keeps_the_winner():
    """Pricing everything (a table of 1000 alternatives disables pruning) finds the same winner."""
    def make(tp, b):
        return [unit("segment:0", 0.3 * b / tp, params=10_000_000 // tp, cut=1e6 * b)] + \
               [unit(f"block:{i}", (1.0 + 0.1 * i) * b / tp + 0.01, params=50_000_000 // tp, saved=3e9 * b / tp,
                     selective=2e9 * b / tp, inputs=1e8 * b, cut=1e6 * b) for i in range(6)]
    world = World.uniform(2, 4, tiny_device(40 * GiB))
    pruned = search_plan(pricer(make), world, global_batch=32, seq=8, alternatives=1)
    everything = search_plan(pricer(make), world, global_batch=32, seq=8, alternatives=1000)
    assert pruned.priced < everything.priced == everything.candidates - _skipped(everything)
    assert pruned.best.candidate == everything.best.candidate
    assert pruned.best.step_seconds == pytest.approx(everything.best.step_seconds)


def _skipped(result) -> int:
    return result.candidates - result.priced  # those the memory lower bound ruled out


# --- pins and errors -----------------------------------------------------------------------------

def test_pins_are_honoured():
    price = pricer(lambda tp, b: [unit(f"block:{i}", b / tp) for i in range(8)])
    best = search_plan(price, parse_world("1x8"), global_batch=16, seq=8, tp=2, pp=2, micro_batch=2,
                       schedule="interleaved", virtual_stages=2, recompute="selective").best.candidate
    assert best == Candidate(tp=2, pp=2, dp=2, micro_batch=2, num_micro_batches=4, schedule="interleaved",
                             virtual_stages=2, recompute="selective")


@pytest.mark.parametrize("pins, message, hint", [
    (dict(tp=3), "tp=3 (tp groups must stay inside a node and 3 does not divide 4 devices per node)",
     "tp in {1, 2, 4}"),
    (dict(micro_batch=3, dp=2), "micro_batch=3 (must divide global_batch / dp", "micro_batch in {1, 2, 4}"),
    (dict(pp=8), "pp=8 (more stages than the 4 units", "pp in {1, 2, 4}"),
    (dict(pp=16), "pp=16 (does not divide the 8 devices)", "pp in {1, 2, 4}"),
    (dict(schedule="interleaved", pp=1), "schedule='interleaved' (needs pp > 1", "schedule in {1f1b} given pp=1"),
    (dict(recompute="some"), "recompute='some' is not a recompute mode", "none, selective, full"),
])
def test_an_impossible_pin_says_why_and_what_would_work(pins, message, hint):
    with pytest.raises(XirangError) as error:
        candidates(parse_world("2x4"), 4, 8, pins=pins)
    assert message in error.value.what
    assert hint in error.value.hint


def test_a_global_batch_no_dp_divides_lists_the_valid_degrees():
    """Two devices per node and two units: tp x pp <= 4, so dp is 2, 4 or 8; 3 is divisible by none."""
    with pytest.raises(XirangError) as error:
        candidates(parse_world("4x2"), 2, 3)
    assert "global_batch 3 is not divisible by any data-parallel degree this world allows: dp in {2, 4, 8}" \
        in error.value.what
    assert "multiple of 2" in error.value.hint


def test_nothing_fits_names_the_least_memory_needed():
    """Two units of 1e9 parameters (16e9 B of model states each) on two 16 GiB devices: the leanest
    plan puts one per device, whose peak is its optimizer step: 16e9 B and AdamW's foreach temporary of one moment,
    4e9 B (plan_memory.step_excess; more than the 2e9 B of bf16 weight gradients its whole backward holds at its
    end) = 18.6 GiB > 0.9 x 16 GiB = 14.4 GiB usable."""
    price = pricer(lambda tp, b: [unit("block:a", params=1_000_000_000 // tp),
                                  unit("block:b", params=1_000_000_000 // tp)])
    world = World.uniform(1, 2, tiny_device(16 * GiB))
    with pytest.raises(XirangError) as error:
        search_plan(price, world, global_batch=2, seq=8)
    what = error.value.what
    assert "no plan fits device memory" in what and f"needs {20e9 / GiB:.1f} GiB" in what
    assert "of which the plan may use 90% (14.4 GiB)" in what
    assert "meshes (dp, pp, tp) (1, 1, 2), (1, 2, 1), (2, 1, 1)" in error.value.where
    assert "recompute ['full', 'none', 'selective']" in error.value.where
    assert f"at least {20e9 / 0.9 / GiB:.1f} GiB" in error.value.hint


# --- the pieces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_rank_zero_holds_what_the_cost_model_says(schedule, v):
    for p, m in ((4, 8), (4, 4), (2, 2), (8, 16)):
        assert in_flight_by_rank(schedule, p, m, v)[0] == pytest.approx(SCHEDULES[schedule].in_flight(p, m, v))
    assert in_flight_by_rank("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight_by_rank("interleaved", 4, 8, 2) == (5.5, 4.5, 3.5, 2.5)  # p + (p - 1 - 2r) / v


def test_fast_cuts_agree_with_the_exact_solver_on_uniform_sends():
    from xirang.passes.planning.solve_stage_cuts import StageCutProblem, solve_stage_cuts_dp
    seconds = (0.5, 1.0, 1.0, 2.0, 1.0, 1.0, 0.2, 3.0, 1.0, 0.4)
    static, act = tuple(10.0 * (i % 3) for i in range(10)), tuple(float(i) for i in range(10))
    table = UnitTable(seconds, static, act, (0.1,) * 9)
    for stages in (1, 2, 3, 5, 10):
        in_flight = [float(stages - s) for s in range(stages)]
        for cap in (math.inf, 60.0):
            fast = fit_stages(table, stages, [cap] * stages, in_flight)
            problem = StageCutProblem(compute=seconds, memory=static, boundary_comm=(0.1,) * 9, stages=stages,
                                      capacities=[cap] * stages, activation_memory=act, in_flight=in_flight)
            if fast is None:  # the greedy finds no cut that fits exactly when none exists
                with pytest.raises(ValueError, match="fits device memory"):
                    solve_stage_cuts_dp(problem)
                continue
            exact = solve_stage_cuts_dp(problem)
            assert max(table.stage_time(a, b) for a, b in fast) == pytest.approx(exact.bottleneck, rel=1e-5)
    # unit memory 0, 11, 22, 3, 14, 25, 6, 17, 28, 9 (135 B): the least largest half is 75 B | 60 B
    assert least_memory_cuts(table, 2, [1.0, 1.0]) == ((0, 6), (6, 10))


def test_dp_sync_estimate_equals_the_bucket_by_bucket_price_at_an_even_rate():
    """Four units, each exactly one 40M-element bucket with equal backward: the closed form the
    search ranks by is exact. Comm-bound on 8 nodes (dp=8 over IB): about 4 all-reduces after the
    first bucket is ready; compute-bound (a slow backward): only the last bucket's."""
    from xirang.passes.planning.plan_costs import CandidatePricer
    world = parse_world("8x1")
    c = Candidate(tp=1, pp=1, dp=8, micro_batch=1, num_micro_batches=1, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    for seconds in (0.01, 10.0):
        split = TensorSplit(1, 1, 8, [unit(f"block:{i}", seconds, params=40_000_000) for i in range(4)])
        pricer = CandidatePricer({(1, 1): split}, world, global_batch=8)
        fast, exact = (pricer.price(c, ((0, 4),), exact=flag).breakdown["dp_exposed"] for flag in (False, True))
        assert fast == pytest.approx(exact) and exact > 0


# --- the rank order (step 5) ---------------------------------------------------------------------

def _order_chosen(cut: float, params: int) -> str:
    """2 nodes of 4, pinned dp 4 x pp 2 x tp 1: pp outermost puts the two pipeline ranks on different nodes and
    each dp group inside one; dp outermost the reverse."""
    make = lambda tp, b: [unit(f"block:{i}", 1e-3 * b, params=params, cut=cut * b) for i in range(4)]  # noqa: E731
    world = World.uniform(2, 4, tiny_device(400 * GiB))
    best = search_plan(pricer(make), world, global_batch=64, seq=8, tp=1, pp=2, dp=4, micro_batch=1,
                       schedule="1f1b", zero_stage=0).best
    assert best.candidate.mesh.order[0] == best.candidate.outermost
    return best.candidate.outermost


def test_pipeline_sends_that_outweigh_gradients_put_the_pipeline_inside_a_node():
    assert _order_chosen(cut=2e9, params=1_000) == "dp"


def test_gradients_that_outweigh_pipeline_sends_keep_the_data_parallel_groups_inside_a_node():
    assert _order_chosen(cut=1e3, params=2_000_000_000) == "pp"
