"""Seconds and bytes of the split problem at one (micro_batch, seq, tp group): what each node's choice
costs, what each link's collectives cost, and the per-node facts both read.

- Compute: the roofline of the node's local share (Williams et al. 2009, ``cost_model.compute_time``):
  forward+backward FLOPs and the bytes it moves, both times the strategy's ``compute_fraction``. The
  analysis counts forward traffic only; it is taken as the step's traffic and split between forward
  and backward like the FLOPs, so forward = cost · F_fwd / F_total (half each for a data-moving op
  with no FLOPs that needs a gradient).
- Fixed cost per op (``DeviceSpec.op_overhead_s``: eager dispatch on a CPU, a kernel launch on a
  GPU; on a calibrated World also its class's measured fixed cost, ``Calibration.op_fixed_s``, for
  matmuls, fused attention and the other FLOP-counted ops): every op the program dispatches (each
  ``call_function`` node but Python's ``getitem``) pays
  it once in the forward, whatever its share of the work; an op that needs a gradient pays the
  backward's per-op cost once per input that takes a gradient (one autograd node, one gradient op
  each), at ``World.calibration.backward_op_overhead_s`` where measured, else the forward's figure.
  Each trainable parameter pays it once more per micro-batch: autograd's AccumulateGrad node, which
  stores or adds the parameter's gradient into ``.grad`` (a hundred of them per GPT step here).
- Fused attention at ``Efficiency.attention`` with the class's fixed cost, or on a calibrated World
  that timed it per sequence length (``Calibration.attention_by_seq``) at the line of the nearest one
  to the node's query length at the point priced.
- Non-matmul FLOPs at ``Efficiency.other``, except on a calibrated World a node of a kind timed on
  its own (``Calibration.other_kind_efficiency``: gelu, layer norm, softmax and log-softmax,
  cross-entropy; ``OTHER_KIND_OPS``), at that kind's measured rate, with its own fixed cost; where the
  kind was timed at several sizes (``Calibration.other_kind_bands``), at the rate and fixed cost of the
  band holding its local FLOPs (these ops slow per element as their tensors outgrow the caches).
- Traffic bytes scale from the traced itemsize (fp32 on meta) to the plan's precision for floating tensors.
- Collectives: ``cost_collectives.collective_cost`` on the tp group (alpha-beta, cheapest algorithm).
- Saved activations, by liveness: the storages the ops of a unit keep for the backward (each
  ``SavedTensor`` of BYTES.saved), each storage once per unit however many ops keep it, at its dtype at
  run time: in a half-precision program the lowering's own run-time dtypes
  (passes/lowering/compute_dtypes.py, handed in as ``run_dtypes``), so a model's fp32 islands (a norm's
  upcast input, an fp32 router's products, the loss's upcast logits) are priced at 4 bytes, a storage
  read through a cast that copies at run time is the cast's (``saved_storages.storage_of``), and an input
  the program casts for the op that reads it (mixed dtypes into a matmul or attention) is that copy;
  without them every floating storage at the plan's precision (masks, indices and float32 statistics
  keep their dtype). Each at its local share on one tp rank: a storage the op reads through an input
  at the layout it reads it in (a column-parallel linear keeps its whole input, a row-parallel one its
  shard; Korthikanti et al. 2022 count the same way), one it makes itself at its output's layout.
- Selective recompute (Korthikanti et al. 2022, sec. 5): the attention core is the ops whose output
  or saved tensors grow with seq² (an eager softmax(QKᵀ)·V, as BERT's eager attention); a fused
  ``scaled_dot_product_attention`` keeps no seq² tensor of its own, so there it changes nothing.
  The rule is ``passes/analysis/attention_core.in_eager_core``, which the lowering's recompute reads too.
  Recomputing the core drops the storages core ops make and keep, and keeps every storage the core
  reads from outside it (what the recompute starts from: q, k, v, the causal mask).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import sympy
import torch
from torch.fx import Node

from xirang.ir.meta_keys import BYTES, FLOPS, PARAM_COUNT, REQUIRES_GRAD, ROLE
from xirang.ir.placement import PlanShard, held_fraction

from xirang.passes.planning.cost_collectives import CollectiveCost, collective_cost
from xirang.passes.planning.cost_model import Efficiency, compute_time
from xirang.passes.analysis.attention_core import FUSED_ATTENTION, in_eager_core
from xirang.passes.analysis.saved_storages import (RunDtypes, input_saved, nbytes as saved_nbytes, storage_of,
                                                   tensors)
from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.analysis.expert_ops import EXPERT_LINEAR, is_expert_weight
from xirang.passes.planning.plan_splits_graph import ExprTable, tensor_info
from xirang.passes.planning.plan_splits_problem import Decision, Term

aten = torch.ops.aten
FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "fp8": 1}
# the experts' grouped matmul is a matmul (priced at the matmul efficiency; its output's gradient waits for W)
MATMUL_OPS = FUSED_ATTENTION | {aten.linear, aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul,
                                aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d,
                                EXPERT_LINEAR.overloadpacket}

# the ops of each kind a calibration times apart (``ir/calibration.OTHER_KINDS``)
OTHER_KIND_OPS = {aten.gelu: "gelu", aten.layer_norm: "layer_norm", aten.native_layer_norm: "layer_norm",
                  aten.softmax: "softmax", aten._softmax: "softmax", aten.log_softmax: "softmax",
                  aten._log_softmax: "softmax", aten.cross_entropy_loss: "cross_entropy"}


@dataclass(frozen=True)
class Kept:
    """One storage a node keeps (or, for the attention core, needs kept to recompute from)."""

    storage: str  # SavedTensor.storage: two Kept of one unit with the same storage are one storage
    producer: str  # the node that makes it
    nbytes: int  # ExprTable index of its bytes at the traced dtype
    scale: float  # plan precision / traced itemsize for a floating storage, else 1
    input: int | None  # read through node.all_input_nodes[input]; None: the node's own (output layout)
    shape: tuple = ()  # sizes (ints or sympy) of the tensor read (or made), as its layout describes it


@dataclass(frozen=True)
class NodeFacts:
    """What pricing reads of one node, sizes as ExprTable indices (tp-independent)."""

    forward: int  # forward FLOPs
    total: int  # forward + backward FLOPs
    traffic: int  # bytes read + written, traced itemsize
    byte_scale: float  # plan precision / traced itemsize of the node's floating tensors
    matmul: bool
    needs_grad: bool
    core: bool  # in the attention core that selective recompute drops
    params: int  # elements of the parameter a placeholder binds, else 0
    param_bytes: float  # the same in the plan's precision
    saved: tuple[Kept, ...] = ()  # the storages it keeps for its backward (BYTES.saved)
    inputs: tuple[Kept, ...] = ()  # the storage of every activation input (what a recompute starts from)
    dispatched: bool = False  # an op the program dispatches (pays DeviceSpec.op_overhead_s)
    grad_inputs: int = 0  # inputs that take a gradient from this op's backward
    attention: bool = False  # a fused attention kernel (priced at Efficiency.attention where given)
    kind: str | None = None  # its kind where a calibration may time it apart (OTHER_KIND_OPS)
    query_length: int | None = None  # a fused attention's query length, ExprTable index (Calibration.attention_by_seq)
    weight_output: int | None = None  # a matmul reading a parameter: its output's bytes (traced itemsize)
    reads_weight: bool = False  # reads a parameter (directly or through a view or cast): a split backward's W runs it
    expert: bool = False  # an experts matmul (xirang.expert_linear): its compute is the experts'
    expert_rows: int | None = None  # the first expert_linear of an experts call: its rows' bytes (traced itemsize)
    expert_out: int | None = None  # the last expert_linear of an experts call: its output's bytes (what combines)
    expert_weight: bool = False  # a parameter placeholder an expert_linear reads as its weight or bias


def _kept(node: Node, item, table: ExprTable, float_bytes: int, run: RunDtypes | None = None) -> Kept:
    """One saved storage of ``node``, priced at its run-time dtype where ``run`` knows it (module
    docstring), else a floating one at the plan's precision."""
    own = item.producer == node.name  # made here: its dtype is that of the node (or the input it is made from)
    source = node.all_input_nodes[item.input] if item.input is not None else node
    read = tensors(source)  # the tensor as the node reads or makes it: what its placement's dim counts
    shape = tuple(read[0].shape) if read else ()
    storage, nbytes, run_dtype = item.storage, item.nbytes, None
    copied = run.read_as.get(node.name, {}).get(item.input) if run is not None and not own else None
    if copied is not None:  # the program casts this input into a copy of the op's own, which it keeps
        storage, nbytes, run_dtype = f"{node.name}:input{item.input}", saved_nbytes(source), copied
    elif not own:  # read through an input: the storage it views, which a run-time cast may own
        source = storage_of(source, run.of if run is not None else None)
        if run is not None:
            storage, nbytes = source.name, saved_nbytes(source)
    found = tensors(source)
    itemsize = found[0].itemsize if found else 1
    if run is not None and run_dtype is None:
        run_dtype = run.of.get(source.name)
    if not item.floating:
        scale = 1.0
    elif run_dtype is not None:
        scale = run_dtype.itemsize / itemsize
    else:
        scale = float_bytes / itemsize
    return Kept(storage, storage.split(":", 1)[0], table.index(nbytes), scale, item.input, shape)


