"""Errors a user can meet. Each says what was wrong, where, and what to do."""
from __future__ import annotations


class XirangError(Exception):
    """Base of every error Xirang raises on purpose.

    ``what`` is the problem, ``where`` the module path / op / source line when known, ``hint`` what
    the user can do about it.
    """

    def __init__(self, what: str, *, where: str = "", hint: str = ""):
        self.what, self.where, self.hint = what, where, hint
        parts = [what]
        if where:
            parts.append(f"  where: {where}")
        if hint:
            parts.append(f"  what to do: {hint}")
        super().__init__("\n".join(parts))


class TraceError(XirangError):
    """The model could not be captured as a graph."""


class PassOrderError(XirangError):
    """A pass list runs a pass before the pass that provides what it requires."""


class PassFailure(XirangError):
    """A pass raised, or did not provide what it declared, or left a malformed graph."""
