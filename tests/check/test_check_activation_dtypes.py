"""The planner prices saved activations at the dtypes the half-precision program keeps them in
(passes/planning/plan_splits_costs.py, from passes/lowering/compute_dtypes.py), measured by the dry run.

A model's fp32 islands stay fp32 in a bf16 program: Llama's and Qwen3's RMSNorm keep an fp32 copy of their
input, Qwen3-MoE's router its fp32 softmax, the loss its upcast logits' fp32 log-probabilities; and Llama's
rotary embedding makes q and k fp32, which attention reads through bf16 copies of its own. Before, the
planner priced every saved float at the plan's 2 bytes: the small Qwen3-MoE's activations at 911 KiB against
the dry run's 1,144, Llama's at 799 against 980 (at 4x8 H100, Qwen3-30B-A3B's planned ranks measured 66.8 to
79.8 GiB against 58.2 to 69.9 predicted). A copying reshape (grouped-query attention's expanded kv heads) was
priced as keeping its input, which its backward does not."""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.hf_families import llama
from examples.hf_moe import qwen3_moe

SEQ, BATCH = 64, 2


@pytest.mark.parametrize("build", [qwen3_moe, llama], ids=["qwen3_moe", "llama"])
def test_a_bf16_plans_activations_are_the_dry_runs(build):
    model, inputs = build(batch=BATCH, seq=SEQ, device="meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=1, hardware="a100-80g", example_kwargs=inputs, global_batch=BATCH, seq=SEQ,
                       precision="bf16", micro_batch=BATCH, analysed=report)
    checked = xirang.check(plan, model, example_kwargs=inputs, analysed=report, workers=1)
    assert checked.ok, checked.explain()
    (row,) = checked.memory_rows()
    predicted, measured = plan.predicted.memory_parts[0]["activations"], row["parts"]["activations"]
    assert predicted == pytest.approx(measured, rel=0.05), (predicted / 1024, measured / 1024)


def test_a_norms_fp32_copy_is_its_own_storage_in_bf16():
    """Llama's RMSNorm upcast is an alias in the fp32 trace and a copy at run time: the op after it keeps the
    copy (4 bytes an element), not the bf16 residual it was traced as viewing."""
    from xirang.passes.analysis.saved_storages import storage_of
    model, inputs = llama(batch=BATCH, seq=SEQ, device="meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    run = report.run_dtypes("bf16")
    upcasts = [n for n in report.graph_module.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
    assert upcasts
    for pow_node in upcasts:
        traced, at_run_time = storage_of(pow_node.args[0]), storage_of(pow_node.args[0], run.of)
        assert traced is not at_run_time and run.of[at_run_time.name] == torch.float32
        assert run.of[traced.name] == torch.bfloat16
