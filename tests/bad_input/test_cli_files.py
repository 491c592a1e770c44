"""Files the CLI reads and writes. Output targets (--json, --picture, --dump, --trace,
--memory-picture, the demo's --timeline/--trace) are checked before any model is built or any rank
starts (the factories write a marker when called: it must stay absent). Input files (model files,
plans) that are missing, folders, binary, malformed or the wrong kind are refused with the file named."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.bad_input.probe import MODELS, assert_clear_cli, cli
from xirang.ir.plan import SCHEMA_VERSION

MODEL = f"{MODELS}:mlp"


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "built"
    monkeypatch.setenv("XIRANG_TEST_MARKER", str(path))
    return path


def _targets(tmp_path):
    """(description, path, words of the refusal) for each bad file target."""
    existing_dir = tmp_path / "a_folder"
    existing_dir.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return [("folder", existing_dir, "is a folder"),
            ("missing folder", tmp_path / "no" / "such" / "out.json", "does not exist"),
            ("parent is a file", a_file / "out.json", "is a file, not a folder"),
            ("empty name", "", "not a file name")]


FILE_OPTIONS = [  # (argv before the target, option)
    (["plan", MODEL, "--global-batch", "8", "--world", "2", "--hardware", "cpu"], "--out"),
    (["explain", "PLAN"], "--picture"),
    (["run", MODEL, "--world", "1"], "--trace"),
    (["run", MODEL, "--world", "1", "--memory"], "--memory-picture"),
    (["demo", "--no-trace"], "--timeline"),
    (["demo", "--no-picture"], "--trace"),
]


@pytest.mark.parametrize("argv,option", FILE_OPTIONS, ids=[o + "-" + a[0] for a, o in FILE_OPTIONS])
@pytest.mark.parametrize("case", range(4), ids=["folder", "missing-folder", "parent-is-file", "empty-name"])
def test_bad_output_file_is_refused_before_the_work(argv, option, case, tmp_path, marker, saved_plan):
    description, target, needle = _targets(tmp_path)[case]
    argv = [saved_plan if a == "PLAN" else a for a in argv]
    err = assert_clear_cli(cli(*argv, option, target), option, needle)
    assert not marker.exists(), f"the model was built before {option} was checked:\n{err}"


def test_existing_output_file_is_replaced(tmp_path, saved_plan):
    """Policy: an existing file target is overwritten, as torch.save and -o options do."""
    out = tmp_path / "plan.json"
    out.write_text("old")
    code, _, err = cli("plan", MODEL, "--global-batch", "8", "--world", "1", "--hardware", "cpu", "--out", out)
    assert code == 0, err
    assert json.loads(out.read_text())["global_batch"] == 8


@contextlib.contextmanager
def _without_root():
    """Root writes anywhere, and CI runs as root: there the probe runs as nobody, keeping root as the saved
    uid to come back to (a process may return to its saved uid; the real uid is what access(2) checks)."""
    if os.getuid() != 0:
        yield
        return
    os.setresgid(65534, 65534, 0)
    os.setresuid(65534, 65534, 0)
    try:
        yield
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)


@pytest.fixture
def open_folder():
    """A folder every user can enter (pytest's tmp_path is its owner's alone, so nobody could not reach it)."""
    folder = Path(tempfile.mkdtemp(prefix="xirang-permissions-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.parametrize("mode", [0o555, 0o000], ids=["read-only-folder", "folder-it-cannot-enter"])
def test_unwritable_output_folder_is_refused(open_folder, marker, mode):
    locked = open_folder / "locked"
    locked.mkdir()
    locked.chmod(mode)
    try:
        with _without_root():
            assert not os.access(locked, os.W_OK)  # the probe has a folder it cannot write to, as root too
            result = cli("plan", MODEL, "--global-batch", "8", "--world", "1", "--out", locked / "p.json")
    finally:
        locked.chmod(0o755)
    assert_clear_cli(result, "--out", "permission")
    assert not marker.exists()


@pytest.mark.parametrize("argv", [["analyze", MODEL], ["inspect", "PLAN", "--rank", "0", "--model", MODEL]],
                         ids=["analyze", "inspect"])
def test_dump_target_that_is_a_file_is_refused_before_the_trace(argv, tmp_path, marker, saved_plan):
    a_file = tmp_path / "dump"
    a_file.write_text("not a folder")
    argv = [saved_plan if a == "PLAN" else a for a in argv]
    assert_clear_cli(cli(*argv, "--dump", a_file), "--dump", "is a file, not a folder")
    assert not marker.exists()


def test_dump_folder_is_created_with_its_parents(tmp_path):
    target = tmp_path / "deep" / "dump"
    code, _, err = cli("analyze", MODEL, "--dump", target)
    assert code == 0, err
    assert any(target.rglob("*")), "nothing dumped"


# --- model files -------------------------------------------------------------------------------

def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


MODEL_FILES = [  # (file name, content or None for no file, spec suffix, words of the refusal)
    ("missing.py", None, ":f", "does not exist"),
    ("plan.json", "{}", ":f", "not a python file"),
    ("syntax.py", "def f(:\n", ":f", "SyntaxError"),
    ("imports.py", "import no_such_package_xyz\ndef f(): pass\n", ":f", "no_such_package_xyz"),
    ("raises_on_import.py", "x = 1\nraise RuntimeError('boom at import')\ndef f(): pass\n", ":f", "boom at import"),
    ("exits.py", "import sys\nsys.exit(3)\ndef f(): pass\n", ":f", "exits when imported"),
    ("argparse_script.py", "import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n", ":f",
     "exits when imported"),
    ("good.py", "def f(): pass\n", ":g", "has no function 'g'"),
    ("good2.py", "def f(): pass\n", "", "is not of the form"),
    ("good3.py", "def f(): pass\n", ":", "is not of the form"),
    ("good4.py", "def f(): pass\n", ":f-g", "is not a Python function name"),
    ("constant.py", "f = 3\n", ":f", "has no function 'f'"),
]


@pytest.mark.parametrize("name,text,suffix,needle", MODEL_FILES, ids=[m[0] + m[2] for m in MODEL_FILES])
@pytest.mark.parametrize("command", ["analyze", "run"])
def test_bad_model_file_is_refused_with_the_file_named(name, text, suffix, needle, command, tmp_path):
    path = tmp_path / name if text is None else _write(tmp_path, name, text)
    extra = ["--world", "1", "--print-command"] if command == "run" else []
    assert_clear_cli(cli(command, f"{path}{suffix}", *extra), needle)


def test_model_file_that_is_a_folder(tmp_path):
    assert_clear_cli(cli("analyze", f"{tmp_path}:f"), "is a folder")


def test_error_in_the_model_file_names_its_line(tmp_path):
    path = _write(tmp_path, "line.py", "a = 1\nb = 2\nc = undefined_name\n")
    err = assert_clear_cli(cli("analyze", f"{path}:f"), "NameError", "undefined_name")
    assert f"{path}:3" in err


# --- plan files -------------------------------------------------------------------------------

PLAN_FILES = [  # (content: str / bytes / None, words of the refusal)
    (None, "does not exist"),
    ("", "not valid JSON"),
    ("{not json", "not valid JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\x00binary", "not a text"),
    ("[]", "must be a JSON object"),
    ('{"schema_version": 99}', "schema_version"),
    ('{"schema_version": %d}' % SCHEMA_VERSION, "missing the field"),  # the version this Xirang reads, no fields
]


@pytest.mark.parametrize("content,needle", PLAN_FILES, ids=["missing", "empty", "not-json", "binary", "list",
                                                            "schema", "fields"])
@pytest.mark.parametrize("command", ["explain", "inspect", "run"])
def test_bad_plan_file_is_refused(content, needle, command, tmp_path):
    path = tmp_path / "plan.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    argv = {"explain": ["explain", path], "inspect": ["inspect", path, "--rank", "0"],
            "run": ["run", MODEL, "--world", "1", "--plan", path, "--print-command"]}[command]
    assert_clear_cli(cli(*argv), needle)


@pytest.mark.parametrize("command", ["explain", "inspect"])
def test_plan_path_that_is_a_folder(command, tmp_path):
    argv = ["explain", tmp_path] if command == "explain" else ["inspect", tmp_path, "--rank", "0"]
    assert_clear_cli(cli(*argv), "is a folder")


def test_edited_plan_field_names_the_field(tmp_path, saved_plan):
    data = json.loads(open(saved_plan).read())
    data["micro_batch"] = 0
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert_clear_cli(cli("explain", path), "micro_batch", ">= 1")


def test_misspelt_plan_field_gets_a_suggestion(tmp_path, saved_plan):
    data = json.loads(open(saved_plan).read())
    data["micro_bacth"] = data.pop("micro_batch")
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert_clear_cli(cli("explain", path), "micro_bacth", "did you mean 'micro_batch'")


def test_launch_of_a_missing_script(tmp_path):
    assert_clear_cli(cli("launch", "-n", "2", tmp_path / "train.py"), "does not exist")
