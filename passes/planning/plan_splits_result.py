"""Turn a solved split problem into a ``TensorSplit``: per-unit costs, a NodeStrategy for every node of
the graph (blocks stamped from their representative), and the tp collectives of each representative.

How to read ``TensorSplit.collectives`` (``CollectiveChoice.node``):

- ``"<consumer>"``: forward, reshards one input of ``<consumer>`` just before it runs (the input whose
  producer's output layout differs from the consumer's input layout in ``placements``), or a
  collective the op issues itself (vocabulary-parallel cross-entropy).
- ``"<producer>.out"``: forward, makes ``<producer>``'s output its boundary layout where it leaves its
  block (Replicate, or a sequence shard of the residual stream: ``TpProblem.boundary``) or is the loss.
- ``"<producer>.grad"`` (``"<producer>[i].grad"`` for element i of a multi-output op): backward,
  turns the summed gradient of ``<producer>``'s output into the layout its backward needs
  (Megatron's f: the all-reduce of the gradient of a column-parallel linear's input).
- ``"<consumer>.grad:<producer>"``: backward, turns the gradient ``<consumer>`` sends to its input
  ``<producer>`` into the layout the gradients of that input are summed in, before the sum.

Only the representative block of each kind and the segments are listed: the other blocks of a kind
run the same collectives at the same nodes of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Node

from xirang.ir.meta_keys import PARAM_COUNT, REQUIRES_GRAD, ROLE, TENSOR
from xirang.ir.placement import PlanShard
from xirang.ir.plan_parts import CollectiveChoice, Layout, NodeStrategy
from xirang.passes.planning.unit_costs import UnitCost

from xirang.passes.planning.plan_splits_costs import Kept, NodeFacts, Pricing, local_fraction
from xirang.passes.planning.plan_splits_graph import SplitGraph, tensor_info
from xirang.passes.planning.plan_splits_problem import R, TpProblem, element


@dataclass
class _Sums:
    forward: float = 0.0
    backward: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0
    params: int = 0
    saved: dict = field(default_factory=dict)  # storage -> bytes on one rank, kept with no recompute
    selective: dict = field(default_factory=dict)  # the same with the attention core recomputed
    recompute: float = 0.0
    saved_tensors: int = 0  # tensors the unit's ops save for the backward (a checkpoint hooks each)
    weight_outputs: float = 0.0  # bytes on one rank of the outputs of matmuls reading a parameter
    saved_past_weights: dict = field(default_factory=dict)  # storage -> bytes saved by ops no weight op depends on
    saved_before_weights: dict = field(default_factory=dict)  # storage -> bytes saved by the others (W keeps them)
    expert_params: int = 0  # elements of expert weights (of ``params``)
    expert_rows: float = 0.0  # bytes of the rows its experts calls dispatch, in the plan's precision
    expert_out: float = 0.0  # bytes the combines send back (the last matmul's output as this rank holds it)
    expert_calls: int = 0
    expert_seconds: float = 0.0  # compute of the experts' matmuls, forward + backward


class Assembly:
    """One solution's numbers, placements and collectives."""

    def __init__(self, graph: SplitGraph, problem: TpProblem, choice: dict, pricing: Pricing,
                 facts: dict[Node, NodeFacts]):
        self.graph, self.problem, self.pricing, self.facts = graph, problem, pricing, facts
        self.chosen = {d.name: d.options[choice[d.name]] for d in problem.decisions}
        self.choice = choice
        self._layouts: dict = {}

    # --- layouts ---------------------------------------------------------------------------------

    def placement_of(self, node: Node, index: int | None = None):
        """The tp placement a node's output (element ``index``) has under the solution."""
        decision = self.problem.of_node.get(self.graph.rep_of.get(node, node))
        return R if decision is None else element(self.chosen[decision.name].output, index) or R

    def local_bytes(self, node: Node, count: int, size: float, whole: bool = False) -> float:
        placement = R if whole else self.placement_of(node)
        info = tensor_info(node)
        return self.pricing.values[count] * size * local_fraction(placement, self.pricing.tp,
                                                                  tuple(info.shape) if info else ())

    def layout(self, placement) -> Layout:
        if placement not in self._layouts:
            self._layouts[placement] = Layout(tp=placement)
        return self._layouts[placement]

    def _read(self, node: Node, value: Node):
        """The layout ``node`` reads ``value`` in without resharding (Replicate across a block's edge)."""
        if node.op != "output" and self.graph.place(node) != self.graph.place(value):
            return R
        index = node.args[1] if node.op == "call_function" and isinstance(TENSOR.get(value, None), tuple) \
            and len(node.args) > 1 and isinstance(node.args[1], int) else None
        return self.placement_of(value, index)

    def node_strategy(self, node: Node) -> NodeStrategy:
        decision = self.problem.of_node.get(node)
        if node.op == "output":
            required = set(self.graph.required_outputs)
            return NodeStrategy("output", tuple(self.layout(R if v in required else self._read(node, v))
                                                for v in node.all_input_nodes), ())
        if decision is None:  # no tensor, or a placeholder several groups share: replicated
            inputs = tuple(self.layout(self._read(node, v)) for v in node.all_input_nodes)
            return NodeStrategy("replicate", inputs, (self.layout(R),))
        strategy = self.chosen[decision.name]
        inputs = tuple(self.layout(p if p is not None else self._read(node, v))
                       for v, p in zip(node.all_input_nodes, strategy.inputs))
        outputs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
        return NodeStrategy(strategy.name, inputs, tuple(self.layout(p) for p in outputs))

    def placements(self) -> dict[str, NodeStrategy]:
        """Every node in graph order; a block's nodes share their representative's NodeStrategy."""
        own = {rep: self.node_strategy(rep) for rep in self.graph.representatives}
        return {name: own[rep] for name, rep in self.graph.named_reps}

    # --- costs -----------------------------------------------------------------------------------

    def sums(self) -> tuple[dict[str, _Sums], list[CollectiveChoice]]:
        """Per-unit totals of the representative units and segments, and their collectives."""
        sums: dict[str, _Sums] = {}
        collectives: list[CollectiveChoice] = []
        pricing, tp = self.pricing, self.pricing.tp
        core = {d.node for d in self.problem.decisions if d.node is not None and self.facts[d.node].core}
        producers = self.graph.by_name
        before_weights = self._before_weights()
        for decision in self.problem.decisions:
            if decision.node is None:
                continue
            facts, strategy = self.facts[decision.node], self.chosen[decision.name]
            unit = sums.setdefault(decision.unit, _Sums())
            seconds = pricing.compute(facts, strategy.compute_fraction)
            share = pricing.forward_share(facts)
            unit.forward += seconds * share
            unit.backward += seconds * (1 - share)
            if facts.expert:
                unit.expert_seconds += seconds
            if facts.expert_rows is not None:  # the rows as this rank holds them (tp may split their hidden dim)
                held = local_fraction(strategy.inputs[0], tp) if strategy.inputs else 1.0
                unit.expert_rows += pricing.values[facts.expert_rows] * facts.byte_scale * held
                unit.expert_calls += 1
            if facts.expert_out is not None:
                output = element(strategy.output, 0) if isinstance(strategy.output, tuple) else strategy.output
                unit.expert_out += pricing.values[facts.expert_out] * facts.byte_scale * local_fraction(output, tp)
            for kind, cost in pricing.op_collectives(strategy):
                unit.comm_forward += cost.seconds
                if cost.algorithm != "none":
                    collectives.append(CollectiveChoice(decision.name, "tp", kind, cost.algorithm,
                                                        round(cost.nbytes)))
            in_core = decision.node in core
            if facts.weight_output is not None:
                output = element(strategy.output, 0) if isinstance(strategy.output, tuple) else strategy.output
                unit.weight_outputs += (pricing.values[facts.weight_output] * facts.byte_scale
                                        * local_fraction(output, tp))
            unit.saved_tensors += len(facts.saved)
            for kept in facts.saved:
                nbytes = self.kept_bytes(decision.node, kept, strategy)
                _keep(unit.saved, kept.storage, nbytes)
                _keep(unit.saved_before_weights if decision.node in before_weights else unit.saved_past_weights,
                      kept.storage, nbytes)
                if not (in_core and producers.get(kept.producer) in core):  # the core makes it: recomputed
                    _keep(unit.selective, kept.storage, nbytes)
            if in_core:
                unit.recompute += seconds * share
                for kept in facts.inputs:  # what the recompute starts from stays
                    if producers.get(kept.producer) not in core:
                        _keep(unit.selective, kept.storage, self.kept_bytes(decision.node, kept, strategy))
            if facts.params:
                held = facts.params // tp if isinstance(strategy.output, PlanShard) else facts.params
                if isinstance(strategy.output, PlanShard) and not strategy.output.pieces:
                    held = round(facts.params * strategy.compute_fraction)  # a padded shard holds its padding
                unit.params += held
                if facts.expert_weight:
                    unit.expert_params += held
                if facts.needs_grad:  # a trainable one: its AccumulateGrad node, every micro-batch
                    unit.backward += pricing.backward_op_s
        for (rows, cols), link in self.problem.links.items():
            for term in link.terms[self.choice[rows]][self.choice[cols]]:
                cost = pricing.term(term)
                unit = sums.setdefault(term.unit, _Sums())
                if term.direction == "forward":
                    unit.comm_forward += cost.seconds
                else:
                    unit.comm_backward += cost.seconds
                if cost.algorithm != "none":
                    collectives.append(CollectiveChoice(term.label, "tp", term.kind, cost.algorithm,
                                                        round(cost.nbytes)))
        return sums, collectives

    def _before_weights(self) -> set:
        """The nodes each weight-reading node of their unit depends on (and those nodes themselves): a split
        backward's B leaves their saved tensors to W, which runs backward from the weight ops through them;
        what a unit's other ops save (a loss after the head's matmul) is freed when B detaches the stage's
        outputs (torch.distributed.pipelining's stage_backward_input)."""
        unit_of = {d.node: d.unit for d in self.problem.decisions if d.node is not None}
        found: set = set()
        stack = [node for node in unit_of if self.facts[node].reads_weight]
        while stack:
            node = stack.pop()
            if node in found:
                continue
            found.add(node)
            stack += [value for value in node.all_input_nodes if unit_of.get(value, None) == unit_of[node]]
        return found

    def kept_bytes(self, node: Node, kept: Kept, strategy) -> float:
        """Bytes of a storage ``node`` keeps, on one tp rank: at the layout ``node`` reads it in (an
        input), or at ``node``'s output layout (what it makes itself)."""
        if kept.input is None:
            placement = element(strategy.output, 0) if isinstance(strategy.output, tuple) else strategy.output
        else:
            placement = strategy.inputs[kept.input] if kept.input < len(strategy.inputs) else None
            if placement is None:
                placement = self._read(node, node.all_input_nodes[kept.input])
        return self.pricing.kept_bytes(kept, placement)

    def crossing_tensors(self, crossing: list) -> tuple:
        """``TensorSplit.crossing``: each tensor crossing a unit boundary, (bytes on one rank, producing unit,
        last reading unit, the units reading it, whether it takes a gradient)."""
        graph, found = self.graph, []
        for node, count, size, whole, first, last in crossing:
            readers = frozenset(graph.unit_order[unit] for unit in (graph.unit_of.get(user) for user in node.users)
                                if unit is not None and unit in graph.unit_order)
            found.append((self.local_bytes(node, count, size, whole), first, last, readers,
                          bool(REQUIRES_GRAD.get(node, False))))
        return tuple(found)

    def units(self, sums: dict[str, _Sums], crossing: list, entering: dict, flops: dict,
              buffer_sizes=()) -> list[UnitCost]:
        """UnitCost per unit of the condensed graph, in execution order (``buffer_sizes``: (unit,
        ExprTable index of the bytes) of each model buffer)."""
        graph, values = self.graph, self.pricing.values
        cut = [0.0] * len(graph.units)
        for node, count, size, whole, first, last in crossing:
            local = self.local_bytes(node, count, size, whole)
            for i in range(first, last):
                cut[i] += local
        shared: dict[str, int] = {}
        buffers: dict[str, float] = {}
        for node in graph.nodes:
            if node.op == "placeholder" and graph.owner.get(node) is None and ROLE.get(node, None) == "parameter":
                unit = graph.unit_of.get(node)
                shared[unit] = shared.get(unit, 0) + PARAM_COUNT.get(node, 0)
        for unit, index in buffer_sizes:  # held whole, in their own dtype
            buffers[unit] = buffers.get(unit, 0.0) + values[index]
        found = []
        for i, unit in enumerate(graph.units):
            own = sums.get(graph.rep_unit.get(unit, unit), _Sums())
            forward_flops, total_flops = flops[unit]
            kind = graph.kind_of_unit.get(unit, unit)
            found.append(UnitCost(
                name=unit, kind=kind, forward_seconds=own.forward, backward_seconds=own.backward,
                tp_comm_forward_seconds=own.comm_forward, tp_comm_backward_seconds=own.comm_backward,
                params_local=own.params + shared.get(unit, 0), saved_bytes=sum(own.saved.values()),
                selective_saved_bytes=sum(own.selective.values()),
                selective_recompute_seconds=own.recompute,
                full_recompute_seconds=own.forward + own.saved_tensors * self.pricing.recompute_saved_s,
                input_bytes=sum(self.local_bytes(*tensor) for tensor in entering.get(unit, ())),
                cut_bytes_after=cut[i] if i < len(graph.units) - 1 else 0.0,
                model_flops=values[total_flops], model_forward_flops=values[forward_flops],
                buffer_bytes=buffers.get(unit, 0.0), weight_output_bytes=own.weight_outputs,
                saved_past_weights_bytes=sum(nbytes for storage, nbytes in own.saved_past_weights.items()
                                             if storage not in own.saved_before_weights),
                expert_params=own.expert_params, expert_rows_bytes=own.expert_rows, expert_calls=own.expert_calls,
                expert_combine_bytes=own.expert_out,
                expert_seconds=own.expert_seconds))
        return found


def _keep(kept: dict, storage: str, nbytes: float) -> None:
    """Count a storage once per unit (at the larger share if two ops read it in different layouts)."""
    kept[storage] = max(kept.get(storage, 0.0), nbytes)
