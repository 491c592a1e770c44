"""The single-device reference the multi-rank equivalence tests compare against: AdamW steps on the
plain model, recording the loss and every gradient per step and the parameters after the last; and
the same loop on a compiled model inside a rank (``compiled_run``), gathering to full tensors.

With ``rng`` (an ``xirang.ExactReference``) the model draws its random numbers (dropout) as programs
compiled with ``rng="exact"`` and the same seed do, so a model with dropout is compared exactly.

AdamW uses eps=1e-3 (see tests/codegen/test_equivalence.py: a gradient that is zero in exact
arithmetic is rounding noise, which Adam's first step with a tiny eps would amplify to lr * sign).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from xirang.cli.verify import loss_of  # a tensor, a tuple's first element or HF `.loss`


def _micro_batch_loss(model, inputs: dict, micro_batch: int):
    """The mean of the model's loss over micro-batches of ``micro_batch`` samples (gradient
    accumulation on one device): what a parallel run computes for a loss that is not a mean over
    samples, such as a Mixture-of-Experts' auxiliary load-balancing loss, whose expert fractions are
    taken over the tokens of one forward."""
    total = next(iter(inputs.values())).shape[0]
    losses = [loss_of(model(**{k: v[start:start + micro_batch] for k, v in inputs.items()}))
              for start in range(0, total, micro_batch)]
    return torch.stack(losses).mean()


def single_device_run(model, batch, steps: int, *, keep_duplicates: bool = False, rng=None,
                      micro_batch=None) -> dict:
    """{"steps": [(loss, {name: grad})...], "params": {name: tensor}} for ``steps`` AdamW steps on
    ``batch(step)``; ``keep_duplicates`` lists a tied parameter under every name; ``rng``: an
    ``ExactReference`` the forward of step k draws under (``rng.forward(k)``); ``micro_batch``: the
    loss is the mean over micro-batches of that many samples (``_micro_batch_loss``)."""
    def named():
        return model.named_parameters(remove_duplicate=not keep_duplicates)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    found = []
    for step in range(steps):
        inputs = batch(step)
        with rng.forward(step) if rng is not None else nullcontext():
            loss = (loss_of(model(**inputs)) if micro_batch is None
                    else _micro_batch_loss(model, inputs, micro_batch))
        loss.backward()
        found.append((loss.item(), {n: p.grad.clone() for n, p in named()}))
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": found, "params": {n: p.detach().clone() for n, p in named()}}


def compiled_run(compiled, batch, steps: int) -> dict:
    """``single_device_run``'s loop on a ``CompiledModel`` in a rank: the same
    global batch per step, gradients and parameters gathered to full tensors (collective calls:
    every rank runs this)."""
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    optimizer.zero_grad()  # gradients accumulate over train_steps, as with backward(): start from none
    found = []
    for step in range(steps):
        loss = compiled.train_step(**batch(step))
        found.append((loss.item(), compiled.full_gradients()))
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": found, "params": compiled.full_state_dict()}


def worst_differences(label: str, results: list, want: dict) -> dict:
    """The largest |difference| of loss (every step), gradients (every step, every parameter) and
    parameters (after the last step) between every rank's ``results[rank][label]`` (``compiled_run``)
    and the reference ``want`` (``single_device_run``); every rank must report every gradient the
    reference has, at its shape."""
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for rank, result in enumerate(results):
        got = result[label]
        for (loss, grads), (want_loss, want_grads) in zip(got["steps"], want["steps"]):
            worst["loss"] = max(worst["loss"], abs(loss - want_loss))
            assert set(grads) == set(want_grads), (label, rank, sorted(set(grads) ^ set(want_grads)))
            for fqn, grad in want_grads.items():
                assert grads[fqn].shape == grad.shape, (label, fqn)
                worst["grad"] = max(worst["grad"], (grads[fqn] - grad).abs().max().item())
        for fqn, param in want["params"].items():
            worst["param"] = max(worst["param"], (got["params"][fqn] - param).abs().max().item())
    return worst
