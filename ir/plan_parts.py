"""The parts of a Plan: per-node tensor layouts, pipeline stages, chosen collectives and the prediction.

Each is frozen, validated on construction and round-trips JSON exactly (see ir/plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping

from xirang.ir.mesh import AXES, Mesh
from xirang.ir.placement import PlanPartial, Placement, PlanReplicate, PlanShard, placement_from_json
from xirang.ir.plan_checks import (REPLAN, PlanError, check_choice, check_float, check_int, check_keys, check_seq,
                                   check_str, check_type, check_unique, errors_at, parse_json_list)

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")

# The algorithms a plan may name per kind (the cost model prices each: passes/planning/cost_collectives.py),
# and what the runtime runs for each (codegen/runtime/data_parallel/grad_sync.py records it on the CommCounter).
# "ring" and "tree" are the backend's own flat collective: NCCL chooses between its ring and tree by
# message size, as the planner's cheaper-of-the-two does, and no per-call switch exists to pin one;
# gloo runs its ring. "hierarchical" is Xirang's: reduce-scatter inside each node, all-reduce across
# nodes, all-gather inside, on sub-groups of the axis's group. "measured" is the backend's own flat
# collective priced by the line `xirang calibrate` fitted to it (ir/calibration.py).
COLLECTIVE_ALGORITHMS = {
    "all_reduce": ("ring", "tree", "hierarchical", "measured"),
    "reduce_scatter": ("ring", "hierarchical", "measured"),
    "all_gather": ("ring", "hierarchical", "measured"),
    "all_to_all": ("pairwise", "measured"),
    "broadcast": ("binomial_tree", "scatter_allgather", "measured"),
    "send": ("direct", "measured"),
}
ENACTED_ALGORITHM = {"ring": "flat", "tree": "flat", "pairwise": "flat", "binomial_tree": "flat",
                     "scatter_allgather": "flat", "direct": "flat", "hierarchical": "hierarchical",
                     "measured": "flat"}
# the mesh axes a tensor layout names; cp and ep layouts come with their runtimes (ir/mesh.py)
LAYOUT_AXES = ("dp", "pp", "tp")

@dataclass(frozen=True)
class Layout:
    """How one tensor lies on the mesh: a placement per mesh axis (replicated unless said)."""

    dp: Placement = PlanReplicate()
    pp: Placement = PlanReplicate()
    tp: Placement = PlanReplicate()

    def __post_init__(self):
        for axis in LAYOUT_AXES:
            check_type(getattr(self, axis), (PlanShard, PlanReplicate, PlanPartial), axis,
                       "placement: PlanShard, PlanReplicate or PlanPartial")

    def __str__(self) -> str:
        parts = [f"{axis}={getattr(self, axis)}" for axis in LAYOUT_AXES if getattr(self, axis) != PlanReplicate()]
        return " ".join(parts) or "R"

    def to_json(self) -> dict:
        return {axis: getattr(self, axis).to_json() for axis in LAYOUT_AXES if getattr(self, axis) != PlanReplicate()}

    @classmethod
    def from_json(cls, data) -> "Layout":
        check_keys(data, LAYOUT_AXES, "layout", required=())
        values = {}
        for axis, value in data.items():
            with errors_at(axis):
                values[axis] = placement_from_json(value)
        return cls(**values)


@dataclass(frozen=True)
class NodeStrategy:
    """The sharding rule chosen for one node: its name, the layout of each tensor argument (in
    argument order) and of each output."""

    strategy: str
    inputs: tuple[Layout, ...] = ()
    outputs: tuple[Layout, ...] = (Layout(),)

    def __post_init__(self):
        check_str(self.strategy, "strategy")
        object.__setattr__(self, "inputs", check_seq(self.inputs, "inputs", lambda v, w: check_type(v, Layout, w)))
        object.__setattr__(self, "outputs", check_seq(self.outputs, "outputs", lambda v, w: check_type(v, Layout, w)))

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "inputs": [x.to_json() for x in self.inputs],
                "outputs": [x.to_json() for x in self.outputs]}

    @classmethod
    def from_json(cls, data) -> "NodeStrategy":
        check_keys(data, ("strategy", "inputs", "outputs"), "node strategy")
        return cls(data["strategy"], parse_json_list(data["inputs"], "inputs", Layout.from_json),
                   parse_json_list(data["outputs"], "outputs", Layout.from_json))


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the units of the condensed block graph it runs ("segment:0",
    "block:model.layers.3", ...) and the device memory it may use. Stage ``index`` runs on pipeline
    rank ``index % pp`` (interleaved schedules give each rank several stages)."""

    index: int
    units: tuple[str, ...]
    memory_limit_bytes: int

    def __post_init__(self):
        check_int(self.index, "index", minimum=0)
        units = check_seq(self.units, "units", check_str)
        if not units:
            raise PlanError(f"stage {self.index} has no units", where="units",
                            hint="every stage needs at least one block or segment; use fewer stages")
        check_unique(units, "units")
        object.__setattr__(self, "units", units)
        check_int(self.memory_limit_bytes, "memory_limit_bytes")

    def to_json(self) -> dict:
        return {"index": self.index, "units": list(self.units), "memory_limit_bytes": self.memory_limit_bytes}

    @classmethod
    def from_json(cls, data) -> "StagePlan":
        check_keys(data, ("index", "units", "memory_limit_bytes"), "stage")
        return cls(data["index"], data["units"], data["memory_limit_bytes"])


