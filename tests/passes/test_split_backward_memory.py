"""Memory of a split backward (passes/planning/plan_memory.py): between a micro-batch's B and its W the runtime
keeps the gradients of its stage's weight-op outputs (codegen/runtime/executor/split_backward.py), for every
micro-batch the schedule has B'd and not yet W'd on that rank (read off the schedule's actions: r + 1 on rank
r of ZB-H1); the first stage keeps none (its B makes no input gradient). 1F1B keeps none."""
from __future__ import annotations

import pytest

from xirang.ir.schedules import build_schedule
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_memory import most_waiting_for_w, split_moments
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost


def _units(tp, micro_batch):
    return [UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                     tp_comm_backward_seconds=0.0, params_local=0, saved_bytes=100.0, selective_saved_bytes=100.0,
                     selective_recompute_seconds=0.1, input_bytes=10.0, cut_bytes_after=0.0, model_flops=0.0,
                     model_forward_flops=0.0, weight_output_bytes=30.0) for i in range(4)]


def _price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
    return TensorSplit(tp, micro_batch, seq, _units(tp, micro_batch))


def test_zb_h1_rank_r_waits_on_r_plus_1_ws():
    assert [most_waiting_for_w(actions) for actions in build_schedule("zb-h1", 4, 8).ranks] == [1, 2, 3, 4]
    assert [most_waiting_for_w(actions) for actions in build_schedule("1f1b", 4, 8).ranks] == [0, 0, 0, 0]


@pytest.mark.parametrize("schedule, kept", [("zb-h1", (0.0, 2 * (30.0 + 30.0))), ("1f1b", (0.0, 0.0))])
def test_the_gradients_waiting_for_w_are_in_the_working_set(schedule, kept):
    """p = 2, m = 4, two blocks of 100 B saved (30 B of weight-op outputs) per stage: rank 1 waits on 2 Ws,
    each keeping 2 x 30 B; rank 0's stage is the first and keeps none."""
    best = search_plan(_price, parse_world(2), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="none", schedule=schedule).best
    assert best.bounds == ((0, 2), (2, 4))
    base = 100.0  # the largest unit's saved bytes: its backward's gradients
    for rank, extra in enumerate(kept):
        assert best.memory_parts[rank]["working_set"] == pytest.approx(base + extra)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_under_full_recompute_w_holds_every_block_of_its_stage_rebuilt(schedule):
    """p = 2, two blocks of 100 B saved and 10 B kept (the block's input) per stage: full recompute rebuilds 90 B
    a block. W's calls share one recompute of each block and keep what they do not read until W ends, so rank 1
    (B before W) holds both of its blocks rebuilt, 90 B more than the one block every backward's working set
    counts; rank 0's W is its whole backward, and 1F1B rebuilds one block at a time."""
    best = search_plan(_price, parse_world(2), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="full", schedule=schedule).best
    assert best.bounds == ((0, 2), (2, 4))
    rebuilt, gradients = 90.0, 100.0  # the largest block's rebuild, and its backward's gradients
    waiting = {"zb-h1": (0, 2), "1f1b": (0, 0)}[schedule]
    held = {"zb-h1": (0.0, 90.0), "1f1b": (0.0, 0.0)}[schedule]
    for rank in range(2):
        expected = rebuilt + gradients + waiting[rank] * 2 * 30.0 + held[rank]
        assert best.memory_parts[rank]["working_set"] == pytest.approx(expected), rank


def test_split_moments_count_micro_batches_before_and_after_their_b():
    """ZB-H1 at p = 2, m = 4: the last rank runs F B, then F B W: at most one micro-batch before its B beside one
    past it, or two past theirs; the first rank (one forward of warm-up) holds two before their B."""
    first, last = (split_moments(actions) for actions in build_schedule("zb-h1", 2, 4).ranks)
    assert last == ((0, 2), (1, 1))
    assert max(before for before, _ in first) == 2


