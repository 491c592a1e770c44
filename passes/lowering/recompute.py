"""Lowering pass ``mark_recompute``: which ops the compiled program recomputes in the backward,
enacting ``plan.recompute`` (Chen et al. 2016; Korthikanti et al. 2022).

- ``"full"``: every block (a node whose ``UNIT`` is ``block:<path>``: passes/analysis/dependencies.py)
  is one region: the block keeps only its inputs after the forward and runs again when its backward
  starts (Megatron-LM's full recompute of each transformer layer). The segments between blocks
  (embedding, final norm, head, loss) keep their activations.
- ``"selective"``: in each unit, the attention core (passes/analysis/attention_core.py, the rule the
  planner prices): the ops of a written-out softmax(QKᵀ)·V whose tensors grow with seq², or a fused
  ``scaled_dot_product_attention`` op; the rest keeps its activations.
- ``"none"``: nothing is marked; the program is what it was before this pass existed.

Each node of a region gets ``RECOMPUTE`` = ``"<mode>:<unit>"``. ``split_stages`` outlines each region
of a stage into a sub-module run under ``torch.utils.checkpoint`` (passes/lowering/regions.py). A
region must be convex (no path leaves it and comes back), so the nodes on such a path join it, and
a tuple's ``getitem`` goes with its producer. The tp collectives of a region run again in its
recompute, in the same order on every tp rank (as Megatron-LM's full recompute does); the
communication counter counts them again, since they move the bytes again.
"""
from __future__ import annotations

import operator

from torch import fx

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import RECOMPUTE, REQUIRES_GRAD, STAGE, SYMBOLS, TENSOR, UNIT
from xirang.ir.pass_spec import compiler_pass

from xirang.passes.analysis.attention_core import in_eager_core, is_fused_attention

COMPUTING = ("call_function", "call_method", "call_module")


@compiler_pass(requires=(UNIT, STAGE, REQUIRES_GRAD, TENSOR), provides=(RECOMPUTE,))
def mark_recompute(gm, ctx):
    """Mark the regions the backward recomputes under plan.recompute (full: blocks; selective: attention cores)."""
    mode = ctx.plan.recompute
    if mode == "none":
        return gm
    if mode == "full":
        chosen = [node for node in gm.graph.nodes if node.op in COMPUTING and STAGE.has(node)
                  and UNIT.get(node, "").startswith("block:")]
    elif mode == "selective":
        seq_known = "seq" in SYMBOLS.get(gm, {})
        chosen = [node for node in gm.graph.nodes if STAGE.has(node)
                  and (is_fused_attention(node) or in_eager_core(node, seq_known=seq_known))]
    else:
        raise XirangError(f"plan.recompute is {mode!r}, which no lowering enacts", where="plan.recompute",
                          hint="use 'none', 'selective' or 'full'")
    regions: dict[str, list] = {}
    for node in chosen:
        regions.setdefault(f"{mode}:{UNIT.get(node)}", []).append(node)
    for region, nodes in regions.items():
        for node in convex_region(gm.graph, nodes):
            found = RECOMPUTE.get(node, None)
            if found is not None and found != region:
                raise XirangError(f"node {node.name} lies in two recompute regions, {found} and {region}",
                                  where=f"node {node.name} ({node.target})",
                                  hint="report this model: its attention cores are not separable by unit")
            RECOMPUTE.set(node, region)
    return gm


def convex_region(graph: fx.Graph, nodes) -> list:
    """``nodes`` plus every node on a path that leaves them and comes back, plus the ``getitem`` of a
    tuple produced inside; graph order. Such a set can be outlined into one call in graph order."""
    order = {node: position for position, node in enumerate(graph.nodes)}
    members = set(nodes)
    lo, hi = min(order[n] for n in members), max(order[n] for n in members)
    span = [node for node in graph.nodes if lo <= order[node] <= hi]
    after = set()  # reached from the region
    for node in span:
        if node in members or any(arg in after for arg in node.all_input_nodes):
            after.add(node)
    before = set()  # reaches the region
    for node in reversed(span):
        if node in members or any(user in before for user in node.users):
            before.add(node)
    members |= after & before
    for node in list(members):
        members.update(user for user in node.users if user.op == "call_function" and user.target is operator.getitem)
    return sorted(members, key=order.__getitem__)
