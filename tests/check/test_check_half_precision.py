"""A bf16 program of a Hugging Face Llama under tensor and sequence parallelism, proven by the dry run on
GPU semantics: what stage 0 sends is what stage 1 allocated to receive (the receive buffers take the
run-time dtypes of passes/lowering/compute_dtypes.py, made on the traced graph, while the sender runs
the rank's lowered graph, with the tp rewrite's collectives in it); a mismatch is a [sends] violation."""
from __future__ import annotations

import torch

import xirang
from tests.conftest import hf_gpt2, hf_llama

GLOBAL, SEQ = 4, 16


def test_a_bf16_llama_under_sequence_parallelism_sends_what_its_receiver_expects():
    model = hf_llama(layers=2)
    ids = torch.zeros(GLOBAL, SEQ, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    report = xirang.analyze(model, example_kwargs=example)
    plan = xirang.plan(model, world=8, hardware="a100-80g", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2,
                       pp=2, micro_batch=1, seq=4096, precision="bf16", sequence_parallel=True, analysed=report)
    assert plan.sequence_parallel and plan.precision == "bf16"
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2)
    proven = xirang.check(plan, model, example_kwargs=example, analysed=report)
    assert proven.ok, proven.explain()
    sends = [call for klass in proven.classes for call in klass.log.calls if call.kind == "send"]
    # the residual stream crosses in bf16 (the rotary angles stay fp32 on purpose, the mask is a boolean)
    assert "bfloat16" in {call.dtype for call in sends}


def test_attention_with_dropout_runs_the_fused_kernel_on_gpu_semantics():
    """GPT-2's attention dropout is the runtime's random op; under random streams it calls the fused kernel,
    which on a GPU keeps no seq x seq scores. The dry run must not run it as the math path (it kept 66 GiB of
    scores per GPU on GPT-3 175B's plan): with dropout the peak is that without, within the dropout's own
    state, and no site at the peak is attention's scores."""
    seq = 128  # hf_gpt2's position table
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    peaks = {}
    for p in (0.0, 0.1):
        model = hf_gpt2(attn_pdrop=p, resid_pdrop=0.0, embd_pdrop=0.0)
        report = xirang.analyze(model, example_kwargs=example)
        plan = xirang.plan(model, world=1, hardware="a100-80g", example_kwargs=example, global_batch=1,
                           analysed=report)
        proven = xirang.check(plan, model, example_kwargs=example, analysed=report)
        assert proven.ok, proven.explain()
        peaks[p] = proven.classes[0].log.memory.peak
    scores = 4 * seq * seq * 4  # one layer's fp32 scores (4 heads): what the math path would keep, each layer
    assert peaks[0.1] < peaks[0.0] + scores, peaks
