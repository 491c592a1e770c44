"""Old spellings of the public API, refused with their new names.

Issue 34 gave each concept one name (``hardware=`` the preset the planner prices, ``device=`` the
torch device, ``world`` the ranks, ``directory`` a checkpoint's folder). An old keyword is refused,
not kept as an alias: the project is at 0.1, and an alias that keeps working keeps two names alive
in every script and answer that quotes it. It is not ignored either: a keyword a function no longer
takes would otherwise be a bare ``TypeError`` that never says what replaced it, or, where the name
now means something else (``device=``), silently do that other thing.
"""
from __future__ import annotations

import functools
from typing import Callable

from xirang.ir.errors import XirangError


def renamed_error(function: str, old: str, new: str) -> XirangError:
    """The error for ``old=`` given to ``function``: ``new`` is the keyword that replaced it, or the
    spelling it moved into (``runtime=xirang.RuntimeOptions(seed=...)``)."""
    moved = "(" in new
    verb = "moved into" if moved else "was renamed"
    return XirangError(f"{function}: `{old}=` {verb} `{new}`", where=f"{function}({old}=...)",
                       hint=f"write {new}{'' if moved else '...'} instead of {old}=...")


def renamed_keywords(**old_to_new: str) -> Callable:
    """Decorate a public function so each old keyword (``path="directory="``) raises ``renamed_error``
    before the call; the signature the docs and ``help()`` show stays the function's own."""
    def decorate(function: Callable) -> Callable:
        name = f"xirang.{function.__name__}"

        @functools.wraps(function)
        def checked(*args, **kwargs):
            for old in old_to_new:
                if old in kwargs:
                    raise renamed_error(name, old, old_to_new[old])
            return function(*args, **kwargs)
        return checked
    return decorate
