"""Activations of an interleaved pipeline rank (passes/planning/plan_memory.py ``chunk_peaks``): each chunk is
charged what it holds at the rank's peak, read off the schedule's own actions, not the rank's average. The
last stage (head and loss) runs each backward right after its forward, so it holds one micro-batch while
the rank's other chunk holds more; the closed form charged it the rank's average (Llama-3-405B's planned
interleaved plan: 10.5 GiB of activations predicted on its last pipeline rank, 1.5 GiB in the dry run)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from xirang.ir.schedules import build_schedule, is_compute
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_memory import chunk_peaks, pareto_front
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

SAVED, HEAD_SAVED = 100.0, 1000.0  # one micro-batch's activations of a block, of the last unit (head and loss)


def _price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
    return TensorSplit(tp, micro_batch, seq, [
        UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                 tp_comm_backward_seconds=0.0, params_local=10, saved_bytes=HEAD_SAVED if i == 3 else SAVED,
                 selective_saved_bytes=SAVED, selective_recompute_seconds=0.1, input_bytes=10.0, cut_bytes_after=0.0,
                 model_flops=0.0, model_forward_flops=0.0) for i in range(4)])


def test_each_chunk_is_charged_what_it_holds_at_the_ranks_peak():
    # pp 2, v 2, 8 micro-batches: rank 1 warms up with two forwards of its first chunk (stage 1), then its
    # last chunk (stage 3) runs F and B in turn: (2, 1) at most, or (3, 0) once stage 3 is idle; stage 3
    # ends first (2 of stage 1 still held), then stage 1 (then both stages' gradient copies are made). The
    # middle pair: both stages' gradients made (each has run a backward) at every moment that can peak
    assert [chunk_peaks(actions) for actions in build_schedule("interleaved", 2, 8, 2).ranks] == [
        ((0, 0, 1, 1, 1, 1), (2, 0, 1, 1, 0, 1), (3, 2, 1, 1, 0, 0), (4, 1, 1, 1, 0, 0)),
        ((0, 0, 1, 1, 1, 1), (2, 0, 1, 1, 0, 1), (2, 1, 1, 1, 0, 0), (3, 0, 1, 1, 0, 0))]
    best = search_plan(_price, parse_world(2), global_batch=8, seq=8, tp=1, pp=2, micro_batch=1, recompute="none",
                       schedule="interleaved", virtual_stages=2, precision="fp32").best
    assert best.bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    activations = [parts["activations"] for parts in best.memory_parts]
    # rank 0 (stages 0 and 2, equal blocks): the closed form's 2.5 micro-batches of both; rank 1: two of
    # block 1 and one of the head, not the closed form's 1.5 x (100 + 1000) = 1650
    assert activations == pytest.approx([2.5 * 2 * SAVED, 2 * SAVED + HEAD_SAVED])


def test_a_chunks_gradient_copy_is_held_from_its_last_backward_beside_what_the_others_hold():
    """bf16 at dp 2: the dp buckets' bf16 copy of a chunk's gradients (2 bytes a parameter) is made after that
    chunk's last backward. On rank 1 the last chunk ends first, while its first chunk still holds two
    micro-batches: its copy beside those, then the first chunk's copy when everything else is gone."""
    params = 1000
    copy = 2.0 * params  # one chunk's bf16 gradients

    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        split = _price(tp, tp_group, micro_batch, seq)
        return TensorSplit(tp, micro_batch, seq, [replace(u, params_local=params) for u in split.units])

    best = search_plan(price, parse_world(4), global_batch=16, seq=8, tp=1, pp=2, dp=2, micro_batch=1,
                       recompute="none", schedule="interleaved", virtual_stages=2, precision="bf16").best
    parts = best.memory_parts[1]
    fp32_grads = 4.0 * 2 * params
    # (2, 0 | 0, 1): two micro-batches of block 1 and the last chunk's copy; more than (2, 1 | 0, 0)'s 1200
    assert parts["activations"] == pytest.approx(2 * SAVED)
    held = copy + max(0.0, 2 * copy - copy - 2 * SAVED - parts["working_set"])  # then the end: both copies
    assert parts["gradients"] == pytest.approx(fp32_grads + held)


def test_the_pareto_front_keeps_exactly_the_moments_nothing_else_matches_or_exceeds():
    moments = {(3, 0, 1), (2, 0, 1), (1, 4, 0), (3, 0, 0), (0, 0, 2), (1, 1, 0)}
    # (2, 0, 1) and (3, 0, 0) lie under (3, 0, 1); (1, 1, 0) under (1, 4, 0)
    assert pareto_front(moments) == ((0, 0, 2), (1, 4, 0), (3, 0, 1))


@pytest.mark.parametrize("name, p, m, v", [("interleaved", 4, 8, 2), ("interleaved", 8, 16, 4), ("zb-h1", 4, 8, 1),
                                           ("1f1b", 3, 5, 1)])
def test_the_memory_figures_read_the_same_from_the_compute_actions_alone(name, p, m, v):
    """The planner builds schedules without their sends and receives (build_schedule(communication=False))."""
    whole, bare = build_schedule(name, p, m, v), build_schedule(name, p, m, v, communication=False)
    assert [tuple(a for a in actions if is_compute(a)) for actions in whole.ranks] == list(bare.ranks)
    assert [chunk_peaks(a) for a in whole.ranks] == [chunk_peaks(a) for a in bare.ranks]
