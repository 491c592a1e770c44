"""Vocabulary-parallel embedding and cross-entropy in a rank's program (Shoeybi et al. 2019, sec. 3).

Where the plan chose strategy "vocab_parallel", the aten op is replaced by a call to
``codegen/ops/vocab_parallel``: each rank holds rows ``[vocab_start, vocab_start + local)`` of the
vocabulary, so ``vocab_start`` is a constant of the rank's program (``tp_rank * ceil(V / tp)``).
The embedding returns the Partial(sum) part (the edge to its reader reduces it); the cross-entropy
returns the full (replicated) loss.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from xirang.ir.errors import XirangError

aten = torch.ops.aten
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
VOCAB_PARALLEL_OPS = (aten.embedding.default, aten.cross_entropy_loss.default)


def _arg(node: Node, args: tuple, kwargs: dict, position: int, name: str, default):
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def vocab_parallel_call(rewriter, node: Node, args: tuple, kwargs: dict) -> Node:
    """The node computing ``node`` vocabulary-parallel on the rewriter's tp rank."""
    from xirang.codegen.ops import vocab_parallel

    tp, rank = rewriter.tp_size, rewriter.tp_rank
    comm = {"group": rewriter.attr("tp_group"), **rewriter.comm()}
    if node.target is aten.embedding.default:
        vocab = int(node.args[0].meta["val"].shape[0])
        if _arg(node, args, kwargs, 2, "padding_idx", -1) != -1 or _arg(node, args, kwargs, 4, "sparse", False):
            raise XirangError("a vocabulary-parallel embedding with padding_idx or sparse gradients",
                              where=f"node {node.name}", hint="pin tp=1 for now, or drop padding_idx")
        start = rank * -(-vocab // tp)
        return rewriter.graph.create_node(
            "call_function", vocab_parallel.vocab_parallel_embedding, (args[1], args[0]),
            {"vocab_start": start, "vocab_size": vocab, **comm}, name=node.name)
    logits = node.args[0]
    class_dim = 1 if logits.meta["val"].dim() >= 2 else 0
    vocab = int(logits.meta["val"].shape[class_dim])
    reduction = REDUCTIONS[_arg(node, args, kwargs, 3, "reduction", 1)]
    if _arg(node, args, kwargs, 2, "weight", None) is not None or _arg(node, args, kwargs, 5, "label_smoothing", 0.0):
        raise XirangError("a vocabulary-parallel cross-entropy with class weights or label smoothing",
                          where=f"node {node.name}", hint="re-plan: the sharding rules do not offer it")
    start = rank * -(-vocab // tp)
    return rewriter.graph.create_node(
        "call_function", vocab_parallel.vocab_parallel_cross_entropy, (args[0], args[1]),
        {"vocab_start": start, "vocab_size": vocab, "ignore_index": _arg(node, args, kwargs, 4, "ignore_index", -100),
         "reduction": reduction, **comm}, name=node.name)
