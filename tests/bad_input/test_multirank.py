"""Faults that need several ranks (slow: -m matrix). Ranks given different or bad batches fail
together with the input named, within seconds, never hang; gradients accumulate across steps at
dp=2 as on one device; a BatchNorm model planned for 2 ranks (kept to dp=1 by the planner) trains
as one device does; the command --print-command prints runs under torchrun."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import torch

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, cli
from xirang.codegen.runtime.launch.launcher import launch

pytestmark = pytest.mark.matrix
REPO = Path(__file__).resolve().parents[2]


def _rank_batch_fault(rank: int, world: int, fault: str):
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, dp=2)
    batch = models.features(8)
    if rank == 1 and fault == "different":
        batch = {k: v.flip(0) for k, v in batch.items()}
    if rank == 1 and fault == "dtype":
        batch["y"] = batch["y"].float()
    try:
        compiled.train_step(**batch)
    except xirang.XirangError as error:
        return str(error)
    return "trained"


@pytest.mark.parametrize("fault,mine,other", [
    ("different", "different batches", "different batches"),
    ("dtype", "'y' has dtype float32", "another rank was given a batch"),
])
def test_ranks_given_bad_batches_fail_together_naming_it(fault, mine, other):
    results = launch(_rank_batch_fault, 2, args=(fault,), timeout_s=120)  # liveness: the launcher's deadline
    assert mine in results[1], results
    assert other in results[0], results


def _two_batches() -> tuple[dict, dict]:
    """Two different batches: the second's gradient is not the first's (a reordered batch would give
    the same mean-loss gradient, and a wrong accumulation could pass unseen)."""
    a = models.features(8)
    return a, {"x": a["x"] * 0.5 + 1.0, "y": a["y"].flip(0)}


def _rank_accumulate(rank: int, world: int, zero_between: bool):
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, dp=2)
    a, b = _two_batches()
    compiled.train_step(**a)
    if zero_between:  # zeroed in place: the gradients stay the same tensors
        for param in compiled.parameters():
            param.grad.zero_()
    compiled.train_step(**b)
    return {k: v.clone() for k, v in compiled.full_gradients().items()}


@pytest.mark.parametrize("zero_between", [False, True], ids=["accumulated", "zeroed-in-place"])
def test_gradients_accumulate_across_steps_at_dp2(zero_between):
    got = launch(_rank_accumulate, 2, args=(zero_between,), timeout_s=180)
    model, _ = models.mlp()
    a, b = _two_batches()
    model(**a).backward()
    if zero_between:
        model.zero_grad(set_to_none=False)
    model(**b).backward()
    for grads in got:
        worst = max(float((grads[k] - p.grad).abs().max()) for k, p in model.named_parameters())
        assert worst < 1e-5


def _rank_batchnorm(rank: int, world: int, plan):
    model, inputs = models.batchnorm()
    compiled = xirang.compile(model, world=2, example_kwargs=inputs, plan=plan)
    losses = []
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for _step in range(3):
        losses.append(compiled.train_step(**models.features(8)).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, {k: v.clone() for k, v in compiled.full_state_dict().items()}


def test_batchnorm_planned_for_two_ranks_equals_one_device():
    model, inputs = models.batchnorm()
    plan = xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert plan.mesh.dp == 1 and plan.num_micro_batches == 1
    results = launch(_rank_batchnorm, 2, args=(plan,), timeout_s=180)
    reference, _ = models.batchnorm()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for _step in range(3):
        loss = reference(**models.features(8))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    for got_losses, params in results:
        assert max(abs(a - b) for a, b in zip(got_losses, losses)) < 1e-5
        assert max(float((params[k] - p).abs().max()) for k, p in reference.named_parameters()) < 1e-5


def test_printed_command_runs_under_torchrun():
    code, out, err = cli("run", f"{MODELS}:mlp", "--world", "2", "--steps", "2", "--global-batch", "8",
                         "--print-command")
    assert code == 0, err
    result = subprocess.run(shlex.split(out.splitlines()[0]), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("loss") == 2, result.stdout