@dataclass(frozen=True)
class CollectiveChoice:
    """A collective the program will run: at which node (or "bucket:<k>"), on which mesh axis,
    what kind, with which algorithm (``COLLECTIVE_ALGORITHMS``), and the size of one rank's full
    buffer in bytes. ``bucket:<k>`` is the dp all-reduce of ``Plan.buckets[k]``."""

    node: str
    axis: str
    kind: str
    algorithm: str
    nbytes: int

    def __post_init__(self):
        check_str(self.node, "node")
        check_choice(self.axis, AXES, "axis")
        check_choice(self.kind, COLLECTIVE_KINDS, "kind")
        check_choice(self.algorithm, COLLECTIVE_ALGORITHMS[self.kind], "algorithm")
        check_int(self.nbytes, "nbytes", minimum=0)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data) -> "CollectiveChoice":
        names = tuple(f.name for f in fields(cls))
        check_keys(data, names, "collective")
        return cls(**data)


MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "working_set", "buffers")


@dataclass(frozen=True)
class Prediction:
    """What the cost model expects of the plan. ``memory_bytes_per_device`` has one entry per
    pipeline rank (the busiest device of that rank's stages); ``memory_parts``, when given, splits
    each of them by ``MEMORY_PARTS`` (bytes of parameters, gradients, optimizer state, activations
    kept for the backward by the micro-batches in flight at the schedule's peak, the working set of
    recompute and offload on top of them (a block rebuilt in its backward, the blocks on the host
    link), and model buffers), summing to it; ``breakdown`` is seconds per step by cause (compute, tp_comm, pp_bubble,
    pp_p2p, dp_exposed, offload, ...)."""

    step_seconds: float
    tflops_per_device: float
    memory_bytes_per_device: tuple[int, ...]
    breakdown: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    memory_parts: tuple[Mapping[str, int], ...] = ()  # one per pipeline rank, or () (plans saved before it)

    def __post_init__(self):
        object.__setattr__(self, "step_seconds", check_float(self.step_seconds, "step_seconds"))
        object.__setattr__(self, "tflops_per_device", check_float(self.tflops_per_device, "tflops_per_device"))
        object.__setattr__(self, "memory_bytes_per_device", check_seq(
            self.memory_bytes_per_device, "memory_bytes_per_device", lambda v, w: check_int(v, w, minimum=0)))
        if not isinstance(self.breakdown, Mapping):
            raise PlanError(f"breakdown must be a mapping cause -> seconds, got {self.breakdown!r}",
                            where="breakdown", hint=REPLAN)
        object.__setattr__(self, "breakdown", MappingProxyType(
            {check_str(k, "breakdown key"): check_float(v, f"breakdown[{k!r}]") for k, v in self.breakdown.items()}))
        object.__setattr__(self, "notes", check_seq(self.notes, "notes", check_str))
        parts = check_seq(self.memory_parts, "memory_parts", lambda v, w: check_type(v, Mapping, w, "mapping"))
        if parts and len(parts) != len(self.memory_bytes_per_device):
            raise PlanError(f"memory_parts has {len(parts)} entries but memory_bytes_per_device "
                            f"{len(self.memory_bytes_per_device)}: one per pipeline rank", where="memory_parts",
                            hint=REPLAN)
        checked = []
        for rank, part in enumerate(parts):
            with errors_at(f"memory_parts[{rank}]"):
                check_keys(dict(part), MEMORY_PARTS, "memory parts")
                checked.append(MappingProxyType({k: check_int(part[k], k, minimum=0) for k in MEMORY_PARTS}))
        object.__setattr__(self, "memory_parts", tuple(checked))

    # A read-only mapping is neither hashable nor picklable; these restore both.
    def __hash__(self) -> int:
        return hash((self.step_seconds, self.tflops_per_device, self.memory_bytes_per_device))

    def __reduce__(self):
        return (Prediction.from_json, (self.to_json(),))

    def to_json(self) -> dict:
        data = {"step_seconds": self.step_seconds, "tflops_per_device": self.tflops_per_device,
                "memory_bytes_per_device": list(self.memory_bytes_per_device),
                "breakdown": dict(self.breakdown), "notes": list(self.notes)}
        if self.memory_parts:
            data["memory_parts"] = [dict(part) for part in self.memory_parts]
        return data

    @classmethod
    def from_json(cls, data) -> "Prediction":
        names = ("step_seconds", "tflops_per_device", "memory_bytes_per_device", "breakdown", "notes")
        check_keys(data, (*names, "memory_parts"), "prediction", required=names)  # memory_parts came later
        return cls(**data)


