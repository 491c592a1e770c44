"""The dp buckets' half-precision copy of the gradients in a rank's memory (passes/planning/plan_memory.py):
made after a chunk's last backward, so the last chunk's copy adds only what it exceeds the activations and
working set by, while under interleaving the other v - 1 chunks' copies are held beside them in full (the dry
run of Llama-3-405B's interleaved v = 4 plan held 4.4 of its 6.0 GiB of copy at the peak)."""
from __future__ import annotations

import pytest

from xirang.ir.world import parse_world
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

PARAMS = 1_000_000  # per unit: its fp32 gradients 4 MB, their bf16 copy 2 MB
SAVED = 50e6  # per unit and micro-batch: far more than the copy, so a copy made after them adds nothing


def _price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
    units = [UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                      tp_comm_backward_seconds=0.0, params_local=PARAMS, saved_bytes=SAVED,
                      selective_saved_bytes=SAVED, selective_recompute_seconds=0.1, input_bytes=10.0,
                      cut_bytes_after=0.0, model_flops=0.0, model_forward_flops=0.0) for i in range(8)]
    return TensorSplit(tp, micro_batch, seq, units)


def _gradients(schedule: str, v: int) -> list[float]:
    best = search_plan(_price, parse_world(4), global_batch=8, seq=8, tp=1, pp=2, dp=2, micro_batch=1,
                       recompute="none", schedule=schedule, virtual_stages=v, zero_stage=0).best
    return [parts["gradients"] for parts in best.memory_parts]


def test_without_interleaving_the_copy_follows_the_activations_and_adds_nothing():
    assert _gradients("1f1b", 1) == [pytest.approx(4 * 4 * PARAMS)] * 2  # 4 units per rank, fp32 only


def test_interleaved_chunks_hold_all_but_the_last_chunks_copy_beside_the_activations():
    fp32, copy = 4 * 4 * PARAMS, 2 * 4 * PARAMS
    assert _gradients("interleaved", 2) == [pytest.approx(fp32 + copy / 2)] * 2  # v = 2: one chunk of two
