"""The ``xirang`` command run as a user would: a real subprocess, its output and its errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def xirang(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xirang", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_analyze_prints_json_report():
    result = xirang("analyze", "examples/catalog.py:gpt_tiny", "--batch", "4", "--seq", "32", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # tiny GPT (vocab 512, positions 64, hidden 64, 2 layers, tied head): embeddings 512*64 + 64*64,
    # per block 2*128 (norms) + (64*192+192) + (64*64+64) + (64*256+256) + (256*64+64) = 49,984, final norm 128
    assert report["total_params"] == 512 * 64 + 64 * 64 + 2 * 49_984 + 128 == 136_960
    assert report["symbols"] == {"batch": 4, "seq": 32}
    assert [(k["type"], k["count"]) for k in report["kinds"]] == [("Block", 2)]


def test_missing_model_file_says_so():
    result = xirang("analyze", "no/such/file.py:build")
    assert result.returncode == 2
    assert "model file 'no/such/file.py' does not exist" in result.stderr


def test_model_without_factory_part_says_the_form():
    result = xirang("analyze", "examples/catalog.py")
    assert result.returncode == 2
    assert "is not of the form path/to/file.py:factory" in result.stderr


def test_unknown_factory_lists_the_functions():
    result = xirang("analyze", "examples/catalog.py:gpt_huge")
    assert result.returncode == 2
    assert "has no function 'gpt_huge'" in result.stderr and "gpt_tiny" in result.stderr
