"""Half-precision weight gradients at the end of a whole backward (passes/planning/plan_memory.py
``cast_gradients``): the weights are cast at the top of their stage, the engine runs the casts' backward
last, so every weight's half-precision gradient of the chunk is held until then, beside what is left of the
micro-batch's activations (its own are freed by then). A split backward's W goes one weight at a time: only
the first stage, whose W is its whole backward, holds them. fp32 programs make no such copy."""
from __future__ import annotations

import pytest

from xirang.ir.world import parse_world
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

PARAMS, SAVED = 1000, 100.0  # per block: local parameters, activations of one micro-batch


def _price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
    return TensorSplit(tp, micro_batch, seq, [
        UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                 tp_comm_backward_seconds=0.0, params_local=PARAMS, saved_bytes=SAVED, selective_saved_bytes=SAVED,
                 selective_recompute_seconds=0.1, input_bytes=10.0, cut_bytes_after=0.0, model_flops=0.0,
                 model_forward_flops=0.0) for i in range(4)])


@pytest.mark.parametrize("schedule, precision, held", [
    ("1f1b", "bf16", (True, True)), ("zb-h1", "bf16", (True, False)), ("1f1b", "fp32", (False, False))])
def test_a_whole_backward_holds_its_chunks_half_precision_weight_gradients(schedule, precision, held):
    best = search_plan(_price, parse_world(2), global_batch=4, seq=8, tp=1, pp=2, micro_batch=1, recompute="none",
                       schedule=schedule, precision=precision).best
    assert best.bounds == ((0, 2), (2, 4))
    extra = 2 * (2 * PARAMS) - 2 * SAVED  # bf16 gradients of the stage's 2 blocks, less their freed activations
    # a bf16 forward starts holding the bf16 copies of the stage's weights beside one micro-batch fewer and none of a
    # backward's working set (plan_memory.forward_cast_excess): where no whole backward holds their gradients (the
    # split W's ranks) that moment is the peak, counted in the working set
    casts = 2 * (2 * PARAMS) - 2 * SAVED - SAVED
    for rank, holds in enumerate(held):
        expected = SAVED + (extra if holds else casts if precision == "bf16" else 0.0)
        assert best.memory_parts[rank]["working_set"] == pytest.approx(expected)
