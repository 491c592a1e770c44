"""Where an op of the dry run comes from: the schedule action, the stage-module node, the runtime line.

The recorder (recorder.py) asks this for every allocation (which part of memory it is, and its site) and
every collective (its action, node, model source line and runtime line). Each answer is a walk up the
Python stack, and a training step makes tens of thousands of allocations, so every fact a walk reads off a
frame is cached by what determines it:
- a code object's role (an executor method, a backward action, a runtime file that allocates a known part,
  a stage module's generated ``forward``, another runtime file, none) depends on the code object alone;
- the fx node a generated ``forward`` is executing depends on (code object, line) alone: torch compiles
  each GraphModule's source under a key of its own (``<eval_with_key>.N``, torch/fx/graph_module.py), so a
  code object belongs to one module's one compilation, whose ``_lineno_map`` maps the line to the node.
The frames themselves are still walked per call (the stack differs per call); the cached facts make each
step of the walk one dictionary lookup instead of string searches and a copy of a frame's locals. The
caches are keyed by ``id(code)``, not the code object: hashing a code object hashes its bytecode and
constants on every lookup (CPython caches no hash for it); each entry holds its code object, so the id
cannot be reused while the entry lives.
"""
from __future__ import annotations

import operator
import sys

import torch

from xirang.ir.meta_keys import INSERTED, MODULE_TYPE, SOURCE

# (a path fragment of the file making a storage, the part of memory it is), innermost frame first
ALLOCATION_SITES = (("codegen/runtime/data_parallel/param_shards.py", "parameters"),
                    ("codegen/runtime/data_parallel/dist_optimizer.py", "parameters"),
                    ("codegen/runtime/data_parallel/grad_sync.py", "gradients"),
                    ("codegen/runtime/executor/p2p.py", "communication"),
                    ("/torch/optim/", "optimizer"))

# a code object's role (Sites._role)
OTHER, EXECUTOR, BACKWARD, SITE, GRAPH, RUNTIME = range(6)


