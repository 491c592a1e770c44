"""Pipeline schedules as data: generators, checker, simulated timing, text and PNG renderings."""
from __future__ import annotations

from fractions import Fraction

import pytest

from tests.codegen.png_reader import read_png
from xirang.codegen.runtime.executor.schedule_check import ScheduleError, check_schedule, max_in_flight
from xirang.codegen.runtime.executor.schedule_sim import TimedAction, idle_fractions, simulate, simulated_bubble
from xirang.ir.schedules import (GRADIENT, Backward, BackwardInput, BackwardWeight, Forward, Recv, Send,
                                 build_schedule, gpipe, interleaved_one_f_one_b, is_compute, one_f_one_b,
                                 with_communication)
from xirang.codegen.viz.timeline import (IDLE, action_colour, format_schedule, render_timeline_png, timeline_layout)
from xirang.passes.planning.cost_model import SCHEDULES, bubble_share

GRID = [(p, m) for p in range(1, 6) for m in range(1, 10)]
INTERLEAVED_GRID = [(p, k * p, v) for p in range(1, 5) for k in (1, 2, 3) for v in (1, 2, 3)]


def compute_orders(schedule):
    return [[a for a in actions if is_compute(a)] for actions in schedule.ranks]


def problems_of(schedule, **options) -> str:
    with pytest.raises(ScheduleError) as error:
        check_schedule(schedule, **options)
    return str(error.value)


# --- every generator produces a sound schedule ---------------------------------------------------


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_and_1f1b_pass_the_checker_with_buffered_and_blocking_sends(p, m):
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        check_schedule(schedule)
        check_schedule(schedule, rendezvous=True)


@pytest.mark.parametrize("p,m,v", INTERLEAVED_GRID)
def test_interleaved_passes_the_checker(p, m, v):
    schedule = interleaved_one_f_one_b(p, m, v)
    assert schedule.num_stages == p * v
    assert [schedule.stages_of(r) for r in range(p)] == [tuple(range(r, p * v, p)) for r in range(p)]
    check_schedule(schedule)


def test_interleaved_needs_non_blocking_sends_as_the_docstring_says():
    message = problems_of(interleaved_one_f_one_b(2, 4, 2), rendezvous=True)
    assert "deadlock (rendezvous point-to-point)" in message and "waits for rank 1 to post Recv" in message


def test_build_schedule_refuses_what_the_plan_would_refuse():
    with pytest.raises(ValueError, match="m=6 micro-batches must be a multiple of p=4"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="needs the 'interleaved' schedule"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 4, 8)
    with pytest.raises(ValueError, match="Forward.micro_batch must be an int >= 0"):
        Forward(0, -1)
    with pytest.raises(ValueError, match="kind must be one of"):
        Send("weights", 0, 0, 1)


# --- text rendering ------------------------------------------------------------------------------


def test_text_rendering_of_1f1b_p2_m3_golden():
    # Hand-checked: rank 0 warms up p - 0 - 1 = 1 forward, runs two F/B pairs, drains one backward;
    # the last rank has no warm-up. Each Recv is posted one compute ahead of its consumer.
    schedule = one_f_one_b(2, 3)
    assert format_schedule(schedule) == ("rank 0 (stage 0): F0 F1 B0 F2 B1 B2\n"
                                         "rank 1 (stage 1): F0 B0 F1 B1 F2 B2")
    assert format_schedule(schedule, communication=True) == (
        "rank 0 (stage 0): F0 Sa0>r1 Rg0<r1 F1 Sa1>r1 B0 Rg1<r1 F2 Sa2>r1 Rg2<r1 B1 B2\n"
        "rank 1 (stage 1): Ra0<r0 F0 Ra1<r0 B0 Sg0>r0 F1 Ra2<r0 B1 Sg1>r0 F2 B2 Sg2>r0")


def test_text_rendering_names_the_stage_when_a_rank_holds_several():
    first_line = format_schedule(interleaved_one_f_one_b(2, 2, 2)).splitlines()[0]
    assert first_line == "rank 0 (stages 0, 2): F0@s0 F1@s0 F0@s2 F1@s2 B0@s2 B1@s2 B0@s0 B1@s0"


# --- simulated bubble ----------------------------------------------------------------------------


