"""cost_model.blocking_1f1b_stage_ends (DeepSpeed's PipelineEngine schedule with blocking, one-after-the-
other sends), optimizer_step_seconds and gradient_accumulation_seconds, against timelines and arithmetic
worked out by hand here."""
from __future__ import annotations

import pytest

from xirang.ir.device import DEVICE_PRESETS
from xirang.ir.errors import InvalidValue
from xirang.passes.planning.cost_model import (ADAM_STEP_BYTES_PER_PARAM, blocking_1f1b_stage_ends,
                                               gradient_accumulation_seconds, optimizer_step_seconds,
                                               pipeline_step_time)


def test_two_stages_one_micro_batch_by_hand():
    # slot 0: stage 0 forward (0 -> 1); slot 1: activation sent (1 -> 1.5), stage 1 forward (-> 2.5);
    # slot 2: stage 1 backward (-> 4.5); slot 3: gradient sent (max(1.5, 4.5) -> 5), stage 0 backward (-> 7)
    assert blocking_1f1b_stage_ends([1.0, 1.0], [2.0, 2.0], [0.5], 1) == pytest.approx([7.0, 5.0])


def test_two_stages_two_micro_batches_sends_wait_for_each_other():
    # stage 0: F0 [0,1]; slot 1 sends a0 [1,1.5]; stage 1 F0 [1.5,2.5]; slot 2: stage 0 F1 [1.5,2.5],
    # stage 1 B0 [2.5,4.5]; slot 3 (stage 0 backward slot): send a1 then receive g0, both waiting for
    # stage 1: [4.5,5] and [5,5.5]; stage 0 B0 [5.5,7.5], stage 1 F1 [5.5,6.5]; slot 4: stage 1 B1
    # [6.5,8.5]; slot 5: g1 [8.5,9], stage 0 B1 [9,11].
    assert blocking_1f1b_stage_ends([1.0, 1.0], [2.0, 2.0], [0.5], 2) == pytest.approx([11.0, 9.0])


def test_free_transfers_give_the_1f1b_step():
    # with nothing to send and equal stages the schedule ends as 1F1B's (m + p - 1) * (F + B)
    p, m = 4, 8
    ends = blocking_1f1b_stage_ends([1.0] * p, [2.0] * p, [0.0] * (p - 1), m)
    assert max(ends) == pytest.approx(pipeline_step_time("1f1b", p, m, 3.0))
    assert ends[0] == max(ends)  # the first stage ends last


def test_blocking_sends_lengthen_each_micro_batch_by_four_transfers_inside():
    # an inner stage sends and receives one after the other twice per micro-batch: 4 transfers; over
    # many micro-batches the step grows by about that per micro-batch
    p, m, c = 4, 64, 0.01
    quiet = max(blocking_1f1b_stage_ends([1.0] * p, [2.0] * p, [0.0] * (p - 1), m))
    busy = max(blocking_1f1b_stage_ends([1.0] * p, [2.0] * p, [c] * (p - 1), m))
    assert (busy - quiet) / m == pytest.approx(4 * c, rel=0.1)


def test_bad_lengths_are_refused():
    with pytest.raises(InvalidValue):
        blocking_1f1b_stage_ends([1.0, 1.0], [2.0], [0.5], 1)
    with pytest.raises(InvalidValue):
        blocking_1f1b_stage_ends([1.0, 1.0], [2.0, 2.0], [0.5], 0)


def test_optimizer_step_by_hand():
    a100 = DEVICE_PRESETS["a100-80g"]
    # overflow check 10, flat fp32 gradients 14, norm 4, unscale 8, fused Adam 28, fp16 copy 6
    assert ADAM_STEP_BYTES_PER_PARAM == 10 + 14 + 4 + 8 + 28 + 6 == 70
    # 1.9e9 parameters x 70 B over 2.039 TB/s x 0.35 (the preset's memory efficiency) = 0.186 s
    assert optimizer_step_seconds(1.9e9, a100) == pytest.approx(1.9e9 * 70 / (2.039e12 * 0.35))
    assert optimizer_step_seconds(1.9e9, a100) == pytest.approx(0.1864, abs=1e-4)


def test_gradient_accumulation_by_hand():
    a100, h100 = DEVICE_PRESETS["a100-80g"], DEVICE_PRESETS["h100-80g"]
    # an MT-NLG stage's 1.888e9 16-bit gradients: 2 B read + 2 B read + 2 B written each, over
    # 2.039 TB/s x 0.35 = 15.9 ms; fp32 gradients (Xirang's own .grad) move twice the bytes
    assert gradient_accumulation_seconds(1.888e9, 2, a100) == pytest.approx(1.888e9 * 6 / (2.039e12 * 0.35))
    assert gradient_accumulation_seconds(1.888e9, 2, a100) == pytest.approx(0.0159, abs=1e-4)
    assert gradient_accumulation_seconds(1e9, 4, a100) == pytest.approx(2 * gradient_accumulation_seconds(1e9, 2, a100))
    # the device's own memory rate: the H100 preset's bandwidth and efficiency, not the A100's
    assert gradient_accumulation_seconds(1e9, 2, h100) == pytest.approx(
        6e9 / (h100.memory_bandwidth * h100.efficiency.memory))
    assert gradient_accumulation_seconds(0, 2, a100) == 0.0
