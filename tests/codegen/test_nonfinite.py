"""Non-finite steps met with the user's policy (codegen/runtime/numerics/nonfinite.py), loss spikes reported
(loss_spikes.py), and no checkpoint written with a NaN or inf (checkpoint/finite_check.py).

Default tier: one process, the tiny GPT compiled for one rank; NaN or inf put into a gradient or a weight
where a divergent run would have them. ``stop`` names the step, the rank with its mesh coordinates, the
first parameter and its optimizer group, and leaves the weights as they were; ``skip`` leaves them too and
zeroes the gradients; ``rollback`` without a checkpoint is refused naming the folder. Matrix tier: two
ranks, a NaN gradient on rank 1 only, rolled back to the last checkpoint and trained on, every checkpoint
file finite.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.test_zero import batch
from xirang.codegen.runtime.checkpoint.finite_check import first_nonfinite, refuse_nonfinite
from xirang.codegen.runtime.numerics.loss_spikes import LossSpikes
from xirang.codegen.runtime.numerics.nonfinite import NonFiniteGuard
from xirang.ir.errors import XirangError


def compiled_gpt():
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt("tiny", device="cpu"), world=1, example_kwargs=batch(0, 2), global_batch=2)
    no_decay = [p for n, p in compiled.named_parameters() if "ln" in n or "bias" in n]
    decay = [p for n, p in compiled.named_parameters() if not ("ln" in n or "bias" in n)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    return compiled, optimizer


def weights(compiled) -> dict:
    return {n: p.detach().clone() for n, p in compiled.named_parameters()}


def poison_gradient(compiled, name: str, value=float("nan")) -> None:
    dict(compiled.named_parameters())[name].grad.view(-1)[0] = value


def test_stop_names_the_step_rank_parameter_and_group_and_takes_no_step():
    compiled, optimizer = compiled_gpt()
    loss = compiled.train_step(**batch(0, 2))
    before = weights(compiled)
    name = [n for n, _ in compiled.named_parameters() if "ln" in n][0]  # in optimizer group 1
    poison_gradient(compiled, name)
    with pytest.raises(XirangError) as caught:
        NonFiniteGuard("stop").step(compiled, optimizer, loss, step=7)
    error = caught.value
    assert error.what.startswith("step 7:") and "gradient norm nan" in error.what, error.what
    assert f"first non-finite gradient {name!r} on rank 0 (dp 0, pp 0, tp 0), optimizer param group 1" in error.what
    assert "step 7" in error.where and "rank 0" in error.where
    assert "--clip" in error.hint and "--on-nonfinite skip" in error.hint and "no step was taken" in error.hint
    assert all(torch.equal(p, before[n]) for n, p in weights(compiled).items())


def test_an_infinite_gradient_stops_as_a_nan_does():
    compiled, optimizer = compiled_gpt()
    loss = compiled.train_step(**batch(0, 2))
    poison_gradient(compiled, "tok_emb.weight", float("inf"))
    with pytest.raises(XirangError, match="gradient norm inf; first non-finite gradient 'tok_emb.weight'"):
        NonFiniteGuard().step(compiled, optimizer, loss, step=1)


def test_a_nan_weight_is_named_with_the_loss_it_makes():
    compiled, optimizer = compiled_gpt()
    name = [n for n, _ in compiled.named_parameters() if n.endswith("weight")][-1]
    with torch.no_grad():
        dict(compiled.named_parameters())[name].view(-1)[0] = float("nan")
    loss = compiled.train_step(**batch(0, 2))
    with pytest.raises(XirangError) as caught:
        NonFiniteGuard("stop").step(compiled, optimizer, loss, step=3)
    what = caught.value.what
    assert "the loss is nan" in what and "first non-finite loss on rank 0 (dp 0, pp 0, tp 0), micro-batch 0" in what
    assert f"first non-finite weight {name!r}" in what and "an earlier step wrote it" in what, what


def test_skip_takes_no_step_zeroes_the_gradients_and_the_next_finite_step_steps():
    compiled, optimizer = compiled_gpt()
    guard = NonFiniteGuard("skip")
    loss = compiled.train_step(**batch(0, 2))
    before = weights(compiled)
    poison_gradient(compiled, "tok_emb.weight")
    outcome = guard.step(compiled, optimizer, loss, step=1)
    assert outcome.action == "skipped" and not outcome.stepped and math.isnan(outcome.norm)
    assert "'tok_emb.weight'" in outcome.found
    assert all(torch.equal(p, before[n]) for n, p in weights(compiled).items())
    assert all(p.grad is None for _, p in compiled.named_parameters())
    outcome = guard.step(compiled, optimizer, compiled.train_step(**batch(1, 2)), step=2)
    assert outcome.stepped and math.isfinite(outcome.norm)
    assert any(not torch.equal(p, before[n]) for n, p in weights(compiled).items())


def test_clip_through_the_guard_clips_and_reports_the_norm_before_clipping():
    compiled, optimizer = compiled_gpt()
    loss = compiled.train_step(**batch(0, 2))
    outcome = NonFiniteGuard().step(compiled, optimizer, loss, step=1, clip=1e-3)
    assert outcome.stepped and outcome.norm > 1e-3  # the total before clipping, as torch returns it


def test_rollback_without_a_checkpoint_is_refused_naming_the_folder(tmp_path):
    compiled, optimizer = compiled_gpt()
    loss = compiled.train_step(**batch(0, 2))
    poison_gradient(compiled, "tok_emb.weight")
    with pytest.raises(XirangError) as caught:
        NonFiniteGuard("rollback", checkpoint_dir=tmp_path).step(compiled, optimizer, loss, step=4)
    assert f"no complete checkpoint in {tmp_path}" in caught.value.what
    assert "--checkpoint-every" in caught.value.hint and str(tmp_path) in caught.value.where


@pytest.mark.parametrize("kwargs, words", [({"policy": "retry"}, "unknown non-finite policy 'retry'"),
                                           ({"policy": "rollback"}, "needs the folder of checkpoints")])
def test_a_wrong_policy_is_refused(kwargs, words):
    with pytest.raises(XirangError, match=words) as caught:
        NonFiniteGuard(**kwargs)
    assert caught.value.hint


def test_a_norm_asked_alone_logs_nothing_and_clipping_no_longer_says_it_skips(caplog):
    compiled, _ = compiled_gpt()
    compiled.train_step(**batch(0, 2))
    poison_gradient(compiled, "tok_emb.weight")
    with caplog.at_level(logging.WARNING, logger="xirang.grad_norm"):
        assert math.isnan(compiled.clip_grad_norm_(math.inf).item())
        assert not [r for r in caplog.records if r.name == "xirang.grad_norm"]
        compiled.clip_grad_norm_(1.0)
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "xirang.grad_norm")
    assert "left unclipped" in said and "skip" not in said, said


# --- loss spikes ---------------------------------------------------------------------------------------------

def test_a_loss_far_above_its_recent_range_is_a_spike_and_noise_is_not():
    spikes = LossSpikes(window=10, least=5)
    for step, loss in enumerate([3.0, 2.9, 3.05, 2.95, 3.0, 2.98], start=1):
        assert spikes.observe(step, loss) is None
    note = spikes.observe(7, 9.5)
    assert note.startswith("loss spike at step 7: 9.5") and "range 2.9-3.05" in note, note
    assert spikes.spikes[0][:2] == (7, 9.5)


def test_too_few_losses_are_not_judged_and_non_finite_ones_are_not_kept():
    spikes = LossSpikes(window=10, least=5)
    assert [spikes.observe(i, v) for i, v in enumerate([1.0, 50.0, 1.0, float("nan")])] == [None] * 4
    assert list(spikes.recent) == [1.0, 50.0, 1.0]


def test_a_new_level_is_reported_once():
    spikes = LossSpikes(window=5, least=3)
    notes = [spikes.observe(i, v) for i, v in enumerate([2.0, 2.0, 2.0, 8.0, 8.0, 8.0, 8.0])]
    assert [i for i, n in enumerate(notes) if n] == [3]


def test_a_flat_loss_needs_a_real_jump():
    spikes = LossSpikes(window=10, least=3)
    for i in range(5):
        spikes.observe(i, 1.0)
    assert spikes.observe(6, 1.1) is None and spikes.observe(7, 1.5) is not None


@pytest.mark.parametrize("kwargs", [{"window": 3, "least": 5}, {"factor": 0}, {"floor": -1}])
def test_loss_spikes_settings_are_checked(kwargs):
    with pytest.raises(XirangError, match="LossSpikes needs"):
        LossSpikes(**kwargs)


# --- no checkpoint with a NaN ---------------------------------------------------------------------------------

def test_first_nonfinite_finds_the_first_float_entry_only():
    state = {"a": torch.ones(2), "ids": torch.tensor([1, 2]), "b": torch.tensor([1.0, float("inf")]), "n": 3.0}
    assert first_nonfinite(state) == "b" and first_nonfinite({"a": torch.ones(1)}) is None


def test_refuse_nonfinite_names_the_tensor_rank_and_step(tmp_path):
    with pytest.raises(XirangError) as caught:
        refuse_nonfinite({"model.w": torch.tensor([float("nan")])}, step=12, folder=tmp_path, rank=0,
                         distributed=False)
    assert "checkpoint step 12 not written: 'model.w' holds non-finite values" in caught.value.what
    assert str(tmp_path) in caught.value.where and "rank 0" in caught.value.where
    assert "--on-nonfinite" in caught.value.hint


def _module_and_optimizer():
    torch.manual_seed(0)
    model = build_gpt("tiny", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from xirang.cli.verify import loss_of
    loss_of(model(**batch(0, 2))).backward()
    optimizer.step()
    return model, optimizer


def test_a_model_with_a_nan_weight_is_not_checkpointed(tmp_path):
    model, optimizer = _module_and_optimizer()
    with torch.no_grad():
        model.tok_emb.weight[0, 0] = float("nan")
    with pytest.raises(XirangError, match="'model.tok_emb.weight' holds non-finite values"):
        xirang.save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert not (tmp_path / "ckpt").exists()  # refused before the folder was made


def test_a_nan_optimizer_state_is_not_checkpointed(tmp_path):
    model, optimizer = _module_and_optimizer()
    next(iter(optimizer.state.values()))["exp_avg"].view(-1)[0] = float("nan")
    with pytest.raises(XirangError, match="optim.*exp_avg' holds non-finite values"):
        xirang.save_checkpoint(model, optimizer, tmp_path / "ckpt", step=1)
    assert xirang.latest_checkpoint(tmp_path / "ckpt", quiet=True) is None if (tmp_path / "ckpt").exists() else True
