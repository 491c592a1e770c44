"""docs/benchmarks.md is what benchmarks/make_docs.py writes from benchmarks/results/*.json, never edited by hand;
every benchmark script is on it, with each recorded run's date, machine and command."""
from __future__ import annotations

import importlib.util
import json

from tests.docs.doc_blocks import REPO


def _make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", REPO / "benchmarks" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_the_generators_output():
    make_docs = _make_docs()
    assert (REPO / "docs" / "benchmarks.md").read_text() == make_docs.render(), \
        "docs/benchmarks.md differs from what benchmarks/make_docs.py writes: run python benchmarks/make_docs.py"


def test_every_benchmark_and_recorded_run_is_on_the_page():
    make_docs = _make_docs()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for name in make_docs.benchmark_scripts():
        assert f"\n## {name}\n" in page, name
    for path in sorted(make_docs.RESULTS.glob("*.json")):
        run = json.loads(path.read_text())
        for key in ("command", "date", "machine", "stdout", "exit_status"):
            assert key in run, f"{path.name} lacks {key}"
        assert run["command"] in page and run["date"] in page and run["machine"]["cpu"] in page, path.name


def test_a_script_without_a_result_is_listed_as_not_yet_recorded(tmp_path, monkeypatch):
    make_docs = _make_docs()
    monkeypatch.setattr(make_docs, "RESULTS", tmp_path)  # no result files at all
    page = make_docs.render()
    assert page.count("Not yet recorded") == len(make_docs.benchmark_scripts())
    assert "```text\npython benchmarks/plan_speed.py" in page  # the command to record it