def node_facts(node: Node, table: ExprTable, float_bytes: int, seq_known: bool,
               run_dtypes: RunDtypes | None = None) -> NodeFacts:
    flops = FLOPS.get(node, None)
    traffic = BYTES.get(node, None)
    floats = [i for i in [tensor_info(node)] + [tensor_info(v) for v in node.all_input_nodes]
              if i is not None and i.is_floating]
    zero = sympy.Integer(0)
    params = PARAM_COUNT.get(node, 0) if ROLE.get(node, None) == "parameter" else 0
    items = traffic.saved if traffic is not None else ()
    reads = [item for value in node.all_input_nodes for item in input_saved(node, value)]
    return NodeFacts(
        forward=table.index(flops.forward if flops else zero), total=table.index(flops.total if flops else zero),
        traffic=table.index(traffic.read + traffic.written if traffic else zero),
        byte_scale=float_bytes / floats[0].itemsize if floats else 1.0,
        matmul=op_packet(node) in MATMUL_OPS, needs_grad=bool(REQUIRES_GRAD.get(node, False)),
        core=in_eager_core(node, seq_known=seq_known),
        params=params, param_bytes=float(params * float_bytes),
        saved=tuple(_kept(node, item, table, float_bytes, run_dtypes) for item in items),
        inputs=tuple(_kept(node, item, table, float_bytes, run_dtypes) for item in reads),
        dispatched=node.op == "call_function" and node.target is not operator.getitem,
        grad_inputs=sum(bool(REQUIRES_GRAD.get(value, False)) for value in node.all_input_nodes),
        attention=op_packet(node) in FUSED_ATTENTION, kind=OTHER_KIND_OPS.get(op_packet(node)),
        weight_output=_weight_output(node, table) if op_packet(node) in MATMUL_OPS else None,
        reads_weight=node.op == "call_function" and reads_parameter(node),
        expert=node.op == "call_function" and node.target == EXPERT_LINEAR,
        expert_rows=_expert_rows(node, table), expert_out=_expert_out(node, table),
        expert_weight=node.op == "placeholder" and is_expert_weight(node),
        query_length=_query_length(node, table) if op_packet(node) in FUSED_ATTENTION else None)


