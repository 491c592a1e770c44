"""The ``xirang`` command run as a user would: a real subprocess, its output and its errors.

Default tier: the subprocess whose point is what a shell sees (analyze from another folder); plan then
explain, the pins and the two module entry points run in this process (an interpreter start is
seconds of the tier on a loaded machine, and what they check is the command, not the start). The error
paths run as subprocesses in the matrix tier only: tests/bad_input probes each message in-process
(test_cli_files.py, test_planning_inputs.py) and test_run_command.py runs one subprocess refusal.
"""
from __future__ import annotations

import importlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input.probe import cli
from xirang.passes.planning.plan_costs import CAUSES

REPO = Path(__file__).resolve().parents[1]


def xirang(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xirang", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_analyze_prints_json_report(tmp_path):
    # run from another folder: examples/catalog.py imports `examples.gpt`, its own package
    result = xirang("analyze", str(REPO / "examples/catalog.py") + ":gpt_tiny", "--batch", "4", "--seq", "32",
                    "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # tiny GPT (vocab 512, positions 64, hidden 64, 2 layers, tied head): embeddings 512*64 + 64*64,
    # per block 2*128 (norms) + (64*192+192) + (64*64+64) + (64*256+256) + (256*64+64) = 49,984, final norm 128
    assert report["total_params"] == 512 * 64 + 64 * 64 + 2 * 49_984 + 128 == 136_960
    assert report["symbols"] == {"batch": 4, "seq": 32}
    assert [(k["type"], k["count"]) for k in report["kinds"]] == [("Block", 2)]


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_missing_model_file_says_so():
    result = xirang("analyze", "no/such/file.py:build")
    assert result.returncode == 2
    assert "model file 'no/such/file.py' does not exist" in result.stderr


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_model_without_factory_part_says_the_form():
    result = xirang("analyze", "examples/catalog.py")
    assert result.returncode == 2
    assert "is not of the form path/to/file.py:factory" in result.stderr


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_unknown_factory_lists_the_functions():
    result = xirang("analyze", "examples/catalog.py:gpt_huge")
    assert result.returncode == 2
    assert "has no function 'gpt_huge'" in result.stderr and "gpt_tiny" in result.stderr


def test_plan_saves_json_that_explain_reads(tmp_path):
    # in this process: what is checked is the commands' output and the file between them, not an interpreter's start
    out = tmp_path / "plan.json"
    code, planned, progress = cli("plan", "examples/catalog.py:gpt_tiny", "--world", "1x2", "--hardware", "cpu",
                                  "--global-batch", "8", "--out", str(out))
    assert code == 0, progress
    assert "Plan for 1 node x 2 cpu" in planned and "Why this plan" in planned
    saved = json.loads(out.read_text())
    assert saved["schema_version"] == 2 and saved["global_batch"] == 8
    assert set(saved["mesh"]) == {"pp", "dp", "cp", "tp", "ep", "order"} and "Mesh axes: pp=" in planned
    code, explained, err = cli("explain", str(out))
    assert code == 0, err
    chosen = [line for line in explained.splitlines() if line.startswith("* dp=")]
    assert len(chosen) == 1 and chosen[0] in planned
    # not a terminal: one progress line per planning step on stderr, stdout is the plan
    steps = [line for line in progress.splitlines() if line.startswith("[")]
    assert [line[:6] for line in steps] == ["[#...]", "[##..]", "[###.]", "[####]"], progress
    code, as_data, err = cli("explain", str(out), "--json")  # the same command as above, read as data
    assert code == 0, err
    table = json.loads(as_data)
    rows = table["rows"]
    assert rows[0]["chosen"] and not any(row["chosen"] for row in rows[1:])
    assert chosen[0].startswith("* " + rows[0]["configuration"])
    assert rows[0]["dp"] * rows[0]["pp"] * rows[0]["tp"] == 2 and rows[0]["fits"]
    assert set(rows[0]["seconds_by_cause"]) == set(CAUSES)  # every cause the cost model prices, zero or not
    assert abs(sum(rows[0]["seconds_by_cause"].values()) - rows[0]["step_seconds"]) <= 1e-6 * rows[0]["step_seconds"]


def test_plan_pins_are_honoured():
    # in this process: what is checked is how the options become pins, not an interpreter's start
    code, out, err = cli("plan", "examples/catalog.py:gpt_tiny", "--world", "2", "--hardware", "cpu",
                         "--global-batch", "8", "--pp", "2", "--micro-batch", "2", "--schedule", "gpipe",
                         "--recompute", "full")
    assert code == 0, err
    assert "* dp=1 pp=2 tp=1 b=2 m=4 gpipe recompute=full" in out


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_bad_world_string_says_the_accepted_forms():
    result = xirang("plan", "examples/catalog.py:gpt_tiny", "--world", "2x9y", "--global-batch", "8")
    assert result.returncode == 2
    assert "bad world '2x9y'" in result.stderr and "'NxM' (N nodes of M devices" in result.stderr


@pytest.mark.matrix  # 13 s of subprocesses: bad plan files are probed in-process by tests/bad_input
def test_stale_or_hand_broken_plan_json_is_refused_naming_the_field(tmp_path):
    out = tmp_path / "plan.json"
    assert xirang("plan", "examples/catalog.py:gpt_tiny", "--world", "2", "--hardware", "cpu", "--global-batch", "4",
                  "--out", str(out)).returncode == 0
    data = json.loads(out.read_text())
    data["schema_version"] = 0
    out.write_text(json.dumps(data))
    result = xirang("explain", str(out))
    assert result.returncode == 2 and "schema_version" in result.stderr and str(out) in result.stderr
    data["schema_version"], data["global_batch"] = 2, 5  # no longer dp x micro_batch x micro-batches
    out.write_text(json.dumps(data))
    result = xirang("explain", str(out))
    assert result.returncode == 2 and "global_batch 5 !=" in result.stderr


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_explain_of_a_missing_file_says_how_to_make_one():
    result = xirang("explain", "no/such/plan.json")
    assert result.returncode == 2 and "plan file 'no/such/plan.json' does not exist" in result.stderr


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_launch_runs_a_training_script_on_local_ranks_through_torchrun():
    result = xirang("launch", "-n", "2", "examples/train_gpt.py", "--", "--tp", "2", "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py --tp 2" in result.stderr
    assert "* dp=1 pp=1 tp=2" in result.stdout  # the plan rank 0 printed: tensor parallel over both ranks
    losses = [float(line.split("loss ")[1]) for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.matrix  # a second interpreter for a message tests/bad_input checks in-process
def test_launch_of_a_missing_script_says_so():
    result = xirang("launch", "-n", "2", "no/such/train.py")
    assert result.returncode == 2 and "script 'no/such/train.py' does not exist" in result.stderr


def test_importing_the_main_module_runs_nothing(capsys, monkeypatch):
    # `python -m xirang` runs the command; importing xirang.__main__ (a tool walking the package) must not.
    # Were it to run, it would print the usage for --help and exit.
    monkeypatch.setattr(sys, "argv", ["xirang", "--help"])
    monkeypatch.delitem(sys.modules, "xirang.__main__", raising=False)
    importlib.import_module("xirang.__main__")
    assert capsys.readouterr().out == ""


def test_the_metrics_picture_command_runs_as_documented(capsys, monkeypatch):
    # docs/architecture.md and the cli README: python -m xirang.cli.train_metrics FILE OUT.png
    monkeypatch.setattr(sys, "argv", ["train_metrics.py", "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("xirang.cli.train_metrics", run_name="__main__")
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m xirang.cli.train_metrics")
