"""Small model factories for the bad-input battery: one good model per kind the checks care about and
one factory per way a user's factory goes wrong. CLI probes name them as
``tests/bad_input/models.py:<factory>``; API probes import them.

``XIRANG_TEST_MARKER``: when set, every good factory appends its name to that file, so a probe can
prove an argument was refused *before* the model was built (the work an early check must save).
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

FEATURES, HIDDEN, CLASSES = 4, 8, 3


def _mark(name: str) -> None:
    marker = os.environ.get("XIRANG_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(name + "\n")


def features(batch: int = 8) -> dict:
    generator = torch.Generator().manual_seed(batch)
    return {"x": torch.randn(batch, FEATURES, generator=generator),
            "y": torch.randint(0, CLASSES, (batch,), generator=generator)}


class MLP(nn.Module):
    """Linear - ReLU - Linear, returns the cross-entropy loss (a scalar that needs grad)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


class Logits(MLP):
    """Forgot the loss: returns logits."""

    def forward(self, x, y=None):
        return self.fc2(torch.relu(self.fc1(x)))


class PerSample(MLP):
    """reduction='none': one loss per sample."""

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y, reduction="none")


class IntOutput(MLP):
    """Returns predicted classes (an int tensor): nothing to differentiate."""

    def forward(self, x, y):
        return (self.fc2(torch.relu(self.fc1(x))).argmax(-1) == y).sum()


class Detached(MLP):
    """The loss computed from detached outputs: a scalar with no gradient to the parameters."""

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))).detach(), y)


class BatchNormNet(nn.Module):
    """Linear - BatchNorm1d - ReLU - Linear: normalises with the statistics of its batch."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


POSITIONS, VOCAB = 8, 16


class Positions(nn.Module):
    """Tokens plus a learned position table of ``POSITIONS`` rows, indexed by arange(seq)."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(POSITIONS, HIDDEN), \
            nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        logits = self.head(self.tok(input_ids) + self.pos(positions))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def tokens(batch: int = 4, seq: int = POSITIONS) -> dict:
    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


# --- factories: good ones --------------------------------------------------------------------------

def mlp(batch: int = 8):
    _mark("mlp")
    torch.manual_seed(0)
    return MLP(), features(batch)


def batchnorm(batch: int = 8):
    _mark("batchnorm")
    torch.manual_seed(0)
    return BatchNormNet(), features(batch)


def positions(batch: int = 4, seq: int = POSITIONS):
    _mark("positions")
    torch.manual_seed(0)
    return Positions(), tokens(batch, seq)


def logits(batch: int = 8):
    return Logits(), features(batch)


def per_sample(batch: int = 8):
    return PerSample(), features(batch)


def int_output(batch: int = 8):
    return IntOutput(), features(batch)


def detached(batch: int = 8):
    return Detached(), features(batch)


def frozen(batch: int = 8):
    model = MLP()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, features(batch)


def model_only():
    """A factory may return the model alone (inputs then come from elsewhere)."""
    return MLP()


# --- factories: wrong ones -------------------------------------------------------------------------

def three_tuple(batch: int = 8):
    return MLP(), features(batch), "extra"


def returns_none(batch: int = 8):
    return None


def returns_dict(batch: int = 8):
    return {"model": MLP(), "inputs": features(batch)}


def kwargs_as_list(batch: int = 8):
    return MLP(), list(features(batch).values())


def inputs_first(batch: int = 8):
    return features(batch), MLP()


def raises(batch: int = 8):
    raise RuntimeError("the dataset folder /data/cifar is missing")


def needs_path(path, batch: int = 8):
    return MLP(), features(batch)


def no_batch_parameter():
    return MLP(), features(8)


NOT_A_FUNCTION = 3