def _expert_rows(node: Node, table: ExprTable) -> int | None:
    """ExprTable index of the bytes of the rows an experts call dispatches, on its first expert_linear
    (the one its ids' users list first: canonical graphs keep users in graph order), else None."""
    if node.op != "call_function" or node.target != EXPERT_LINEAR:
        return None
    first = next(user for user in node.args[1].users if user.op == "call_function" and user.target == EXPERT_LINEAR)
    rows = tensor_info(node.args[0]) if first is node else None
    return table.index(rows.numel * rows.itemsize) if rows is not None else None


def _expert_out(node: Node, table: ExprTable) -> int | None:
    """ExprTable index of the bytes an experts call's combine sends back: its last expert_linear's output."""
    if node.op != "call_function" or node.target != EXPERT_LINEAR:
        return None
    last = [user for user in node.args[1].users if user.op == "call_function" and user.target == EXPERT_LINEAR][-1]
    out = tensor_info(node) if last is node else None
    return table.index(out.numel * out.itemsize) if out is not None else None


def _query_length(node: Node, table: ExprTable) -> int | None:
    """ExprTable index of the query's sequence length (its dim -2), or None where there is none."""
    query = tensor_info(node.args[0]) if node.args else None
    return table.index(sympy.sympify(query.shape[-2])) if query is not None and len(query.shape) >= 2 else None


