"""Solve a small mixed 0/1 linear program with CBC, handing CBC exactly the file PuLP would write.

A ``LinearProgram`` is named columns (binary, or continuous >= 0), rows ``sum coef * column (= or <=)
rhs`` in the order added, and a minimised objective. ``mps_text`` writes it in PuLP 3's MPS dialect
byte for byte (columns sorted by name and renamed X0000000..., rows C0000000... in order, one MARK
pair around each integer column, ``% .12e`` numbers, an objective without columns given PuLP's
``__dummy`` column fixed at 0), and ``solve_cbc`` runs PuLP's bundled CBC with PuLP's command line
plus ``SPEED_OPTIONS``, reading back only the nonzero columns.

Why not through PuLP's objects: for the split ILPs, building LpVariable and LpAffineExpression
objects and PuLP's writer cost about as much CPU as CBC's own solve. CBC breaks exact ties (equally
cheap shardings) its own way, and which one it picks depends on the file it reads, so the text is
kept identical to PuLP's, not merely equivalent: plans do not change
(``tests/passes/test_solve_splits.py`` compares the text with PuLP's writer).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading

import pulp
from xirang.ir.errors import SolverFailure


class LinearProgram:
    """Columns by name; ``add_row`` and ``add_objective`` name them, ``binary`` marks the 0/1 ones."""

    def __init__(self):
        self.objective: dict[str, float] = {}
        self.rows: list[tuple[str, dict[str, float], float]] = []  # (sense "E" or "L", coefficients, rhs)
        self.binary: set[str] = set()

    def add_binary(self, name: str) -> str:
        self.binary.add(name)
        return name

    def add_row(self, sense: str, coefficients: dict[str, float], rhs: float) -> None:
        self.rows.append((sense, coefficients, rhs))

    def add_objective(self, name: str, coefficient: float) -> None:
        """Adds to the column's objective coefficient (zero adds nothing, as PuLP's expression)."""
        if coefficient != 0:
            self.objective[name] = self.objective.get(name, 0.0) + coefficient

    def columns(self) -> list[str]:
        names = set(self.objective)
        for _, coefficients, _ in self.rows:
            names.update(coefficients)
        if not self.objective:
            names.add(_DUMMY)
        return sorted(names)

    def mps_text(self) -> tuple[str, dict[str, str]]:
        """(the MPS file, column name -> the name CBC knows it by)."""
        columns = self.columns()
        renamed = {name: "X%07d" % k for k, name in enumerate(columns)}
        entries: dict[str, list[str]] = {name: [] for name in columns}
        rows = ["*SENSE:Minimize\n", "NAME          MODEL\n", "ROWS\n", " N  OBJ\n"]
        rhs_lines = []
        # the generated names have 8 characters or more, so PuLP's "%-8s" leaves them as they are
        for r, (sense, coefficients, rhs) in enumerate(self.rows):
            row = "C%07d" % r
            rows.append(f" {sense}  {row}\n")
            for name, value in coefficients.items():
                text = _UNIT_TEXT.get(value) or "% .12e" % value
                entries[name].append(f"    {renamed[name]}  {row}  {text}\n")
            rhs_lines.append("    RHS       %-8s  % .12e\n" % (row, rhs if rhs != 0 else 0))
        objective = self.objective or {_DUMMY: 1}
        lines, bounds = rows + ["COLUMNS\n"], []
        for name in columns:
            mps_name, integer = renamed[name], name in self.binary
            if integer:
                lines.append("    MARK      'MARKER'                 'INTORG'\n")
            lines += entries[name]
            if name in objective:
                lines.append("    %-8s  %-8s  % .12e\n" % (mps_name, "OBJ", objective[name]))
            if integer:
                lines.append("    MARK      'MARKER'                 'INTEND'\n")
                bounds.append(" BV BND       %-8s\n" % mps_name)
            elif name == _DUMMY:
                bounds.append(" FX BND       %-8s  % .12e\n" % (mps_name, 0))
        lines += ["RHS\n"] + rhs_lines + ["BOUNDS\n"] + bounds + ["ENDATA\n"]
        return "".join(lines), renamed


_DUMMY = "__dummy"  # PuLP's stand-in column for an objective without columns
# nearly every coefficient is 1 or -1 (the one-strategy and marginal rows): their "% .12e" text, once
_UNIT_TEXT = {1: "% .12e" % 1, -1: "% .12e" % -1}

# Skip CBC's integer preprocessing, root cuts and primal heuristics: the split ILPs' LP relaxation is
# already integral at the root (the local polytope, see solve_splits), so they only cost time (~40% of
# CBC's CPU, mostly the feasibility pump's mini branch and bound). Branch and bound still proves the
# optimum, and Clp's own presolve stays on: it decides which of several exact ties the LP lands on
# ("-presolve off" picks other ties). On the 136 split ILPs of the plan_speed setups every column came
# out as with PuLP's command line, and tests/passes/test_plan_speed.py holds random ILPs to PuLP's answer.
SPEED_OPTIONS = ("-preprocess", "off", "-cuts", "off", "-heuristics", "off")


# A split or stage-cut ILP takes CBC milliseconds to a few seconds; one still running after this long
# is stuck (or the machine is), and planning says so instead of hanging.
CBC_TIMEOUT_S = 300.0


def solve_cbc(program: LinearProgram, what: str, *, timeout_s: float = CBC_TIMEOUT_S) -> dict[str, float]:
    """Column name -> value of CBC's optimum (a SolverFailure naming ``what`` if CBC finds none, or is
    still running after ``timeout_s`` seconds: it is then killed)."""
    text, renamed = program.mps_text()
    with tempfile.TemporaryDirectory(prefix="xirang-cbc-") as folder:
        model, solution = os.path.join(folder, "model.mps"), os.path.join(folder, "model.sol")
        with open(model, "w") as file:
            file.write(text)
        # PuLP's, with SPEED_OPTIONS before -solve and only the nonzero columns written back ("normal",
        # not "all": ~230 lines instead of ~2700 for a Llama layer's ILP; what is left out reads as 0)
        command = [pulp.PULP_CBC_CMD().path, model, "-timeMode", "elapsed", *SPEED_OPTIONS, "-solve",
                   "-printingOptions", "normal", "-solution", solution]
        returncode = _run_within(command, timeout_s)
        if returncode is None:
            raise SolverFailure(f"CBC ({command[0]}) did not finish {what} within {timeout_s:g} s and was "
                                f"stopped", where="passes/planning/solve_cbc.py",
                                hint="plan fewer candidates (pin dp, tp, pp or the micro-batch) or a smaller "
                                     "model; if the machine is busy, plan again when it is not")
        if returncode != 0 or not os.path.exists(solution):
            raise SolverFailure(f"CBC ({command[0]}) failed on {what} with exit status {returncode}")
        with open(solution) as file:
            lines = file.read().splitlines()
    status = lines[0].split() if lines else ["(empty)"]
    # PuLP's reading: "Optimal ...", or "Stopped on ... - objective value ..." with a solution found
    if not (status[0] == "Optimal" or (status[0] == "Stopped" and len(status) >= 5 and status[4] == "objective")):
        raise SolverFailure(f"CBC returned status {' '.join(status[:3])!r} for {what}")
    original = {mps_name: name for name, mps_name in renamed.items()}
    values = dict.fromkeys(renamed, 0.0)
    for line in lines[1:]:
        fields = line.split()
        if len(fields) < 3:
            break
        if fields[0] == "**":  # CBC marks values outside their bounds; PuLP reads past the mark
            fields = fields[1:]
        if fields[1] in original:
            values[original[fields[1]]] = float(fields[2])
    return values


def _run_within(command: list, timeout_s: float):
    """The exit status of ``command``, or None where it ran past ``timeout_s`` and was killed. The wait blocks
    in waitpid and a timer kills: subprocess's own timeout polls in sleeps growing to 50 ms, tens of ms late
    on a split ILP CBC solves in 100-200 ms, and planning solves a hundred of them."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    killed = threading.Event()

    def stop():
        if process.poll() is None:  # still running: a process that just ended is not a timeout
            killed.set()
            process.kill()
    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    try:
        returncode = process.wait()
    except BaseException:  # interrupted (Ctrl-C): CBC goes with the planner, as under subprocess.run
        process.kill()
        process.wait()
        raise
    finally:
        timer.cancel()
    return None if killed.is_set() else returncode
