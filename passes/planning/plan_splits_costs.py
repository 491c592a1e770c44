"""Seconds and bytes of the split problem at one (micro_batch, seq, tp group): what each node's choice
costs, what each link's collectives cost, and the per-node facts both read.

- Compute: the roofline of the node's local share (Williams et al. 2009, ``cost_model.compute_time``):
  forward+backward FLOPs and the bytes it moves, both times the strategy's ``compute_fraction``. The
  analysis counts forward traffic only; it is taken as the step's traffic and split between forward
  and backward like the FLOPs, so forward = cost · F_fwd / F_total (half each for a data-moving op
  with no FLOPs that needs a gradient).
- Bytes scale from the traced itemsize (fp32 on meta) to the plan's precision for floating tensors.
- Collectives: ``cost_collectives.collective_cost`` on the tp group (alpha-beta, cheapest algorithm).
- Saved activations: BYTES.saved_for_backward times the local share of the tensors the op reads
  (most ops keep their inputs: a column-parallel linear keeps its whole input, a row-parallel one
  its shard; Korthikanti et al. 2022 count the same way), weighted by their sizes.
- Selective recompute (Korthikanti et al. 2022, sec. 5): the attention core is the ops whose output
  or saved tensors grow with seq² (an eager softmax(QKᵀ)·V, as BERT's eager attention); a fused
  ``scaled_dot_product_attention`` keeps no seq² tensor of its own, so there it changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch.fx import Node

from xirang.ir.meta_keys import BYTES, FLOPS, PARAM_COUNT, REQUIRES_GRAD, ROLE, symbol
from xirang.ir.placement import Shard

from xirang.passes.planning.cost_collectives import CollectiveCost, collective_cost
from xirang.passes.planning.cost_model import Efficiency, compute_time
from xirang.passes.analysis.memory_traffic import is_persistent
from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.planning.plan_splits_graph import ExprTable, tensor_info
from xirang.passes.planning.plan_splits_problem import Decision, Term

aten = torch.ops.aten
FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "fp8": 1}
FUSED_ATTENTION = frozenset({aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
                             aten._scaled_dot_product_efficient_attention,
                             aten._scaled_dot_product_flash_attention_for_cpu})
MATMUL_OPS = FUSED_ATTENTION | {aten.linear, aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul,
                                aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d}


@dataclass(frozen=True)
class NodeFacts:
    """What pricing reads of one node, sizes as ExprTable indices (tp-independent)."""

    forward: int  # forward FLOPs
    total: int  # forward + backward FLOPs
    traffic: int  # bytes read + written, traced itemsize
    saved: int  # BYTES.saved_for_backward, traced itemsize
    byte_scale: float  # plan precision / traced itemsize of the node's floating tensors
    matmul: bool
    needs_grad: bool
    core: bool  # in the attention core that selective recompute drops
    params: int  # elements of the parameter a placeholder binds, else 0
    param_bytes: float  # the same in the plan's precision
    activations: tuple[tuple[int, int, float], ...]  # (input position, element count, bytes/elem) read


def node_facts(node: Node, table: ExprTable, float_bytes: int, seq_known: bool) -> NodeFacts:
    flops = FLOPS.get(node, None)
    traffic = BYTES.get(node, None)
    floats = [i for i in [tensor_info(node)] + [tensor_info(v) for v in node.all_input_nodes]
              if i is not None and i.is_floating]
    activations = []
    for k, value in enumerate(node.all_input_nodes):
        info = tensor_info(value)
        if info is not None and not is_persistent(value):
            activations.append((k, table.index(info.numel), float(float_bytes if info.is_floating else info.itemsize)))
    zero = sympy.Integer(0)
    params = PARAM_COUNT.get(node, 0) if ROLE.get(node, None) == "parameter" else 0
    saved = traffic.saved_for_backward if traffic is not None else zero
    return NodeFacts(
        forward=table.index(flops.forward if flops else zero), total=table.index(flops.total if flops else zero),
        traffic=table.index(traffic.read + traffic.written if traffic else zero), saved=table.index(saved),
        byte_scale=float_bytes / floats[0].itemsize if floats else 1.0,
        matmul=op_packet(node) in MATMUL_OPS, needs_grad=bool(REQUIRES_GRAD.get(node, False)),
        core=seq_known and node.op == "call_function" and REQUIRES_GRAD.get(node, False)
        and op_packet(node) not in FUSED_ATTENTION and _grows_with_seq_squared(node, saved),
        params=params, param_bytes=float(params * float_bytes), activations=tuple(activations))


def _grows_with_seq_squared(node: Node, saved) -> bool:
    seq = symbol("seq")
    info = tensor_info(node)
    for expr in ([info.numel] if info is not None else []) + [saved]:
        try:
            if sympy.degree(sympy.expand(expr), seq) >= 2:
                return True
        except sympy.PolynomialError:  # ceiling/floor of seq: not a polynomial, not an attention score
            continue
    return False


def local_fraction(placement, tp: int) -> float:
    """Share of a tensor one rank holds: 1/tp of a shard, all of a replicated or partial tensor."""
    return 1.0 / tp if isinstance(placement, Shard) else 1.0


class Pricing:
    """Numbers at one point: sizes evaluated, collectives priced on one tp group (memoised)."""

    def __init__(self, values: list[float], tp: int, group: tuple[int, ...], world, device, precision: str,
                 efficiency: Efficiency, table: ExprTable):
        self.values, self.tp, self.group, self.world = values, tp, group, world
        self.device, self.precision, self.efficiency, self.table = device, precision, efficiency, table
        self._collectives: dict = {}

    def collective(self, kind: str, nbytes: float) -> CollectiveCost:
        key = (kind, nbytes)
        if key not in self._collectives:
            self._collectives[key] = collective_cost(kind, nbytes, self.group, self.world)
        return self._collectives[key]

    def term(self, term: Term) -> CollectiveCost:
        return self.collective(term.kind, self.values[term.tensor] * term.scale)

    def entry(self, terms) -> float:
        """Seconds of one link entry (a tuple of terms)."""
        return sum(self.term(t).seconds for t in terms)

    def compute(self, facts: NodeFacts, fraction: float) -> float:
        """Roofline seconds (forward + backward) of a node's local share."""
        values = self.values
        return compute_time(values[facts.total] * fraction, values[facts.traffic] * facts.byte_scale * fraction,
                            self.device, self.precision, efficiency=self.efficiency, is_matmul=facts.matmul)

    def forward_share(self, facts: NodeFacts) -> float:
        total = self.values[facts.total]
        if total > 0:
            return self.values[facts.forward] / total
        return 0.5 if facts.needs_grad else 1.0

    def op_collectives(self, strategy) -> list[tuple[str, CollectiveCost]]:
        """(kind, price) of each collective an op issues itself (vocabulary-parallel cross-entropy)."""
        return [(c.kind, self.collective(c.kind, self.values[self.table.index(c.nbytes)]))
                for c in strategy.collectives]

    def option(self, decision: Decision, facts: NodeFacts | None, index: int) -> tuple[float, float]:
        """(seconds, parameter bytes held) of one option of a decision, for one copy of it."""
        strategy = decision.options[index]
        if facts is None:
            return 0.0, 0.0
        seconds = self.compute(facts, strategy.compute_fraction)
        seconds += sum(cost.seconds for _, cost in self.op_collectives(strategy))
        memory = facts.param_bytes * local_fraction(strategy.output, self.tp)
        return seconds, memory

    def saved(self, facts: NodeFacts, strategy) -> float:
        """Bytes a node keeps for its backward on one rank (see the module docstring)."""
        full = self.values[facts.saved] * facts.byte_scale
        if not full:
            return 0.0
        weights = [(self.values[count] * size, local_fraction(strategy.inputs[k], self.tp))
                   for k, count, size in facts.activations]
        total = sum(w for w, _ in weights)
        share = sum(w * f for w, f in weights) / total if total else local_fraction(strategy.output, self.tp)
        return full * share
