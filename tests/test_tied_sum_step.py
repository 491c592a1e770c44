"""The tied sum is in the predicted step: a token embedding tied to the LM head on two pipeline ranks is
summed after the dp sync (``CompiledModel.train_step``), nothing hides it, so the plan's step pays its
all-reduce (xirang_compile/plan_assemble.py ``tied_sum_seconds``), and a plan without one pays nothing."""
from __future__ import annotations

import math

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.passes.planning.cost_collectives import collective_cost


def test_the_tied_sum_is_in_the_step_of_every_pipelined_row_and_of_no_other():
    model = build_gpt("tiny", device="meta")
    batch = {name: torch.zeros(2, 16, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    plan = xirang.plan(model, world=2, hardware="a100-80g", example_kwargs=batch, global_batch=2, seq=4096,
                       precision="fp32", tp=1, micro_batch=1, schedule="1f1b", cp=1)  # cp rows would fill the table
    rows = [plan.predicted, *plan.alternatives]
    meshes = [plan.mesh, *(row.mesh for row in plan.alternatives)]
    assert {mesh.pp for mesh in meshes} == {1, 2}  # both kinds are in the table
    tied = [c for c in plan.collectives if c.node.startswith("tied:")]
    assert [c.node for c in tied] == (["tied:tok_emb.weight"] if plan.mesh.pp == 2 else [])
    # one rank's fp32 gradient of the whole table, all-reduced over the two pipeline ranks (dp = 1 at pp = 2)
    want = collective_cost("all_reduce", model.tok_emb.weight.numel() * 4, (0, 1), plan.world).seconds
    assert want > 0
    for row, mesh in zip(rows, meshes):
        assert row.step_seconds == pytest.approx(math.fsum(row.breakdown.values()), rel=1e-12)
        if mesh.pp == 2:
            assert row.breakdown["tied_sum"] == pytest.approx(want, rel=1e-12)
        else:
            assert "tied_sum" not in row.breakdown
