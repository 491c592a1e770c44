"""CompiledModel.train_step and load_full_state_dict given what a new user passes: gradients follow
torch's semantics (they accumulate until zeroed); a batch that does not match the program (names,
kinds, dtypes, ranks, sizes) and a state dict that does not match the model are refused with the
input or key named; what is valid gives one device's result."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import xirang
from tests.bad_input import models
from tests.bad_input.probe import assert_clear_error
from xirang.ir.errors import XirangError


@pytest.fixture(scope="module")
def compiled():
    model, inputs = models.mlp()
    return xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8)


@pytest.fixture
def fresh(compiled):
    """The module's compiled MLP with the initial weights back and no gradients."""
    model, _ = models.mlp()
    compiled.load_full_state_dict(model.state_dict())
    for p in compiled.parameters():
        p.grad = None
    return compiled


def _eager_grads(batches, zero_between=False):
    model, _ = models.mlp()
    for i, batch in enumerate(batches):
        if zero_between and i:
            model.zero_grad()
        model(**batch).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_two_steps_without_zero_grad_accumulate_like_backward(fresh):
    a, b = models.features(8), {k: v.flip(0) for k, v in models.features(8).items()}
    fresh.train_step(**a)
    fresh.train_step(**b)
    assert _worst(fresh.full_gradients(), _eager_grads([a, b])) < 1e-6


def test_zero_grad_between_steps_starts_afresh(fresh):
    a, b = models.features(8), {k: v.flip(0) for k, v in models.features(8).items()}
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.0)
    fresh.train_step(**a)
    optimizer.zero_grad()
    fresh.train_step(**b)
    assert _worst(fresh.full_gradients(), _eager_grads([a, b], zero_between=True)) < 1e-6


def test_zero_grad_to_zeros_not_none_also_starts_afresh(fresh):
    a = models.features(8)
    fresh.train_step(**a)
    torch.optim.SGD(fresh.parameters(), lr=0.0).zero_grad(set_to_none=False)
    fresh.train_step(**a)
    assert _worst(fresh.full_gradients(), _eager_grads([a])) < 1e-6


def test_positional_inputs_give_the_same_loss(fresh):
    batch = models.features(8)
    by_name = fresh.train_step(**batch).item()
    assert fresh.train_step(batch["x"], batch["y"]).item() == pytest.approx(by_name, abs=1e-7)


def _good():
    return models.features(8)


BAD_BATCHES = [  # (name, batch, words of the refusal)
    ("missing-y", lambda: {"x": _good()["x"]}, "missing the input(s) ['y']"),
    ("typo-label", lambda: {**_good(), "lables": _good()["y"]}, "['lables'], which the compiled program does not read"),
    ("y-float", lambda: {**_good(), "y": _good()["y"].float()}, "'y' has dtype float32; the program was built "
                                                                   "for int64"),
    ("x-double", lambda: {**_good(), "x": _good()["x"].double()}, "'x' has dtype float64"),
    ("x-3d", lambda: {**_good(), "x": _good()["x"][:, None]}, "'x' has 3 dim(s)"),
    ("x-1d", lambda: {**_good(), "x": _good()["x"][:, 0]}, "'x' has 1 dim(s)"),
    ("x-features", lambda: {**_good(), "x": torch.randn(8, 5)}, "size 5 on dim 1; the program was built for 4"),
    ("batch-7", lambda: {k: v[:7] for k, v in _good().items()}, "global batch of 7 samples"),
    ("batch-16", lambda: models.features(16), "global batch of 16 samples"),
    ("batch-0", lambda: {k: v[:0] for k, v in _good().items()}, "global batch of 0 samples"),
    ("x-list", lambda: {**_good(), "x": _good()["x"].tolist()}, "'x' is a list"),
    ("x-numpy", lambda: {**_good(), "x": np.zeros((8, 4), dtype=np.float32)}, "'x' is a ndarray"),
    ("y-none", lambda: {**_good(), "y": None}, "'y' is a NoneType"),
]


