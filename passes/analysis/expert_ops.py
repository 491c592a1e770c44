"""``xirang::expert_linear``: the op an experts module's two matmuls are captured as.

Row ``s`` of ``rows`` is multiplied by the weight of expert ``ids[s]`` (plus its bias):

    out[s] = rows[s] @ weight[ids[s]].T + bias[ids[s]]      (weight: experts x out x in)
    out[s] = rows[s] @ weight[ids[s]]   + bias[ids[s]]      (transposed: experts x in x out)

Its output shape is the rows' count by the output features whatever the routing, so a model traced
with it gives one graph on ``meta``, on a CPU and on a GPU (the Hugging Face implementations choose
kernels and dtypes by device: passes/analysis/experts.py). It is an opaque custom op, kept as one
node by ``torch.export``, with its backward a second opaque op, so fake tensors (tracing, the
full-scale check) never see the data-dependent loop inside.

On real tensors the rows are sorted by expert and each expert's rows multiplied as one matrix
(one host read of the per-expert counts); the same arithmetic as Hugging Face's eager loop, so a
captured model trains as the model does. Expert parallelism (codegen/ops/expert_dispatch.py) calls it
with the rows sent to this rank and its local experts' weights: the op does not know about ranks.
"""
from __future__ import annotations

from typing import Optional

import torch

OP = "xirang::expert_linear"


def _out_features(weight: torch.Tensor, transposed: bool) -> int:
    return weight.shape[2] if transposed else weight.shape[1]


def _groups(ids: torch.Tensor, experts: int):
    """The permutation sorting rows by expert, and each expert's row count (one host read)."""
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts).tolist() if ids.numel() else [0] * experts
    return order, counts


def _forward(rows: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             transposed: bool) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], _out_features(weight, transposed))
    order, counts = _groups(ids, weight.shape[0])
    sorted_rows, start, pieces = rows[order], 0, []
    for expert, count in enumerate(counts):
        if not count:
            continue
        part = sorted_rows[start:start + count]
        w = weight[expert]
        y = part @ (w if transposed else w.t())
        pieces.append(y + bias[expert] if bias is not None else y)
        start += count
    if pieces:
        out.index_copy_(0, order, torch.cat(pieces))
    return out


def _backward(grad: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, has_bias: bool,
              transposed: bool):
    experts, out_features = weight.shape[0], _out_features(weight, transposed)
    grad_rows = torch.zeros_like(rows)
    grad_weight = torch.zeros_like(weight)
    grad_bias = grad.new_zeros(experts, out_features) if has_bias else grad.new_zeros(0)
    order, counts = _groups(ids, experts)
    sorted_rows, sorted_grad, start, pieces = rows[order], grad[order], 0, []
    for expert, count in enumerate(counts):
        if not count:
            continue
        x, g, w = sorted_rows[start:start + count], sorted_grad[start:start + count], weight[expert]
        if transposed:  # y = x @ w: dx = g @ w.T, dw = x.T @ g
            pieces.append(g @ w.t())
            grad_weight[expert] = x.t() @ g
        else:  # y = x @ w.T: dx = g @ w, dw = g.T @ x
            pieces.append(g @ w)
            grad_weight[expert] = g.t() @ x
        if has_bias:
            grad_bias[expert] = g.sum(0)
        start += count
    if pieces:
        grad_rows.index_copy_(0, order, torch.cat(pieces))
    return grad_rows, grad_weight, grad_bias


@torch.library.custom_op(OP, mutates_args=())
def expert_linear(rows: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  transposed: bool) -> torch.Tensor:
    return _forward(rows, ids, weight, bias, transposed)


@expert_linear.register_fake
def _expert_linear_fake(rows, ids, weight, bias, transposed):
    # the real op multiplies rows by the weights: refuse what a matmul refuses, so a dry run on fake
    # tensors (xirang check) fails where the run would (fp32 rows into a bf16 program's expert weights)
    if rows.dtype != weight.dtype:
        raise RuntimeError(f"expert_linear: rows are {rows.dtype} and the expert weights {weight.dtype}: a matmul "
                           f"needs one dtype")
    return rows.new_empty(rows.shape[0], _out_features(weight, transposed))


@torch.library.custom_op("xirang::expert_linear_backward", mutates_args=())
def expert_linear_backward(grad: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                           has_bias: bool, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, rows, ids, weight, has_bias, transposed)


@expert_linear_backward.register_fake
def _expert_linear_backward_fake(grad, rows, ids, weight, has_bias, transposed):
    grad_bias = grad.new_empty(weight.shape[0], _out_features(weight, transposed)) if has_bias else grad.new_empty(0)
    return torch.empty_like(rows), torch.empty_like(weight), grad_bias


def _setup_context(ctx, inputs, output):
    rows, ids, weight, bias, transposed = inputs
    ctx.save_for_backward(rows, ids, weight)
    ctx.has_bias, ctx.transposed = bias is not None, transposed


def _expert_linear_grad(ctx, grad):
    rows, ids, weight = ctx.saved_tensors
    grad_rows, grad_weight, grad_bias = torch.ops.xirang.expert_linear_backward(
        grad.contiguous(), rows, ids, weight, ctx.has_bias, ctx.transposed)
    return grad_rows, None, grad_weight, (grad_bias if ctx.has_bias else None), None


expert_linear.register_autograd(_expert_linear_grad, setup_context=_setup_context)


EXPERT_LINEAR = torch.ops.xirang.expert_linear.default
WEIGHT_ARGS = (2, 3)  # expert_linear(rows, ids, weight, bias, transposed)


def expert_calls(graph) -> dict:
    """ids node -> the expert_linear calls reading it, in graph order: one entry per experts module call."""
    found = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target == EXPERT_LINEAR:
            found.setdefault(node.args[1], []).append(node)
    return found


def routed_rows(graph) -> frozenset:
    """The nodes whose dim 0 holds an experts call's rows as expert parallelism sends them: every
    ``expert_linear`` of a call and the row-local gate between its first and its last (the nodes on a
    path from the first to the last). Under ep > 1 a rank holds as many of these rows as the routing
    sent it, a data-dependent count (passes/lowering/expert_parallel.py): no fixed slicing of that dim
    (a tp shard of it) keeps every row."""
    found = set()
    for linears in expert_calls(graph).values():
        first, last = linears[0], linears[-1]
        ahead, stack = {first}, [first]
        while stack:  # everything the first call's output reaches, up to the last call
            node = stack.pop()
            if node is last:
                continue
            for user in node.users:
                if user not in ahead:
                    ahead.add(user)
                    stack.append(user)
        between, stack = {last}, [last]
        while stack:  # of those, what the last call reads
            for value in stack.pop().all_input_nodes:
                if value in ahead and value not in between:
                    between.add(value)
                    stack.append(value)
        found |= between | set(linears)
    return frozenset(found)


def is_expert_weight(node) -> bool:
    """A node read as an expert_linear's weight or bias."""
    return any(user.op == "call_function" and user.target == EXPERT_LINEAR
               and any(i < len(user.args) and user.args[i] is node for i in WEIGHT_ARGS) for user in node.users)


def expert_count(graph) -> int:
    """The experts every experts call can be split by: the gcd of their weights' expert counts (0: none)."""
    import math
    counts = [int(call.args[2].meta["val"].shape[0]) for calls in expert_calls(graph).values() for call in calls[:1]]
    return math.gcd(*counts) if counts else 0
