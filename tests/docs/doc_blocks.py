"""The code blocks of README.md and docs/, and how the tests run them.

A fenced block whose language is ``bash`` (``sh``, ``shell``) holds commands, one a line (``\\`` continues
a line, ``#`` starts a comment, ``&&`` chains); ``python`` holds a snippet. Every such block is run by
tests/docs/test_doc_blocks.py unless the HTML comments on the lines right above its fence say otherwise:

- ``<!-- needs: cluster -->``  not run here (the test reports it as skipped, with its page and line);
- ``<!-- covered-by: PATH, ... -->``  run by another test or script (each PATH must exist, or be a file
  the page writes); not run twice;
- ``<!-- slow -->``  run only in the ``matrix`` tier (multi-rank runs, large models);
- ``<!-- file: NAME -->``  (python) written to NAME in the page's folder instead of run: later blocks use it;
- ``<!-- expect: error -->``  must fail (a command with a non-zero exit, a snippet with an exception) with
  the message of the ``text`` block that follows: each line of it, ``...`` standing for any text, is
  found in what the command printed (whitespace runs compared as one space).

The blocks of one page run in order in one temporary folder (holding a link to ``examples/``), so a
block may read what an earlier one wrote. ``xirang`` commands run in this process (``xirang.cli.main``:
no interpreter start-up per command); other commands run in a shell with the repository on PYTHONPATH.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_LANGS = {"bash", "sh", "shell"}
PYTHON_LANGS = {"python", "py"}
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->$")
KNOWN_DIRECTIVES = {"needs", "covered-by", "slow", "file", "expect"}


def doc_pages() -> list[Path]:
    """README.md and every page under docs/ (the generated benchmarks page holds only its output)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in pages if p.name != "benchmarks.md"]


@dataclass
class Block:
    page: str          # relative to the repository
    line: int          # of the opening fence, 1-based
    lang: str
    text: str
    directives: dict = field(default_factory=dict)
    expected: str | None = None  # the text block after an ``expect: error`` block

    @property
    def runnable(self) -> bool:
        return self.lang in COMMAND_LANGS | PYTHON_LANGS

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[list[str]]:
        """The block's commands as argv lists (continuations joined, comments dropped, ``&&`` split)."""
        joined, pending = [], ""
        for raw in self.text.splitlines():
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            joined.append(pending + raw)
            pending = ""
        commands = []
        for line in joined:
            tokens = shlex.split(line, comments=True)
            current: list[str] = []
            for token in tokens + ["&&"]:
                if token == "&&":
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(token)
        return commands


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown page, with the directives written right above it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending: dict = {}
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        directive = DIRECTIVE.match(line)
        fence = FENCE.match(line)
        if directive:
            pending[directive.group(1)] = directive.group(2) or ""
        elif fence:
            start, body = index, []
            index += 1
            while index < len(lines) and not lines[index].strip().startswith("```"):
                body.append(lines[index])
                index += 1
            blocks.append(Block(str(path.relative_to(REPO)), start + 1, fence.group(1).lower(), "\n".join(body),
                                pending))
            pending = {}
        elif line:
            pending = {}
        index += 1
    for block, after in zip(blocks, blocks[1:] + [None]):
        if "expect" in block.directives and after is not None and after.lang == "text":
            block.expected = after.text
    return blocks


def matches(expected: str, actual: str) -> list[str]:
    """The lines of ``expected`` not found in ``actual`` (``...`` is any text; whitespace runs are one space)."""
    flat = " ".join(actual.split())
    missing = []
    for line in expected.splitlines():
        pieces = [" ".join(p.split()) for p in line.split("...")]
        position = 0
        for piece in pieces:
            if not piece:
                continue
            found = flat.find(piece, position)
            if found < 0:
                missing.append(line)
                break
            position = found + len(piece)
    return missing


@dataclass
class Outcome:
    code: int
    output: str


@contextlib.contextmanager
def inside(folder: Path):
    """This process in ``folder``, which is also first on sys.path (a page's own files import)."""
    cwd = os.getcwd()
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path.remove(str(folder))


def run_xirang(argv: list[str], folder: Path) -> Outcome:
    from xirang.cli import main
    out, err = io.StringIO(), io.StringIO()
    with inside(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Outcome(code or 0, out.getvalue() + err.getvalue())


def run_shell(argv: list[str], folder: Path, timeout_s: float = 900) -> Outcome:
    argv = [sys.executable if token == "python" else token for token in argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(shlex.join(argv), shell=True, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    return Outcome(done.returncode, done.stdout + done.stderr)


class PageRun:
    """Runs one page's blocks in order in ``folder``; python snippets share one namespace."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.namespace: dict = {"__name__": "__doc_snippet__"}
        (folder / "examples").symlink_to(REPO / "examples")

    def run(self, block: Block) -> None:
        if "file" in block.directives:
            (self.folder / block.directives["file"]).write_text(block.text + "\n")
            return
        expect_error = "expect" in block.directives
        if expect_error:
            assert block.expected is not None, f"{block.where}: an expect: error block needs a text block after it"
        if block.lang in PYTHON_LANGS:
            self._python(block, expect_error)
            return
        for argv in block.commands():
            outcome = run_xirang(argv[1:], self.folder) if argv[0] == "xirang" else run_shell(argv, self.folder)
            command = shlex.join(argv)
            if expect_error:
                assert outcome.code != 0, f"{block.where}: `{command}` succeeded but the page shows it failing"
                assert "Traceback" not in outcome.output or argv[0] != "xirang", outcome.output[-3000:]
                missing = matches(block.expected, outcome.output)
                assert not missing, (f"{block.where}: `{command}` printed no line like {missing}; it printed:\n"
                                     f"{outcome.output[-3000:]}")
            else:
                assert outcome.code == 0, (f"{block.where}: `{command}` exited {outcome.code}:\n"
                                           f"{outcome.output[-4000:]}")

    def _python(self, block: Block, expect_error: bool) -> None:
        before = set(sys.modules)
        error = None
        try:
            with inside(self.folder), contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block.text, block.where, "exec"), self.namespace)  # noqa: S102 -- the docs' snippet
        except Exception as exc:  # noqa: BLE001 -- judged below
            error = exc
        finally:
            for name in set(sys.modules) - before:  # the page's own files, not another page's
                module_file = getattr(sys.modules[name], "__file__", None) or ""
                if module_file.startswith(str(self.folder)):
                    del sys.modules[name]
        if expect_error:
            assert error is not None, f"{block.where}: the snippet ran but the page shows it failing"
            missing = matches(block.expected, str(error))
            assert not missing, f"{block.where}: the error lacks {missing}:\n{error}"
        elif error is not None:
            raise AssertionError(f"{block.where}: the snippet raised {type(error).__name__}: {error}") from error
