"""Count the bytes each node reads, writes, and keeps alive for the backward pass.

Each op has a row in ``TRAFFIC_RULES``: which storages autograd saves for its backward, and, where
the default is wrong, what it reads and writes. The defaults: an op reads every tensor input in full
and writes its outputs. Views and aliases (``ALIAS_OPS``) move no bytes. All sizes are sympy
expressions in the batch/seq symbols.

What "saved" counts, and why:
- Storages, not tensors: each saved tensor is named by the storage it keeps alive (``SavedTensor``),
  a view followed to the tensor it views (``storage_of``), which it keeps alive whole: k and v read
  as views of one fused qkv projection keep the one qkv storage. So memory is liveness: the storages
  a set of ops saves, each once (``live_saved_bytes``), not a sum per op, which counted a tensor two
  ops keep (a LayerNorm output fed to separate q, k and v Linears) at each.
- Only activations. A saved parameter, buffer or constant (or a view of one) costs nothing extra:
  it is resident anyway, so it is left out.
- Only what the gradients actually needed require: ``mm(a, b)`` keeps ``b`` to compute ``da`` and
  ``a`` to compute ``db`` (the autograd formulas in torch's derivatives.yaml), and nothing when the
  output needs no gradient.
- An op's own intermediates are storages of their own: a dropout's mask (one byte per element), a
  norm's float32 statistics, a cross-entropy's log-probabilities, a fused attention's logsumexp.
- Attention is priced as the fused (flash / memory-efficient) kernels save it: q, k, v, the output
  and the float32 logsumexp, never the (seq x seq) score matrix.
Ops with no row: the default read/write, and saved = every activation input when the output needs a
gradient (an over-estimate, the safe side for memory); ``ops_without_traffic_rule`` lists them.
"""

import logging

import sympy
from torch.fx import Node

from xirang.ir.facts import ByteCount
from xirang.ir.meta_keys import BYTES, REQUIRES_GRAD, ROLE, TENSOR
from xirang.ir.pass_spec import compiler_pass
from xirang.ir.run_log import once_per_run

from xirang.passes.analysis.op_tables import in_any, op_packet, ops_missing_from
from xirang.passes.analysis.saved_storages import (ALIAS_OPS, ZERO, distinct, input_saved, is_alias,
                                                    live_saved_bytes, nbytes)
from xirang.passes.analysis.traffic_rules import TRAFFIC_RULES

log = once_per_run(logging.getLogger(__name__))  # a warning about the model: once per run, rank 0


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD, ROLE), provides=(BYTES,))
def count_bytes(gm, ctx):
    """Record the bytes each node reads, writes and saves for backward, as sympy expressions."""
    for node in gm.graph.nodes:
        BYTES.set(node, node_bytes(node))
    unknown = ops_without_traffic_rule(gm)
    if unknown:
        log.warning("count_bytes: no rule for %s; priced as read-all, write-all, save-all-inputs",
                    ", ".join(f"{op} (x{len(names)})" for op, names in unknown.items()))
    return gm


def node_bytes(node: Node) -> ByteCount:
    """Bytes read, written and saved for backward by one node."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return ByteCount(read=ZERO, written=ZERO, saved_for_backward=ZERO)
    rule = TRAFFIC_RULES.get(op_packet(node))
    if is_alias(node):
        return ByteCount(read=ZERO, written=ZERO, saved_for_backward=ZERO)
    read = sympy.Add(*(nbytes(i) for i in node.all_input_nodes))
    written = nbytes(node)
    if rule is None and op_packet(node) in ALIAS_OPS:  # a view op that copies here (saved_storages._reshape_copies):
        saved = ()  # its backward reshapes the gradient back and keeps nothing
    elif rule is None:  # unknown op: assume every activation input is kept (see module docstring)
        saved = tuple(item for i in node.all_input_nodes for item in input_saved(node, i)) \
            if REQUIRES_GRAD.get(node, False) else ()
    else:
        if rule.read is not None:
            read = rule.read(node)
        if rule.extra_written is not None:
            written = written + rule.extra_written(node)
        saved = rule.saved(node)
    saved = distinct(saved)
    return ByteCount(read=read, written=written, saved_for_backward=sympy.Add(*(t.nbytes for t in saved)),
                     saved=saved)


def ops_without_traffic_rule(gm) -> dict[str, list[str]]:
    """Op name -> names of the nodes that call an op ``TRAFFIC_RULES`` has no row for."""
    return ops_missing_from(gm, in_any(ALIAS_OPS, TRAFFIC_RULES))


def total_bytes(gm) -> ByteCount:
    """Sum of every node's bytes read and written; saved: the storages the whole graph keeps for the
    backward, each once (``live_saved_bytes``)."""
    nodes = [n for n in gm.graph.nodes if BYTES.has(n)]
    counts = [BYTES.get(n) for n in nodes]
    return ByteCount(read=sympy.Add(*(c.read for c in counts)),
                     written=sympy.Add(*(c.written for c in counts)),
                     saved_for_backward=live_saved_bytes(nodes))
