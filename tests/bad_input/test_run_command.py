"""``xirang run --print-command`` prints a command that trains MODEL with the pins given (--dp
included), refuses a missing model or plan file, and the printed rank command really trains that
model (run here for one rank, in this process). Two subprocess probes check what a shell sees: a
non-zero exit and one paragraph, no traceback."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input.probe import MODELS, assert_clear_cli, cli

REPO = Path(__file__).resolve().parents[2]
MODEL = f"{MODELS}:mlp"


def _printed(*argv) -> list:
    code, out, err = cli("run", *argv, "--print-command")
    assert code == 0, err
    return shlex.split(out.splitlines()[0])


def test_printed_command_trains_the_model_given_with_every_pin():
    command = _printed(MODEL, "--world", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--global-batch", "16",
                       "--steps", "5")
    assert command[command.index("--nproc-per-node") + 1] == "8"
    rank = command[command.index("-m", 3) + 1:]  # after torchrun's own options: -m xirang run ...
    assert rank[:3] == ["xirang", "run", MODEL]
    for option, value in (("--world", "8"), ("--dp", "2"), ("--tp", "2"), ("--pp", "2"), ("--global-batch", "16"),
                          ("--steps", "5")):
        assert rank[rank.index(option) + 1] == value, (option, rank)
    assert "--torchrun" in rank and "train_gpt" not in " ".join(command)


def test_printed_command_carries_the_plan(saved_plan):
    command = _printed(MODEL, "--world", "1", "--plan", saved_plan)
    assert command[command.index("--plan") + 1] == saved_plan


def test_print_command_refuses_a_missing_plan(tmp_path):
    assert_clear_cli(cli("run", MODEL, "--world", "2", "--plan", tmp_path / "nope.json", "--print-command"),
                     "does not exist")


def test_the_printed_rank_command_trains_that_model_on_one_rank():
    command = _printed(MODEL, "--world", "1", "--steps", "2", "--global-batch", "8")
    rank_args = command[command.index("-m", 3) + 2:]  # what each torchrun rank runs: xirang <these>
    code, out, err = cli(*rank_args)
    assert code == 0, err
    assert out.count("loss") == 2, out


def test_torchrun_rank_outside_torchrun_says_how_to_launch():
    assert_clear_cli(cli("run", MODEL, "--world", "2", "--torchrun"), "needs 2 ranks", "torch.distributed.run")


def _shell(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "xirang", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_subprocess_bad_input_is_one_paragraph_and_no_traceback(tmp_path):
    result = _shell("plan", f"{MODELS}:three_tuple", "--global-batch", "8", "--out", tmp_path / "no" / "p.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("xirang: error: --out") and "what to do:" in result.stderr
    assert result.stdout == ""


@pytest.mark.matrix  # a second interpreter start (seconds on a loaded machine): the first probe covers the path
def test_subprocess_argparse_refusal_has_no_traceback():
    result = _shell("verify", MODEL, "--world", "1", "--steps", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --steps: 0 is out of range" in result.stderr
