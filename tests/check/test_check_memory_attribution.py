"""What the dry run counts at a rank's peak is what the rank holds: no full-size model tensor of the check's own
making (run_rank builds the CompiledModel from full-size meta tensors and drops them, as a launched rank
keeps its shards only)."""
from __future__ import annotations

import torch

import xirang
from tests.conftest import hf_gpt2


def test_no_full_size_model_tensor_is_live_at_any_ranks_peak():
    """A loop variable over the full tensors kept the last one (lm_head's, vocab x hidden fp32) alive through
    the step: 2.3 GiB counted as activations at every GPT-3 175B peak, made at no site of the runtime."""
    model = hf_gpt2(layers=2)
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    report = xirang.analyze(model, example_kwargs=example)
    plan = xirang.plan(model, world=4, hardware="a100-80g", example_kwargs=example, global_batch=2, tp=2, pp=2,
                       micro_batch=1, analysed=report)
    proven = xirang.check(plan, model, example_kwargs=example, analysed=report, workers=1)
    assert proven.ok, proven.explain()
    full = model.lm_head.weight.numel() * 4  # fp32 on the rank: the check's meta copy
    for klass in proven.classes:
        unnamed = sum(size for size, part, site in klass.log.memory.largest if not site)
        assert unnamed < full, (klass.log.coords, klass.log.memory.largest)
