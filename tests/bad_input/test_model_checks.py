"""Models that cannot train as asked: no scalar loss, positions past the table, batch statistics
under a split batch, plans whose placements the graph cannot run. Refused by xirang.plan /
xirang.compile (and the CLI) before any rank trains, with the node and plan field named."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, assert_clear_cli, assert_clear_error, cli
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard
from xirang.ir.plan import Plan
from xirang.ir.plan_parts import Layout

NO_LOSS = [  # (factory, words of the refusal, words of what to do)
    ("logits", "shape (8, 3), not a scalar loss", "pass the labels"),
    ("per_sample", "shape (8,), not a scalar loss", "reduction='mean'"),
    ("int_output", "torch.int64 scalar, not a floating loss", "scalar that needs grad"),
    ("detached", "does not depend on any trainable parameter", ".detach()"),
    ("frozen", "does not depend on any trainable parameter", "requires_grad=True"),
]


@pytest.mark.parametrize("factory,needle,hint", NO_LOSS, ids=[n[0] for n in NO_LOSS])
def test_compile_refuses_a_model_without_a_scalar_loss(factory, needle, hint):
    model, inputs = getattr(models, factory)()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert_clear_error(info.value, needle, hint=hint)


@pytest.mark.parametrize("factory,needle,hint", NO_LOSS[:2], ids=[n[0] for n in NO_LOSS[:2]])
def test_plan_refuses_it_too(factory, needle, hint):
    model, inputs = getattr(models, factory)()
    with pytest.raises(XirangError) as info:
        xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert_clear_error(info.value, needle, where="node")


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_cli_refuses_logits_before_launching(command):
    argv = ["--global-batch", "8", "--world", "2", "--hardware", "cpu"] if command == "plan" else ["--world", "2"]
    assert_clear_cli(cli(command, f"{MODELS}:logits", *argv), "not a scalar loss", "reduction")


# --- positions ----------------------------------------------------------------------------------

def test_seq_past_the_position_table_is_refused_by_analyze():
    assert_clear_cli(cli("analyze", f"{MODELS}:positions", "--seq", "9"), "9 positions", "8 rows", "--seq 8")


def test_seq_at_the_position_table_size_is_accepted():
    code, _, err = cli("analyze", f"{MODELS}:positions", "--seq", "8", "--json")
    assert code == 0, err


def test_compile_refuses_positions_past_the_table():
    model, inputs = models.positions(seq=12)
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=4)
    assert_clear_error(info.value, "12 positions", "8 rows", where="module pos")


def test_plan_refuses_positions_past_the_table():
    model, inputs = models.positions(seq=10)
    with pytest.raises(XirangError) as info:
        xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=4)
    assert_clear_error(info.value, "10 positions")


# --- batch statistics ---------------------------------------------------------------------------

@pytest.mark.parametrize("pins", [{"dp": 2}, {"micro_batch": 2}, {"dp": 2, "micro_batch": 4}],
                         ids=["dp2", "micro-batch2", "dp2-mb4"])
def test_batchnorm_plan_that_splits_the_batch_is_refused_with_the_reason(pins):
    model, inputs = models.batchnorm()
    with pytest.raises(XirangError) as info:
        xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, **pins)
    assert_clear_error(info.value, "batch statistics", "module bn", "differ from one device",
                       hint="dp=1 and micro_batch=global_batch")


def test_batchnorm_unpinned_plan_keeps_the_whole_batch_on_one_rank():
    model, inputs = models.batchnorm()
    plan = xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert plan.mesh.dp == 1 and plan.num_micro_batches == 1, plan.mesh


@pytest.fixture(scope="module")
def batchnorm_dp2_plan(monkeypatch_module=None):
    """A (2,1,1) plan of the BatchNorm model as a planner without the batch-statistics rule made it
    (an old plan, or one written by hand): the compile-time check must refuse it on its own."""
    import xirang.plan_api as plan_api
    model, inputs = models.batchnorm()
    original = plan_api.batch_statistics_nodes
    plan_api.batch_statistics_nodes = lambda gm: []
    try:
        return xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, dp=2)
    finally:
        plan_api.batch_statistics_nodes = original


def test_batchnorm_at_dp2_is_refused_by_compile_before_any_rank_starts(batchnorm_dp2_plan):
    """The issue's acceptance: BatchNorm at (2,1,1) equal to one device or refused with the reason."""
    assert (batchnorm_dp2_plan.mesh.dp, batchnorm_dp2_plan.mesh.tp, batchnorm_dp2_plan.mesh.pp) == (2, 1, 1)
    model, inputs = models.batchnorm()
    with pytest.raises(XirangError) as info:  # before ensure_distributed: no launch needed to refuse
        xirang.compile(model, world=2, example_kwargs=inputs, plan=batchnorm_dp2_plan)
    assert_clear_error(info.value, "batch statistics", "dp 2", where="plan.mesh.dp")


