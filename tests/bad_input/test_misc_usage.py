"""More of what a new user gets wrong: compile arguments, a multi-rank compile in one process,
inspect's rank and stage, a saved plan combined with pins or another world or batch."""
from __future__ import annotations

import os

import pytest
import torch

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, assert_clear_cli, assert_clear_error, cli
from xirang.ir.errors import XirangError

MODEL = f"{MODELS}:mlp"


def _refused(needle, where="", hint="", **kwargs):
    model, inputs = models.mlp()
    call = {"world": 1, "hardware": "cpu", "example_kwargs": inputs, "global_batch": 8, **kwargs}
    with pytest.raises(XirangError) as info:
        xirang.compile(model, **call)
    return assert_clear_error(info.value, needle, where=where, hint=hint)


def test_compile_without_global_batch_or_plan():
    _refused("needs global_batch=", global_batch=None)


def test_compile_with_an_unknown_rng_mode():
    _refused("unknown rng mode 'exactly'", where="rng=", runtime=xirang.RuntimeOptions(rng="exactly"))


def test_compile_for_two_ranks_in_one_process_says_how_to_launch():
    _refused("needs 2 ranks but runs as a single process", hint="torch.distributed.run", world=2)


def test_compile_with_inputs_the_forward_does_not_take():
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=1, hardware="cpu", example_kwargs={**inputs, "z": torch.ones(8)}, global_batch=8)
    assert "z" in str(info.value) and info.value.hint


def test_compile_with_a_global_batch_the_plan_cannot_split():
    _refused("global_batch=0", global_batch=0)


def test_inspect_rank_out_of_range(saved_plan):
    assert_clear_cli(cli("inspect", saved_plan, "--rank", "5"), "--rank 5 is out of range", "from 0 to 0")


def test_inspect_stage_not_on_the_rank(saved_plan):
    assert_clear_cli(cli("inspect", saved_plan, "--rank", "0", "--stage", "3"), "--stage 3 does not run on rank 0")


def test_inspect_dump_without_the_model(saved_plan, tmp_path):
    assert_clear_cli(cli("inspect", saved_plan, "--rank", "0", "--dump", tmp_path / "d"), "--dump needs --model")


def test_inspect_with_another_model_than_the_plans(saved_plan):
    assert_clear_cli(cli("inspect", saved_plan, "--rank", "0", "--model", f"{MODELS}:batchnorm"), "different model")


def test_run_with_a_plan_and_pins(saved_plan):
    assert_clear_cli(cli("run", MODEL, "--world", "1", "--plan", saved_plan, "--tp", "1"), "cannot be combined")


def test_run_with_a_plan_for_another_world(saved_plan):
    assert_clear_cli(cli("run", MODEL, "--world", "2", "--plan", saved_plan), "made for 1 ranks, not --world 2")


def test_run_with_a_plan_for_another_global_batch(saved_plan):
    assert_clear_cli(cli("run", MODEL, "--world", "1", "--plan", saved_plan, "--global-batch", "16"),
                     "--global-batch 16 differs from the plan's 8")


def test_run_with_a_plan_for_another_model(saved_plan):
    assert_clear_cli(cli("run", f"{MODELS}:batchnorm", "--world", "1", "--plan", saved_plan), "different model")


@pytest.mark.matrix  # launches a rank process and a reference: tens of seconds on a loaded machine
def test_verify_of_a_good_model_on_one_rank_passes():
    code, out, err = cli("verify", MODEL, "--world", "1", "--steps", "1")
    assert code == 0 and "verify: PASS" in out, err + out


@pytest.mark.matrix
def test_verify_with_zero_tolerance_is_a_valid_strict_check():
    code, out, err = cli("verify", MODEL, "--world", "1", "--steps", "1", "--tolerance", "0")
    assert code in (0, 1) and "verify:" in out and "Traceback" not in err


def test_debug_shows_the_traceback_of_xirangs_error_and_only_then(tmp_path, monkeypatch):
    """A clear error needs no traceback; `xirang --debug` (or XIRANG_DEBUG=1) asks for it, and its
    ranks and launch's report see the request (XIRANG_DEBUG set while the command runs, then restored)."""
    monkeypatch.delenv("XIRANG_DEBUG", raising=False)
    missing = tmp_path / "missing.json"
    assert_clear_cli(cli("explain", missing), "missing.json")
    code, _, err = cli("--debug", "explain", missing)
    assert code == 2 and "Traceback (most recent call last)" in err and "xirang: error:" in err, err
    assert err.index("Traceback") < err.index("xirang: error:"), err  # the explanation stays the last word
    assert "XIRANG_DEBUG" not in os.environ
    monkeypatch.setenv("XIRANG_DEBUG", "1")
    code, _, err = cli("explain", missing)
    assert code == 2 and "Traceback (most recent call last)" in err, err


def test_compile_plans_at_the_sequence_it_is_given_and_refuses_one_beside_a_plan():
    # examples/train_gpt.py plans at seq 2048 and runs at 32: compile passes seq= on to xirang.plan
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8, seq=8)
    plan = xirang.plan(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8)
    _refused("both a plan and plan choices ['seq']", plan=plan, seq=8)
    assert compiled.plan.mesh.size == 1