@pytest.mark.parametrize("name,make,needle", BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_batch_that_does_not_match_the_program_is_refused(compiled, name, make, needle):
    before = {k: v.clone() for k, v in compiled.full_state_dict().items()}
    with pytest.raises(XirangError) as info:
        compiled.train_step(**make())
    assert_clear_error(info.value, needle, where="train_step")
    after = compiled.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused step changed the model"


def test_pre_sharded_share_of_the_wrong_size(compiled):
    with pytest.raises(XirangError) as info:
        compiled.train_step(**{k: v[:4] for k, v in _good().items()}, pre_sharded=True)
    assert_clear_error(info.value, "4 samples", "exactly 8", where="pre_sharded=True")


def test_pre_sharded_that_is_not_a_bool(compiled):
    with pytest.raises(XirangError) as info:
        compiled.train_step(**_good(), pre_sharded="yes")
    assert_clear_error(info.value, "pre_sharded='yes'", "True or False")


def test_too_many_positional_inputs(compiled):
    batch = _good()
    with pytest.raises(XirangError) as info:
        compiled.train_step(batch["x"], batch["y"], batch["y"])
    assert_clear_error(info.value, "do not match the model", "too many positional", hint="by name")


# --- load_full_state_dict ---------------------------------------------------------------------

def test_full_state_dict_of_the_model_loads_exactly(compiled):
    model, _ = models.mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result = compiled.load_full_state_dict(model.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = compiled.full_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


BAD_STATES = [  # (name, edit of a good state dict, words of the refusal)
    ("unexpected", lambda sd: {**sd, "fc3.weight": torch.zeros(2)}, "unexpected keys", "'fc3.weight'"),
    ("prefixed", lambda sd: {"module." + k: v for k, v in sd.items()}, "unexpected keys", "'module.fc1.weight'"),
    ("missing", lambda sd: {k: v for k, v in sd.items() if k != "fc2.bias"}, "missing keys", "'fc2.bias'"),
    ("shape", lambda sd: {**sd, "fc1.weight": torch.zeros(4, 4)}, "shape (4, 4)", "fc1.weight"),
    ("not-tensor", lambda sd: {**sd, "fc1.bias": [0.0] * 8}, "are not tensors", "fc1.bias"),
    ("checkpoint", lambda sd: {"model": sd, "step": 3}, "are not tensors", "'model' entry"),
]


@pytest.mark.parametrize("name,edit,needle,named", BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_state_dict_that_does_not_match_is_refused_before_loading(compiled, name, edit, needle, named):
    model, _ = models.mlp()
    before = {k: v.clone() for k, v in compiled.full_state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a copy that would show
    with pytest.raises(XirangError) as info:
        compiled.load_full_state_dict(edit(model.state_dict()))
    assert_clear_error(info.value, needle, named)
    if name in ("unexpected", "prefixed", "missing", "not-tensor", "checkpoint"):  # refused before any copy
        after = compiled.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_dict_that_is_not_a_mapping(compiled):
    with pytest.raises(XirangError) as info:
        compiled.load_full_state_dict([torch.zeros(2)])
    assert_clear_error(info.value, "needs a mapping", hint="state_dict()")


def test_non_strict_loads_what_matches_and_reports_the_rest(compiled):
    model, _ = models.mlp()
    state = copy.deepcopy(model.state_dict())
    state["fc2.weight"] = state["fc2.weight"] + 5.0
    del state["fc1.bias"]
    state["extra"] = torch.ones(1)
    result = compiled.load_full_state_dict(state, strict=False)
    assert result.missing_keys == ["fc1.bias"] and result.unexpected_keys == ["extra"]
    assert torch.equal(compiled.full_state_dict()["fc2.weight"], state["fc2.weight"])


def test_compile_dump_dir_writes_the_graph_after_every_analysis_and_lowering_pass(tmp_path):
    # docs/architecture.md: xirang.compile(..., dump_dir=DIR) writes what `xirang inspect --dump DIR` writes
    from xirang.pipeline import ANALYSIS_PASSES, LOWERING_PASSES
    model, inputs = models.mlp()
    xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8,
                   debug=xirang.DebugHooks(dump_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis", "rank0"]
    for folder, passes in (("analysis", ANALYSIS_PASSES), ("rank0", LOWERING_PASSES)):
        dumps = sorted(p.name for p in (tmp_path / folder).iterdir())
        assert dumps == [f"{i:02d}_{p.name}.txt" for i, p in enumerate(passes)], dumps
