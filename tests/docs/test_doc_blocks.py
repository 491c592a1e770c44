"""Every command and snippet of README.md and docs/ runs (tests/docs/doc_blocks.py says how blocks are
marked): the default tier runs each page's quick blocks, the matrix tier the slow ones too; blocks that
need a cluster are reported as skipped; blocks covered elsewhere name where."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.docs.doc_blocks import KNOWN_DIRECTIVES, REPO, Block, PageRun, doc_pages, parse_blocks

PAGES = {str(page.relative_to(REPO)): parse_blocks(page) for page in doc_pages()}


def _runs_here(block: Block, slow_too: bool) -> bool:
    if not block.runnable or "needs" in block.directives or "covered-by" in block.directives:
        return False
    return slow_too or "slow" not in block.directives


def _pages_with(predicate) -> list[str]:
    return [page for page, blocks in PAGES.items() if any(predicate(b) for b in blocks)]


@pytest.mark.parametrize("page", _pages_with(lambda b: _runs_here(b, False) and "file" not in b.directives))
def test_page_quick_blocks_run(page, tmp_path):
    run = PageRun(tmp_path)
    for block in PAGES[page]:
        if _runs_here(block, slow_too=False):
            run.run(block)


@pytest.mark.matrix
@pytest.mark.parametrize("page", _pages_with(lambda b: _runs_here(b, True) and "slow" in b.directives))
def test_page_blocks_run_slow_ones_too(page, tmp_path):
    run = PageRun(tmp_path)
    for block in PAGES[page]:
        if _runs_here(block, slow_too=True):
            run.run(block)


CLUSTER = [b for blocks in PAGES.values() for b in blocks if b.runnable and "needs" in b.directives]


@pytest.mark.parametrize("block", CLUSTER, ids=[b.where for b in CLUSTER])
def test_cluster_block_is_reported(block):
    """Not run here: a cluster is needed. Its shell syntax is checked, and the skip names it."""
    assert block.directives["needs"] == "cluster", f"{block.where}: unknown need {block.directives['needs']!r}"
    if block.lang in {"bash", "sh", "shell"}:
        checked = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True)
        assert checked.returncode == 0, f"{block.where}: {checked.stderr}"
    pytest.skip(f"needs a cluster: {block.where}")


def test_directives_are_known_and_covered_blocks_name_what_covers_them():
    for blocks in PAGES.values():
        files = {b.directives["file"] for b in blocks if "file" in b.directives}
        for block in blocks:
            unknown = set(block.directives) - KNOWN_DIRECTIVES
            assert not unknown, f"{block.where}: unknown directive(s) {unknown}"
            if "expect" in block.directives:
                assert block.directives["expect"] == "error" and block.expected is not None, block.where
            if "file" in block.directives:
                assert block.lang in {"python", "py"}, f"{block.where}: file: is for python blocks"
            for name in re.split(r"[,\s]+", block.directives.get("covered-by", "")):
                if "/" in name or "." in name:
                    assert (REPO / name).exists() or name in files, f"{block.where}: {name} does not exist"


def test_readme_test_commands_are_what_ci_runs():
    """The README's test line is run by .ci/run, command for command."""
    ci = (REPO / ".ci/run").read_text()
    block = next(b for b in PAGES["README.md"] if "pytest" in b.text)
    line = next(line for line in block.text.splitlines() if "pytest" in line and not line.startswith("#"))
    for command in line.split("&&"):
        assert re.search(rf"^{re.escape(command.strip())}(\s|$)", ci, re.M), f"{command.strip()!r} not in .ci/run"


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; it is the front page (150 at most)"
    first = next(b for b in PAGES["README.md"] if b.runnable)
    assert first.line <= 5 and "xirang demo" in first.text and "pytest" in first.text


# sessions and runs by number or letter ("run G", "runs G-Y"), issues, before/after narratives
HISTORY = re.compile(r"\b([Ss]essions? \d+|[Rr]uns? [A-Z](?![\w-])|[Ii]ssue \d+|before this change|"
                     r"the code of then)")


@pytest.mark.parametrize("page", [p for p in PAGES if p != "docs/architecture.md"])
def test_product_pages_describe_the_product_not_its_history(page):
    text = (REPO / page).read_text()
    found = [m.group(0) for m in HISTORY.finditer(text)]
    assert not found, f"{page}: development history belongs in git, not in the product's pages: {found}"
