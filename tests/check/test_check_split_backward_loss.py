"""A split backward's B frees what the ops past the last stage's head save (the loss's fp32 log-probabilities):
torch's stage_backward_input detaches the stage's outputs, and W runs backward from the weight ops only. The plan
prices the last pipeline rank's activations at the moments of its actions, a micro-batch past its B keeping the
rest (passes/planning/plan_memory.py ``freed_by_b``), and the dry run holds what it prices.

Before, every micro-batch in flight was priced whole until its W: a Llama of hidden 64 and vocabulary 2,048 at pp 2
zb-h1 priced 1,137 KiB of activations on pipeline rank 1 with full recompute (1,767 without) where the dry run
held 639 (1,243)."""
from __future__ import annotations

import pytest
import transformers

import xirang
from examples.hf_families import build_from_config, token_batch

SEQ, VOCAB = 64, 2048  # a vocabulary 32 times the hidden size: the loss's tensors are most of the last stage's


@pytest.mark.matrix  # two dry runs of a 2-stage plan (~10 CPU s): not in the default tier
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_last_stages_loss_is_priced_as_freed_by_b(recompute):
    model = build_from_config(transformers.LlamaConfig, transformers.LlamaForCausalLM, "meta", num_hidden_layers=2,
                              hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                              vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    inputs = token_batch(2, SEQ, "meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=2, hardware="a100-80g", example_kwargs=inputs, global_batch=8, seq=SEQ,
                       precision="bf16", pp=2, dp=1, tp=1, micro_batch=1, schedule="zb-h1", recompute=recompute,
                       analysed=report)
    assert plan.schedule == "zb-h1" and plan.mesh.pp == 2 and plan.recompute == recompute
    checked = xirang.check(plan, model, example_kwargs=inputs, analysed=report, workers=1)
    assert checked.ok, checked.explain()
    last = next(row for row in checked.memory_rows() if row["pp_rank"] == 1)
    priced = plan.predicted.memory_parts[1]
    assert priced["activations"] == pytest.approx(last["parts"]["activations"], rel=0.05), (priced, last)
    assert last["peak_bytes"] == pytest.approx(last["predicted_bytes"], rel=0.05), last
