"""Expert parallelism in the cost model: a tensor split's unit costs as one rank of an ep group sees them.

The split ILP prices every unit with each experts call run whole on the rank (ep = 1: every rank
holds every expert and computes all its own tokens' rows). For a candidate with ep > 1 each unit
with experts is re-priced (``with_expert_parallel``), per micro-batch:

- memory: the unit's expert weights are ``experts / ep`` of them, so ``params_local`` loses
  ``expert_params * (1 - 1/ep)`` elements; gradients and optimizer state follow the parameters.
- communication, for each experts call: the dispatch and the combine each send the rank's whole row
  buffer, R = tokens x top_k x hidden x bytes (what the runtime's counter records: its own share
  included; as tp holds them: a row-parallel first matmul dispatches hidden / tp, a row-parallel last
  one combines its partial sums whole), on the ep group, forward, and their gradients the same way
  backward: four all-to-alls,
  ``collective_cost("all_to_all", ...)`` (pairwise exchange: (ep - 1)/ep of R crosses links), plus
  the count exchange before each dispatch (ep integers: its latency). At the most-loaded rank the
  buffers it receives are ``routing_imbalance`` times the mean, so each exchange is priced at
  ``R * routing_imbalance``: 1 (balanced routing) unless given, which is what a router trained with a
  load-balancing loss approaches and what forced-balance benchmarks measure; a measured max/mean
  load belongs in ``PlanChoices(routing_imbalance=...)``.
- compute: the experts' matmuls (``expert_seconds``) of the most-loaded rank take
  ``routing_imbalance`` times as long (a third forward, two thirds backward, as a matmul's).
- capacity factor ``f`` (``Plan.capacity_factor``, token dropping: codegen/ops/expert_capacity.py):
  each expert takes at most ceil(S / E x f) of the S rows each rank routes per micro-batch, so the
  rank holding E/ep experts receives at most ep x E/ep x S x f / E = f times the balanced rows: the
  exchanges and the extra expert compute of the most-loaded rank are priced at ``min(imbalance, f)``
  instead of ``imbalance`` (f < 1 also bounds the balanced rows: every expert full). The rows a rank
  sends are its own routing's whatever f, priced like those it receives.
- Not modelled: the activations of the most-loaded rank's extra rows (priced balanced); the expert
  gradients' reduction runs over the edp group, which is priced as the dp group's (dearer: an
  upper bound); at ep = 1 the compute dropped rows save (priced dropless).

The all-to-alls run on the critical path (the rows are needed by the next op), so they are counted
as their own cause, ``ep_comm``, not overlapped, unless the plan records ``ep_overlap``: Megatron-Core's
batch-level overlap (``--overlap-moe-expert-parallel-comm``, MCore v0.14: NVIDIA/Megatron-LM's
``combined_1f1b`` schedules and ``schedule_layer_1f1b`` in megatron/core) runs the forward
of one micro-batch and the backward of another layer by layer, attention and experts on the compute stream,
dispatch and combine on a communication stream, so one micro-batch's all-to-alls run under the other's
compute. Per micro-batch a unit with experts then takes max(C, A) instead of C + A (C: its forward and
backward compute, A: its four all-to-alls and the count exchanges), so only ``max(0, A - C)`` is priced
exposed, shared between forward and backward in proportion to their all-to-alls. Not modelled there: the
schedule's first forward and last backward, which have no partner (one micro-batch's A exposed per step),
and the contention of the two streams. Megatron refuses the overlap beside full recompute and, at pp > 1,
without virtual stages (the checks of its ``TransformerConfig``); a full recompute's second forward is priced
with its all-to-alls exposed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from xirang.ir.errors import InvalidValue
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

DEFAULT_ROUTING_IMBALANCE = 1.0
COUNT_BYTES = 8  # one int64 count per ep rank


def check_routing_imbalance(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise InvalidValue(f"routing_imbalance={value!r} must be a number >= 1: the most-loaded rank's rows over "
                           f"the mean (1: balanced routing)", where="PlanChoices(routing_imbalance=...)")
    return float(value)


def check_capacity_factor(value):
    """``value`` as a float, or None (dropless); refused unless a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidValue(f"capacity_factor={value!r} must be a number > 0 (each expert's rows per micro-batch over "
                           f"the balanced share), or None for dropless", where="PlanChoices(capacity_factor=...)")
    return float(value)


def has_experts(split: TensorSplit) -> bool:
    return any(u.expert_calls or u.expert_params for u in split.units)


def exchange_seconds(unit: UnitCost, ep: int, all_to_all: Callable[[float], float],
                     imbalance: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's all-to-alls of ``unit``'s experts calls."""
    if not unit.expert_calls:
        return 0.0, 0.0
    rows = unit.expert_rows_bytes / unit.expert_calls * imbalance
    back = (unit.expert_combine_bytes or unit.expert_rows_bytes) / unit.expert_calls * imbalance
    both = all_to_all(rows) + all_to_all(back)
    counts = all_to_all(COUNT_BYTES * ep)
    return unit.expert_calls * (both + counts), unit.expert_calls * both


def overlapped(forward: float, backward: float, compute: float) -> tuple[float, float]:
    """The exposed part of all-to-alls of ``forward`` + ``backward`` seconds run beside ``compute``
    seconds of another micro-batch (Megatron's batch-level overlap: max(C, A) - C exposed)."""
    total = forward + backward
    if total <= 0.0:
        return 0.0, 0.0
    exposed = max(0.0, total - compute)
    return forward * exposed / total, backward * exposed / total


def with_expert_parallel(split: TensorSplit, ep: int, all_to_all: Callable[[float], float],
                         imbalance: float = DEFAULT_ROUTING_IMBALANCE, overlap: bool = False,
                         capacity_factor: float | None = None) -> TensorSplit:
    """``split`` re-priced for one rank of an ep group of ``ep`` ranks (see the module docstring);
    ``all_to_all(nbytes)``: seconds of an all-to-all of an nbytes send buffer on the ep group;
    ``overlap``: the all-to-alls run under another micro-batch's compute (``Plan.ep_overlap``);
    ``capacity_factor``: the most-loaded rank's rows bounded at that many times the balanced ones."""
    if ep == 1 or not has_experts(split):
        return split
    if capacity_factor is not None:
        imbalance = min(imbalance, capacity_factor)
    units = []
    for unit in split.units:
        if not (unit.expert_calls or unit.expert_params):
            units.append(unit)
            continue
        held = unit.expert_params // ep
        forward, backward = exchange_seconds(unit, ep, all_to_all, imbalance)
        extra = unit.expert_seconds * (imbalance - 1.0)
        if overlap:
            forward, backward = overlapped(forward, backward, unit.forward_seconds + unit.backward_seconds + extra)
        units.append(replace(unit, params_local=unit.params_local - unit.expert_params + held, expert_params=held,
                             forward_seconds=unit.forward_seconds + extra / 3,
                             backward_seconds=unit.backward_seconds + 2 * extra / 3,
                             full_recompute_seconds=unit.full_recompute_seconds + extra / 3,
                             ep_comm_forward_seconds=forward, ep_comm_backward_seconds=backward))
    return replace(split, units=tuple(units))


def exchange_bytes_per_call(split: TensorSplit) -> float:
    """Bytes one rank's dispatch sends per experts call and micro-batch (the mean over the calls)."""
    calls = sum(u.expert_calls for u in split.units)
    return sum(u.expert_rows_bytes for u in split.units) / calls if calls else 0.0
