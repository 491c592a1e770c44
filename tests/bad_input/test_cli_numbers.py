"""Numbers the CLI takes, out of range or not numbers at all: refused at parse time, naming the
option, before any model is built (the factories write a marker when called; it stays empty)."""
from __future__ import annotations

import pytest

from tests.bad_input.probe import MODELS, assert_clear_cli, cli

MODEL = f"{MODELS}:mlp"
BASE = {
    "analyze": ["analyze", MODEL],
    "plan": ["plan", MODEL, "--global-batch", "8", "--world", "2", "--hardware", "cpu"],
    "inspect": ["inspect", "plan.json", "--rank", "0"],
    "run": ["run", MODEL, "--world", "1"],
    "verify": ["verify", MODEL, "--world", "1"],
    "launch": ["launch", "examples/train_gpt.py"],
}
CASES = [  # (command, option, bad value, words the refusal must contain)
    ("analyze", "--batch", "0", "positive integer"),
    ("analyze", "--batch", "-2", "positive integer"),
    ("analyze", "--batch", "two", "is not a positive integer"),
    ("analyze", "--seq", "0", "positive integer"),
    ("analyze", "--seq", "1.5", "is not a positive integer"),
    ("plan", "--global-batch", "0", "positive integer"),
    ("plan", "--global-batch", "-8", "positive integer"),
    ("plan", "--global-batch", "1e3", "is not a positive integer"),
    ("plan", "--batch", "0", "positive integer"),
    ("plan", "--seq", "-1", "positive integer"),
    ("plan", "--tp", "0", "positive integer"),
    ("plan", "--pp", "-1", "positive integer"),
    ("plan", "--dp", "0", "positive integer"),
    ("plan", "--micro-batch", "0", "positive integer"),
    ("plan", "--virtual-stages", "0", "positive integer"),
    ("inspect", "--rank", "-1", "integer >= 0"),
    ("inspect", "--stage", "-1", "integer >= 0"),
    ("inspect", "--batch", "0", "positive integer"),
    ("run", "--world", "0", "positive integer"),
    ("run", "--world", "-4", "positive integer"),
    ("run", "--steps", "-3", "positive integer"),
    ("run", "--steps", "0", "positive integer"),
    ("run", "--global-batch", "0", "positive integer"),
    ("run", "--timeout", "0", "seconds > 0"),
    ("run", "--timeout", "-5", "seconds > 0"),
    ("run", "--timeout", "nan", "finite"),
    ("run", "--timeout", "inf", "finite"),
    ("run", "--tp", "0", "positive integer"),
    ("run", "--dp", "-2", "positive integer"),
    ("verify", "--steps", "0", "positive integer"),
    ("verify", "--tolerance", "-1", "number >= 0"),
    ("verify", "--tolerance", "nan", "finite"),
    ("verify", "--tolerance", "abc", "is not"),
    ("verify", "--timeout", "0", "seconds > 0"),
    ("verify", "--pp", "0", "positive integer"),
    ("launch", "-n", "0", "positive integer"),
]


@pytest.mark.parametrize("command,option,value,needle", CASES, ids=[f"{c}{o}={v}" for c, o, v, _ in CASES])
def test_out_of_range_number_is_refused_naming_the_option(command, option, value, needle, tmp_path, monkeypatch):
    marker = tmp_path / "built"
    monkeypatch.setenv("XIRANG_TEST_MARKER", str(marker))
    argv = BASE[command][:1] + [option, value] + BASE[command][1:]
    assert_clear_cli(cli(*argv), f"argument {option}", needle)
    assert not marker.exists(), "the model was built before the argument was checked"


@pytest.mark.parametrize("mesh", ["dp=0,pp=2,tp=2", "dp=2,tp", "dq=2", "dp=-1,pp=2", "dp=2,dp=2", "2x2", "axbxc"])
def test_demo_mesh_that_is_not_named_positive_degrees(mesh):
    assert_clear_cli(cli("demo", f"--mesh={mesh}", "--no-picture", "--no-trace"), f"--mesh {mesh!r}", "AXIS=N",
                     "dp=2,pp=2,tp=2")


def test_demo_mesh_in_the_old_positional_form_is_refused_with_its_named_form():
    # 1x2x4 was read DPxTPxPP: dp=1, tp=2, pp=4
    assert_clear_cli(cli("demo", "--mesh=1x2x4", "--no-picture", "--no-trace"), "old positional form",
                     "--mesh dp=1,pp=4,tp=2")


def test_demo_mesh_with_context_or_expert_axes_is_refused_until_their_runtimes_land():
    assert_clear_cli(cli("demo", "--mesh=dp=2,cp=2,tp=2", "--no-picture", "--no-trace"), "cp", "not yet enacted")


def test_unknown_command_and_missing_required_option_are_argparse_errors():
    assert_clear_cli(cli("trian", MODEL), "invalid choice", "trian")
    assert_clear_cli(cli("plan", MODEL), "--global-batch", "required")
    assert_clear_cli(cli("run", MODEL), "--world", "required")
