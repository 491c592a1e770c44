"""Issue 13's acceptance: an unsupported construct (a custom autograd Function, data-dependent control
flow, an op with no FLOP or sharding rule) gives the one-line reason and where, and the rest still
plans (where it can: a branch on tensor values cannot be traced at all, so it is refused, naming the
module, the line and what to do)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import xirang
from xirang.ir.errors import TraceError
from xirang.ir.placement import PlanShard

HIDDEN, WIDE = 2048, 8192


class DoubleWithOwnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3  # not the derivative: what export does not keep


class CustomFunction(nn.Module):
    def forward(self, x):
        return DoubleWithOwnBackward.apply(x)


class NoRule(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, dim=-1)  # no FLOP rule and no sharding rule


class BranchOnValues(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Sandwich(nn.Module):
    """An MLP whose middle is the construct under test: the linears around it still plan."""

    def __init__(self, middle: nn.Module):
        super().__init__()
        self.up, self.middle, self.down = nn.Linear(HIDDEN, WIDE), middle, nn.Linear(WIDE, HIDDEN)

    def forward(self, x):
        return self.down(self.middle(torch.relu(self.up(x)))).square().mean()


def plan_of(middle: nn.Module):
    with torch.device("meta"):
        model = Sandwich(middle)
    return xirang.plan(model, world=2, example_kwargs={"x": torch.zeros(8, 4096, HIDDEN, device="meta")},
                       global_batch=8, hardware="a100-80g", precision="fp32", dp=1, tp=2, pp=1)


def split_linears(plan) -> list:
    """The linears the plan splits over tp (by weight or by rows); the rest of the model planned."""
    return [n for n in ("linear", "linear_1") if plan.placements[n].strategy != "replicate"
            and any(isinstance(layout.tp, PlanShard) for layout in plan.placements[n].inputs)]


def test_a_custom_autograd_function_is_named_with_its_module_and_line_and_the_rest_plans():
    plan = plan_of(CustomFunction())
    (note,) = [n for n in plan.predicted.notes if "autograd Function" in n]
    line = CustomFunction.forward.__code__.co_firstlineno + 1
    assert "\n" not in note and "DoubleWithOwnBackward in module 'middle' (CustomFunction)" in note, note
    assert f"test_unsupported_constructs.py:{line}" in note and "backward is not traced" in note, note
    assert "torch.library custom op" in note  # what to do
    assert split_linears(plan) == ["linear", "linear_1"], {n: s.strategy for n, s in plan.placements.items()}
    assert any(note in line for line in plan.explain().splitlines())


def test_an_op_without_flop_or_sharding_rule_is_named_with_its_module_and_line_and_the_rest_plans():
    plan = plan_of(NoRule())
    assert plan.fallbacks == ("cumprod",)
    (note,) = [n for n in plan.predicted.notes if "no sharding rule" in n]
    line = NoRule.forward.__code__.co_firstlineno + 1
    assert note == f"1 op(s) have no sharding rule and run replicated: cumprod (in 'middle' (NoRule), " \
                   f"test_unsupported_constructs.py:{line})", note
    assert plan.placements["cumprod"].strategy == "replicate"
    assert split_linears(plan), {n: s.strategy for n, s in plan.placements.items()}
    with torch.device("meta"):
        report = xirang.analyze(Sandwich(NoRule()), example_kwargs={"x": torch.zeros(8, 16, HIDDEN, device="meta")})
    assert list(report.unpriced_ops) == ["aten.cumprod"], report.unpriced_ops


def test_data_dependent_control_flow_is_refused_with_module_line_and_what_to_do():
    with pytest.raises(TraceError) as caught:
        plan_of(BranchOnValues())
    message = str(caught.value)
    first = message.splitlines()[0]
    assert "control flow that depends on tensor values" in first, message
    line = BranchOnValues.forward.__code__.co_firstlineno + 1
    assert "module 'middle' (BranchOnValues), " in message and f"test_unsupported_constructs.py:{line}" in message
    assert "torch.where" in message
