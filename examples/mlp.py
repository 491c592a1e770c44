"""A model that is not a transformer: an MLP classifier whose forward returns its loss, for
`xirang run examples/mlp.py:mlp --world 2` (data parallelism; tensor parallelism if planned).

    mlp(batch=16) -> (model, {"x": float features [batch, 32], "y": class labels [batch]})

The factory returns real CPU tensors so the model can be traced, planned and trained as it is.
"""
from __future__ import annotations

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, DEPTH = 32, 64, 10, 3


class MLP(nn.Module):
    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, classes: int = CLASSES, depth: int = DEPTH):
        super().__init__()
        widths = [features] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        # the loss is part of forward: Xirang compiles training programs, which end in a scalar loss
        return nn.functional.cross_entropy(self.head(x), y)


def mlp(batch: int = 16):
    """The MLP and example inputs of ``batch`` samples."""
    return MLP(), {"x": torch.randn(batch, FEATURES), "y": torch.zeros(batch, dtype=torch.long)}
