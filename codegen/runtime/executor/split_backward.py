"""The zero-bubble schedules' split backward of one stage: B (input gradients) and W (weight gradients).

B is torch.distributed.pipelining's ``stage_backward_input``: the gradient w.r.t. the stage inputs,
keeping, per group of weights, the gradient that reached each op using them (its "intermediates").
W back-propagates those kept gradients into the weights only (for a weight read by several ops, what
lies between them runs again).
W uses ``torch.autograd.backward`` (not torch's ``stage_backward_weight``, which writes ``.grad``
directly) so that the data-parallel buckets' gradient hooks fire.

torch groups the weights by the ops that read them (one group per weight here). A group whose weight
is read by two ops where one feeds the other (a bias added twice, a matrix or a layer applied twice
in a chain) reaches its earlier op through the later one, and so through graph that other groups'
calls back-propagate too: run one after the other, the second found its saved tensors freed (torch's
own W fails there with "Trying to backward through the graph a second time"). Every call but the
last therefore keeps the graph (it lives until W ends anyway: B kept it for W), and every op is
handed exactly its kept gradient (a pre-hook per op), so what flows into it from a later op of the
same call is replaced, not added, and nothing counts twice.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


def backward_input(outputs: list, grads: list, inputs: list, weights: list) -> tuple[list, list]:
    """B: (the gradients of ``inputs``, the weight groups W needs), from ``outputs`` and their ``grads``."""
    return stage_backward_input(outputs, grads, inputs, iter(weights))


def ungrouped_weights(groups: list, weights: list) -> list[int]:
    """Indices of ``weights`` in no group: read on no path from the stage's inputs, so W cannot reach them."""
    grouped = {node for group in groups for node in group["params"]}
    return [i for i, weight in enumerate(weights) if _get_grad_fn_or_grad_acc(weight) not in grouped]


def backward_weights(groups: list, weights: list) -> None:
    """W: B's weight ``groups`` into ``weights``, one autograd call per group (``xirang calibrate`` times
    this too)."""
    weight_of = {_get_grad_fn_or_grad_acc(weight): weight for weight in weights}
    for i, group in enumerate(groups):
        _weight_backward(group, weight_of, keep_graph=i < len(groups) - 1)
    for group in groups:  # drop the hold on the graph now: left to the garbage collector (B's hooks made
        group.pop("intermediates", None)  # a cycle through it), the stage's activations outlive the step's W
        group.pop("grads", None)


def _weight_backward(group: dict, weight_of: dict, keep_graph: bool) -> None:
    """One autograd call: the gradients B kept at the group's ops, back-propagated into its weights."""
    ops = list(zip(group.get("grads") or [], group["intermediates"]))
    edges, grads = [], []
    for kept, node in ops:
        for index, grad in enumerate(kept):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                grads.append(grad)
    if not edges:
        return
    handles = []
    if len(ops) > 1:  # a later op's gradient into an earlier one is already in the earlier one's kept
        handles = [node.register_prehook(lambda _outputs, kept=kept: kept) for kept, node in ops]
    try:
        torch.autograd.backward(edges, grads, inputs=[weight_of[node] for node in group["params"]],
                                retain_graph=keep_graph)
    finally:
        for handle in handles:
            handle.remove()
