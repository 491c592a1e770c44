"""What a pipeline stage's executor holds per micro-batch in flight beyond its units' saved activations
(passes/planning/plan_memory.py ``stage_held``), measured by the dry run: the outputs it sends that take a
gradient (kept for the backward), and under full recompute what it receives that no block of it counts as its
input (the rotary tables every block reads, counted once in the model's first reader, fp32 in a bf16 program).
Llama-3-405B's interleaved plan (pp 16, v 6, full recompute) was priced 1.00 GiB of activations per pipeline
rank where the dry run held 1.53: per micro-batch of a two-layer chunk 64 MiB priced, 104 held (the received
hidden state, the second layer's input, the stage's output, the fp32 cos and sin)."""
from __future__ import annotations

import pytest
import torch

import xirang
from xirang.codegen.check.send_completion import release_points
from xirang.ir.schedule_actions import GRADIENT
from xirang.ir.schedules import build_schedule


def test_an_interleaved_full_recompute_plans_activations_are_the_dry_runs():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=512, max_position_embeddings=1024, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    report = xirang.analyze(model, example_kwargs=example)
    plan = xirang.plan(model, world=4, hardware="h100-80g", example_kwargs=example, global_batch=4, analysed=report,
                       tp=2, pp=2, micro_batch=1, schedule="interleaved", virtual_stages=2, recompute="full")
    checked = xirang.check(plan, model, example_kwargs=example, analysed=report, workers=1)
    assert checked.ok, checked.explain()
    rows = checked.memory_rows()
    assert len(rows) == 2
    for row in rows:  # before: 1.78 vs 3.81 MiB on pp 0, 3.76 vs 5.07 on pp 1
        predicted = plan.predicted.memory_parts[row["pp_rank"]]["activations"]
        measured = row["parts"]["activations"]
        assert predicted == pytest.approx(measured, rel=0.05), (row["pp_rank"], predicted / 2 ** 20, measured / 2 ** 20)


def test_an_interleaved_ranks_gradient_sends_are_released_round_the_ring():
    """The dry run frees a sent gradient once causality proves it delivered (codegen/check/send_completion.py).
    Rank 0 sends rank 1 nothing after its backwards, but the gradient rank 1 sent it for stage 4 comes back
    round the ring (rank 0's stage 4 -> rank 3's stage 3 -> rank 2's stage 2 -> rank 1's stage 1): taking that
    proves the send delivered. By the direct rule alone they stayed to the step's end: 81 of them, 2.5 GiB of
    working set, on Llama-3-405B's interleaved plan's pipeline rank 1 (pp 16, v 6, 16 micro-batches)."""
    released = release_points(build_schedule("interleaved", 4, 4, 2), 1)
    assert {key: by for key, by in released.items() if key[0] == GRADIENT} == {
        (GRADIENT, 4, mb): (GRADIENT, 1, mb) for mb in range(4)}
