"""Lowering pass ``mark_offload``: which blocks send their saved activations to host memory,
enacting ``plan.offload``.

``"blocks"``: every block (``UNIT`` = ``block:<path>``) gets ``OFFLOAD`` = its unit on each of its
computing nodes. ``split_stages`` outlines each such block of a stage into a sub-module
(``codegen/ops/activations.OffloadedBlock``, passes/lowering/regions.py) that the runtime points at
this process's ``ActivationOffload`` (codegen/runtime/memory/offload.py): what the block saves for its
backward is copied to host memory after its forward (parameters, already resident, stay) and
comes back ahead of the block's backward, prefetched one block ahead, on a side stream (CUDA) or
by a background copy thread (CPU ranks). ``"none"``: nothing is marked.

With ``recompute = "full"`` a block keeps only its inputs; those are what goes to host memory then
(the offloaded block holds the recomputed one). With ``"selective"`` the attention core's region
nests inside its block's: the core keeps its inputs, which are offloaded with the rest.
"""
from __future__ import annotations

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import OFFLOAD, STAGE, UNIT
from xirang.ir.pass_spec import compiler_pass

from xirang.passes.lowering.recompute import COMPUTING, convex_region


@compiler_pass(requires=(UNIT, STAGE), provides=(OFFLOAD,))
def mark_offload(gm, ctx):
    """Mark the blocks whose saved activations go to host memory under plan.offload."""
    mode = ctx.plan.offload
    if mode == "none":
        return gm
    if mode != "blocks":
        raise XirangError(f"plan.offload is {mode!r}, which no lowering enacts", where="plan.offload",
                          hint="use 'none' or 'blocks'")
    blocks: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op in COMPUTING and STAGE.has(node) and UNIT.get(node, "").startswith("block:"):
            blocks.setdefault(UNIT.get(node), []).append(node)
    for unit, nodes in blocks.items():
        for node in convex_region(gm.graph, nodes):
            found = OFFLOAD.get(node, None)
            if found is not None and found != unit:
                raise XirangError(f"node {node.name} lies between two blocks, {found} and {unit}",
                                  where=f"node {node.name} ({node.target})", hint="report this model")
            OFFLOAD.set(node, unit)
    return gm
