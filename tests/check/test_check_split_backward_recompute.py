"""Full recompute under a split backward (ZB-H1) holds what the planner prices: the block rebuilt once in B's
backward and once in W's.

Before, each of W's autograd calls (one per weight) recomputed the block, a region under ``torch.utils.checkpoint``
being recomputed once per call that reads it and kept until the graph is freed: a small bf16 Llama at pp 2 peaked
at 6,534 KiB on pipeline rank 1 with full recompute (3,142 without), priced 2,753; Qwen3-30B-A3B at dp8 pp4 ep8
zb-h1 with full recompute on 4x8 H100 held 168-177 GiB on pipeline ranks 1-3 against 29-50 GiB predicted, all of
it working set during BackwardWeight. W's calls now share one recompute (codegen/runtime/executor/split_backward.py):
2,726 KiB.

Pipeline rank 0 (no B: its W is its whole backward) is priced at its backward, 923 KiB; the dry run peaks there at
768: priced above, never below."""
from __future__ import annotations

import pytest

import xirang
from examples.hf_families import llama

SEQ = 64


@pytest.mark.matrix  # two dry runs of a 2-stage plan (~10 CPU s): not in the default tier
def test_full_recompute_under_a_split_backward_is_priced_as_the_dry_run_holds_it():
    model, inputs = llama(batch=2, seq=SEQ, device="meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=2, hardware="a100-80g", example_kwargs=inputs, global_batch=8, seq=SEQ,
                       precision="bf16", pp=2, dp=1, tp=1, micro_batch=1, schedule="zb-h1", recompute="full",
                       analysed=report)
    assert plan.recompute == "full" and plan.schedule == "zb-h1" and plan.mesh.pp == 2
    checked = xirang.check(plan, model, example_kwargs=inputs, analysed=report, workers=1)
    assert checked.ok, checked.explain()
    for row in checked.memory_rows():
        assert row["peak_bytes"] <= 1.05 * row["predicted_bytes"], row  # never held above the price
        if row["pp_rank"] > 0:  # B before W: the ranks the per-weight recompute blew up
            assert row["peak_bytes"] == pytest.approx(row["predicted_bytes"], rel=0.10), row
