"""``xirang check`` and ``xirang plan --check`` run as a user would. The default tier's run is in this process
(the command's ``main``, argparse included): what it checks is the commands' output and the saved check, not an
interpreter's start (tests/test_cli.py and tests/test_demo.py run the entry point as real subprocesses); the
matrix tier's refusal runs real subprocesses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input.probe import cli

REPO = Path(__file__).resolve().parents[2]


def xirang(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xirang", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_plan_check_then_check_a_saved_plan(tmp_path):
    plan = tmp_path / "plan.json"
    code, printed, err = cli("plan", "examples/catalog.py:gpt_tiny", "--world", "4", "--hardware", "cpu",
                             "--global-batch", "8", "--pp", "2", "--dp", "2", "--out", str(plan), "--check")
    assert code == 0, err
    assert "xirang check: dp=2 x pp=2 x tp=1" in printed and "proven on all 4 ranks" in printed
    out = tmp_path / "check.json"
    code, _, err = cli("check", str(plan), "--model", "examples/catalog.py:gpt_tiny", "--out", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["ok"] and data["mesh"] == "dp=2 x pp=2 x tp=1" and len(data["classes"]) == 2
    assert all(row["calls"] > 0 and row["peak_bytes"] > 0 for row in data["classes"])


@pytest.mark.matrix  # two more interpreters: the refusal is check_plan_matches' (tests/passes/test_fingerprint.py)
def test_check_of_a_plan_for_another_model_is_refused_naming_it(tmp_path):
    plan = tmp_path / "plan.json"
    assert xirang("plan", "examples/catalog.py:gpt_tiny", "--world", "2", "--hardware", "cpu", "--global-batch", "8",
                  "--out", str(plan)).returncode == 0
    checked = xirang("check", str(plan), "--model", "examples/catalog.py:gpt_tiny_dropout")
    assert checked.returncode != 0
    assert "fingerprint" in checked.stderr or "different model" in checked.stderr, checked.stderr
