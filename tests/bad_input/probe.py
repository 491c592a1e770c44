"""How the battery asks and what it demands of an answer.

``cli(*argv)`` runs the ``xirang`` command in this process (its ``main``, argparse included) and
returns (exit code, stdout, stderr). ``assert_clear_cli`` and ``assert_clear_error`` demand the
three parts of a clear error: what went wrong (each needle given), where (a ``where:`` line, or
argparse naming the option) and what to do; never a traceback, never the catch-all "internal
error" (which means an exception Xirang did not expect, a bug)."""
from __future__ import annotations

import contextlib
import io

from xirang.cli import main
from xirang.ir.errors import XirangError

MODELS = "tests/bad_input/models.py"


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse refuses with exit 2 after printing usage and the error
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _has_all(text: str, needles) -> None:
    low = text.lower()
    missing = [n for n in needles if n.lower() not in low]
    assert not missing, f"message lacks {missing}:\n{text}"


def assert_clear_cli(result, *needles: str) -> str:
    """A refused command: non-zero exit, one message with what/where/what-to-do, the needles in it."""
    code, out, err = result
    assert code not in (0, None), f"accepted (exit {code}); stdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in err + out and "internal error" not in err, err
    if err.startswith("usage:"):  # argparse: usage, then "xirang CMD: error:" naming the option and why
        assert ": error: " in err, err
    else:
        _has_all(err, ["xirang: error:", "where:", "what to do:"])
    _has_all(err, needles)
    return err


def assert_clear_error(error: BaseException, *needles: str, where: str = "", hint: str = "") -> XirangError:
    """A refused API call: a XirangError with a non-empty what, where and hint, the needles in its text."""
    assert isinstance(error, XirangError), f"{type(error).__name__} is not a XirangError: {error}"
    assert error.what and error.where and error.hint, f"what/where/hint missing: {error!r}\n{error}"
    _has_all(str(error), needles)
    if where:
        _has_all(error.where, [where])
    if hint:
        _has_all(error.hint, [hint])
    return error
