"""The plan's notes on what the tensor split keeps whole: each compute op named with its reason, and the
warning a tp > 1 plan carries when it shards no parameter (passes/planning/sharding_report.py)."""
from __future__ import annotations

import torch
from torch import nn

import xirang
from xirang.passes.planning.sharding_report import idle_tp_warning, replicated_compute, replicated_notes


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


def planned(width: int, hidden: int, tp: int = 2, batch: int = 8, seq: int = 512):
    torch.manual_seed(0)
    model, inputs = Mlp(width, hidden), {"x": torch.randn(batch, seq, width)}
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=tp, example_kwargs=inputs, global_batch=batch, hardware="cpu", precision="fp32",
                       dp=1, tp=tp, pp=1, micro_batch=batch, analysed=report)
    return report.graph_module, plan


def test_a_model_tp_cannot_split_is_named_op_by_op_and_warned_about():
    gm, plan = planned(width=1, hidden=1, batch=3, seq=5)  # no dim of either linear splits, even padded
    found = replicated_compute(gm, plan.placements, 2)
    assert [n.name for n in found["no split fits"]] == ["linear", "linear_1"] and not found["cheaper whole"]
    notes = replicated_notes(gm, plan.placements, 2)
    assert "linear ('up'), linear_1 ('down')" in notes[0] and "of size 1" in notes[0]
    assert notes[-1].startswith("warning: tp=2 shards none of this model's parameters")
    assert set(notes) <= set(plan.predicted.notes) and notes[-1] in plan.explain()  # the plan says so


def test_a_split_model_carries_no_warning():
    gm, plan = planned(width=256, hidden=1024)
    assert idle_tp_warning(gm, plan.placements, 2) is None
    assert not any(note.startswith("warning: tp=") for note in plan.predicted.notes)
    assert not replicated_compute(gm, plan.placements, 2)["no split fits"]
    assert replicated_notes(gm, plan.placements, 1) == ()  # one rank: nothing is kept whole by tp
