"""Where a node a lowering pass inserted runs: the unit (and so the pipeline stage) it belongs to.

A collective or cast inserted into a rank's program takes the ``UNIT`` of the first node that
reads it, so a resharding runs in its consumer's stage: an f before a block runs with the block,
and what crosses a pipeline cut is the replicated residual, once. A chain of insertions (a cast
feeding a gather) is placed readers first, so each link takes its reader's unit. A node nobody
reads takes its producer's.
"""
from __future__ import annotations

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import INSERTED, REQUIRES_GRAD, TENSOR, UNIT


def place_inserted(graph, inserted: list, why: str) -> None:
    """Mark each node of ``inserted`` (in graph order) with ``why`` and its reader's unit."""
    order = {node: position for position, node in enumerate(graph.nodes)}
    for node in inserted:
        if not INSERTED.has(node):
            INSERTED.set(node, why)
    for node in reversed(inserted):
        readers = sorted((user for user in node.users if UNIT.has(user)), key=order.get)
        producers = [arg for arg in node.all_input_nodes if UNIT.has(arg)]
        unit = readers[0] if readers else producers[0] if producers else None
        if unit is None:
            raise XirangError(f"the inserted node {node.name} ({node.target}) has no unit: neither what it reads "
                              f"nor what reads it belongs to one", where=f"rank program node {node.name}",
                              hint="report this model; as a workaround plan with pp=1")
        UNIT.set(node, UNIT.get(unit))


def read_through(graph, node, target, *extra):
    """A call ``target(node, *extra)`` inserted after ``node`` that every other reader of ``node`` now reads
    instead (its facts: ``node``'s tensor and whether it takes a gradient). Returns the new node."""
    with graph.inserting_after(node):
        made = graph.call_function(target, (node, *extra))
    node.replace_all_uses_with(made, delete_user_cb=lambda user: user is not made)
    if TENSOR.has(node):
        TENSOR.set(made, TENSOR.get(node))
    REQUIRES_GRAD.set(made, bool(REQUIRES_GRAD.get(node, False)))
    return made