def test_batchnorm_in_eval_mode_may_split_the_batch():
    model, inputs = models.batchnorm()
    model.eval()  # running statistics: per-sample, so dp gives one device's result
    plan = xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, dp=2)
    assert plan.mesh.dp == 2


def test_batchnorm_at_one_device_equals_eager():
    model, inputs = models.batchnorm()
    reference, _ = models.batchnorm()
    compiled = xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8)
    loss = compiled.train_step(**inputs)
    expected = reference(**inputs)
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-6
    grads = compiled.full_gradients()
    assert max(float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()) < 1e-6


# --- placements the graph cannot run ------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_plan():
    model, inputs = models.mlp()
    return xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, tp=2)


def _with_placement(plan, name, **changes):
    placements = dict(plan.placements)
    placements[name] = dataclasses.replace(placements[name], **changes)
    return Plan.from_json({**plan.to_json(), "placements": {k: v.to_json() for k, v in placements.items()}})


def _linear(plan):
    return next(name for name in plan.placements if name.startswith("linear"))


@pytest.mark.parametrize("dim", [2, 5], ids=["dim2-of-2d", "dim5"])
def test_output_sharded_on_a_dim_the_tensor_lacks_is_refused(mlp_plan, dim):
    name = _linear(mlp_plan)
    plan = _with_placement(mlp_plan, name, outputs=(Layout(tp=PlanShard(dim)),))
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=2, example_kwargs=inputs, plan=plan)
    assert_clear_error(info.value, f"sharded on dim {dim}", "has 2 dim(s)",
                       where=f"plan.placements['{name}'].outputs[0].tp")


def test_input_sharded_on_a_dim_the_tensor_lacks_is_refused(mlp_plan):
    name = _linear(mlp_plan)
    strategy = mlp_plan.placements[name]
    inputs_ = (Layout(tp=PlanShard(3)),) + tuple(strategy.inputs[1:])
    plan = _with_placement(mlp_plan, name, inputs=inputs_)
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=2, example_kwargs=inputs, plan=plan)
    assert_clear_error(info.value, "inputs[0]", "dim 3", where="inputs[0].tp")


def test_placement_of_a_node_the_graph_lacks_is_refused(mlp_plan):
    data = mlp_plan.to_json()
    name = _linear(mlp_plan)
    data["placements"][name + "_typo"] = data["placements"][name]
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=2, example_kwargs=inputs, plan=Plan.from_json(data))
    assert_clear_error(info.value, f"{name}_typo", "does not have", "did you mean")


def test_inspect_with_the_model_refuses_the_bad_placement(mlp_plan, tmp_path):
    name = _linear(mlp_plan)
    path = tmp_path / "edited.json"
    _with_placement(mlp_plan, name, outputs=(Layout(tp=PlanShard(4)),)).save(path)
    assert_clear_cli(cli("inspect", path, "--rank", "0", "--model", f"{MODELS}:mlp"), "sharded on dim 4",
                     f"plan.placements['{name}']")


def test_run_with_the_bad_placement_is_refused_before_launching(mlp_plan, tmp_path):
    name = _linear(mlp_plan)
    path = tmp_path / "edited.json"
    _with_placement(mlp_plan, name, outputs=(Layout(tp=PlanShard(4)),)).save(path)
    assert_clear_cli(cli("run", f"{MODELS}:mlp", "--world", "2", "--plan", path, "--timeout", "20"),
                     "sharded on dim 4")


def test_plan_of_another_model_is_refused(mlp_plan):
    model, inputs = models.batchnorm()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=2, example_kwargs=inputs, plan=mlp_plan)
    # what differs first: the parameters and buffers of BatchNorm, which the plan's MLP lacks
    assert_clear_error(info.value, "different model", "this model has 5 parameters or buffers the plan's model lacks: "
                       "bn.weight, bn.bias, bn.running_mean (and 2 more)", where="plan.fingerprint")


@pytest.mark.parametrize("plan", ["plan.json", {"mesh": 1}, 3], ids=["path", "dict", "int"])
def test_plan_that_is_not_a_plan_object_is_refused(plan):
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=1, example_kwargs=inputs, plan=plan)
    assert_clear_error(info.value, "must be a xirang Plan", hint="Plan.load")


def test_compile_with_plan_and_pins_is_refused(mlp_plan):
    model, inputs = models.mlp()
    with pytest.raises(XirangError) as info:
        xirang.compile(model, world=2, example_kwargs=inputs, plan=mlp_plan, tp=2)
    assert_clear_error(info.value, "both a plan and plan choices")


def test_model_that_is_not_a_module_is_refused():
    with pytest.raises(XirangError) as info:
        xirang.compile(lambda x: x.sum(), world=1, example_kwargs={"x": torch.ones(2)}, global_batch=2)
    assert_clear_error(info.value, "torch.nn.Module, got function", where="model=")