def test_simulated_bubble_p4_m8():
    gpipe_timeline, f1b1_timeline = simulate(gpipe(4, 8)), simulate(one_f_one_b(4, 8))
    interleaved_timeline = simulate(interleaved_one_f_one_b(4, 8, 2))
    # Forward 1, backward 2 per stage: 8 micro-batches x 3 = 24 busy units per rank.
    assert gpipe_timeline.makespan == f1b1_timeline.makespan == 33
    assert interleaved_timeline.makespan == 57  # 8 stages of 1 + 2 each: 48 busy units per rank
    for timeline in (gpipe_timeline, f1b1_timeline):
        report = idle_fractions(timeline.entries)
        assert report.per_rank == (Fraction(9, 33),) * 4
        assert report.overall == Fraction(3, 11)
    interleaved = idle_fractions(interleaved_timeline.entries)
    assert interleaved.per_rank == (Fraction(9, 57),) * 4 and interleaved.overall == Fraction(3, 19)
    assert interleaved.overall < Fraction(3, 11)
    # The closed forms of passes/planning/cost_model.py agree: (p-1)/(m+p-1) and (p-1)/(v·m+p-1).
    assert float(Fraction(3, 11)) == pytest.approx(bubble_share("1f1b", 4, 8))
    assert float(Fraction(3, 19)) == pytest.approx(bubble_share("interleaved", 4, 8, 2))


def test_simulation_with_unbalanced_stages_hand_checked():
    timeline = simulate(gpipe(2, 1), forward=(1, 3), backward=(2, 6))
    assert [(e.rank, e.action, e.start, e.end) for e in timeline.entries] == [
        (0, Forward(0, 0), 0, 1), (0, Backward(0, 0), 10, 12), (1, Forward(1, 0), 1, 4), (1, Backward(1, 0), 4, 10)]
    assert idle_fractions(timeline.entries).per_rank == (Fraction(9, 12), Fraction(3, 12))


def test_measured_idle_from_executor_timestamps():
    records = [(0, Forward(0, 0), 10.0, 11.0), (0, Recv(GRADIENT, 0, 0, 1), 11.0, 13.0),
               (0, Backward(0, 0), 13.0, 15.0), (1, Forward(1, 0), 11.0, 12.0), (1, Backward(1, 0), 12.0, 14.0)]
    report = idle_fractions(records)  # window 10..15; a wait inside a Recv counts as idle
    assert report.window == 5.0
    assert report.per_rank == pytest.approx((2 / 5, 2 / 5)) and report.overall == pytest.approx(4 / 10)
    assert idle_fractions(records, pipeline_ranks=3).per_rank[2] == 1
    as_tuples = [tuple(entry) for entry in simulate(one_f_one_b(3, 4)).entries]
    assert idle_fractions(as_tuples) == simulated_bubble(one_f_one_b(3, 4))
    with pytest.raises(ValueError, match="ends at 1 before it starts at 2"):
        idle_fractions([TimedAction(0, Forward(0, 0), 2, 1)])


# --- activations in flight -----------------------------------------------------------------------


@pytest.mark.parametrize("p,m", GRID)
def test_in_flight_is_p_minus_s_for_1f1b_and_m_for_gpipe(p, m):
    assert max_in_flight(one_f_one_b(p, m)) == tuple(min(p - s, m) for s in range(p))
    assert max_in_flight(gpipe(p, m)) == (m,) * p
    check_schedule(one_f_one_b(p, m), in_flight_budget=[p - s for s in range(p)])


def test_interleaved_in_flight_matches_the_cost_model():
    # Rank 0 holds 2(p-1) + (v-1)p + 1 = 11 chunks of 1/v of its layers: p + (p-1)/v = 5.5 micro-batches.
    peaks = max_in_flight(interleaved_one_f_one_b(4, 8, 2))
    assert peaks == (11, 9, 7, 5)
    assert peaks[0] / 2 == SCHEDULES["interleaved"].in_flight(4, 8, 2)


def test_checker_enforces_the_in_flight_budget():
    message = problems_of(gpipe(4, 8), in_flight_budget=[4, 3, 2, 1])
    assert "rank 0 action #" in message and "Forward(stage=0, micro_batch=4)" in message
    assert "holds the activations of 5 (stage, micro-batch) pairs, over its budget of 4" in message


# --- the checker rejects broken schedules --------------------------------------------------------


def test_dropped_recv_is_reported_from_both_ends():
    schedule = one_f_one_b(2, 3)
    rank1 = [a for a in schedule.ranks[1] if a != Recv("activation", 1, 0, 0)]
    message = problems_of(schedule.with_rank(1, rank1))
    assert ("rank 0 action #1 Send(activation, stage=0, micro_batch=0, peer=1) has no matching "
            "Recv(activation, stage=1, micro_batch=0, peer=0) on rank 1") in message
    assert ("rank 1 action #0 Forward(stage=1, micro_batch=0): its input activation for micro-batch 0 comes "
            "from rank 0 but was not received before this point") in message


