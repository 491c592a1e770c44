"""The split problem of one tp degree, as structure: decisions (nodes with their candidate strategies),
and links between them whose every pair of choices lists the tp collectives it needs.

Resharding a tensor from layout ``src`` to ``dst`` on the tp axis (``transition``):

    R -> S, R -> P(sum)      free: take the local slice; one rank keeps the value, the others zero
    S -> R                   all_gather
    S -> P(sum)              all_gather, then as R -> P (zero-padding the shard would be free, but
                             keeping to the conversions above keeps the runtime's list short)
    P -> R                   all_reduce
    P -> S                   reduce_scatter
    S(i) -> S(j)             all_to_all (also between a chunked and a plain shard of one dim); all_gather
                             where either is split in whole units (PlanShard.unit > 1): it goes through R
    P(op) -> P(other op)     not offered

A link from producer p to consumer c prices the forward reshard of p's output into c's input, and the
backward: the gradient c sends back has the layout ``sharding_rules.gradient_placements`` gives, and
p's backward needs the dual of its output (S as S, R as R, P as R). Gradients from several consumers
are summed first; where that matters, an accumulator decision picks the layout of the sum
(Megatron's f: q, k and v projections each send a Partial gradient to their shared input, summed,
then all-reduced once). Forward reshards are priced per edge, as Alpa does (Zheng et al. 2022).
Nothing here is priced: terms name a collective kind and a tensor size; ``plan_splits`` prices them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch.fx import Node

from xirang.ir.meta_keys import REQUIRES_GRAD, TENSOR
from xirang.ir.placement import PlanPartial, Placement, PlanReplicate, PlanShard
from xirang.passes.planning.sharding_rules import Strategy, gradient_placements, strategies_for
from xirang.passes.planning.sharding_rules_sequence import stream_dim

from xirang.passes.planning.plan_splits_graph import ExprTable, Group, SplitGraph, produces_tensor, tensor_info

R = PlanReplicate()


def external(placement: Placement) -> Strategy:
    """A tensor made outside the group, in its boundary layout (``TpProblem.boundary``)."""
    return Strategy("external", (), placement, 1.0)


def boundary(placement: Placement) -> Strategy:
    """A tensor read outside the group (or the loss), made its boundary layout before it leaves."""
    return Strategy("boundary", (placement,), placement, 1.0)


def transition(src: Placement, dst: Placement | None) -> tuple[str, ...] | None:
    """Collective kinds that turn ``src`` into ``dst`` on the tp axis: () when free, None when not
    offered (see the module docstring); ``dst`` None asks nothing."""
    if dst is None or src is None or src == dst:  # src None: no gradient comes back that way
        return ()
    if isinstance(dst, PlanReplicate):
        return ("all_gather",) if isinstance(src, PlanShard) else ("all_reduce",)
    if isinstance(dst, PlanShard):
        if isinstance(src, PlanReplicate):
            return ()
        if isinstance(src, PlanShard):  # between shards in whole units (heads), through R as the lowering runs it
            return ("all_to_all",) if src.unit == dst.unit == 1 else ("all_gather",)
        return ("reduce_scatter",)
    if dst.op == "sum" and not isinstance(src, PlanPartial):
        return () if isinstance(src, PlanReplicate) else ("all_gather",)
    return None


def dual(placement: Placement) -> Placement:
    """The layout of the gradient a producer's backward needs, given its output's layout."""
    return R if isinstance(placement, PlanPartial) else placement


def element(placement, index: int | None):
    """The placement of element ``index`` of a multi-output producer (a single one when all agree)."""
    if not isinstance(placement, tuple):
        return placement
    if index is not None:
        return placement[index]
    return placement[0] if len(set(placement)) == 1 else None


@dataclass(frozen=True)
class Term:
    """One collective a pair of choices needs: on the tensor of size ``table[tensor] * scale`` bytes."""

    direction: str  # "forward" or "backward"
    kind: str
    tensor: int  # ExprTable index of the tensor's element count
    scale: float  # bytes per element, divided by tp for all_to_all (nbytes is one rank's send buffer)
    unit: str | None  # where its time is attributed
    label: str  # CollectiveChoice.node (see plan_splits)


@dataclass
class Decision:
    """One choice of the ILP: a graph node, or a virtual one (external input, boundary, gradient sum)."""

    name: str
    group: Group
    options: tuple[Strategy, ...]
    node: Node | None = None
    unit: str | None = None


@dataclass
class Link:
    """``terms[i][j]``: collectives when ``rows`` takes option i and ``cols`` option j (None: not offered)."""

    rows: Decision
    cols: Decision
    terms: list = field(default_factory=list)


class TpProblem:
    """Decisions and links of every group at one tp degree (built once per tp, priced per call)."""

    def __init__(self, graph: SplitGraph, table: ExprTable, tp: int, float_bytes: int, *,
                 sequence_parallel: bool = False):
        self.graph, self.table, self.tp, self.float_bytes = graph, table, tp, float_bytes
        self.sequence_parallel = sequence_parallel
        self.decisions: list[Decision] = []
        self.links: dict[tuple[str, str], Link] = {}
        self.of_node: dict[Node, Decision] = {}
        for group in graph.groups:
            self._build(group)

    # --- sizes ---------------------------------------------------------------------------------

    def tensor(self, node: Node, index: int | None) -> tuple[int, float]:
        """(ExprTable index of its element count, bytes per element in the plan's precision)."""
        info = tensor_info(node, index)
        size = self.float_bytes if info.is_floating else info.itemsize
        return self.table.index(info.numel), float(size)

    def boundary(self, node: Node, index: int | None = None) -> Placement:
        """The layout ``node``'s tensor has where it crosses a group's edge, the same on both sides so
        the groups' solutions compose: Replicate (Megatron-LM, Shoeybi et al. 2019), or, with sequence
        parallelism, a residual-stream tensor (floating, one sequence dim, read by exactly one other
        place: the next block, or the final norm) split along the sequence, as Korthikanti et al. 2022
        keep each layer's input and output. The lowering hands a consumer its producer's layout
        directly, so a Replicate boundary between two sequence shards would price an all-gather each
        way that never runs. Blocks of a kind take their representative's answer."""
        if not self.sequence_parallel or self.tp == 1 or index is not None:
            return R
        node = self.graph.rep_of.get(node, node)
        info = tensor_info(node)
        if node.op != "call_function" or info is None or not info.is_floating or node in self.graph.required_outputs:
            return R
        here = self.graph.place(node)
        readers = {self.graph.place(u) for u in node.users if u.op == "call_function" and produces_tensor(u)}
        dim = stream_dim(node)
        return PlanShard(dim) if dim is not None and len(readers - {here}) == 1 else R

    # --- building ------------------------------------------------------------------------------

    def _add(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        return decision

    def _link(self, rows: Decision, cols: Decision) -> Link:
        key = (rows.name, cols.name)
        if key not in self.links:
            self.links[key] = Link(rows, cols, [[() for _ in cols.options] for _ in rows.options])
        return self.links[key]

    def _terms(self, link: Link, pick, direction: str, tensor: tuple[int, float], unit, label) -> None:
        """Add to each entry the collectives ``pick(i, j) -> (src, dst)`` needs."""
        count, size = tensor
        made: dict[tuple[str, ...], tuple[Term, ...]] = {}  # most cells need the same few transitions
        for i in range(len(link.rows.options)):
            for j in range(len(link.cols.options)):
                if link.terms[i][j] is None:
                    continue
                kinds = transition(*pick(i, j))
                if kinds is None:
                    link.terms[i][j] = None
                    continue
                if kinds not in made:
                    made[kinds] = tuple(Term(direction, kind, count, size / self.tp if kind == "all_to_all" else size,
                                             unit, label) for kind in kinds)
                link.terms[i][j] += made[kinds]

    def _build(self, group: Group) -> None:
        """Decisions of one group's nodes, links for every tensor they read, boundaries, gradients."""
        place = group.unit.removeprefix("block:") if group.kind is not None else "segments"
        for node in group.nodes:
            options = tuple(strategies_for(node, self.tp, self.sequence_parallel))
            for collective in (c for option in options for c in option.collectives):
                self.table.index(collective.nbytes)  # registered before any pricing reads the table
            unit = group.unit or self.graph.unit_for(node)
            self.of_node[node] = self._add(Decision(node.name, group, options, node, unit))
        self._external: dict[tuple, Decision] = {}  # (node outside the group, element) -> "in:" decision
        self._gradients: dict[tuple, list] = {}  # (producer decision name, element) -> [(consumer, input)]
        self._sources: dict[tuple, tuple] = {}  # the same key -> (decision, node, element, tensor size)
        for node in group.nodes:
            if node.op != "call_function":
                continue
            decision = self.of_node[node]
            for k, value in enumerate(node.all_input_nodes):
                index = node.args[1] if node.target is operator.getitem and isinstance(TENSOR.get(value, None),
                                                                                        tuple) else None
                if tensor_info(value, index) is None or all(s.inputs[k] is None for s in decision.options):
                    continue  # a SymInt, or a read of metadata only
                self._consume(group, value, index, decision, k,
                              REQUIRES_GRAD.get(value, False) and REQUIRES_GRAD.get(node, False))
        for node in group.nodes:
            if tensor_info(node) is not None and any(self._reads_outside(u, node, place) for u in node.users):
                leaving = self._add(Decision(f"out:{node.name}", group, (boundary(self.boundary(node)),), None, None))
                self._consume(group, node, None, leaving, 0, REQUIRES_GRAD.get(node, False))
        for key, consumers in self._gradients.items():
            self._backward(group, consumers, *self._sources[key])

    def _consume(self, group: Group, producer: Node, index, consumer: Decision, k: int, needs_grad: bool) -> None:
        """``consumer`` reads ``producer`` (element ``index``) as its input k: price the forward reshard,
        and note the gradient that flows back."""
        decision = self.of_node.get(producer)
        if decision is None or decision.group is not group:  # made elsewhere: in its boundary layout
            key = (producer, index)
            if key not in self._external:
                name = f"in:{group.name}:{producer.name}" + ("" if index is None else f"[{index}]")
                self._external[key] = self._add(Decision(name, group, (external(self.boundary(producer, index)),)))
            decision = self._external[key]
        source = decision
        tensor = self.tensor(producer, index)
        label = consumer.node.name if consumer.node is not None else f"{producer.name}.out"
        self._terms(self._link(source, consumer),
                    lambda i, j: (element(source.options[i].output, index), consumer.options[j].inputs[k]),
                    "forward", tensor, consumer.unit or source.unit, label)
        if needs_grad and tensor_info(producer, index).is_floating:
            key = (source.name, index)
            self._gradients.setdefault(key, []).append((consumer, k))
            self._sources[key] = (source, producer, index, tensor)

    def _reads_outside(self, user: Node, node: Node, place: str) -> bool:
        """Does ``user`` read ``node``'s data from outside the group (so it must be Replicate)?"""
        if user.op == "output":
            return node in self.graph.required_outputs
        return self.graph.place(user) != place and user.op == "call_function" and produces_tensor(user)

    def _backward(self, group: Group, consumers: list, source: Decision, producer: Node, index, tensor) -> None:
        """Price the gradient of one tensor back into its producer: directly, or through a sum."""
        label = f"{producer.name}.grad" if index is None else f"{producer.name}[{index}].grad"
        unit = source.unit or consumers[0][0].unit
        outs = [dual(element(o.output, index)) for o in source.options]
        grads = [[gradient_placements(o)[k] for o in consumer.options] for consumer, k in consumers]
        if all(transition(g, out) == () for row in grads for g in row for out in outs):
            return  # every gradient already arrives as the producer needs it
        if len(consumers) == 1:
            (consumer, _), = consumers
            self._terms(self._link(source, consumer), lambda i, j: (grads[0][j], outs[i]), "backward",
                        tensor, unit, label)
            return
        shards = {p for p in [g for row in grads for g in row] + outs if isinstance(p, PlanShard)}
        # Partial first: on a tie, sum the gradients as they come and convert the sum once
        layouts = [PlanPartial("sum"), R] + sorted(shards, key=lambda p: (p.dim, p.chunks))
        total = self._add(Decision(f"sum:{group.name}:{label}", group,
                                   tuple(Strategy(str(p), (), p, 1.0) for p in layouts), None, unit))
        for (consumer, _), row in zip(consumers, grads):
            self._terms(self._link(consumer, total), lambda j, a, row=row: (row[j], layouts[a]), "backward",
                        tensor, consumer.unit or unit, f"{consumer.name}.grad:{producer.name}")
        self._terms(self._link(total, source), lambda a, i: (layouts[a], outs[i]), "backward", tensor, unit, label)
