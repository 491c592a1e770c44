"""One name per concept in the public API and the CLI (issue 34, item 5): each old spelling is refused
with Xirang's error naming the new one, and the new one works.

    hardware preset   plan/compile(device=)        -> hardware=        xirang plan --device -> --hardware
    torch device      compile(runtime_device=)     -> device=
    the ranks         launch(fn, nprocs=)          -> world=           xirang launch --nprocs -> --world;
                      --world N or NxM in every command (it was NxM in `plan` only)
    writing a file    xirang plan/check --json FILE -> --out FILE      (--json prints as JSON)
    checkpoint folder load_checkpoint(path=), latest_checkpoint(root=) -> directory=
    placements        xirang.Shard/Replicate/Partial -> PlanShard/PlanReplicate/PlanPartial
    grouped options   compile(seed=, rng=, ...)   -> runtime=RuntimeOptions(...); counter=, event_log=,
                      dump_dir= -> debug=DebugHooks(...); pins also as choices=PlanChoices(...)
"""
from __future__ import annotations

import pytest

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, assert_clear_error
from xirang.cli import build_parser, main
from xirang.ir.errors import XirangError

MLP = f"{MODELS}:mlp"


def _refused(call, old: str, new: str) -> XirangError:
    with pytest.raises(XirangError) as info:
        call()
    return assert_clear_error(info.value, f"`{old}=`", f"`{new}", where=f"{old}=", hint=new)


# --- the hardware preset and the torch device -------------------------------------------------------------

def test_plan_device_is_renamed_hardware():
    model, inputs = models.mlp()
    _refused(lambda: xirang.plan(model, world=2, device="cpu", example_kwargs=inputs, global_batch=8),
             "device", "hardware=")
    plan = xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert plan.world.device_of(0).name == "cpu"


def test_parse_world_device_is_renamed_hardware():
    _refused(lambda: xirang.parse_world(4, device="h100-80g"), "device", "hardware=")
    assert xirang.parse_world(4, hardware="h100-80g").device_of(3).name == "h100-80g"


def test_compile_runtime_device_is_renamed_device():
    model, inputs = models.mlp()
    _refused(lambda: xirang.compile(model, world=1, runtime_device="cpu", example_kwargs=inputs, global_batch=8),
             "runtime_device", "device=")


def test_compile_refuses_a_hardware_preset_given_as_device():
    """``device=`` used to be the preset in compile: an old call is refused, not read as a torch device."""
    model, inputs = models.mlp()
    error = _refused(lambda: xirang.compile(model, world=1, device="a100-80g", example_kwargs=inputs,
                                            global_batch=8), "device", "hardware=")
    assert "hardware='a100-80g'" in error.hint


def test_compile_takes_hardware_and_device_and_grouped_options():
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=1, hardware="cpu", device="cpu", example_kwargs=inputs, global_batch=8,
                              choices=xirang.PlanChoices(micro_batch=4), runtime=xirang.RuntimeOptions(seed=3))
    assert compiled.device.type == "cpu" and compiled.plan.world.device_of(0).name == "cpu"
    assert compiled.plan.micro_batch == 4 and compiled.plan.num_micro_batches == 2


def test_compile_device_cpu_alone_prices_cpu_ranks():
    """An explicit CPU device without ``hardware=`` plans for CPU ranks, as ``device="cpu"`` always did."""
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=1, device="cpu", example_kwargs=inputs, global_batch=8)
    assert compiled.plan.world.device_of(0).name == "cpu"


# --- grouped options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("old,value,new", [
    ("seed", 0, "runtime=xirang.RuntimeOptions(seed=...)"),
    ("rng", "exact", "runtime=xirang.RuntimeOptions(rng=...)"),
    ("bucket_bytes", 1024, "runtime=xirang.RuntimeOptions(bucket_bytes=...)"),
    ("dp_shares", (8,), "runtime=xirang.RuntimeOptions(dp_shares=...)"),
    ("rebalance_every", 2, "runtime=xirang.RuntimeOptions(rebalance_every=...)"),
    ("inject_every", 2, "runtime=xirang.RuntimeOptions(inject_every=...)"),
    ("counter", None, "debug=xirang.DebugHooks(counter=...)"),
    ("event_log", [], "debug=xirang.DebugHooks(event_log=...)"),
    ("dump_dir", "d", "debug=xirang.DebugHooks(dump_dir=...)"),
])
def test_compile_runtime_and_debug_keywords_moved_into_their_dataclass(old, value, new):
    model, inputs = models.mlp()
    error = _refused(lambda: xirang.compile(model, world=1, example_kwargs=inputs, global_batch=8, **{old: value}),
                     old, new)
    assert "moved into" in error.what


