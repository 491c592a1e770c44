"""docs/benchmarks.md is what benchmarks/make_docs.py writes from benchmarks/results/*.json, never edited by hand;
every benchmark script is on it, with each recorded run's date, machine and command."""
from __future__ import annotations

import importlib.util
import json

import pytest

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


def test_pages_show_the_recorded_output_make_docs_writes_there():
    make_docs = _make_docs()
    pages = make_docs.pages_with_recorded_output()
    assert REPO / "docs" / "guides" / "explain.md" in pages  # the explain guide's example is a recorded run
    for page in pages:
        assert page.read_text() == make_docs.fill_recorded(page, page.read_text()), \
            f"{page.relative_to(REPO)} differs from what benchmarks/make_docs.py writes: run benchmarks/make_docs.py"


def test_a_recorded_region_is_rewritten_from_its_result_file(tmp_path):
    make_docs = _make_docs()
    run = {"script": "toy.py", "command": "python benchmarks/toy.py --fast", "date": "2026-01-02 03:04 UTC",
           "machine": {"cpu": "Some CPU", "cores": 2, "torch": "2.13.0"}, "load_average_before": "1.5 1.0 0.5",
           "exit_status": 0, "stdout": "step 1.25 s\n"}
    (tmp_path / "toy__fast.json").write_text(json.dumps(run))
    page = REPO / "docs" / "guides" / "made_up.md"
    stale = "# A page\n\n<!-- recorded: toy__fast -->\n```text\nstep 9.99 s\n```\n<!-- end recorded -->\nAfter.\n"
    filled = make_docs.fill_recorded(page, stale, tmp_path)
    assert "step 9.99 s" not in filled and "```text\nstep 1.25 s\n```" in filled
    assert "`python benchmarks/make_docs.py record toy --fast` on 2026-01-02 03:04 UTC (Some CPU, 2 cores, load 1.5" \
        in filled and "(../benchmarks.md#toy)" in filled
    assert filled.endswith("<!-- end recorded -->\nAfter.\n")
    assert make_docs.fill_recorded(page, filled, tmp_path) == filled  # writing twice changes nothing
    with pytest.raises(SystemExit, match="has no '<!-- end recorded -->'"):
        make_docs.fill_recorded(page, "<!-- recorded: toy__fast -->\n```text\n```\n", tmp_path)
    with pytest.raises(SystemExit, match="not recorded"):
        make_docs.fill_recorded(page, "<!-- recorded: other -->\n<!-- end recorded -->\n", tmp_path)
    (tmp_path / "toy__fast.json").write_text(json.dumps({**run, "exit_status": 1}))
    with pytest.raises(SystemExit, match="failed"):
        make_docs.fill_recorded(page, stale, tmp_path)