@dataclass(frozen=True)
class Alternative:
    """Another configuration the planner priced, kept so a plan can say why it won: its mesh, batch
    split, schedule and recompute, what the cost model predicts for it (``memory_bytes_per_device``
    one entry per pipeline rank, ``breakdown`` as in Prediction), whether it fits device memory,
    and ``why`` it lost (or was rejected), in words."""

    mesh: Mesh
    micro_batch: int
    num_micro_batches: int
    schedule: str
    virtual_stages: int
    recompute: str
    step_seconds: float
    tflops_per_device: float
    memory_bytes_per_device: tuple[int, ...]
    breakdown: Mapping[str, float] = field(default_factory=dict)
    fits: bool = True
    why: str = ""
    offload: str = "none"
    zero_stage: int = 0  # 0, or 1: ZeRO-1's optimizer state sharded over dp (Plan.zero_stage)
    sequence_parallel: bool = False  # the residual stream sharded along the sequence (Plan.sequence_parallel)
    context_method: str = "ring"  # how attention runs at cp > 1: "ring" or "all_to_all" (context_parallel_cost.py)

    def __post_init__(self):
        check_type(self.mesh, Mesh, "mesh")
        check_str(self.context_method, "context_method")
        check_int(self.zero_stage, "zero_stage", minimum=0)
        for name in ("micro_batch", "num_micro_batches", "virtual_stages"):
            check_int(getattr(self, name), name)
        check_str(self.schedule, "schedule")
        check_str(self.recompute, "recompute")
        check_str(self.offload, "offload")
        for name in ("step_seconds", "tflops_per_device"):
            object.__setattr__(self, name, check_float(getattr(self, name), name))
        object.__setattr__(self, "memory_bytes_per_device", check_seq(
            self.memory_bytes_per_device, "memory_bytes_per_device", lambda v, w: check_int(v, w, minimum=0)))
        check_type(self.breakdown, Mapping, "breakdown", "mapping cause -> seconds")
        object.__setattr__(self, "breakdown", MappingProxyType(
            {check_str(k, "breakdown key"): check_float(v, f"breakdown[{k!r}]") for k, v in self.breakdown.items()}))
        check_type(self.fits, bool, "fits")
        check_type(self.sequence_parallel, bool, "sequence_parallel")
        check_type(self.why, str, "why")

    def __hash__(self) -> int:
        return hash((self.mesh, self.micro_batch, self.schedule, self.virtual_stages, self.recompute, self.offload,
                     self.zero_stage, self.sequence_parallel, self.context_method))

    def __reduce__(self):
        return (Alternative.from_json, (self.to_json(),))

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(mesh=self.mesh.to_json(), memory_bytes_per_device=list(self.memory_bytes_per_device),
                    breakdown=dict(self.breakdown))
        return data

    @classmethod
    def from_json(cls, data) -> "Alternative":
        names = tuple(f.name for f in fields(cls))
        came_later = ("offload", "zero_stage", "sequence_parallel", "context_method")
        check_keys(data, names, "alternative", required=tuple(n for n in names if n not in came_later))
        with errors_at("mesh"):
            mesh = Mesh.from_json(data["mesh"])
        return cls(**{**data, "mesh": mesh})
