"""Lowering pass ``insert_collectives``: the graph as one tp rank's program, local tensors and
collectives on the edges.

Every node keeps its name, op and meta (its ``TENSOR`` made local: the shape this rank holds under
the node's output layout, in its run-time dtype); what changes, from the nodes' ``LAYOUT``:

- an edge whose producer's output layout differs from the layout the consumer reads gets the
  collective that converts it (``reshard``): Partial -> R all-reduce (Megatron's g), S -> R
  all-gather, R -> S local slice, Partial -> S reduce-scatter, S(i) -> S(j) all-to-all,
  R -> Partial(sum) "tp rank 0 keeps it, the others zero it" (a row-parallel bias);
- where the consumer's strategy makes the gradient of an R input Partial (its output is split, so
  each rank back-propagates only its share, ``sharding_rules.gradient_placements``), the consumer
  reads the value through ``copy_to_group`` (Megatron's f: identity forward, all-reduce backward).
  All such consumers of one producer share one f, so the partial gradients are summed first and
  all-reduced once (the plan's ``<producer>.grad`` collective); consumers whose gradient is
  already R read the value directly, their full gradients added after the all-reduce;
- sizes on sharded dims become local (``local_sizes``); a row-parallel linear over a padded dim reads
  its input with the padding zeroed (``padded_shards``);
- vocabulary-parallel embedding and cross-entropy call ``codegen/ops/vocab_parallel``.

Collectives are call_function nodes on the functions of ``collectives.py`` / ``local_ops.py``; the
process group and the communication counter are module attributes of the emitted GraphModule
(``tp_group = self.tp_group``, ``comm_counter = self.comm_counter``) so the program is one
readable function and the same code runs with any group object (None: this rank alone).

Each inserted node says why (``INSERTED``), holds the local ``TENSOR`` of its result and runs in
the unit of its first reader (passes/lowering/inserted.py), so the stage split needs nothing else.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from xirang.ir.errors import XirangError
from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import INSERTED, LAYOUT, REQUIRES_GRAD, ROLE, RUN_DTYPE, SYMBOLS, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard, local_shape
from xirang.passes.lowering.inserted import place_inserted
from xirang.passes.planning.sharding_rules import Strategy, gradient_placements

from xirang.codegen.ops import collectives, local_ops
from xirang.passes.lowering.fused_pieces import convert_pieces, pieces_call
from xirang.passes.lowering.local_sizes import localise_sizes, output_placement
from xirang.passes.lowering.padded_shards import zero_contracted_padding
from xirang.passes.lowering.trace_device import on_device
from xirang.passes.lowering.vocab_calls import VOCAB_PARALLEL_OPS, vocab_parallel_call

R = PlanReplicate()
SKIPPED_OPS = (torch.ops.aten._assert_tensor_metadata.default,)  # trace-time checks of fake tensors


class TpRewriter:
    """Builds the program of tp rank ``tp_rank`` of ``tp_size`` from ``gm`` and its nodes' ``LAYOUT``."""

    def __init__(self, gm, *, tp_rank: int, tp_size: int, device: torch.device):
        self.gm = gm
        self.tp_rank, self.tp_size, self.device = tp_rank, tp_size, device
        self.graph = Graph()
        self.env: dict[Node, Node] = {}
        self.resharded: dict[tuple, Node] = {}  # (producer, placement, via f) -> node read
        self._attrs: dict[str, Node] = {}
        self.inserted: list[Node] = []  # every node this rewrite added, in creation order

    # --- attributes of the emitted module --------------------------------------------------------

    def attr(self, name: str) -> Node:
        if name not in self._attrs:
            self._attrs[name] = self.graph.get_attr(name)
        return self._attrs[name]

    def call(self, fn, args: tuple, kwargs: Optional[dict] = None) -> Node:
        """A call to ``fn``, named after it (``reduce_from_group_3``) so the program reads as calls."""
        node = self.graph.call_function(fn, args, kwargs or {})
        self.inserted.append(node)
        return node

    def comm(self) -> dict:
        return {"counter": self.attr("comm_counter")}

    # --- the walk --------------------------------------------------------------------------------

    def run(self) -> Graph:
        nodes = list(self.gm.graph.nodes)
        for node in nodes:
            if node.op == "placeholder":
                new = self.graph.placeholder(node.name)
                self._keep_meta(node, new)  # "val" stays the full (global) fake tensor: shapes for shard maps
                self.env[node] = new
        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                if node.target in SKIPPED_OPS:
                    continue
                self.env[node] = self._call(node)
                self._keep_meta(node, self.env[node])
            else:
                raise XirangError(f"unexpected {node.op} node {node.name} in the traced graph",
                                  where=f"node {node.name}", hint="report this model; traced graphs hold "
                                                                  "placeholders, call_function and output")
        return self.graph

    def _keep_meta(self, source: Node, node: Node) -> None:
        """``source``'s meta on its rewritten ``node``, ``TENSOR`` made local and in the run-time dtype."""
        node.meta.update(source.meta)
        info = TENSOR.get(source, None)
        if isinstance(info, TensorInfo):
            TENSOR.set(node, self._local_info(source, info, self.produced(source)))

    def _local_info(self, value: Node, info: TensorInfo, placement) -> TensorInfo:
        dtype = RUN_DTYPE.get(value, None)
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size() if dtype else info.itemsize
        return TensorInfo(local_shape(info.shape, placement, self.tp_size), dtype or info.dtype, itemsize)

    def _describe_conversion(self, value: Node, node: Node, wanted) -> Node:
        """An inserted node holding ``value`` as ``wanted``: its local tensor and gradient flag."""
        info = TENSOR.get(value, None)
        if isinstance(info, TensorInfo):
            TENSOR.set(node, self._local_info(value, info, wanted))
        REQUIRES_GRAD.set(node, bool(REQUIRES_GRAD.get(value, False)) or ROLE.get(value, None) == "parameter")
        INSERTED.set(node, f"tp: {value.name} as {wanted}")
        return node

    def _call(self, node: Node) -> Node:
        strategy = self.layout(node)
        reads = self._inputs(node, strategy)
        args = on_device(torch.fx.node.map_arg(node.args, lambda v: reads[v]), self.device)
        kwargs = on_device(torch.fx.node.map_arg(node.kwargs, lambda v: reads[v]), self.device)
        first = next((reads_p for v, reads_p in zip(node.all_input_nodes, strategy.inputs) if _is_tensor(v)), None)
        if node.target in VOCAB_PARALLEL_OPS and strategy.strategy == "vocab_parallel" and self.tp_size > 1:
            return vocab_parallel_call(self, node, args, kwargs)
        picked = pieces_call(self, node, args, kwargs, strategy)  # a fused projection's pieces
        if picked is not None:
            return picked
        args = zero_contracted_padding(self, node, args, strategy)  # a row-parallel linear over padding
        args = localise_sizes(node, args, output_placement(strategy.outputs),
                              first.tp if first is not None else None, self.tp_size, self._sym_local)
        new = self.graph.create_node("call_function", node.target, args, kwargs, name=node.name)
        return new

    def _output(self, node: Node) -> None:
        """Return the loss only: the first output (HF models also return logits), made R."""
        values = node.args[0]
        loss = values[0] if isinstance(values, (tuple, list)) else values
        strategy = LAYOUT.get(node, None)
        position = node.all_input_nodes.index(loss)
        wanted = strategy.inputs[position].tp if strategy is not None else R
        if wanted != R:
            raise XirangError(f"the plan reads the loss {loss.name} as {wanted}, not replicated",
                              where="plan.placements['output']", hint="re-plan: the loss must be replicated")
        self.graph.output((self.reshard(loss, R),))

    # --- edges -----------------------------------------------------------------------------------

    def _inputs(self, node: Node, strategy) -> dict:
        grads = gradient_placements(Strategy(strategy.strategy, tuple(x.tp for x in strategy.inputs),
                                             tuple(x.tp for x in strategy.outputs) or R, 1.0))
        reads = {}
        for value, layout, grad in zip(node.all_input_nodes, strategy.inputs, grads):
            if not _is_tensor(value):
                reads[value] = self.env[value]
                continue
            via_f = (layout.tp == R and isinstance(grad, PlanPartial) and REQUIRES_GRAD.get(value, False)
                     and self.tp_size > 1)
            reads[value] = self.reshard(value, layout.tp, via_f=via_f)
        return reads

    def layout(self, node: Node):
        strategy = LAYOUT.get(node, None)
        if strategy is None:
            raise XirangError(f"node {node.name} ({node.target}) has no layout",
                              where=f"plan.placements[{node.name!r}]",
                              hint="re-plan this model (xirang.plan): the plan must list every computing node")
        return strategy

    def produced(self, value: Node):
        """The tp placement ``value``'s output has (element ``i`` for ``getitem(multi, i)``)."""
        strategy = LAYOUT.get(value, None)
        return strategy.outputs[0].tp if strategy is not None and strategy.outputs else R

    def reshard(self, value: Node, wanted, *, via_f: bool = False) -> Node:
        """The node holding ``value`` in placement ``wanted`` (collectives added once per producer)."""
        key = (value, wanted, via_f)
        if key in self.resharded:
            return self.resharded[key]
        have = self.produced(value)
        if via_f and wanted == R and isinstance(have, PlanShard) and have.chunks == 1 and \
                LAYOUT.get(value).strategy.startswith("seq "):
            # a sequence shard read whole by an op whose input gradient is partial: all-gather forward,
            # reduce-scatter backward (what the split prices), not all-reduce then slice
            full = _full_shape(value)
            size = full[have.dim] if isinstance(full[have.dim], int) else None
            found = self.call(collectives.gather_summing_grad, (self.env[value], self.attr("tp_group"), have.dim),
                              {"full_size": size, **self.comm()})
            self._describe_conversion(value, found, wanted)
        elif via_f:
            found = self.call(collectives.copy_to_group, (self.reshard(value, wanted), self.attr("tp_group")),
                              self.comm())
            self._describe_conversion(value, found, wanted)
        else:
            found = self._convert(value, self.env[value], self.produced(value), wanted)
            if found is not self.env[value]:
                self._describe_conversion(value, found, wanted)
        self.resharded[key] = found
        return found

    def _convert(self, value: Node, x: Node, have, wanted) -> Node:
        """``x`` (holding ``value`` as ``have``) converted to ``wanted``."""
        if have == wanted or self.tp_size == 1:
            return x
        if any(isinstance(p, PlanShard) and p.pieces for p in (have, wanted)):
            return convert_pieces(self, value, x, have, wanted)
        group = self.attr("tp_group")
        full = _full_shape(value)
        if isinstance(have, PlanPartial) and have.op != "sum" or isinstance(wanted, PlanPartial) and wanted.op != "sum":
            raise XirangError(f"no conversion from {have} to {wanted} for {value.name}",
                              where=f"node {value.name}", hint="re-plan: only Partial(sum) is supported")
        if isinstance(have, PlanPartial) and wanted == R:
            return self.call(collectives.reduce_from_group, (x, group), self.comm())
        if isinstance(have, PlanShard) and wanted == R:
            if have.chunks > 1:
                return self.call(local_ops.gather_chunks, (x, group, have.dim, have.chunks), self.comm())
            size = full[have.dim] if have.dim < len(full) and isinstance(full[have.dim], int) else None
            return self.call(collectives.gather_from_group, (x, group, have.dim),
                             {"full_size": size, **self.comm(), **_unit(have)})
        if have == R and isinstance(wanted, PlanShard):
            if wanted.chunks > 1:
                return self.call(local_ops.scatter_chunks, (x, group, wanted.dim, wanted.chunks), self.comm())
            return self.call(collectives.scatter_to_group, (x, group, wanted.dim), {**self.comm(), **_unit(wanted)})
        if isinstance(have, PlanPartial) and isinstance(wanted, PlanShard) and wanted.chunks == 1:
            return self.call(collectives.reduce_scatter_to_group, (x, group, wanted.dim),
                             {**self.comm(), **_unit(wanted)})
        if isinstance(have, PlanShard) and isinstance(wanted, PlanShard) and have.plain and wanted.plain:
            size = full[have.dim] if isinstance(full[have.dim], int) else None
            return self.call(collectives.all_to_all, (x, group),
                             {"scatter_dim": wanted.dim, "gather_dim": have.dim, "gather_size": size,
                              **self.comm()})
        if have == R and isinstance(wanted, PlanPartial):
            return self.call(local_ops.partial_from_replicate, (x, self.tp_rank == 0), {})
        # anything else goes through R: S -> Partial, chunked S -> another S, ...
        return self._convert(value, self.reshard(value, R), R, wanted)

    # --- small helpers ---------------------------------------------------------------------------

    def _sym_local(self, size: Node) -> Node:
        key = ("local_size", size)
        if key not in self.resharded:
            self.resharded[key] = self.call(local_ops.local_size, (self.env[size], self.tp_size))
        return self.resharded[key]


