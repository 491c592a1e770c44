"""The one error root: every error Xirang raises on purpose is a ``XirangError`` and says what was
wrong, where (module path, op, source line, plan field) and what to do. Every layer raises these;
the CLI catches the root alone."""
from __future__ import annotations

import os

DEBUG_ENV = "XIRANG_DEBUG"  # set (not "0"): Xirang's errors come with their Python traceback (`xirang --debug`)


def tracebacks_wanted() -> bool:
    """Whether the user asked for the traceback of Xirang's own errors (``XIRANG_DEBUG=1``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


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


class PlanError(XirangError, ValueError):
    """A plan is inconsistent, malformed, or made for another model or world (``where``: the field)."""


MAX_PROBLEMS_SHOWN = 12


class ScheduleError(XirangError, ValueError):
    """A schedule that would compute wrong results, hang, or overrun memory; ``problems`` lists all."""

    def __init__(self, name: str, problems):
        self.problems = tuple(problems)
        shown = "\n  - ".join(self.problems[:MAX_PROBLEMS_SHOWN])
        more = len(self.problems) - MAX_PROBLEMS_SHOWN
        tail = f"\n  ... and {more} more (see ScheduleError.problems)" if more > 0 else ""
        super().__init__(f"pipeline schedule {name!r} is invalid ({len(self.problems)} problem"
                         f"{'s' if len(self.problems) != 1 else ''}):\n  - {shown}{tail}",
                         where=f"schedule {name!r}",
                         hint="build schedules with xirang.ir.schedules.build_schedule, or fix the listed actions")


class InvalidValue(XirangError, ValueError):
    """A value handed to one of Xirang's data types, solvers or cost terms is outside its domain
    (the message names the value and what is valid). Also a ``ValueError``, as Python code expects."""


class InvalidType(XirangError, TypeError):
    """A value of the wrong type handed to one of Xirang's data types or functions. Also a ``TypeError``."""


class SolverFailure(XirangError, RuntimeError):
    """A solver or simulator could not finish a problem it was given (the message says which and why)."""
