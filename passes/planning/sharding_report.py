"""What the tensor split left whole, and why, in the plan's words (notes that ``xirang explain`` prints).

An op the split keeps replicated runs whole on every tp rank. For the ops that hold the work of a model
(products, attention, embeddings, the loss: ``sharding_rules.COMPUTE_RULES``) the notes name each one
with its module and one of two reasons:

- "no split fits": its rule offers no sharded row at this tp (``strategies_for`` gives only the
  replicated one), e.g. a linear whose in- and out-features tp does not divide, or attention whose
  kv heads tp neither divides nor broadcasts;
- "cheaper whole": rows were offered and the ILP found every split dearer (the collectives a split
  needs, with the reshards to neighbours that have no rule and run whole, cost more than the compute
  it saves at this width and sequence).

Ops with no rule at all are listed by the plan already (``plan.fallbacks``). Views and pointwise ops
follow their neighbours, so they are not named one by one.

``idle_tp_warning`` is the line that a plan with tp > 1 whose split shards no parameter and splits no
op carries: its tp ranks would do the same work tp times, and the plan says so rather than hide it.
"""
from __future__ import annotations

from typing import Mapping

from torch.fx import Node

from xirang.ir.meta_keys import MODULE_PATH, ROLE
from xirang.ir.placement import PlanReplicate, PlanShard
from xirang.passes.analysis.op_tables import op_packet
from xirang.passes.planning.sharding_rules import COMPUTE_RULES, strategies_for

NAMED = 8  # ops named per reason; the rest are counted


def _where(node: Node) -> str:
    path = MODULE_PATH.get(node, "")
    return f"{node.name} ('{path}')" if path else node.name


def _listed(nodes: list[Node]) -> str:
    return ", ".join(_where(n) for n in nodes[:NAMED]) + (f", and {len(nodes) - NAMED} more" if len(nodes) > NAMED
                                                           else "")


def replicated_compute(gm, placements: Mapping, tp: int) -> dict[str, list[Node]]:
    """{"no split fits": [...], "cheaper whole": [...]}: the compute ops the plan keeps replicated at ``tp``."""
    found: dict[str, list[Node]] = {"no split fits": [], "cheaper whole": []}
    if tp == 1:
        return found
    for node in gm.graph.nodes:
        chosen = placements.get(node.name)
        if node.op != "call_function" or chosen is None or op_packet(node) not in COMPUTE_RULES:
            continue
        if chosen.strategy != "replicate":
            continue
        offered = len(strategies_for(node, tp)) > 1
        found["cheaper whole" if offered else "no split fits"].append(node)
    return found


def replicated_notes(gm, placements: Mapping, tp: int) -> tuple[str, ...]:
    """Plan notes naming each compute op kept whole at ``tp`` with its reason (module docstring)."""
    found = replicated_compute(gm, placements, tp)
    notes = []
    if found["no split fits"]:
        notes.append(f"tp={tp}: {len(found['no split fits'])} compute op(s) run whole on every tp rank because no "
                     f"split of theirs fits tp={tp} (the dims their rule splits are of size 1, or not multiples of "
                     f"{tp} where no padded split is offered): "
                     f"{_listed(found['no split fits'])}")
    if found["cheaper whole"]:
        notes.append(f"tp={tp}: {len(found['cheaper whole'])} compute op(s) run whole on every tp rank because the "
                     f"split prices them cheaper whole (a split's collectives, with the reshards to neighbours that "
                     f"run whole, cost more than the compute it saves): {_listed(found['cheaper whole'])}")
    warning = idle_tp_warning(gm, placements, tp)
    return tuple(notes) + ((warning,) if warning else ())


def idle_tp_warning(gm, placements: Mapping, tp: int) -> str | None:
    """The warning a plan with tp > 1 carries when its split shards no parameter; None otherwise."""
    if tp == 1:
        return None
    split_params = split_ops = 0
    for node in gm.graph.nodes:
        chosen = placements.get(node.name)
        if chosen is None or not chosen.outputs:
            continue
        sharded = any(isinstance(layout.tp, PlanShard) for layout in chosen.outputs)
        if node.op == "placeholder" and ROLE.get(node, None) == "parameter":
            split_params += sharded
        elif node.op == "call_function":
            split_ops += any(not isinstance(layout.tp, PlanReplicate) for layout in chosen.outputs)
    if split_params:
        return None
    does = ("splits no op either: its tp ranks do the same work" if not split_ops else
            f"splits {split_ops} op(s) but holds every weight whole on each of its tp ranks")
    return (f"warning: tp={tp} shards none of this model's parameters and {does}; plan with tp=1 "
            f"(the ranks go to dp or pp), or see the ops named above for what keeps the split whole")
