"""``xirang train --config run.toml`` (xirang_compile/cli/train_config.py): every option from the file, flags given on
the command line over it (a flag given at its default value too), unknown keys and wrong types refused naming
the key, and the effective options written as TOML that ``--config`` reads back to the same options. No
training here: the run that writes the file is tests/test_train_watch.py's."""
from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from xirang.cli import main
from xirang.cli.train import parse_train_args, run_options
from xirang.ir.errors import XirangError
from xirang.cli.train_config import toml_value, write_config

REPO = Path(__file__).resolve().parents[1]
MODEL = "examples/catalog.py:gpt_tiny"


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_the_file_gives_every_option_and_flags_on_the_command_line_win(tmp_path):
    run = _config(tmp_path, f'model = "{MODEL}"\nworld = 4\npp = 2\nsynthetic = true\nsteps = 7\nlr = 1e-3\n'
                            f'clip = 1\ncheckpoint_dir = "ckpt"\n')
    args = parse_train_args(["--config", run])
    assert (args.model, args.world, args.pp, args.synthetic, args.steps, args.lr) == (MODEL, 4, 2, True, 7, 1e-3)
    assert args.clip == 1.0 and isinstance(args.clip, float)  # an integer is a fine number of a float option
    assert args.tp is None and args.warmup == 0  # neither in the file nor given: the parser's default
    # a flag given at its default value still overrides the file: which flags were given is recorded, not guessed
    args = parse_train_args(["--config", run, "--steps", "100", "--world", "2", "--tp", "2", "other.py:f"])
    assert (args.steps, args.world, args.tp, args.model, args.pp) == (100, 2, 2, "other.py:f", 2)
    assert not hasattr(args, "given_options")


@pytest.mark.parametrize("text, words", [
    ("stepz = 3", ["unknown key 'stepz'", "did you mean 'steps'", "the valid keys are:", "global_batch"]),
    ('steps = "ten"', ["steps must be an integer, got 'ten' (str)"]),
    ("steps = 2.5", ["steps must be an integer, got 2.5"]),
    ("synthetic = 1", ["synthetic must be true or false, got 1"]),
    ("world = 0", ["world = 0", "positive integer"]),
    ("lr = -1.0", ["lr = -1.0", "out of range"]),
    ("checkpoint_dir = 3", ["checkpoint_dir must be a string, got 3 (int)"]),
    ("steps = [1, 2]", ["steps must be an integer"]),
    ("steps = ", ["is not valid TOML"]),
])
def test_unknown_keys_and_wrong_types_are_refused_naming_the_key(tmp_path, text, words):
    run = _config(tmp_path, f'model = "{MODEL}"\n{text}\n')
    with pytest.raises(XirangError) as caught:
        parse_train_args(["--config", run])
    message = str(caught.value)
    assert all(word in message for word in words), message
    assert run in message


def test_the_command_refuses_a_bad_config_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "--config", _config(tmp_path, f'model = "{MODEL}"\nworld = 1\nwarmpu = 3\n')]) == 2
    assert "unknown key 'warmpu'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train", "--config", _config(tmp_path, "world = 1\nsynthetic = true\n")]) == 2
    assert "give the model to train" in capsys.readouterr().err
    assert main(["train", MODEL, "--synthetic"]) == 2
    assert "--world N" in capsys.readouterr().err


def test_the_effective_options_written_as_toml_read_back_to_the_same_options(tmp_path):
    run = _config(tmp_path, f'model = "{MODEL}"\nworld = 2\nsynthetic = true\nsteps = 5\n')
    args = parse_train_args(["--config", run, "--lr", "0.00025", "--clip", "0.5", "--checkpoint-dir",
                             str(tmp_path / 'a "quoted" \\ folder'), "--resume", "--min-lr-ratio", "0"])
    saved = write_config(tmp_path / "config.toml", run_options(args), header="the run's options\nline two")
    text = saved.read_text()
    assert text.startswith("# the run's options\n# line two\n") and "# tp: not set" in text
    again = parse_train_args(["--config", str(saved)])
    assert run_options(again) == run_options(args)
    assert "resume" not in run_options(args) and "config" not in run_options(args)  # this invocation's switches


@pytest.mark.parametrize("value", [0.00025, 1e-10, 3.0, 1e300, math.inf, -math.inf, 7, -3, True, False, "",
                                   'a "b" \\ c\td\ne\x7f\x01 é 字', ["x", 1, 2.5, False]])
def test_each_value_is_written_as_toml_that_reads_back_equal(value):
    assert tomllib.loads(f"k = {toml_value(value)}")["k"] == value
