"""``named_parameters()`` under ZeRO yields what the optimizer must step, so optimizer groups chosen by name train.

The Hugging Face weight-decay idiom -- AdamW groups by name from ``compiled.named_parameters()``, no decay
for biases and norms -- used to train nothing under ZeRO (the loss stayed 5.9149 at dp = 2: the names
came with the whole parameters, which under ZeRO get no gradient). Matrix tier (two ranks, one launch):
the tiny GPT at dp = 2 under ZeRO-1 and ZeRO-3, 3 AdamW steps with the idiom, equal to one device with the
same idiom (loss each step, parameters after) within 1e-5; the same groups with one weight decay equal
``parameters()``; an optimizer over the whole parameters (``named_model_parameters()``) refused on both ranks
at its first step. Default tier: an optimizer over tensors the runtime does not step is refused at the first
``train_step``, naming the tensor and what to pass.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.test_zero import STEPS, TOLERANCE, batch
from xirang.cli.verify import loss_of
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import XirangError

NO_DECAY = ("bias", "ln", "norm")


def grouped(named, decay: float = 0.1, other: float = 0.0) -> list:
    """The HF idiom: weight decay for matrices, none for biases and norms (by name)."""
    named = list(named)
    return [{"params": [p for n, p in named if not any(k in n for k in NO_DECAY)], "weight_decay": decay},
            {"params": [p for n, p in named if any(k in n for k in NO_DECAY)], "weight_decay": other}]


def gpt():
    torch.manual_seed(0)
    return build_gpt("tiny", device="cpu")


def _rank(rank, world, plan_of):
    out = {}
    for stage, plan in plan_of.items():
        found = {}
        for label, groups in (("idiom", lambda c: grouped(c.named_parameters())),
                              ("same", lambda c: grouped(c.named_parameters(), 0.1, 0.1)),
                              ("flat", lambda c: [{"params": c.parameters(), "weight_decay": 0.1}])):
            compiled = xirang.compile(gpt(), world=2, example_kwargs=batch(0, 2), plan=plan)
            names = [n for n, _ in compiled.named_parameters()]
            optimizer = torch.optim.AdamW(groups(compiled), lr=1e-3, eps=1e-3)
            losses = []
            for step in range(STEPS):
                losses.append(compiled.train_step(**batch(step)).item())
                optimizer.step()
                optimizer.zero_grad()
            found[label] = {"losses": losses, "params": compiled.full_state_dict(), "names": names}
        compiled = xirang.compile(gpt(), world=2, example_kwargs=batch(0, 2), plan=plan)
        stray = torch.optim.AdamW([t for _, t in compiled.named_model_parameters()], lr=1e-3)  # the whole ones
        try:
            compiled.train_step(**batch(0))
            found["refused"] = None
        except XirangError as error:
            found["refused"] = (error.what, error.where, error.hint)
        del stray
        out[stage] = found
    return out


def _one_device(groups) -> dict:
    model = gpt()
    optimizer = torch.optim.AdamW(groups(model), lr=1e-3, eps=1e-3)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model(**batch(step)))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.matrix  # two ranks, six compiled models: over the default tier's budget
def test_name_grouped_adamw_trains_under_zero1_and_zero3_as_one_device():
    base = xirang.plan(gpt(), world=2, example_kwargs=batch(0, 2), global_batch=8, dp=2, tp=1, pp=1,
                       micro_batch=2, schedule="1f1b", precision="fp32")
    plans = {1: base.with_zero_stage(1), 3: base.with_zero_stage(3)}
    results = launch(_rank, 2, (plans,), timeout_s=600, heartbeat_s=60)
    want = {"idiom": _one_device(lambda m: grouped(m.named_parameters())),
            "same": _one_device(lambda m: [{"params": list(m.parameters()), "weight_decay": 0.1}])}
    initial = dict(gpt().named_parameters())
    for stage in plans:
        for rank, result in enumerate(results):
            found = result[stage]
            what, where, hint = found["refused"]  # an optimizer over the whole parameters: refused on every rank
            assert "the model's whole parameter: under ZeRO its gradient goes to this rank's shard pieces" in what
            assert f"rank {rank}" in where and "compiled.named_parameters()" in hint
            assert set(found["idiom"]["names"]) <= set(initial) and found["idiom"]["names"], stage
            moved = min((found["idiom"]["params"][n] - p).abs().max().item() for n, p in initial.items())
            assert moved > 1e-4, (stage, "a parameter the name-grouped AdamW never stepped", moved)
            for label, reference in (("idiom", want["idiom"]), ("same", want["same"]), ("flat", want["same"])):
                got = found[label]
                assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"])) <= TOLERANCE, \
                    (stage, label, got["losses"], reference["losses"])
                worst = max((got["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
                assert worst <= TOLERANCE, (stage, label, worst)


def test_an_optimizer_over_the_single_device_models_parameters_is_refused_at_the_first_step():
    model = gpt()
    compiled = xirang.compile(model, world=1, example_kwargs=batch(0, 2), global_batch=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the module's own: the rank trains copies
    with pytest.raises(XirangError) as caught:
        compiled.train_step(**batch(0, 2))
    error = caught.value
    assert "of the single-device model" in error.what and "never gets a gradient" in error.what, error.what
    assert "optimizer param group 0" in error.where and "first step" in error.where, error.where
    assert "compiled.named_parameters()" in error.hint and "compiled.parameters()" in error.hint
    del optimizer


def test_an_optimizer_over_compiled_parameters_is_not_refused_and_a_foreign_one_is_ignored():
    model = gpt()
    compiled = xirang.compile(model, world=1, example_kwargs=batch(0, 2), global_batch=2)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # another model's: none of its business
    optimizer = torch.optim.AdamW(grouped(compiled.named_parameters()), lr=1e-3)
    first = compiled.train_step(**batch(0, 2)).item()
    optimizer.step()
    optimizer.zero_grad()
    assert compiled.train_step(**batch(0, 2)).item() < first
    del other