def test_dropped_send_leaves_a_recv_waiting():
    schedule = one_f_one_b(2, 3)
    rank1 = [a for a in schedule.ranks[1] if a != Send(GRADIENT, 1, 1, 0)]
    message = problems_of(schedule.with_rank(1, rank1))
    assert ("Recv(gradient, stage=0, micro_batch=1, peer=1) has no matching "
            "Send(gradient, stage=1, micro_batch=1, peer=0) on rank 1, so it would wait forever") in message


def test_swapped_order_deadlocks_and_names_what_each_rank_waits_for():
    orders = compute_orders(gpipe(2, 2))  # rank 0: F0 F1 B0 B1; rank 1 likewise
    orders[0][1], orders[0][2] = orders[0][2], orders[0][1]  # rank 0: F0 B0 F1 B1
    message = problems_of(with_communication("swapped", 2, 2, orders))
    assert "deadlock (buffered point-to-point): no rank can proceed" in message
    assert "Backward(stage=0, micro_batch=0) waits for the gradient of micro-batch 0 from rank 1" in message
    assert "Forward(stage=1, micro_batch=1) waits for the activation of micro-batch 1 from rank 0" in message


def test_backward_before_its_forward():
    schedule = one_f_one_b(2, 3)
    rank0 = list(schedule.ranks[0])
    rank0.insert(0, rank0.pop(rank0.index(Backward(0, 0))))
    message = problems_of(schedule.with_rank(0, rank0))
    assert ("rank 0 action #0 Backward(stage=0, micro_batch=0) runs before Forward(stage=0, micro_batch=0) "
            "(action #1), whose saved activations a backward needs") in message
    assert "its input gradient for micro-batch 0 comes from rank 1 but was not received" in message


def test_duplicated_and_missing_computes():
    schedule = one_f_one_b(2, 3)
    duplicated = schedule.with_rank(0, (*schedule.ranks[0], Forward(0, 1)))
    assert "Forward(stage=0, micro_batch=1) appears 2 times on rank 0, at actions #3, #12" in problems_of(duplicated)
    missing = schedule.with_rank(1, [a for a in schedule.ranks[1] if a != Backward(1, 2)])
    assert "Backward(stage=1, micro_batch=2) is missing: rank 1 must run it once" in problems_of(missing)


def test_action_on_the_wrong_rank_or_peer():
    schedule = one_f_one_b(2, 3)
    wrong_rank = schedule.with_rank(0, (*schedule.ranks[0], Forward(1, 0)))
    assert "stage 1 runs on pipeline rank 1 (stage i runs on rank i % 2), not rank 0" in problems_of(wrong_rank)
    wrong_peer = schedule.with_rank(0, [Send("activation", 0, 0, 0) if a == Send("activation", 0, 0, 1) else a
                                        for a in schedule.ranks[0]])
    assert "stages 0 and 1 both run on rank 0" not in problems_of(wrong_peer)
    assert "goes to/from rank 1, not rank 0; set peer=1" in problems_of(wrong_peer)


def test_receives_posted_out_of_the_senders_order():
    schedule = gpipe(2, 3)
    recvs = [Recv("activation", 1, mb, 0) for mb in (0, 2, 1)]  # rank 0 sends 0, 1, 2
    rank1 = recvs + [a for a in schedule.ranks[1] if not isinstance(a, Recv)]
    message = problems_of(schedule.with_rank(1, rank1))
    assert ("rank 1 action #1 Recv(activation, stage=1, micro_batch=2, peer=0) is rank 1's receive number 1 "
            "from rank 0, but rank 0's send number 1 to it pairs with Recv(activation, stage=1, micro_batch=1, "
            "peer=0); NCCL matches messages between two ranks in posting order") in message


