"""``xirang train --config run.toml``: a command's options from a TOML file, flags over the file, and the
effective options written back as TOML so ``--config`` of that file runs the same thing again.

    # run.toml: the option names with underscores; every option of the command may be here
    model = "examples/catalog.py:gpt_tiny"
    world = 4
    pp = 2
    synthetic = true
    steps = 200
    lr = 3e-4

    xirang train --config run.toml --steps 50     # --steps given on the command line wins

Which options the command line gave is recorded while argparse parses (``track_given``: the parser's
actions are registered subclasses that note their ``dest``), not guessed by comparing values with the
defaults, so ``--steps 100`` overrides a file's ``steps = 50`` even though 100 is the default. A key
the command does not have is refused naming it and the valid keys; a value of the wrong type (a string
for ``steps``, a number for ``synthetic``) or out of the option's range is refused naming the key.

The writer is a few lines for what these files hold, flat keys with a string, integer, float,
boolean or list value (the standard library reads TOML, ``tomllib``, but does not write it). An option
without a value (``--tp`` not pinned: searched) is written as a comment, since TOML has no null.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
from pathlib import Path

from xirang.cli.args import world_arg
from xirang.ir.errors import XirangError

GIVEN = "given_options"  # the namespace attribute holding the dests the command line gave


class _GivenStore(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        if option_string is not None or values is not self.default:  # an absent optional positional passes its default
            _note(namespace, self.dest)


class _GivenTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note(namespace, self.dest)


def _note(namespace, dest: str) -> None:
    setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {dest})


def track_given(parser: argparse.ArgumentParser) -> None:
    """Make the arguments added to ``parser`` after this call record, when the command line gives them,
    their dest in ``namespace.given_options`` (plain stores and ``store_true`` flags)."""
    parser.register("action", None, _GivenStore)
    parser.register("action", "store", _GivenStore)
    parser.register("action", "store_true", _GivenTrue)


# --- reading -------------------------------------------------------------------------------------------

def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise XirangError("reading --config needs tomllib (Python 3.11 or later) or the tomli package",
                              where="--config", hint="pip install tomli, or use Python 3.11+") from None
    return tomllib


def read_config(path) -> dict:
    """The TOML file at ``path`` as a dict; a missing or malformed file is refused naming it."""
    target = Path(path)
    if not target.is_file():
        raise XirangError(f"--config {path}: {'that is a folder' if target.is_dir() else 'no such file'}",
                          where="--config", hint="give a TOML file, e.g. --config run.toml")
    tomllib = _toml()
    try:
        with open(target, "rb") as handle:
            return tomllib.load(handle)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise XirangError(f"--config {path} is not valid TOML: {error}", where=str(path),
                          hint='write one option per line, e.g. steps = 200 or model = "file.py:factory"') from None


def _kind(action: argparse.Action) -> type:
    """The Python type a config value of ``action`` must have: bool for flags, else what its ``type``
    function returns (int or float; str without one)."""
    if isinstance(action, argparse._StoreTrueAction):
        return bool
    if action.type is None:
        return str
    probe = action.type("1")  # the range checks of cli/args.py accept 1 for every numeric option
    return type(probe)


def check_value(key: str, value, action: argparse.Action, where: str):
    """``value`` of config key ``key`` as the option takes it (an int is a fine float), or a XirangError
    naming the key, the expected type and what it got."""
    if action.type is world_arg:  # world = 8 or world = "2x4", as --world takes them
        try:
            return world_arg(value if isinstance(value, (int, str)) and not isinstance(value, bool) else "?")
        except argparse.ArgumentTypeError as error:
            raise XirangError(f"{key} = {value!r}: {error}", where=where, hint=f'e.g. {key} = 8 or {key} = "2x4"') \
                from None
    kind = _kind(action)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    fits = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, fits = float(value), True
    if not fits:
        raise XirangError(f"{key} must be {names[kind]}, got {value!r} ({type(value).__name__})", where=where,
                          hint=f"e.g. {key} = {_example(kind)}")
    if action.type is not None and kind is not str:
        try:
            action.type(repr(value))
        except argparse.ArgumentTypeError as error:
            raise XirangError(f"{key} = {value!r}: {error}", where=where, hint=f"e.g. {key} = {_example(kind)}") \
                from None
    if action.choices is not None and value not in action.choices:
        raise XirangError(f"{key} = {value!r} is not one of {sorted(action.choices)}", where=where,
                          hint=f"pick one of {sorted(action.choices)}")
    return value


def _example(kind: type) -> str:
    return {bool: "true", int: "2", float: "0.5", str: '"text"'}[kind]


def merge_config(args: argparse.Namespace, values: dict, actions: dict, *, where: str) -> argparse.Namespace:
    """A copy of ``args`` with every key of ``values`` (a config file's) set where the command line did
    not give that option itself. ``actions``: the command's argparse actions by dest."""
    unknown = sorted(set(values) - set(actions))
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(actions), n=1)
        raise XirangError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in {where}",
                          where=where, hint=(f"did you mean {near[0]!r}? " if near else "")
                          + f"the valid keys are: {', '.join(sorted(actions))}")
    given = getattr(args, GIVEN, frozenset())
    merged = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != GIVEN})
    for key, value in values.items():
        checked = check_value(key, value, actions[key], where)
        if key not in given:
            setattr(merged, key, checked)
    return merged


# --- writing -------------------------------------------------------------------------------------------

def toml_value(value) -> str:
    """``value`` (str, int, float, bool or a list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value)  # a --world of "2x4" (cli/args.py WorldArg) is written as the string it was given
        return text if text.lstrip("-").isdigit() else json.dumps(text)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-trip form: 0.0003, 1e-10, 100.0
    if isinstance(value, str):
        # a JSON string is a TOML basic string except for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")


def write_config(path, options: dict, header: str = "") -> Path:
    """Write ``options`` as flat TOML to ``path`` (the keys sorted; a None value as a comment, since TOML
    has no null); the file is complete or absent (written beside, then renamed)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key in sorted(options):
        value = options[key]
        lines.append(f"# {key}: not set" if value is None else f"{key} = {toml_value(value)}")
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
    partial.replace(target)
    return target
