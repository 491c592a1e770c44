"""The optimizer step's moment is priced (passes/planning/plan_memory.py ``step_excess``): on a GPU torch's AdamW
takes its foreach path, which holds a temporary the size of one moment beside both moments, the fp32 weights and
their gradients. Where activations are small the step is a rank's peak: a bf16 Llama at seq 8 and pp 2 peaks there
on pipeline rank 1 in the dry run, at 2,103 KiB, which the plan priced at 1,803 KiB (its backward's) before."""
from __future__ import annotations

import pytest

import xirang
from examples.hf_families import llama

SEQ = 8  # short sequences: activations far below the model state


@pytest.mark.matrix  # a dry run of a 2-stage plan (~5 CPU s): not in the default tier
def test_a_rank_that_peaks_in_the_optimizer_step_is_priced_there():
    model, inputs = llama(batch=2, seq=SEQ, device="meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=2, hardware="a100-80g", example_kwargs=inputs, global_batch=8, seq=SEQ,
                       precision="bf16", pp=2, dp=1, tp=1, micro_batch=1, schedule="zb-h1", recompute="none",
                       analysed=report)
    checked = xirang.check(plan, model, example_kwargs=inputs, analysed=report, workers=1)
    assert checked.ok, checked.explain()
    last = next(klass for klass in checked.classes if klass.log.coords["pp"] == 1)
    assert last.log.memory.peak_action == ""  # after every schedule action: the optimizer step
    row = next(row for row in checked.memory_rows() if row["pp_rank"] == 1)
    assert row["peak_bytes"] == pytest.approx(row["predicted_bytes"], rel=0.05), row
