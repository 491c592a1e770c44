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
        raise XirangError(f"model {spec!r} is not of the form path/to/file.py:factory", where=f"MODEL {spec!r}",
                          hint="name a Python file and a function in it that builds the model, e.g. "
                               "examples/catalog.py:gpt_tiny")
    path = Path(path_text)
    if path.is_dir():
        raise XirangError(f"model file {path_text!r} is a folder, not a Python file", where=path_text,
                          hint="name a .py file inside it, e.g. examples/catalog.py:gpt_tiny")
    if not path.is_file():
        raise XirangError(f"model file {path_text!r} does not exist", where=f"current directory {Path.cwd()}",
                          hint="give the path of a .py file, relative to the current directory or absolute")
    if path.suffix != ".py":
        raise XirangError(f"model file {path_text!r} is not a Python file (.py)", where=path_text,
                          hint="name the .py file that defines the factory; plans (.json) go to --plan")
    if not name.isidentifier():
        raise XirangError(f"{name!r} is not a Python function name", where=spec,
                          hint="write path/to/file.py:factory, the factory a function defined in the file")
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
    except SystemExit as error:  # a script that parses arguments or exits when imported
        raise XirangError(f"model file {path_text} exits when imported (SystemExit {error.code!r})",
                          where=path_text, hint="put the script part under `if __name__ == '__main__':` so "
                                                "importing the file only defines the factory") from None
    except Exception as error:  # the user's file failed: its error and line, not our traceback
        line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else _failing_line(error, path)
        raise XirangError(f"model file {path_text} could not be loaded: {type(error).__name__}: {error}",
                          where=f"{path_text}:{line}" if line else path_text,
                          hint="install what it imports, or fix the file; it is run as a plain Python file "
                               "with its folder and the folder above its package on sys.path") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise XirangError(f"{path_text} has no function {name!r}", where=path_text,
                          hint=f"functions there: {', '.join(found) or 'none'}")
    return factory


def _failing_line(error: BaseException, path: Path):
    """The line of ``path`` in ``error``'s traceback, if the error passed through it."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return frames[-1].lineno if frames else None


def build(factory, batch: int | None, seq: int | None, *, strict: bool = False):
    """Call the factory with the batch/seq it accepts; it returns a model or (model, example kwargs).

    ``strict``: ``batch``/``seq`` came from the user (``--batch``, ``--seq``), so a factory that does
    not take one is refused rather than silently building another size. Whatever the factory does
    wrong (raises, returns something else) is an error naming the factory and what it must return."""
    name = getattr(factory, "__name__", repr(factory))
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepted = {}
    if strict:
        for option, value in (("batch", batch), ("seq", seq)):
            if value is not None and option not in accepted and not _takes_kwargs(accepted):
                raise XirangError(f"--{option} {value}: the factory {name} does not take {option!r}, so it would "
                                  f"be ignored", where=f"{name}({', '.join(accepted)})",
                                  hint=f"drop --{option}, or give the factory a {option}= parameter")
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None
              and (k in accepted or _takes_kwargs(accepted))}
    needed = [p.name for p in accepted.values() if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs]
    if needed:
        raise XirangError(f"the factory {name} needs the argument(s) {needed}, which xirang does not pass",
                          where=f"{name}({', '.join(accepted)})",
                          hint="give them defaults; xirang passes only batch= and seq= (from --batch, --seq)")
    try:
        built = factory(**kwargs)
    except Exception as error:  # the factory's own failure, with its line
        path = Path(inspect.getsourcefile(factory) or "") if inspect.isfunction(factory) else None
        line = _failing_line(error, path) if path else None
        raise XirangError(f"the factory {name}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) raised "
                          f"{type(error).__name__}: {error}", where=f"{path}:{line}" if line else name,
                          hint="fix the factory, or pass a batch/seq it accepts") from error
    return check_built(built, name)


def _takes_kwargs(parameters) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


FACTORY_RETURNS = "return the model, or (model, example_kwargs) with example_kwargs a dict of the forward's inputs"


def check_built(built, name: str = "the factory"):
    """(model, example kwargs) from what a factory returned, or an error saying what it must return."""
    import torch
    if isinstance(built, torch.nn.Module):
        return built, {}
    if not isinstance(built, tuple):
        raise XirangError(f"{name} returned a {type(built).__name__}, not a torch.nn.Module", where=name,
                          hint=FACTORY_RETURNS)
    if len(built) != 2:
        kinds = ", ".join(type(b).__name__ for b in built)
        raise XirangError(f"{name} returned a tuple of {len(built)} items ({kinds}); it must be (model, "
                          f"example_kwargs)", where=name, hint=FACTORY_RETURNS)
    model, example_kwargs = built
    if not isinstance(model, torch.nn.Module):
        raise XirangError(f"{name} returned ({type(model).__name__}, ...): the first item is not a torch.nn.Module",
                          where=name, hint=FACTORY_RETURNS)
    if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) for k in example_kwargs):
        raise XirangError(f"{name} returned (model, {type(example_kwargs).__name__}): the example inputs must be a "
                          f"dict of input name -> value", where=name,
                          hint=FACTORY_RETURNS + " (positional inputs: name them by the forward's parameters)")
    return model, example_kwargs
