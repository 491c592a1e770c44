"""Model files the CLI takes: ``path/to/file.py:factory``, a function that builds the model (and, if it
likes, example inputs). Every command that reads a model (analyze, plan, inspect, run, verify)
loads it here, so they all accept the same files and fail with the same messages."""
from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from pathlib import Path

from xirang.ir.errors import XirangError


def load_factory(spec: str):
    """'path/to/file.py:factory' -> the factory function, with errors that say what to fix."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise XirangError(f"model {spec!r} is not of the form path/to/file.py:factory",
                          hint="name a Python file and a function in it that builds the model, e.g. "
                               "examples/catalog.py:gpt_tiny")
    path = Path(path_text)
    if not path.is_file():
        raise XirangError(f"model file {path_text!r} does not exist", where=f"current directory {Path.cwd()}",
                          hint="give the path of a .py file, relative to the current directory or absolute")
    # The file may import its neighbours (`import gpt`) or its package (`from examples.gpt import
    # ...`, examples/ being a package): put its folder and the folder above its package on the path.
    folder = path.resolve().parent
    package_root = folder
    while (package_root / "__init__.py").is_file() and package_root.parent != package_root:
        package_root = package_root.parent
    for entry in dict.fromkeys((str(Path.cwd()), str(package_root), str(folder))):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as error:
        line = getattr(error, "lineno", None) or _failing_line(error, path)
        raise XirangError(f"model file {path_text} could not be loaded: {type(error).__name__}: {error}",
                          where=f"{path_text}:{line}" if line else path_text,
                          hint="install what it imports, or fix the file; it is run as a plain Python file "
                               "with its folder and the folder above its package on sys.path") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise XirangError(f"{path_text} has no function {name!r}", hint=f"functions there: {', '.join(found)}")
    return factory


def _failing_line(error: BaseException, path: Path):
    """The line of ``path`` in ``error``'s traceback, if the error passed through it."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return frames[-1].lineno if frames else None


def build(factory, batch: int | None, seq: int | None):
    """Call the factory with the batch/seq it accepts; it returns a model or (model, example kwargs)."""
    accepted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None and k in accepted}
    built = factory(**kwargs)
    return built if isinstance(built, tuple) else (built, {})
