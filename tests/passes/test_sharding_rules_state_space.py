"""Sharding rules for the ops Mamba's mixer traces to (passes/planning/sharding_rules_state_space.py):
its depthwise convolution, the stack of the scan's outputs, the scan's zero initial state, and
``dt_proj``'s ``W @ X``. Hand-checked expectations."""
from __future__ import annotations

import torch
from torch import nn

from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from tests.passes.test_sharding_rules import analysed, layouts, only

R, P = PlanReplicate(), PlanPartial("sum")


class Conv(nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 4, groups=groups, padding=3)

    def forward(self, x):
        return self.conv(x)


def test_a_depthwise_convolution_splits_its_channels_and_any_convolution_its_batch():
    found = layouts(only(analysed(Conv(groups=8), {}, x=torch.randn(2, 8, 5)), "conv1d"), tp=2)
    assert ((PlanShard(1), PlanShard(0), PlanShard(0)), PlanShard(1)) in found  # each channel its own filter
    assert ((PlanShard(0), R, R), PlanShard(0)) in found
    found = layouts(only(analysed(Conv(groups=1), {}, x=torch.randn(2, 8, 5)), "conv1d"), tp=2)
    assert not any(out == PlanShard(1) for _, out in found)  # a full convolution mixes the channels


class Scan(nn.Module):
    def forward(self, a, u):
        state = torch.zeros(2, 8, 4)
        outputs = []
        for i in range(3):
            state = a[:, :, i, :] * state + u[:, :, i, :]
            outputs.append(state.sum(-1))
        return torch.stack(outputs, dim=-1)


def test_the_scan_keeps_its_channels_split_through_zeros_select_and_stack():
    gm = analysed(Scan(), {}, a=torch.randn(2, 8, 3, 4), u=torch.randn(2, 8, 3, 4))
    assert ((), PlanShard(1)) in layouts(only(gm, "zeros"), tp=2)  # zeros: made split
    stack = only(gm, "stack")  # three [2, 8] outputs -> [2, 8, 3]
    assert ((PlanShard(1),) * 3, PlanShard(1)) in layouts(stack, tp=2)
    assert ((P,) * 3, P) in layouts(stack, tp=2)


class LeftWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return torch.matmul(self.weight, x)  # [8, 4] @ [b, 4, s]


def test_a_weight_times_a_batch_splits_the_weights_rows():
    found = layouts(only(analysed(LeftWeight(), {}, x=torch.randn(2, 4, 5)), "matmul"), tp=2)
    assert ((PlanShard(0), R), PlanShard(1)) in found


class SplitAtIndex(nn.Module):
    def forward(self, x):  # Mamba's scan since transformers 5.25: tensor_split(x, [k], dim=2) along the sequence
        head, tail = torch.tensor_split(x, [3], dim=2)
        return torch.cat([head, tail], dim=2)


def test_a_split_at_indices_keeps_the_channels_split_but_never_the_split_dim():
    found = layouts(only(analysed(SplitAtIndex(), {}, x=torch.randn(2, 8, 5)), "tensor_split"), tp=2)
    assert ((PlanShard(1),), (PlanShard(1),) * 2) in found
    assert not any(out[0] == PlanShard(2) for _, out in found)  # its indices are positions: not localised
