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

Full recompute: a region under ``torch.utils.checkpoint`` (non-reentrant) is recomputed once per
autograd call that reads it, and each recompute is kept until the graph is freed; one call per
weight rebuilt every block once per weight and held them all (a small bf16 Llama at pp 2, ZB-H1:
pipeline rank 1 peaked at 6,534 KiB with full recompute, 3,142 without). So the calls of the groups
that run one op each (merged where an op reads two weights, a linear's weight and bias) share one
recompute (``GraphExecGroup``: 2,726 KiB there): each op's backward runs in exactly one of them, so
none reads a saved tensor another read, which the shared recompute forbids. A chained group walks
ops other calls run too, and keeps its own call and recompute, after them.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import GraphExecGroup
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


def backward_input(outputs: list, grads: list, inputs: list, weights: list) -> tuple[list, list]:
    """B: (the gradients of ``inputs``, the weight groups W needs), from ``outputs`` and their ``grads``."""
    return stage_backward_input(outputs, grads, inputs, iter(weights))


def ungrouped_weights(groups: list, weights: list) -> list[int]:
    """Indices of ``weights`` in no group: read on no path from the stage's inputs, so W cannot reach them."""
    grouped = {node for group in groups for node in group["params"]}
    return [i for i, weight in enumerate(weights) if _get_grad_fn_or_grad_acc(weight) not in grouped]


def backward_weights(groups: list, weights: list) -> None:
    """W: B's weight ``groups`` into ``weights``; the one-op calls under one shared recompute, then the chained
    groups' (module docstring). ``xirang calibrate`` times this too."""
    weight_of = {_get_grad_fn_or_grad_acc(weight): weight for weight in weights}
    single, chained = _calls(groups)
    with GraphExecGroup():
        for i, call in enumerate(single):
            _weight_backward(call, weight_of, keep_graph=bool(chained) or i < len(single) - 1)
    for i, call in enumerate(chained):
        _weight_backward(call, weight_of, keep_graph=i < len(chained) - 1)
    for group in groups:  # drop the hold on the graph now: left to the garbage collector (B's hooks made
        group.pop("intermediates", None)  # a cycle through it), the stage's activations outlive the step's W
        group.pop("grads", None)


def _calls(groups: list) -> tuple[list, list]:
    """B's groups as W's autograd calls: groups sharing an op merged into one call (its ops and weights),
    split into those of one op and the chained ones (more than one op: a weight read by several)."""
    calls: list = []
    call_of: dict = {}  # op node -> index into calls
    for group in groups:
        ops = list(zip(group.get("grads") or [], group["intermediates"]))
        joined = sorted({call_of[node] for _, node in ops if node in call_of})
        call = {"ops": {}, "params": {}}
        for index in joined:  # an op already met: one call for both groups
            call["ops"].update(calls[index]["ops"])
            call["params"].update(calls[index]["params"])
            calls[index] = None
        call["ops"].update({node: kept for kept, node in ops})
        call["params"].update(dict.fromkeys(group["params"]))
        calls.append(call)
        for node in call["ops"]:
            call_of[node] = len(calls) - 1
    calls = [call for call in calls if call is not None]
    return [c for c in calls if len(c["ops"]) == 1], [c for c in calls if len(c["ops"]) > 1]


def _weight_backward(call: dict, weight_of: dict, keep_graph: bool) -> None:
    """One autograd call: the gradients B kept at the call's ops, back-propagated into its weights."""
    edges, grads = [], []
    for node, kept in call["ops"].items():
        for index, grad in enumerate(kept):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                grads.append(grad)
    if not edges:
        return
    handles = []
    if len(call["ops"]) > 1:  # a later op's gradient into an earlier one is already in the earlier one's kept
        handles = [node.register_prehook(lambda _outputs, kept=kept: kept) for node, kept in call["ops"].items()]
    try:
        torch.autograd.backward(edges, grads, inputs=[weight_of[node] for node in call["params"]],
                                retain_graph=keep_graph)
    finally:
        for handle in handles:
            handle.remove()
