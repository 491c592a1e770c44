"""What the ``xirang`` command checks of its arguments before doing any work, one place per concept.

- Numbers: argparse ``type=`` functions (``positive_int``, ``nonnegative_int``, ``positive_float``,
  ``nonnegative_float``), so ``--batch 0``, ``--steps -3``, ``--timeout 0``, ``--tolerance -1`` or
  ``--tolerance nan`` stop at parse time with argparse's usage line and the option named.
- Output paths (``--json OUT``, ``--picture PNG``, ``--trace JSON``, ``--dump DIR`` ...): checked
  before the command traces, plans or launches anything, so a bad target does not lose minutes of
  work. The policy: a file target's folder must exist and be writable, the target must not be a
  folder, and an existing file is replaced (as ``torch.save`` and ``-o`` options do); a folder
  target (``--dump``) must not be a file and is created (with its parents) up front.
- Input files (a plan, a world file): a clear error when missing, a folder, unreadable or not text.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from xirang.ir.errors import XirangError


def _number(text: str, kind, minimum, inclusive: bool, noun: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number ({noun})")
    if value < minimum or (value == minimum and not inclusive):
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {noun}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, True, "a positive integer (1, 2, ...)")


def nonnegative_int(text: str) -> int:
    return _number(text, int, 0, True, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, False, "a number of seconds > 0")


def nonnegative_float(text: str) -> float:
    return _number(text, float, 0.0, True, "a number >= 0")


def check_output_file(path, option: str) -> Path:
    """``path`` can be written as a file (see the module docstring); raise naming ``option`` if not."""
    target = Path(path)
    if str(path) == "" or target.name in ("", ".", ".."):
        raise XirangError(f"{option} {str(path)!r} is not a file name", where=option,
                          hint=f"give a file path, e.g. {option} out/result.json")
    try:
        return _check_output_file(target, path, option)
    except PermissionError:  # a folder on the way this user cannot enter: stat itself is refused
        raise XirangError(f"{option} {path}: no permission to reach that folder", where=option,
                          hint="give a path in a folder you can write, e.g. the current directory") from None


def _check_output_file(target: Path, path, option: str) -> Path:
    if target.is_dir():
        raise XirangError(f"{option} {path}: that is a folder, not a file", where=option,
                          hint=f"give a file inside it, e.g. {option} {target / ('out' + _suffix(option))}")
    folder = target.parent
    if not folder.exists():
        raise XirangError(f"{option} {path}: its folder {folder} does not exist", where=option,
                          hint=f"create it first (mkdir -p {folder}) or give another path")
    if not folder.is_dir():
        raise XirangError(f"{option} {path}: {folder} is a file, not a folder", where=option,
                          hint="give a path whose parent is a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise XirangError(f"{option} {path}: no permission to write there", where=option,
                          hint="give a path in a folder you can write, e.g. the current directory")
    return target


def check_output_dir(path, option: str) -> Path:
    """``path`` is (or is now created as) a writable folder; raise naming ``option`` if it cannot be."""
    target = Path(path)
    if str(path) == "":
        raise XirangError(f"{option} '' is not a folder name", where=option, hint=f"e.g. {option} dump")
    if target.exists() and not target.is_dir():
        raise XirangError(f"{option} {path}: that is a file, not a folder", where=option,
                          hint="give a folder path (it is created if missing), or remove the file")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise XirangError(f"{option} {path}: cannot create the folder ({error.strerror})", where=option,
                          hint="give a folder you can write, e.g. ./dump") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise XirangError(f"{option} {path}: no permission to write in that folder", where=option,
                          hint="give a folder you can write, e.g. ./dump")
    return target


def read_input_text(path, what: str, hint: str) -> str:
    """The text of an input file, or an error saying what is wrong with it (missing, folder, binary)."""
    target = Path(path)
    if target.is_dir():
        raise XirangError(f"{what} {str(path)!r} is a folder, not a file", where=str(path), hint=hint)
    if not target.is_file():
        raise XirangError(f"{what} {str(path)!r} does not exist", where=f"current directory {Path.cwd()}", hint=hint)
    try:
        return target.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise XirangError(f"{what} {path} is not a text (JSON) file", where=str(path), hint=hint) from None
    except OSError as error:
        raise XirangError(f"{what} {path} cannot be read: {error.strerror}", where=str(path), hint=hint) from None


def _suffix(option: str) -> str:
    return ".png" if "picture" in option or "timeline" in option else ".json"
