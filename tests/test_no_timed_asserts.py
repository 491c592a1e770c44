"""No test asserts on wall-clock time (issue 38 item 1): speed is measured in benchmarks/, liveness is the
launcher's ``timeout_s`` or a process's ``wait(timeout=)``, and a guard against a blow-up counts work
(configurations priced, solver calls), so a loaded machine cannot fail a test and a fast one cannot hide
a regression.

The check reads every test file's source: a value is *timed* when it comes from a clock call
(``time.time``, ``perf_counter``, ``monotonic``, ``process_time``, ``thread_time``, their ``_ns``
forms) or is computed from a timed value: through assignments (a tuple's elements one by one), a
container's stored items, and what a function of the same file returns. An ``assert`` that orders a
timed value (``<``, ``<=``, ``>``, ``>=``) fails the test. Sleeps that set a stage's speed on purpose
and deadlines of polling loops are not asserts and stay allowed. Out of its reach: a time measured in
another process and read back as data (a rank's result, a log line); review catches those. The last
tests run the check on the timed asserts this repository once had, so a checker that finds nothing
cannot pass unnoticed. Default tier, in-process (reading the sources only, ~2 s).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "thread_time"}
CLOCKS |= {f"{name}_ns" for name in CLOCKS}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}  # `from time import perf_counter`


def _any(taint) -> bool:
    """Whether any part of a taint is timed: True, a tuple of element taints, or {"item": taint}."""
    if isinstance(taint, tuple):
        return any(_any(t) for t in taint)
    if isinstance(taint, dict):
        return _any(taint["item"])
    return bool(taint)


def _merge(a, b):
    if a is True or b is True:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return {"item": _merge(a["item"], b["item"])}
    if not _any(a):
        return b
    if not _any(b):
        return a
    return _any(a) or _any(b)


class _Taint:
    """Timed values of one module, by name (one namespace for the whole file: coarse, never missing one)."""

    def __init__(self, tree: ast.Module):
        self.names: dict = {}
        self.returns: dict = {}
        self.tree = tree
        for _ in range(20):  # to a fixed point: a function may be defined below its caller
            before = (repr(self.names), repr(self.returns))
            self._pass()
            if (repr(self.names), repr(self.returns)) == before:
                break

    def of(self, node: ast.AST):
        if node is None or isinstance(node, ast.Constant):
            return False
        if _is_clock(node):
            return True
        if isinstance(node, ast.Name):
            return self.names.get(node.id, False)
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self.of(e) for e in node.elts)
        if isinstance(node, ast.Subscript):
            base = self.of(node.value)
            if isinstance(base, dict):
                return base["item"]
            index = node.slice
            if isinstance(base, tuple) and isinstance(index, ast.Constant) and isinstance(index.value, int):
                return base[index.value] if -len(base) <= index.value < len(base) else False
            return _any(base) or _any(self.of(index))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.returns:
            return self.returns[node.func.id]
        if isinstance(node, ast.Lambda):
            return False
        return any(_any(self.of(child)) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))

    def _assign(self, target: ast.AST, taint) -> None:
        if isinstance(target, ast.Name):
            self.names[target.id] = _merge(self.names.get(target.id, False), taint)
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = taint if isinstance(taint, tuple) and len(taint) == len(target.elts) else [_any(taint)] * len(
                target.elts)
            for element, part in zip(target.elts, parts):
                self._assign(element.value if isinstance(element, ast.Starred) else element, part)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            self._assign(target.value, {"item": taint})

    def _pass(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._assign(target, self.of(node.value))
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                self._assign(node.target, self.of(node.value))
            elif isinstance(node, ast.NamedExpr):
                self._assign(node.target, self.of(node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                self._assign(node.target, _any(self.of(node.iter)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Return) and inner.value is not None:
                        self.returns[node.name] = _merge(self.returns.get(node.name, False), self.of(inner.value))


def timed_asserts(source: str) -> list[int]:
    """The lines of the asserts in ``source`` that order a timed value."""
    tree = ast.parse(source)
    taint = _Taint(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in ast.walk(node.test):
            if isinstance(compare, ast.Compare) and any(isinstance(op, ORDERING) for op in compare.ops):
                if any(_any(taint.of(side)) for side in [compare.left, *compare.comparators]):
                    found.append(node.lineno)
                    break
    return found


def test_no_test_asserts_on_wall_clock_time():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100, len(files)  # the scan really reads the test suite
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}" for path in files
                 for line in timed_asserts(path.read_text())]
    assert not offenders, ("asserts on wall-clock time (measure speed in benchmarks/, count work in tests, let "
                           f"the launcher's timeout bound liveness): {offenders}")


# The timed asserts this repository's tests once had (before 0099595, 3b2e705 and this file's commit),
# each in the shape it had there.
ONCE_HAD = {
    "a bound on an elapsed time": """
import time
def test_plan():
    began = time.perf_counter()
    found = search()
    assert found and time.perf_counter() - began < 5.0
""",
    "times of two sizes compared": """
import time
def test_huge():
    times = {}
    for batch in (8, 10 ** 9):
        started = time.perf_counter()
        plan(batch)
        times[batch] = time.perf_counter() - started
    assert times[10 ** 9] < 3 * times[8] + 2.0, times
""",
    "a helper returning the seconds after a kill": """
import time
def _run(command):
    killed_at = time.monotonic()
    code = wait()
    took = None if killed_at is None else time.monotonic() - killed_at
    return code, "out", "err", took
def test_kill():
    code, out, err, took = _run([])
    assert code != 0 and took < 30, took
""",
    "a build time kept in a cache": """
import time
_built = {}
def _build(name):
    if name not in _built:
        started = time.perf_counter()
        model, inputs = make(name)
        _built[name] = (model, inputs, time.perf_counter() - started)
    return _built[name]
def test_builds(name):
    model, inputs, seconds = _build(name)
    assert seconds < 60, seconds
""",
    "a clock imported by name": """
from time import monotonic
def test_fast():
    start = monotonic()
    work()
    assert monotonic() - start <= 1
""",
}

# Asserts of the same shapes that are not about time: none must be found.
NOT_TIMED = """
import time
_built = {}
def _build(name):
    started = time.perf_counter()
    model, inputs = make(name)
    _built[name] = (model, inputs, time.perf_counter() - started)
    return _built[name]
def test_counts(name):
    model, inputs, seconds = _build(name)
    print(f"built in {seconds:.1f} s")                  # printed, not asserted
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - 10) <= 1 and len(inputs) > 0
    deadline = time.monotonic() + 60                    # a polling loop's deadline, not an assert
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)
    step_seconds = predicted()
    assert step_seconds < 2 * step_seconds + 1          # a model's predicted seconds, not a clock's
"""


@pytest.mark.parametrize("name", sorted(ONCE_HAD))
def test_the_check_finds_the_timed_asserts_this_repository_once_had(name):
    assert timed_asserts(ONCE_HAD[name]), name


def test_the_check_leaves_untimed_asserts_alone():
    assert timed_asserts(NOT_TIMED) == []
