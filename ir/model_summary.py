"""What a plan remembers of its model, so a plan refused for another model can say what differs.

The fingerprint (passes/analysis/fingerprint.py) says only *that* two traced graphs differ. A
``ModelSummary`` keeps enough to say *what*, in a few bytes per node: every parameter and buffer
by name with its shape and dtype, the names tied to one tensor, the user inputs, and per node of
the graph its op and two short hashes (of its output's shape and dtype, and of the values it reads
and its other arguments). ``first_difference`` compares the plan's summary with this model's and
names the first thing that differs, in that order: a tie (with the fix for ``model.to("meta")``,
which re-creates each parameter and so unties a tied embedding and head), a parameter, an input,
an op (with this model's node described by the caller: op, module path, source line). A plan
written before summaries has none and is refused by fingerprint alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from xirang.ir.errors import PlanError

TIE_HINT = ('a model moved with `model.to("meta")` loses its ties (torch makes a new parameter for each '
            'module that held the tied one): build the model under `with torch.device("meta"):`, which keeps '
            'the tie, instead of `model.to("meta")`, and plan and compile the same model')
REPLAN_HINT = "re-plan with xirang.plan(...) for this model, or pass the model the plan was made for"
_SHOWN = 3  # differences of one kind named before "and N more"


@dataclass(frozen=True)
class ModelSummary:
    """A traced model in brief (see the module docstring). ``state``: (name, role, shape, dtype) of each
    parameter and buffer, every name of a tied tensor listed; ``ties``: the names bound to one tensor,
    sorted, each group of two or more; ``inputs``: (name, shape, dtype) of each user input; ``ops``:
    the op names the nodes use; ``nodes``: one record per graph node, "<op index>:<shape hash><wiring
    hash>" in hex, separated by spaces."""

    state: tuple[tuple[str, str, str, str], ...]
    ties: tuple[tuple[str, ...], ...]
    inputs: tuple[tuple[str, str, str], ...]
    ops: tuple[str, ...]
    nodes: str

    def to_json(self) -> dict:
        return {"state": [list(s) for s in self.state], "ties": [list(t) for t in self.ties],
                "inputs": [list(i) for i in self.inputs], "ops": list(self.ops), "nodes": self.nodes}

    @classmethod
    def from_json(cls, data) -> "ModelSummary":
        try:
            return cls(state=tuple(tuple(map(str, s)) for s in data["state"]),
                       ties=tuple(tuple(map(str, t)) for t in data["ties"]),
                       inputs=tuple(tuple(map(str, i)) for i in data["inputs"]),
                       ops=tuple(map(str, data["ops"])), nodes=str(data["nodes"]))
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"model_summary is malformed ({type(error).__name__}: {error})", where="model_summary",
                            hint="delete the model_summary field (the plan is then checked by fingerprint "
                                 "alone), or re-plan") from None

    def first_difference(self, this: "ModelSummary", describe_node: Callable[[int], str]) -> Optional[tuple]:
        """(what differs, what to do) between this plan's model (``self``) and ``this`` model, the
        first kind found of: ties, parameters and buffers, inputs, ops; None where the summaries
        agree (a difference they do not record). ``describe_node(i)``: this model's node i in words."""
        for check in (self._ties, self._state, self._inputs):
            found = check(this)
            if found:
                return found
        return self._nodes(this, describe_node)

    # --- one kind each ---------------------------------------------------------------------------
    def _ties(self, this: "ModelSummary") -> Optional[tuple]:
        mine, theirs = set(self.ties), set(this.ties)
        for tie in sorted(theirs - mine):
            return (f"this model ties {_names(tie)} (one tensor), but they are separate parameters in the plan's "
                    f"model", TIE_HINT + " (the plan's model was likely moved that way: re-plan from one built "
                                         "under the device context)")
        for tie in sorted(mine - theirs):
            return (f"the plan's model ties {_names(tie)} (one tensor), but they are separate parameters in this "
                    f"model", TIE_HINT)
        return None

    def _state(self, this: "ModelSummary") -> Optional[tuple]:
        mine = {name: (role, shape, dtype) for name, role, shape, dtype in self.state}
        theirs = {name: (role, shape, dtype) for name, role, shape, dtype in this.state}
        changed = [f"{mine[n][0]} {n} is {_tensor(*theirs[n][1:])} in this model, {_tensor(*mine[n][1:])} in the "
                   f"plan's model" for n in mine if n in theirs and mine[n] != theirs[n]]
        lacking = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        parts = []
        if changed:
            parts.append(_listed(changed, "more changed", "; "))
        if lacking:
            parts.append(f"this model lacks {_count(lacking, mine)} of the plan's model: {_listed(lacking, 'more')}")
        if extra:
            parts.append(f"this model has {_count(extra, theirs)} the plan's model lacks: {_listed(extra, 'more')}")
        return ("; ".join(parts), REPLAN_HINT) if parts else None

    def _inputs(self, this: "ModelSummary") -> Optional[tuple]:
        if self.inputs == this.inputs:
            return None
        mine, theirs = ", ".join(_input(*i) for i in self.inputs), ", ".join(_input(*i) for i in this.inputs)
        return (f"this model takes the inputs {theirs or '(none)'}, the plan's model took {mine or '(none)'}",
                "pass the example inputs the plan was made with (same names, ranks and dtypes), or re-plan")

    def _nodes(self, this: "ModelSummary", describe_node: Callable[[int], str]) -> Optional[tuple]:
        mine, theirs = self.nodes.split(), this.nodes.split()
        for index, (a, b) in enumerate(zip(mine, theirs)):
            if a == b:
                continue
            (op_a, hashes_a), (op_b, hashes_b) = a.split(":"), b.split(":")
            node = f"node {index} of the graph"
            if self.ops[int(op_a, 16)] != this.ops[int(op_b, 16)]:
                what = (f"{node}: this model runs {describe_node(index)}; the plan's model ran "
                        f"{self.ops[int(op_a, 16)]} there")
            elif hashes_a[:len(hashes_a) // 2] != hashes_b[:len(hashes_b) // 2]:
                what = f"{node}: {describe_node(index)}; the plan's model's node there made another shape or dtype"
            else:
                what = (f"{node}: {describe_node(index)}; the plan's model's node there read other values or took "
                        f"other arguments")
            return what, REPLAN_HINT
        if len(mine) == len(theirs):
            return None
        if len(theirs) > len(mine):
            return (f"this model has {len(theirs) - len(mine)} more node(s) than the plan's model, the first "
                    f"{describe_node(len(mine))}", REPLAN_HINT)
        first = self.ops[int(mine[len(theirs)].split(":")[0], 16)]
        return (f"the plan's model has {len(mine) - len(theirs)} more node(s) than this model, the first "
                f"{first} after this model's last", REPLAN_HINT)


def _names(tie: tuple) -> str:
    return " and ".join(tie) if len(tie) == 2 else ", ".join(tie[:-1]) + f" and {tie[-1]}"


def _tensor(shape: str, dtype: str) -> str:
    return f"{dtype}[{shape}]"


def _input(name: str, shape: str, dtype: str) -> str:
    return f"{name} {dtype}[{shape}]" if dtype else name


def _count(names: list, state: dict) -> str:
    """'3 parameters', '1 buffer', '5 parameters or buffers'."""
    roles = sorted({state[n][0] for n in names}, reverse=True)  # parameter before buffer
    plural = "s" if len(names) != 1 else ""
    return f"{len(names)} " + " or ".join(f"{role}{plural}" for role in roles)


def _listed(items: list, more: str, separator: str = ", ") -> str:
    shown = separator.join(items[:_SHOWN])
    return shown + (f" (and {len(items) - _SHOWN} {more})" if len(items) > _SHOWN else "")
