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
- The ranks: ``--world`` takes what ``xirang.compile(world=)`` takes, N or NxM, in every command
  (``world_arg``).
- Renamed flags (``--device`` is ``--hardware``, ``--json FILE`` is ``--out FILE``, ``--nprocs`` is
  ``--world``): kept hidden only to refuse them naming the new flag (``add_renamed_flag``), so an old
  command line fails with what to write instead of argparse's bare "unrecognized arguments".
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from xirang.ir.errors import XirangError
from xirang.ir.world import parse_world


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


class WorldArg(int):
    """The rank count ``--world`` names, spelt as given: every command uses it as a count (ranks to
    launch, torchrun's ``--nproc-per-node``), and ``str()`` gives back "2x4" so the ranks a command
    starts, its printed torchrun command and its saved config all plan the same nodes."""

    def __new__(cls, count: int, spec: str):
        made = super().__new__(cls, count)
        made.spec = spec
        return made

    def __str__(self) -> str:
        return self.spec

    __repr__ = __str__

    def __getnewargs__(self):  # pickled to launched ranks: rebuilt with its spelling
        return int(self), self.spec

    def world(self):
        """What ``xirang.plan`` / ``xirang.compile`` take: the count, or the "NxM" text."""
        return int(self) if self.spec.isdigit() else self.spec


def world_arg(text) -> WorldArg:
    """``--world``: N ranks or "NxM" (N nodes of M devices; node groups "2x8:a100-80g+2x8:h100-80g"), as
    ``xirang.compile(world=)`` takes it."""
    spec = str(text).strip().lower()
    try:
        if not spec:
            raise ValueError("empty")
        return WorldArg(parse_world(spec, "cpu").size, spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"world={str(text)!r}: {error}; give a positive integer N (ranks) or NxM "
                                         f"(N nodes of M devices, e.g. 2x4)") from None


class _RenamedFlag(argparse.Action):
    def __init__(self, option_strings, dest, new: str = "", note: str = "", **kwargs):
        self.new, self.note = new, note
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise XirangError(f"{option_string} was renamed {self.new}" + (f" ({self.note})" if self.note else ""),
                          where=f"{parser.prog} {option_string}",
                          hint=f"write {self.new}{' ' + values if isinstance(values, str) else ''} instead")


def add_renamed_flag(parser: argparse.ArgumentParser, old: str, new: str, *, note: str = "",
                     takes_value: bool = True) -> None:
    """``old`` refused at parse time naming ``new``; hidden from ``--help`` and the CLI reference."""
    parser.add_argument(old, action=_RenamedFlag, new=new, note=note, nargs="?" if takes_value else 0,
                        default=argparse.SUPPRESS, dest=f"renamed_{old.lstrip('-').replace('-', '_')}",
                        help=argparse.SUPPRESS)


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
