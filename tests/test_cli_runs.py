"""The CLI across ranks and over time (issue 34's leftovers): a whole-run limit is off unless asked for
(a frozen rank is caught by its heartbeat, codegen/runtime/launch/launcher.py), and an error printed by a
rank torchrun started names that rank."""
from __future__ import annotations

import pytest

from tests.bad_input.probe import MODELS
from xirang.cli import build_parser, main

MLP = f"{MODELS}:mlp"


@pytest.mark.parametrize("command", [["run", MLP, "--world", "2"], ["verify", MLP, "--world", "2"],
                                     ["train", MLP, "--world", "2"], ["calibrate"]])
def test_whole_run_timeout_is_off_by_default_and_kept_as_a_choice(command):
    assert build_parser().parse_args(command).timeout is None
    assert build_parser().parse_args(command + ["--timeout", "30"]).timeout == 30.0


def test_an_error_under_torchrun_names_its_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["plan", MLP, "--global-batch", "8", "--world", "4", "--out", "/no/such/folder/p.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xirang: error (rank 3 of 4): --out /no/such/folder/p.json") and "what to do:" in err


def test_an_error_in_one_process_has_no_rank(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["plan", MLP, "--global-batch", "8", "--out", "/no/such/folder/p.json"]) == 2
    assert capsys.readouterr().err.startswith("xirang: error: --out")