_VIEWS = frozenset({"t", "transpose", "permute", "view", "reshape", "_to_copy", "to", "expand"})


def reads_parameter(node: Node) -> bool:
    """Whether ``node`` reads a parameter, directly or through a view or cast of it."""
    for value in node.all_input_nodes:
        while value.op == "call_function" and getattr(value.target, "__name__", "").split(".")[0] in _VIEWS \
                and value.all_input_nodes:
            value = value.all_input_nodes[0]
        if ROLE.get(value, None) == "parameter":
            return True
    return False


def _weight_output(node: Node, table) -> int | None:
    """ExprTable index of the output bytes of a matmul that reads a parameter (directly or through a view
    or cast): a split backward keeps this output's gradient from B until W
    (codegen/runtime/executor/split_backward.py)."""
    if not reads_parameter(node):
        return None
    info = tensor_info(node)
    return table.index(info.numel * info.itemsize) if info is not None else None


def local_fraction(placement, tp: int, shape: tuple = ()) -> float:
    """Share of a tensor of ``shape`` one tp rank holds at ``placement`` (``held_fraction``: a padded or
    pieced shard holds more than 1/tp; a shape not known, 1/tp of a shard)."""
    dim = placement.dim if isinstance(placement, PlanShard) else None
    return held_fraction(placement, tp, shape[dim] if dim is not None and dim < len(shape) else None)


