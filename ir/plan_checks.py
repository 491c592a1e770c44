"""Field checks and JSON helpers of the Plan: each failure is a PlanError naming the field at fault."""
from __future__ import annotations

import difflib
import json
import math
from contextlib import contextmanager

from xirang.ir.errors import PlanError, XirangError

REPLAN = "re-plan with xirang.plan(...) and save the new plan, or fix this field by hand"


# --- checks shared by the dataclasses: each names the field and what would be valid --------------

def check_int(value, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{where} must be an int >= {minimum}, got {value!r}", where=where, hint=REPLAN)
    return value


def check_float(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanError(f"{where} must be a finite number >= 0, got {value!r}", where=where, hint=REPLAN)
    return float(value)


def check_str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise PlanError(f"{where} must be a non-empty string, got {value!r}", where=where, hint=REPLAN)
    return value


def check_choice(value, choices: tuple, where: str) -> str:
    if value not in choices:
        raise PlanError(f"{where} is {value!r}, which is not one of {', '.join(choices)}", where=where,
                        hint=f"use one of: {', '.join(choices)}")
    return value


def check_seq(value, where: str, item) -> tuple:
    """A list or tuple, each element checked by ``item(element, where_of_element)``."""
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"{where} must be a list, got {value!r}", where=where, hint=REPLAN)
    return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))


def check_unique(names: tuple, where: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise PlanError(f"{where} lists {name!r} twice", where=where, hint="each name may appear once")
        seen.add(name)


def check_type(value, cls, where: str, noun: str = ""):
    if not isinstance(value, cls):
        noun = noun or cls.__name__
        raise PlanError(f"{where} must be a {noun}, got {value!r}", where=where, hint=REPLAN)
    return value


# --- JSON helpers --------------------------------------------------------------------------------

@contextmanager
def errors_at(path: str):
    """Prefix the ``where`` of errors raised inside with ``path`` (errors from Mesh, World and
    placements, which raise ValueError, become PlanErrors there)."""
    try:
        yield
    except PlanError as error:
        inner = error.where
        where = path if not inner else f"{path}{inner}" if inner.startswith("[") else f"{path}.{inner}"
        raise PlanError(error.what, where=where, hint=error.hint) from None
    except XirangError as error:  # a Mesh's or World's own error: its words, at the plan's field
        raise PlanError(error.what, where=path, hint=error.hint or REPLAN) from None
    except (ValueError, TypeError) as error:
        raise PlanError(str(error), where=path, hint=REPLAN) from None


def parse_at(path: str, parse, value):
    with errors_at(path):
        return parse(value)


def parse_json_list(value, where: str, parse) -> tuple:
    if not isinstance(value, list):
        raise PlanError(f"{where} must be a JSON list, got {value!r}", where=where, hint=REPLAN)
    return tuple(parse_at(f"{where}[{i}]", parse, v) for i, v in enumerate(value))


def check_keys(data, names: tuple, what: str, required: tuple | None = None) -> None:
    """``data`` is a JSON object with no key outside ``names`` and every key of ``required``
    (default: all of ``names``); a misspelt key gets a suggestion."""
    if not isinstance(data, dict):
        raise PlanError(f"{what} must be a JSON object, got {data!r}", hint=REPLAN)
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(f"{what} has an unknown field {key!r}{guess}", where=str(key),
                            hint=f"valid fields: {', '.join(names)}")
    for key in names if required is None else required:
        if key not in data:
            raise PlanError(f"{what} is missing the field {key!r}", where=key, hint=REPLAN)


def compact_dumps(value, indent: str = "", width: int = 100) -> str:
    """json.dumps, indented by two, but a value that fits in ``width`` columns stays on one line."""
    flat = json.dumps(value, allow_nan=False)
    if not isinstance(value, (dict, list)) or not value or len(indent) + len(flat) <= width:
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {compact_dumps(v, inner, width)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + compact_dumps(v, inner, width) for v in value) + f"\n{indent}]"


def first_difference(a, b, path: str) -> str:
    """'; first difference at world.nodes[0].device.memory_bytes: 85899345920 vs 42949672960'."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for key in a:
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return ""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return ""
    if isinstance(a, list) and isinstance(b, list):  # the lengths differ: the count says it, not both lists
        return f"; first difference at {path}: {len(a)} entries vs {len(b)}"
    return "" if a == b else f"; first difference at {path}: {a!r} vs {b!r}"


# --- placements against the graph they were made for ----------------------------------------------

def check_placement_ranks(placements, ranks) -> None:
    """Refuse placements a graph cannot run: a node the graph lacks, or a layout sharding a dim its
    tensor does not have. ``ranks``: node name -> (rank of each input tensor, None for a non-tensor;
    rank of each output). A hand-edited plan keeps its fingerprint, so only this check sees such an
    edit before every rank crashes inside the tp rewrite."""
    for name, strategy in placements.items():
        where = f"plan.placements[{name!r}]"
        if name not in ranks:
            close = difflib.get_close_matches(name, list(ranks), n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(f"the plan places node {name!r}, which this model's graph does not have{guess}",
                            where=where, hint=REPLAN)
        inputs, outputs = ranks[name]
        for kind, layouts, tensor_ranks in (("inputs", strategy.inputs, inputs), ("outputs", strategy.outputs,
                                                                                   outputs)):
            for i, layout in enumerate(layouts):
                rank = tensor_ranks[i] if i < len(tensor_ranks) else None
                for axis in ("dp", "pp", "tp"):
                    dim = getattr(getattr(layout, axis), "dim", None)
                    if dim is None:
                        continue
                    if rank is None or dim >= rank:
                        has = "is not a tensor" if rank is None else f"has {rank} dim(s) (0..{rank - 1})"
                        raise PlanError(f"{kind}[{i}] of node {name!r} is sharded on dim {dim} over {axis}, but "
                                        f"that tensor {has}", where=f"{where}.{kind}[{i}].{axis}",
                                        hint=f"shard a dim below {rank} or replicate it; {REPLAN}"
                                        if rank else REPLAN)
