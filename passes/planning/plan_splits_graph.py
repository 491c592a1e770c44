"""The graph side of the split ILP (``plan_splits``): which nodes each split problem holds, how the
blocks of one kind map onto their representative, what leaves and enters each unit, and every size
as a number at a (micro_batch, seq).

Problems ("groups"): one per distinct block kind, holding its first block (the representative) with
weight = number of blocks of that kind, and one holding every op outside blocks (the segments:
embedding, final norm, head, loss) with weight 1. Segments are solved together so that a tied weight
(GPT-2's ``wte``, read by the embedding and by the LM head) gets one placement. A group holds the
tensor-producing ops of its nodes and the placeholders only it reads; a placeholder read by several
groups is "shared" and kept Replicate. Tensors crossing a group's edge are Replicate on tp (Megatron
without sequence parallelism; with it, the residual stream is split along the sequence there,
``TpProblem.boundary``), so the groups' solutions compose.

Blocks of one kind have the same structure in the same order (``find_blocks`` hashes exactly that):
node i of the representative is node i of every other block of its kind, which ``copies`` records.
Nothing here depends on tp.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
from torch.fx import Node

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import (BLOCK, BLOCK_GRAPH, BLOCK_KINDS, FLOPS, ROLE, SYMBOLS, TENSOR, UNIT,
                                 symbol)
from xirang.ir.errors import InvalidValue

KNOWN_SYMBOLS = ("batch", "seq")


class ExprTable:
    """Sizes (sympy in batch/seq) registered once, evaluated together: one lambdified function per
    batch of registrations, values cached per point, so pricing 80 blocks costs microseconds."""

    def __init__(self, names: tuple[str, ...]):
        self.symbols = tuple(symbol(name) for name in names)
        self._index: dict = {}
        self._exprs: list = []
        self._compiled: list[tuple[list, object]] = []  # (expressions, their lambdified function)
        self._cache: dict = {}

    def index(self, expr) -> int:
        expr = sympy.sympify(expr)
        if expr not in self._index:
            self._index[expr] = len(self._exprs)
            self._exprs.append(expr)
        return self._index[expr]

    def values(self, point: tuple[int, ...]) -> list[float]:
        done = sum(len(exprs) for exprs, _ in self._compiled)
        if done < len(self._exprs):
            fresh = self._exprs[done:]
            self._compiled.append((fresh, sympy.lambdify(self.symbols, fresh, modules="math")))
        key = (point, len(self._exprs))
        if key not in self._cache:
            self._cache[key] = [float(v) for _, function in self._compiled for v in function(*point)]
        return self._cache[key]


@dataclass
class Group:
    """Nodes solved together: one representative block of a kind, or every op outside blocks."""

    name: str  # "kind:<hash>" or "segments"
    kind: str | None  # the block kind, None for segments
    weight: int  # blocks of this kind: costs and memory count that many times
    nodes: list[Node]  # owned placeholders and tensor-producing ops, graph order
    unit: str | None  # the representative's unit; None for segments (each node's own UNIT)


def tensor_info(node: Node, element: int | None = None) -> TensorInfo | None:
    found = TENSOR.get(node, None) if isinstance(node, Node) else None
    if isinstance(found, tuple):
        found = found[element] if element is not None and element < len(found) else None
    return found if isinstance(found, TensorInfo) else None


def produces_tensor(node: Node) -> bool:
    found = TENSOR.get(node, None)
    return isinstance(found, TensorInfo) or (isinstance(found, tuple) and any(
        isinstance(t, TensorInfo) for t in found))


class SplitGraph:
    """Groups, block copies, the loss, and the unit structure of an analysed graph."""

    def __init__(self, gm):
        if not BLOCK_GRAPH.has(gm) or not BLOCK_KINDS.has(gm):
            raise InvalidValue("plan_splits needs an analysed graph (BLOCK_GRAPH and BLOCK_KINDS missing): "
                             "pass xirang.analyze(model, ...).graph_module")
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.by_name = {node.name: node for node in self.nodes}
        names = tuple(SYMBOLS.get(gm, {}))
        unknown = [name for name in names if name not in KNOWN_SYMBOLS]
        if unknown:
            raise InvalidValue(f"plan_splits prices sizes in {', '.join(KNOWN_SYMBOLS)} only; the graph has "
                             f"symbol(s) {', '.join(unknown)}. Trace with symbolic_dims naming only batch/seq.")
        self.symbol_names = names
        block_graph = BLOCK_GRAPH.get(gm)
        self.units = sorted(block_graph.nodes, key=lambda u: block_graph.nodes[u]["order"])
        self.unit_order = {unit: i for i, unit in enumerate(self.units)}
        self.output = next(node for node in self.nodes if node.op == "output")
        self.unit_of = {node: UNIT.get(node, None) for node in self.nodes}
        self._find_loss()
        self._group_nodes(BLOCK_KINDS.get(gm))
        self._crossings(block_graph)

    # --- the loss and the other outputs -----------------------------------------------------------

    def _find_loss(self) -> None:
        """The loss is the model's first scalar floating output; other outputs (HF logits) are exempt
        from any layout: the compiled step returns only the loss. No scalar: every output must be R."""
        outputs = [v for v in _flatten(self.output.args) if isinstance(v, Node) and tensor_info(v) is not None]
        scalars = [v for v in outputs if tensor_info(v).shape == () and tensor_info(v).is_floating]
        self.loss = scalars[0] if scalars else None
        self.required_outputs = [self.loss] if self.loss is not None else outputs
        self.exempt_outputs = [v for v in outputs if v not in self.required_outputs]

    # --- groups and block copies ----------------------------------------------------------------

    def _group_nodes(self, kinds: dict) -> None:
        members: dict[str, list[Node]] = {}
        for node in self.nodes:
            block = BLOCK.get(node, None)
            if block is not None and node.op in ("placeholder", "get_attr", "call_function"):
                members.setdefault(block.path, []).append(node)
        self.owner: dict[Node, str | None] = {}  # placeholder -> block path, "segments", or None (shared)
        for node in self.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.owner[node] = self._owner_of(node)
        self.groups: list[Group] = []
        self.copies: dict[Node, list[Node]] = {}  # representative node -> same node in later blocks
        self.rep_of: dict[Node, Node] = {}  # any block node -> its representative's node
        self.rep_unit: dict[str, str] = {}  # any unit -> the unit whose numbers it shares
        self.kind_of_unit: dict[str, str] = {}  # block unit -> its kind
        for kind, paths in kinds.items():
            self.rep_unit.update({f"block:{path}": f"block:{paths[0]}" for path in paths})
            self.kind_of_unit.update({f"block:{path}": kind for path in paths})
            rep = members[paths[0]]
            for path in paths[1:]:
                other = members[path]
                if len(other) != len(rep) or any(a.op != b.op or (a.op == "call_function" and a.target != b.target)
                                                 for a, b in zip(rep, other)):
                    raise InvalidValue(f"blocks {paths[0]} and {path} share kind {kind} but differ node by node; "
                                     f"re-run the analysis (find_blocks) on this graph")
            for i, node in enumerate(rep):
                self.copies[node] = [members[path][i] for path in paths[1:]]
                for copy in [node] + self.copies[node]:
                    self.rep_of[copy] = node
            own = [n for n in rep if self._decides(n, paths[0])]
            self.groups.append(Group(f"kind:{kind}", kind, len(paths), own, f"block:{paths[0]}"))
        outside = [n for n in self.nodes if BLOCK.get(n, None) is None and self._decides(n, "segments")]
        if outside:
            self.groups.append(Group("segments", None, 1, outside, None))
        # every node's name with the node whose strategy it shares, in graph order: each split's
        # placements (one per node, ~6000 for Llama-2-70B) are read off its representatives
        self.named_reps = [(node.name, self.rep_of.get(node, node)) for node in self.nodes]
        self.representatives = list(dict.fromkeys(rep for _, rep in self.named_reps))

    def _owner_of(self, placeholder: Node) -> str | None:
        """The one place that reads a placeholder, if it is also the placeholder's own place (a block's
        parameter read only by that block); None for a shared or unread one, which stays whole."""
        places = {self.place(user) if user.op == "call_function" else None for user in placeholder.users}
        return places.pop() if len(places) == 1 and self.place(placeholder) in places else None

    def _decides(self, node: Node, place: str) -> bool:
        """Nodes that are ILP decisions of the group at ``place``: tensor ops and owned placeholders."""
        if node.op in ("placeholder", "get_attr"):
            return self.owner.get(node) == place and produces_tensor(node)
        return node.op == "call_function" and produces_tensor(node)

    @staticmethod
    def place(node: Node) -> str:
        """The block path a node belongs to, or "segments" outside blocks."""
        block = BLOCK.get(node, None)
        return block.path if block is not None else "segments"

    def leaves_place(self, producer: Node) -> bool:
        """Is the tensor read by data in another place (so it is Replicate there, by contract)?"""
        return any(self.place(user) != self.place(producer) for user in producer.users
                   if user.op == "call_function" and produces_tensor(user))

    def unit_for(self, node: Node) -> str | None:
        """The unit a node's work is attributed to: its representative's unit inside blocks."""
        return self.unit_of.get(self.rep_of.get(node, node))

    # --- what crosses unit boundaries -------------------------------------------------------------

    def _crossings(self, block_graph) -> None:
        """Tensors crossing a pipeline cut after each unit (from the condensed graph's edges), and
        the tensors entering each unit from outside it, each counted in the first unit that reads
        it (a mask or rotary table read by every block is held once, like a tied weight)."""
        span: dict[str, list[int]] = {}
        for source, target, data in block_graph.edges(data=True):
            for name in data.get("tensors", ()):
                low, high = self.unit_order[source], self.unit_order[target]
                first, last = span.setdefault(name, [low, high])
                span[name] = [min(first, low), max(last, high)]
        self.crossing = [(self.by_name[name], first, last) for name, (first, last) in span.items()
                         if tensor_info(self.by_name[name]) is not None]  # in the order the edges list them
        entering: dict[Node, str] = {}
        for node in self.nodes:
            unit = self.unit_of.get(node)
            if node.op != "call_function" or unit is None:
                continue
            for value in node.all_input_nodes:
                role = ROLE.get(value, "activation")
                if role in ("parameter", "buffer", "constant") or tensor_info(value) is None:
                    continue
                inside = value.op != "placeholder" and self.unit_of.get(value) == unit
                if not inside and (value not in entering
                                   or self.unit_order[unit] < self.unit_order[entering[value]]):
                    entering[value] = unit
        self.entering: dict[str, list[Node]] = {}
        for value, unit in entering.items():
            self.entering.setdefault(unit, []).append(value)

    def unit_flops(self, table: ExprTable) -> dict[str, tuple[int, int]]:
        """(forward, total) FLOP expression indices per unit; a block shares its representative's."""
        forward: dict[str, list] = {}
        total: dict[str, list] = {}
        for node in self.nodes:
            unit = self.unit_of.get(node)
            if unit is None or self.rep_unit.get(unit, unit) != unit or not FLOPS.has(node):
                continue
            flops = FLOPS.get(node)
            forward.setdefault(unit, []).append(flops.forward)
            total.setdefault(unit, []).append(flops.total)
        own = {unit: (table.index(sympy.Add(*forward.get(unit, []))), table.index(sympy.Add(*total.get(unit, []))))
               for unit in self.units if self.rep_unit.get(unit, unit) == unit}
        return {unit: own[self.rep_unit.get(unit, unit)] for unit in self.units}


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    else:
        yield value
