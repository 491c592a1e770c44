"""Lowering pass ``overlap_tp_collectives``: where ``plan.tp_overlap`` says so, each linear and the
sequence-parallel collective next to it become one chunked collective matmul
(codegen/ops/collective_matmul.py: Wang et al. 2023; PyTorch's async-TP), so the collective of one
chunk runs while another chunk's matmul computes, forward and backward.

Two rewrites, as rules that return nothing when they do not apply:

- ``gather_summing_grad(x, tp_group, dim) -> aten.linear(., W, b)`` (a column-parallel linear reading
  a sequence shard whole) becomes ``gather_linear(x, W, b, tp_group, dim, chunks=...)``;
- a gather read by several linears (q, k and v; gate and up) becomes one ``gather_linears`` (their
  weights stacked) whose outputs the linears' nodes take with ``getitem``;
- ``aten.linear(x, W, b) -> reduce_scatter_to_group(., tp_group, dim)`` (a row-parallel linear whose
  partial output becomes a sequence shard) becomes ``linear_reduce_scatter(x, W, b, tp_group, dim, ...)``.

Each applies only where the collective's one reader (or producer) is that linear, both run in the same
unit (so no computation moves to another pipeline stage and the stage's sends stay the plan's) and
``dim`` is a row dim of the matmul. The linear's node is kept (its name, unit and meta; for the
reduce-scatter it takes over the collective's local ``TENSOR``; it is not marked ``INSERTED``, which
would let ``assign_stages`` move it), the collective's node goes. The
bytes each collective moves are unchanged, so the plan's tp byte count still holds
(``CommRecord.chunks`` shows the pieces). ``plan.tp_overlap`` 0 leaves the graph as it is.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from xirang.codegen.ops import collective_matmul, collectives
from xirang.ir.meta_keys import INSERTED, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass

LINEAR = torch.ops.aten.linear.default


def _row_dim(node, dim) -> bool:
    """``dim`` of ``node``'s local tensor is a row of a matmul (not its contracted last dim)."""
    info = TENSOR.get(node, None)
    rank = len(info.shape) if info is not None else None
    return isinstance(dim, int) and rank is not None and 0 <= dim % rank < rank - 1


def _linear_args(linear) -> tuple:
    x, weight, *rest = linear.args
    return x, weight, rest[0] if rest else None


def fuse_gather_linear(gather, chunks: int) -> bool:
    """``gather_summing_grad -> linear`` as ``gather_linear``; False where the rule does not apply."""
    if gather.target is not collectives.gather_summing_grad or len(gather.users) != 1:
        return False
    linear = next(iter(gather.users))
    x, group, dim = gather.args
    if linear.target is not LINEAR or linear.args[0] is not gather or linear.kwargs or gather in linear.args[1:] \
            or UNIT.get(linear, None) != UNIT.get(gather, None) or not _row_dim(x, dim):
        return False
    _, weight, bias = _linear_args(linear)
    linear.target = collective_matmul.gather_linear
    linear.args = (x, weight, bias, group, dim)
    linear.kwargs = {"chunks": chunks, "full_size": gather.kwargs.get("full_size"),
                     "counter": gather.kwargs["counter"]}
    gather.graph.erase_node(gather)
    return True


def fuse_gather_linears(gather, chunks: int) -> bool:
    """``gather_summing_grad`` read by several linears (q, k, v) as one ``gather_linears`` whose outputs the
    linears' nodes take (``getitem``); False where the rule does not apply."""
    if gather.target is not collectives.gather_summing_grad:
        return False
    linears = list(gather.users)
    x, group, dim = gather.args
    if len(linears) < 2 or not _row_dim(x, dim) or any(
            user.target is not LINEAR or user.args[0] is not gather or user.kwargs or gather in user.args[1:]
            or UNIT.get(user, None) != UNIT.get(gather, None) for user in linears):
        return False
    first = min(linears, key=_position(gather.graph))
    params = [value for linear in linears for value in _linear_args(linear)[1:] if isinstance(value, Node)]
    if any(_position(gather.graph)(value) > _position(gather.graph)(first) and not _bound_only(value)
           for value in params):
        return False  # a weight computed after the first linear from activations: leave it
    for value in params:  # casts of parameters (half precision) may sit after the first linear
        if _position(gather.graph)(value) > _position(gather.graph)(first):
            first.prepend(value)
    with gather.graph.inserting_before(first):
        weights, biases = zip(*(_linear_args(linear)[1:] for linear in linears))
        fused = gather.graph.call_function(collective_matmul.gather_linears, (x, weights, biases, group, dim), {
            "chunks": chunks, "full_size": gather.kwargs.get("full_size"), "counter": gather.kwargs["counter"]})
    fused.meta.update({key: value for key, value in gather.meta.items() if key != TENSOR.name})
    TENSOR.set(fused, tuple(TENSOR.get(linear) for linear in linears))
    INSERTED.set(fused, f"tp overlap: {INSERTED.get(gather, 'all-gather')} and its {len(linears)} linears")
    for index, linear in enumerate(linears):
        linear.target, linear.args, linear.kwargs = operator.getitem, (fused, index), {}
    gather.graph.erase_node(gather)
    return True


def _position(graph):
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _bound_only(node) -> bool:
    """``node`` computes from placeholders alone (a parameter's cast), so it can move earlier."""
    return node.op == "call_function" and all(arg.op == "placeholder" for arg in node.all_input_nodes)


def fuse_linear_reduce_scatter(scatter, chunks: int) -> bool:
    """``linear -> reduce_scatter_to_group`` as ``linear_reduce_scatter``; False where it does not apply."""
    if scatter.target is not collectives.reduce_scatter_to_group:
        return False
    linear, group, dim = scatter.args
    if getattr(linear, "target", None) is not LINEAR or len(linear.users) != 1 or linear.kwargs \
            or UNIT.get(linear, None) != UNIT.get(scatter, None) or not _row_dim(linear, dim):
        return False
    x, weight, bias = _linear_args(linear)
    linear.target = collective_matmul.linear_reduce_scatter
    linear.args = (x, weight, bias, group, dim)
    linear.kwargs = {"chunks": chunks, "counter": scatter.kwargs["counter"]}
    TENSOR.set(linear, TENSOR.get(scatter))  # the node now yields this rank's sequence shard
    scatter.replace_all_uses_with(linear)
    scatter.graph.erase_node(scatter)
    return True


@compiler_pass(requires=(INSERTED, TENSOR, UNIT))
def overlap_tp_collectives(gm, ctx):
    """Fuse each sequence-parallel all-gather / reduce-scatter with its linear into a chunked collective matmul."""
    chunks = ctx.plan.tp_overlap
    if not chunks or ctx.plan.mesh.tp == 1:
        return gm
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.graph is gm.graph:
            fuse_gather_linear(node, chunks) or fuse_gather_linears(node, chunks) \
                or fuse_linear_reduce_scatter(node, chunks)
    gm.graph.lint()
    gm.recompile()
    return gm