def _unit(placement: PlanShard) -> dict:
    """The ``unit`` argument of a collective on a shard split in whole units (heads), only where it is
    not 1, so programs without such shards are emitted as before."""
    return {"unit": placement.unit} if placement.unit > 1 else {}


def _is_tensor(value) -> bool:
    return isinstance(value, Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _full_shape(value: Node) -> tuple:
    val = value.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    return tuple(int(s) if isinstance(s, int) or (hasattr(s, "node") and s.node.is_constant()) else s
                 for s in shape)


def check_sequence_shards(gm, tp: int) -> None:
    """A sequence-sharded layout (sharding_rules_sequence) needs tp to divide the sequence the program is
    built for: a padded shard would put padding rows into norms and reductions."""
    seq = SYMBOLS.get(gm, {}).get("seq")
    if tp == 1 or seq is None or seq % tp == 0:
        return
    for node in gm.graph.nodes:
        strategy = LAYOUT.get(node, None)
        if strategy is not None and strategy.strategy.startswith("seq "):
            raise XirangError(f"{node.name} is sharded along the sequence on tp={tp}, but the program is built "
                              f"for seq {seq}, which {tp} does not divide", where=f"plan.placements[{node.name!r}]",
                              hint=f"use a sequence length that is a multiple of {tp}, or re-plan with "
                                   f"sequence_parallel=False")


@compiler_pass(requires=(LAYOUT, TENSOR, UNIT, REQUIRES_GRAD), provides=(INSERTED,))
def insert_collectives(gm, ctx):
    """Rewrite the graph into this tp rank's program: local shapes, a collective wherever layouts differ."""
    check_sequence_shards(gm, ctx.plan.mesh.tp)
    rewriter = TpRewriter(gm, tp_rank=ctx.coords["tp"], tp_size=ctx.plan.mesh.tp, device=torch.device(ctx.device))
    graph = rewriter.run()
    graph.eliminate_dead_code()
    place_inserted(graph, [node for node in rewriter.inserted if node.graph is graph and node in graph.nodes
                           and not node.op == "get_attr"], "tp resharding")
    root = torch.nn.Module()
    root.tp_group = root.comm_counter = collectives.UNATTACHED  # this process's are attached by the runtime
    program = GraphModule(root, graph, class_name=f"Rank{ctx.rank}Program")
    program.meta.update(gm.meta)
    return program