def test_split_backward_fits_the_data():
    # Zero-bubble schedules split each backward (Qi et al. 2024); here simply in place of 1F1B's.
    orders = [[c for a in order for c in ((BackwardInput(a.stage, a.micro_batch),
                                            BackwardWeight(a.stage, a.micro_batch))
                                           if isinstance(a, Backward) else (a,))]
              for order in compute_orders(one_f_one_b(3, 4))]
    split = with_communication("1f1b-split", 3, 4, orders)
    check_schedule(split, rendezvous=True)
    assert max_in_flight(split) == (3, 2, 1)
    # Same order, yet shorter: the gradient leaves after the input half (1 unit, not 2), so each of
    # the p - 1 = 2 hops back to rank 0 saves 1 unit: 18 -> 16. That is the zero-bubble idea.
    assert simulate(one_f_one_b(3, 4)).makespan == 18 and simulate(split).makespan == 16
    orders[0].remove(BackwardWeight(0, 0))
    orders[0].insert(0, BackwardWeight(0, 0))
    message = problems_of(with_communication("weight-first", 3, 4, orders))
    assert "BackwardWeight(stage=0, micro_batch=0) runs before BackwardInput(stage=0, micro_batch=0)" in message


# --- PNG timeline --------------------------------------------------------------------------------


def pixel(rows, x, y):
    return tuple(rows[y][3 * x:3 * x + 3])


def test_png_timeline_is_valid_and_draws_actions_where_they_ran():
    timeline = simulate(one_f_one_b(4, 8))
    layout = timeline_layout(timeline)
    width, height, rows = read_png(render_timeline_png(timeline))
    assert (width, height) == (layout.width, layout.height)
    entry = next(e for e in timeline.entries if e.action == Backward(2, 3))
    x0, y0, x1, y1 = layout.box(entry)
    assert pixel(rows, x0 + 1, y1 - 2) == pixel(rows, x1 - 2, y0 + 1) == action_colour(Backward(2, 3))
    assert action_colour(Backward(2, 3)) != action_colour(Forward(2, 3)) != action_colour(Forward(2, 4))
    # Rank 0 waits from t=4 (its warm-up done) to t=10 (micro-batch 0's gradient is back).
    assert pixel(rows, layout.x(7), layout.row_top(0) + 5) == IDLE


# --- zero-bubble schedules: the checker knows the split backward's order -----------------------


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_schedules_are_sound_and_split(name):
    for p, m in [(1, 3), (2, 3), (3, 5), (4, 8), (5, 9)]:
        schedule = build_schedule(name, p, m)
        check_schedule(schedule, rendezvous=False)
        kinds = {type(a) for actions in schedule.ranks for a in actions if is_compute(a)}
        assert kinds == {Forward, BackwardInput, BackwardWeight}  # never a fused Backward


def test_checker_refuses_a_weight_gradient_before_its_input_gradient():
    schedule = build_schedule("zb-h1", 2, 4)
    actions = list(schedule.ranks[1])
    weight = actions.index(BackwardWeight(1, 0))
    actions.insert(actions.index(BackwardInput(1, 0)), actions.pop(weight))  # W(1, 0) now before B(1, 0)
    message = problems_of(schedule.with_rank(1, actions))
    assert "BackwardWeight(stage=1, micro_batch=0) runs before BackwardInput(stage=1, micro_batch=0)" in message
    assert "weight gradients are computed from; move it after" in message


def test_checker_refuses_an_input_gradient_before_the_next_stages():
    # Two stages on one rank: B of stage 0 needs stage 1's B of the same micro-batch first.
    local = with_communication("zb-local", 2, 1, [[Forward(0, 0), Forward(1, 0), BackwardInput(0, 0),
                                                   BackwardInput(1, 0), BackwardWeight(1, 0), BackwardWeight(0, 0)]])
    message = problems_of(local)
    assert ("BackwardInput(stage=0, micro_batch=0) runs before BackwardInput(stage=1, micro_batch=0)" in message
            and "whose input gradient it takes on the same rank" in message)
    # Across ranks: rank 0 runs B(0, 1) before the gradient rank 1's B(1, 1) sends has been received.
    schedule = build_schedule("zb-h1", 2, 4)
    actions = list(schedule.ranks[0])
    early = actions.pop(actions.index(BackwardInput(0, 1)))
    actions.insert(actions.index(BackwardInput(0, 0)) + 1, early)
    message = problems_of(schedule.with_rank(0, actions))
    assert "BackwardInput(stage=0, micro_batch=1): its input gradient for micro-batch 1 comes from rank 1" in message


def test_simulator_times_f_b_and_w_apart():
    schedule = build_schedule("zb-h1", 4, 8)
    timeline = simulate(schedule, forward=1, backward_input=2, backward_weight=3)
    lengths = {type(e.action): e.end - e.start for e in timeline.entries}
    assert lengths == {Forward: 1, BackwardInput: 2, BackwardWeight: 3}
    half = simulate(schedule, forward=1, backward=2)  # no split given: B = W = backward / 2
    assert {e.end - e.start for e in half.entries} == {1}