class Pricing:
    """Numbers at one point: sizes evaluated, collectives priced on one tp group (memoised)."""

    def __init__(self, values: list[float], tp: int, group: tuple[int, ...], world, device, precision: str,
                 efficiency: Efficiency, table: ExprTable):
        self.values, self.tp, self.group, self.world = values, tp, group, world
        calibration = getattr(world, "calibration", None)
        self.device, self.precision, self.efficiency, self.table = device, precision, efficiency, table
        self._collectives: dict = {}
        self.backward_op_s = device.op_overhead_s if calibration is None else calibration.backward_op_overhead_s
        self.op_fixed = dict(calibration.op_fixed_s) if calibration is not None else {}
        # a recomputed region's checkpoint cost per tensor it saves, beyond the forward it runs again
        self.recompute_saved_s = calibration.recompute_saved_s if calibration is not None else 0.0
        # each measured kind's rate in place of the class's; only with the device's own efficiency,
        # which the kinds' fractions were measured beside (a caller's derating is kept as given)
        kinds = calibration.other_kind_efficiency if calibration is not None else {}
        self.kind_efficiency = {kind: replace(efficiency, other=fraction) for kind, fraction in kinds.items()
                                if efficiency == device.efficiency}
        # fused attention's line per sequence length, likewise only with the device's own efficiency
        self.attention_line = calibration.attention_line if calibration is not None and \
            calibration.attention_by_seq and efficiency == device.efficiency else None
        # the measured kinds' bands by size, likewise
        self.kind_band = calibration.other_kind_line if calibration is not None and \
            calibration.other_kind_bands and efficiency == device.efficiency else None

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
        efficiency = self.kind_efficiency.get(facts.kind, self.efficiency)
        line = self._attention_line(facts)
        if line is not None:
            efficiency = replace(efficiency, attention=line[0])
        band = self._kind_band(facts, fraction)
        if band is not None:
            efficiency = replace(efficiency, other=band[0])
        seconds = compute_time(values[facts.total] * fraction, values[facts.traffic] * facts.byte_scale * fraction,
                               self.device, self.precision, efficiency=efficiency, is_matmul=facts.matmul,
                               is_attention=facts.attention)
        return seconds + self.op_overhead(facts, fraction)

    def _kind_band(self, facts: NodeFacts, fraction: float):
        """(rate fraction, fixed seconds) of a measured kind's band at the node's local size, where
        measured: its local FLOPs as the samples count them (forward and backward: a node that needs no
        gradient is looked up at twice its forward's, the same tensors' size)."""
        if facts.kind is None or self.kind_band is None:
            return None
        flops = self.values[facts.total] * fraction * (1.0 if facts.needs_grad else 2.0)
        return self.kind_band(facts.kind, flops)

    def _attention_line(self, facts: NodeFacts):
        """(rate fraction, fixed seconds) at a fused attention node's query length, where measured."""
        if not facts.attention or self.attention_line is None or facts.query_length is None:
            return None
        return self.attention_line(float(self.values[facts.query_length]))

    def op_overhead(self, facts: NodeFacts, fraction: float = 1.0) -> float:
        """Fixed seconds of one node (its local share ``fraction``), forward + backward (see the module
        docstring)."""
        if not facts.dispatched:
            return 0.0
        backward = max(1, facts.grad_inputs) * self.backward_op_s if facts.needs_grad else 0.0
        return self.device.op_overhead_s + backward + self.class_fixed(facts, fraction)

    def class_fixed(self, facts: NodeFacts, fraction: float = 1.0) -> float:
        """A calibrated World's fixed cost of the node's op class, or of its kind where one was timed
        apart (``Calibration.op_fixed_s``, or the band of its local size where the kind has bands),
        measured for a call forward and backward: its forward share alone where no gradient is needed."""
        line = self._attention_line(facts)
        if line is not None:  # the line of its sequence length, forward share as the class's below
            return line[1] * (1.0 if facts.needs_grad else 1 / 3)
        band = self._kind_band(facts, fraction)
        if band is not None:  # as a kind's op_fixed_s below
            return band[1] * (1.0 if facts.needs_grad else 1 / 2)
        if not self.op_fixed:
            return 0.0
        if facts.attention:
            name, forward_share = "attention", 1 / 3  # the backward computes twice the forward's products
        elif facts.matmul:
            name, forward_share = "matmul", 1 / 3  # one product forward, two for the gradients
        elif self.values[facts.total] > 0:  # a kind measured apart pays its own, the rest the class's
            name, forward_share = (facts.kind if facts.kind in self.op_fixed else "other"), 1 / 2
        else:
            return 0.0  # views, copies, indexing: their dispatch is all they pay
        return self.op_fixed.get(name, 0.0) * (1.0 if facts.needs_grad else forward_share)

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
        if facts.params and isinstance(strategy.output, PlanShard) and not strategy.output.pieces:
            memory = facts.param_bytes * strategy.compute_fraction  # a padded shard holds its padding too
        return seconds, memory

    def kept_bytes(self, kept: Kept, placement) -> float:
        """Bytes of one kept storage on one rank, in the plan's precision, at ``placement``'s share."""
        return self.values[kept.nbytes] * kept.scale * local_fraction(placement, self.tp, kept.shape)