def _with_a_loss(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
    units = _units(tp, micro_batch)
    units[-1] = UnitCost("segment:loss", "segment:loss", forward_seconds=0.4, backward_seconds=0.6,
                         tp_comm_forward_seconds=0.0, tp_comm_backward_seconds=0.0, params_local=0, saved_bytes=100.0,
                         selective_saved_bytes=100.0, selective_recompute_seconds=0.0, input_bytes=10.0,
                         cut_bytes_after=0.0, model_flops=0.0, model_forward_flops=0.0, weight_output_bytes=30.0,
                         saved_past_weights_bytes=60.0)
    return TensorSplit(tp, micro_batch, seq, units)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_what_b_frees_is_not_held_until_w(schedule):
    """p = 2, m = 4, 200 B a micro-batch on the last stage, 60 B of it saved past its weight ops (a loss): under
    ZB-H1 the last rank holds at most one micro-batch whole beside one past its B (200 + 140), or two past theirs
    (280), not two whole (400); 1F1B frees every micro-batch whole at its backward."""
    best = search_plan(_with_a_loss, parse_world(2), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="none", schedule=schedule).best
    assert best.bounds == ((0, 2), (2, 4))
    expected = {"zb-h1": 200.0 + 140.0, "1f1b": 200.0}[schedule]
    assert best.memory_parts[1]["activations"] == pytest.approx(expected)


def _blocks_of(params: int, saved: float):
    """A price function of four blocks, each of ``params`` local parameters and ``saved`` bytes a micro-batch."""
    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        return TensorSplit(tp, micro_batch, seq, [
            UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                     tp_comm_backward_seconds=0.0, params_local=params, saved_bytes=saved,
                     selective_saved_bytes=saved, selective_recompute_seconds=0.0, input_bytes=1.0,
                     cut_bytes_after=0.0, model_flops=0.0, model_forward_flops=0.0) for i in range(4)])
    return price


@pytest.mark.parametrize("hardware, temporary", [("a100-80g", 0.5), ("cpu", 0.0)])
def test_the_optimizer_steps_moment_is_the_peak_where_it_holds_more(hardware, temporary):
    """200 parameters a rank and a byte of activations a unit: the step holds the fp32 weights and gradients, both
    AdamW moments and, on a GPU, a temporary of one moment (torch's foreach path): 4 + 4 + 8 x 1.5 bytes a
    parameter, more than the backward's peak; a CPU steps one weight at a time."""
    best = search_plan(_blocks_of(100, 1.0), parse_world(2, hardware), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="none", schedule="1f1b").best
    for rank in range(2):
        parts = best.memory_parts[rank]
        if temporary:  # the step's moment is the rank's peak, its excess over the backward's in "optimizer"
            assert sum(parts.values()) == pytest.approx(200 * (4 + 4 + 8 * 1.5)) and parts["optimizer"] > 200 * 8
        else:
            assert parts["optimizer"] == pytest.approx(200 * 8) and sum(parts.values()) < 200 * (4 + 4 + 8 * 1.5)


@pytest.mark.parametrize("precision, excess", [("bf16", 2 * 200 + 20 - (40 + 10)), ("fp32", 0.0)])
def test_a_forward_starts_holding_every_weights_half_precision_copy(precision, excess):
    """ZB-H1 at p = 2, m = 4, two units of 100 parameters and 10 B saved a micro-batch on each stage: the last rank's
    backward peak holds two micro-batches (40 B) and a unit's gradients (10 B); a bf16 forward starts with the
    2-byte copies of its 200 weights (400 B) beside one micro-batch (20 B): 370 B more, counted in the working set.
    The first rank's whole backward holds its weights' bf16 gradients at its end already; fp32 casts nothing."""
    best = search_plan(_blocks_of(100, 10.0), parse_world(2), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1,
                       recompute="none", schedule="zb-h1", precision=precision).best
    assert best.bounds == ((0, 2), (2, 4))
    assert best.memory_parts[1]["activations"] == pytest.approx(40.0)
    assert best.memory_parts[1]["working_set"] == pytest.approx(10.0 + excess)