def test_plan_choices_given_directly_or_grouped_are_the_same_plan():
    model, inputs = models.mlp()
    report = xirang.analyze(model, example_kwargs=inputs)
    common = dict(world=2, hardware="cpu", example_kwargs=inputs, global_batch=8, analysed=report)
    direct = xirang.plan(model, dp=2, micro_batch=2, **common)
    grouped = xirang.plan(model, choices=xirang.PlanChoices(dp=2, micro_batch=2), **common)
    assert direct.to_json() == grouped.to_json()
    assert (direct.mesh.dp, direct.micro_batch) == (2, 2)


def test_plan_choice_given_twice_or_misspelt_is_refused():
    model, inputs = models.mlp()
    call = dict(world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    with pytest.raises(XirangError) as twice:
        xirang.plan(model, choices=xirang.PlanChoices(dp=2), dp=1, **call)
    assert_clear_error(twice.value, "dp both directly and in choices=")
    with pytest.raises(XirangError) as typo:
        xirang.plan(model, tpp=2, **call)
    assert_clear_error(typo.value, "unknown keyword(s) tpp=", hint="micro_batch")
    with pytest.raises(XirangError) as wrong_type:
        xirang.compile(model, world=1, runtime={"seed": 0}, example_kwargs=inputs, global_batch=8)
    assert_clear_error(wrong_type.value, "runtime= must be a xirang.RuntimeOptions", hint="RuntimeOptions(")


# --- the ranks, checkpoints, placements ---------------------------------------------------------------------

def _rank(rank, size):
    return rank, size


def test_launch_nprocs_is_renamed_world_and_takes_nxm():
    _refused(lambda: xirang.launch(_rank, nprocs=2), "nprocs", "world=")
    assert xirang.launch(_rank, "1x2") == [(0, 2), (1, 2)]


def test_checkpoint_folder_is_directory_in_save_load_and_latest(tmp_path):
    _refused(lambda: xirang.load_checkpoint(None, None, path=tmp_path), "path", "directory=")
    _refused(lambda: xirang.latest_checkpoint(root=tmp_path), "root", "directory=")
    assert xirang.latest_checkpoint(directory=tmp_path / "none yet") is None


@pytest.mark.parametrize("old,new", [("Shard", "PlanShard"), ("Replicate", "PlanReplicate"),
                                     ("Partial", "PlanPartial")])
def test_placements_do_not_reuse_dtensor_names(old, new):
    with pytest.raises(XirangError) as info:
        getattr(xirang, old)
    assert_clear_error(info.value, f"xirang.{old}", f"xirang.{new}", hint=new)
    assert getattr(xirang, new).__name__ == new and old not in xirang.__all__


# --- the command line ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,old,new", [
    (["plan", MLP, "--global-batch", "8", "--device", "cpu"], "--device", "--hardware"),
    (["plan", MLP, "--global-batch", "8", "--json", "p.json"], "--json", "--out"),
    (["check", "p.json", "--model", MLP, "--json", "c.json"], "--json", "--out"),
    (["launch", "--nprocs", "2", "train.py"], "--nprocs", "--world"),
])
def test_cli_old_flag_is_refused_naming_the_new(argv, old, new, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xirang: error: {old} was renamed {new}") and "what to do:" in err
    assert "Traceback" not in err


def test_cli_plan_hardware_and_out_write_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", MLP, "--global-batch", "8", "--world", "1x2", "--hardware", "cpu", "-o", str(out)]) == 0
    plan = xirang.Plan.load(out)
    assert plan.world.size == 2 and plan.world.device_of(1).name == "cpu"
    assert f"plan written to {out}" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["plan", MLP, "--global-batch", "8"], ["run", MLP], ["verify", MLP],
                                     ["train", MLP], ["calibrate"], ["launch", "train.py"]])
def test_cli_world_is_n_or_nxm_in_every_command(command):
    parser = build_parser()
    where = 1 if command[0] == "launch" else len(command)
    for spelling, count in (("4", 4), ("2x4", 8)):
        args = parser.parse_args(command[:where] + ["--world", spelling] + command[where:])
        assert (int(args.world), str(args.world)) == (count, spelling)


def test_train_config_world_takes_nxm_and_passes_it_to_the_ranks(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('model = "examples/catalog.py:gpt_tiny"\nworld = "2x4"\nsynthetic = true\nsteps = 2\n')
    assert main(["train", "--config", str(config), "--print-command"]) == 0
    command = capsys.readouterr().out
    assert "--nproc-per-node 8 " in command and command.rstrip().endswith("--world 2x4")
