"""What tensor splitting hands the degree search: per-unit costs of one micro-batch at one tp degree.

The split ILP (``plan_splits.price_units``) solves each distinct block kind once for a given tp,
micro-batch and sequence length, then prices every unit of the condensed block graph (segments and
blocks, in execution order) with the strategies it chose. The degree search (``plan_search``) reads
only these numbers: it never looks at the graph, so it can be tested with hand-made costs.

All seconds are for one micro-batch on one device of a tp group; all bytes are per device, in the
plan's activation precision. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from xirang.ir.plan_parts import CollectiveChoice, NodeStrategy
from xirang.ir.errors import InvalidValue


@dataclass(frozen=True)
class UnitCost:
    """One unit of the condensed block graph ("segment:0", "block:model.layers.3", ...).

    - ``forward_seconds`` / ``backward_seconds``: local compute (roofline per node, each node's
      share of the work under its chosen strategy).
    - ``tp_comm_forward_seconds`` / ``tp_comm_backward_seconds``: the tensor-parallel collectives
      of the unit (resharding on edges and collectives ops issue themselves), not overlapped.
    - ``params_local``: parameter elements one tp rank holds (a tied weight counted in the first
      unit that reads it, as the condensed graph does).
    - ``saved_bytes``: activations kept for the backward with no recompute.
    - ``selective_saved_bytes`` / ``selective_recompute_seconds``: the same when the attention
      core (the ops whose tensors grow with seq², or the fused attention op) is recomputed, and the
      forward time that recompute adds to the backward.
    - ``input_bytes``: the unit's inputs from earlier units, what full recompute keeps.
    - ``cut_bytes_after``: bytes one rank sends to the next stage if a pipeline cut follows this unit
      (every tensor made at or before it and read after it); 0 for the last unit.
    - ``model_flops``: forward + backward FLOPs of the whole unit (not the local share, no
      recompute), for TFLOP/s figures; ``model_forward_flops`` the forward part of it (what full
      recompute runs again, counted in hardware FLOP/s as Megatron-LM's figures do).
    - ``weight_output_bytes``: the outputs of the matmuls that read a parameter, on one rank: a split
      backward keeps their gradients from B until W.
    - ``saved_past_weights_bytes``: of ``saved_bytes``, what ops that no weight-reading op of the unit depends
      on save (a loss after the head's matmul): a split backward's B frees it, W never reads it.
    - ``buffer_bytes``: the model buffers (non-trainable state: rotary tables, masks) the unit holds
      on one rank, resident like the parameters.
    - Experts (``xirang.expert_linear``, passes/analysis/experts.py): ``expert_params`` of
      ``params_local`` are expert weights (split by ep, not by tp); ``expert_rows_bytes`` the rows one
      rank's experts calls send per micro-batch (tokens x top_k x hidden, every call of the unit),
      ``expert_combine_bytes`` what their combines send back (the same unless tp splits them apart);
      ``expert_calls`` how many calls; ``expert_seconds`` the forward + backward compute of the
      experts' matmuls (what routing imbalance makes the most-loaded rank do more of);
      ``ep_comm_forward_seconds`` / ``ep_comm_backward_seconds``: the all-to-alls of expert
      parallelism, set by ``passes/planning/expert_costs.py`` for a candidate with ep > 1 (0 here).
    - ``cp_comm_forward_seconds`` / ``cp_comm_backward_seconds``: context parallelism's attention transfers
      left exposed (the ring's sends not hidden by attention, or the all-to-alls), set by
      ``passes/planning/context_parallel_cost.py`` for a candidate with cp > 1 (0 here).
    """

    name: str
    kind: str  # block kind hash for blocks, the unit name for segments
    forward_seconds: float
    backward_seconds: float
    tp_comm_forward_seconds: float
    tp_comm_backward_seconds: float
    params_local: int
    saved_bytes: float
    selective_saved_bytes: float
    selective_recompute_seconds: float
    input_bytes: float
    cut_bytes_after: float
    model_flops: float
    model_forward_flops: float
    buffer_bytes: float = 0.0
    full_recompute_seconds: float | None = None  # None: one more forward (its compute)
    weight_output_bytes: float = 0.0  # outputs of matmuls reading a parameter: their gradients wait for W
    saved_past_weights_bytes: float = 0.0  # of saved_bytes, what B frees under a split backward
    expert_params: int = 0
    expert_rows_bytes: float = 0.0
    expert_combine_bytes: float = 0.0
    expert_calls: int = 0
    expert_seconds: float = 0.0
    ep_comm_forward_seconds: float = 0.0
    ep_comm_backward_seconds: float = 0.0
    cp_comm_forward_seconds: float = 0.0
    cp_comm_backward_seconds: float = 0.0

    def __post_init__(self):
        if self.full_recompute_seconds is None:
            object.__setattr__(self, "full_recompute_seconds", self.forward_seconds)
        for name in ("forward_seconds", "backward_seconds", "tp_comm_forward_seconds",
                     "tp_comm_backward_seconds", "saved_bytes", "selective_saved_bytes",
                     "selective_recompute_seconds", "input_bytes", "cut_bytes_after", "model_flops",
                     "model_forward_flops", "buffer_bytes", "full_recompute_seconds", "weight_output_bytes",
                     "saved_past_weights_bytes",
                     "expert_rows_bytes", "expert_combine_bytes", "expert_seconds", "ep_comm_forward_seconds",
                     "ep_comm_backward_seconds", "cp_comm_forward_seconds", "cp_comm_backward_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidValue(f"UnitCost {self.name!r}: {name} must be a non-negative number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("params_local", "expert_params", "expert_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidValue(f"UnitCost {self.name!r}: {name} must be a non-negative int, got {value!r}")

    def activation_bytes(self, recompute: str) -> float:
        """Bytes kept for the backward under recompute mode none / selective / full."""
        return {"none": self.saved_bytes, "selective": self.selective_saved_bytes,
                "full": self.input_bytes}[recompute]

    def recompute_seconds(self, recompute: str) -> float:
        """Compute the recompute mode adds to one micro-batch's backward, its collectives apart (full:
        the forward again, plus a calibrated World's checkpoint cost per saved tensor)."""
        return {"none": 0.0, "selective": self.selective_recompute_seconds,
                "full": self.full_recompute_seconds}[recompute]

    def seconds(self, recompute: str) -> float:
        """Forward + backward of one micro-batch, communication included, with the recompute the
        mode adds (full: the forward and its collectives once more before the backward, expert
        parallelism's all-to-alls and context parallelism's transfers among them)."""
        comm_forward = self.tp_comm_forward_seconds + self.ep_comm_forward_seconds + self.cp_comm_forward_seconds
        forward = self.forward_seconds + comm_forward
        backward = (self.backward_seconds + self.tp_comm_backward_seconds + self.ep_comm_backward_seconds
                    + self.cp_comm_backward_seconds)
        comm = comm_forward if recompute == "full" else 0.0
        return forward + backward + self.recompute_seconds(recompute) + comm


@dataclass(frozen=True)
class TensorSplit:
    """The split ILP's answer for one (tp, micro_batch, seq): costs per unit in execution order, the
    strategy of every node, the tp collectives of one representative of each unit kind, and the
    ops that had no sharding rule (run replicated)."""

    tp: int
    micro_batch: int
    seq: int
    units: tuple[UnitCost, ...]
    placements: Mapping[str, NodeStrategy] = field(default_factory=dict)
    collectives: tuple[CollectiveChoice, ...] = ()
    fallbacks: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # the tensors crossing a unit boundary, each (bytes on one rank, producing unit, last reading unit, units
    # reading it, whether it takes a gradient), unit indices in execution order: a pipeline stage's executor
    # keeps what it receives and the outputs it sends for the backward (plan_memory.RankMemory.stage_held)
    crossing: tuple[tuple[float, int, int, frozenset, bool], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "placements", MappingProxyType(dict(self.placements)))
        if not self.units:
            raise InvalidValue("TensorSplit needs at least one unit")

    def __hash__(self) -> int:
        return hash((self.tp, self.micro_batch, self.seq, self.units))
