"""A pipeline send is free once causality proves it delivered (codegen/check/send_completion.py): the fake
process group never completes a message, so the dry run kept every micro-batch's sent tensors to the step's
end and a 1F1B first stage's peak grew with the number of micro-batches, which no launched rank's does."""
from __future__ import annotations

import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.check.send_completion import release_points
from xirang.ir.schedule_actions import ACTIVATION, GRADIENT
from xirang.ir.schedules import build_schedule


def test_each_activation_send_is_released_by_the_gradient_the_peer_sends_back_after_using_it():
    schedule = build_schedule("1f1b", 2, 4, 1)
    released = release_points(schedule, 0)
    # rank 1 runs F0 B0 F1 B1 ...: after consuming activation mb k in F(k) its next send to rank 0 is the
    # gradient of mb k, so rank 0's send of mb k is proven delivered when it takes that gradient
    assert released == {(ACTIVATION, 1, mb): (GRADIENT, 0, mb) for mb in range(4)}
    # rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3: the gradients of mb 0 and 1 are proven delivered by the activations
    # of mb 2 and 3 it sends after their backwards; after B2 and B3 it sends nothing, so those stay to the end
    assert release_points(schedule, 1) == {(GRADIENT, 0, 0): (ACTIVATION, 1, 2), (GRADIENT, 0, 1): (ACTIVATION, 1, 3)}


def _first_stage_peak(global_batch: int) -> int:
    model = build_gpt("tiny", device="meta")
    ids = torch.zeros(global_batch, 64, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    plan = xirang.plan(model, world=2, hardware="cpu", example_kwargs=example, global_batch=global_batch, dp=1,
                       tp=1, pp=2, micro_batch=1, schedule="1f1b")
    assert plan.num_micro_batches == global_batch
    report = xirang.check(plan, model, example_kwargs=example)
    assert report.ok, report.explain()
    return next(row["peak_bytes"] for row in report.memory_rows() if row["pp_rank"] == 0)


def test_a_1f1b_first_stage_peak_does_not_grow_with_the_micro_batches():
    few, many = _first_stage_peak(4), _first_stage_peak(16)
    # 1F1B keeps pp micro-batches in flight however many the step runs: only the rank's share of the batch
    # grows (input_ids and labels, int64, 12 more rows of 64)
    assert many - few == 2 * 12 * 64 * 8, (few, many)
