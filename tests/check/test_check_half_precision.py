"""A bf16 program of a Hugging Face Llama under tensor and sequence parallelism, proven by the dry run on
GPU semantics: what stage 0 sends is what stage 1 allocated to receive (the receive buffers take the
run-time dtypes of passes/lowering/compute_dtypes.py, made on the traced graph, while the sender runs
the rank's lowered graph, with the tp rewrite's collectives in it); a mismatch is a [sends] violation."""
from __future__ import annotations

import torch

import xirang
from tests.conftest import hf_llama

GLOBAL, SEQ = 4, 16


def test_a_bf16_llama_under_sequence_parallelism_sends_what_its_receiver_expects():
    model = hf_llama(layers=2)
    ids = torch.zeros(GLOBAL, SEQ, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    report = xirang.analyze(model, example_kwargs=example)
    plan = xirang.plan(model, world=8, device="a100-80g", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2,
                       pp=2, micro_batch=1, seq=4096, precision="bf16", sequence_parallel=True, analysed=report)
    assert plan.sequence_parallel and plan.precision == "bf16"
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2)
    proven = xirang.check(plan, model, example_kwargs=example, analysed=report)
    assert proven.ok, proven.explain()
    sends = [call for klass in proven.classes for call in klass.log.calls if call.kind == "send"]
    # the residual stream crosses in bf16 (the rotary angles stay fp32 on purpose, the mask is a boolean)
    assert "bfloat16" in {call.dtype for call in sends}