class Sites:
    """The stack's answers for one rank's step; ``executor_codes``: the executor's methods whose local
    ``action`` is the schedule action running (their names containing "backward" are backward actions)."""

    def __init__(self, executor_codes=()):
        self.executor_codes = tuple(executor_codes)
        self._executor_ids = frozenset(id(code) for code in self.executor_codes)
        self._roles: dict = {}  # id(code) -> (role, allocation site, runtime path, code): see _classify
        self._nodes: dict = {}  # (id(code), line) -> (fx node or None, code)

    def _role(self, code) -> tuple:
        found = self._roles.get(id(code))
        if found is None:
            found = self._roles[id(code)] = (*self._classify(code), code)
        return found

    def _classify(self, code) -> tuple:
        # (role, (part, file) of an allocation site, path of a runtime file under codegen/); the role's
        # precedence is the walk's: backward action, executor, allocation site, stage module, runtime file
        name = code.co_filename
        path = _runtime_path(name)
        if id(code) in self._executor_ids:
            return (BACKWARD if "backward" in code.co_name else EXECUTOR), None, path
        for site, part in ALLOCATION_SITES:
            if site in name:  # named by its file (a folder's site, torch/optim/, by the file in it: adam.py)
                return SITE, (part, site.rsplit("/", 1)[-1] or name.rsplit("/", 1)[-1]), path
        if name.startswith("<eval_with_key>"):
            return GRAPH, None, path
        return (RUNTIME if path else OTHER), None, path

    def node_at(self, frame):
        """The fx node whose generated line ``frame`` (a GraphModule's forward) is executing, or None."""
        key = (id(frame.f_code), frame.f_lineno)
        found = self._nodes.get(key)
        if found is None:
            found = self._nodes[key] = (_node_at(frame), frame.f_code)
        return found[0]

    @staticmethod
    def frames(depth: int = 2):
        frame = sys._getframe(depth)
        while frame is not None:
            yield frame
            frame = frame.f_back

    def action(self) -> str:
        """The schedule action running now ("" outside the schedule)."""
        for frame in self.frames(2):
            if id(frame.f_code) in self._executor_ids:
                return str(frame.f_locals.get("action", ""))
        return ""

    def context(self) -> dict:
        """A call's schedule action, the stage node issuing it and its model source line, the runtime line."""
        action = node = source = where = ""
        for frame in self.frames(2):
            role, _, path, _ = self._role(frame.f_code)
            if not action and role in (EXECUTOR, BACKWARD):
                action = str(frame.f_locals.get("action", ""))
            elif not node and role == GRAPH:
                found = self.node_at(frame)
                if found is not None:
                    node = found.name
                    location = SOURCE.get(found, None)
                    source = str(location) if location is not None else ""
            elif not where and path:
                where = f"{path}:{frame.f_lineno}"
        return {"action": action, "node": node, "source": source, "where": f"codegen/{where}" if where else ""}

    def part(self) -> tuple:
        """Which part of a rank's memory a storage made now is, by where it is made (ALLOCATION_SITES; inside a
        backward action the rest is the backward's working set; in a stage module a cast of a parameter is a
        weight copy; else an activation), and the site: the innermost stage node making it (its op), else the
        runtime's line."""
        backward = cast = False
        node = runtime = None
        roles, frame = self._roles, sys._getframe(1)  # the walk inlined: it runs for every allocation of a step
        while frame is not None:
            code = frame.f_code
            found = roles.get(id(code))
            role, site, path, _ = found if found is not None else self._role(code)
            if role == BACKWARD:
                backward = True
                break
            if role == SITE:
                return site[0], f"{site[1]}:{frame.f_lineno}"
            if role == GRAPH:
                if node is None:
                    node = self.node_at(frame)
                    cast = node is not None and _casts_a_parameter(node)
            elif runtime is None and path:
                runtime = f"{path}:{frame.f_lineno}"
            frame = frame.f_back
        where = _site_of_node(node) if node is not None else runtime or ""
        if backward:
            return "working_set", where or "backward"
        return ("weight_casts" if cast else "activations"), where


def _runtime_path(filename: str) -> str:
    """The path under codegen/ of a runtime file (not the check's own), else ""."""
    if "/codegen/" in filename and "/codegen/check/" not in filename:
        return filename.rsplit("/codegen/", 1)[-1]
    return ""


def _casts_a_parameter(node) -> bool:
    """Whether ``node`` makes a half-precision copy of a parameter (the precision pass's cast of a weight)."""
    inputs = node.all_input_nodes
    return str(INSERTED.get(node, "")).startswith("precision") and len(inputs) == 1 \
        and inputs[0].op == "placeholder" and inputs[0].name.startswith("p_")  # torch.export names parameters p_


def _site_of_node(node) -> str:
    """A stage node as a site that adds up over layers and micro-batches: its op (a tuple's item, its maker's)
    and the class of the module it is in, e.g. "mm in LlamaMLP"."""
    op = node
    while op.target is operator.getitem and op.args and isinstance(op.args[0], torch.fx.Node):
        op = op.args[0]
    name = getattr(op.target, "__name__", str(op.target)).removesuffix(".default")
    module = MODULE_TYPE.get(op, "") or MODULE_TYPE.get(node, "")
    return f"{name} in {module}" if module else name


def _node_at(frame):
    """The fx node whose generated line ``frame`` (a GraphModule's forward) is executing, or None."""
    module = frame.f_locals.get("self")
    lines = getattr(module, "_lineno_map", None)
    start = getattr(module, "_prologue_start", None)
    if not lines or start is None:
        return None
    index = lines.get(frame.f_lineno - start)  # as torch._utils reads it
    if index is None:
        return None
    nodes = list(module.graph.nodes)
    return nodes[index] if 0 <= index < len(nodes) else None
