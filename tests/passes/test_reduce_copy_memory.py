"""The dp buckets' half-precision copy of the gradients in a rank's memory (passes/planning/plan_memory.py):
made after a chunk's last backward, so the last chunk's copy adds only what it exceeds the activations and
working set by. Under interleaving each chunk's copy is held from its own last backward on, beside what the
other chunks hold then (``chunk_peaks``): where activations dominate, the peak is in the steady state, before
any chunk's last backward, and holds no copy (Llama-2-70B's planned plan: none in the dry run, where the
earlier (v-1)/v rule priced 3.6 GiB); tests/passes/test_interleaved_memory.py has a copy beside activations."""
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


def test_interleaved_chunks_copies_are_not_beside_an_activation_peak_that_comes_before_them():
    # v = 2, 4 micro-batches: each rank's most activations are held before either chunk's last backward, and
    # once a chunk ends the other holds no more than 50 MB x 2, far above its 8 MB copy
    assert _gradients("interleaved", 2) == [pytest.approx(4 * 4 * PARAMS)] * 2
