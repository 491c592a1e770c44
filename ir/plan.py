"""The Plan: every decision the compiler made, as frozen data that round-trips JSON exactly.

A plan names the mesh, the batch split, the pipeline schedule and stage cuts, each node's tensor
layouts, the gradient buckets and the collectives, with what the cost model predicts for it. It is
validated on construction, so a hand-edited ``plan.json`` that is inconsistent is refused with the
field at fault, and it carries the fingerprint of the traced graph and the World it was made for,
so ``check_matches`` refuses it for another model or cluster, naming what differs first from the
summary of its model it keeps (``model_summary``, ir/model_summary.py; absent in older files, which
are refused by fingerprint alone). ``from_json(to_json(plan)) == plan``.

Layouts: one placement per mesh axis; in JSON only the non-replicated axes are written,
``{"tp": {"shard": 1}}``, and ``{}`` is replicated everywhere.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, Optional

from xirang.ir.mesh import Mesh
from xirang.ir.model_summary import ModelSummary
from xirang.ir.plan_checks import (REPLAN, PlanError, check_choice, check_int, check_keys, check_seq, check_str,
                                   check_type, check_unique, compact_dumps, errors_at, first_difference, parse_at,
                                   parse_json_list)
from xirang.ir.plan_explain import explain_plan
from xirang.ir.plan_parts import Alternative, CollectiveChoice, NodeStrategy, Prediction, StagePlan
from xirang.ir.plan_trials import Trial
# re-exported: the plan's parts and PlanError are importable from here as well
from xirang.ir.plan_parts import COLLECTIVE_KINDS, Layout  # noqa: F401
from xirang.ir.schedules import SCHEDULES
from xirang.ir.world import World

SCHEMA_VERSION = 2
# why a plan of an older schema version cannot be read, said when one is refused
OLDER_SCHEMAS = {1: "version 1 plans name only the mesh axes dp, pp, tp and number the ranks dp outermost; version 2 "
                    "names dp, pp, cp, tp, ep and numbers them pp outermost (ir/mesh.py), so an old plan's ranks "
                    "would land on other devices"}
RECOMPUTE_MODES = ("none", "selective", "full")
# activation offload: "none", or "blocks": each block's saved activations go to host memory after its
# forward and are prefetched back one block ahead of its backward (passes/lowering, codegen/runtime)
OFFLOAD_MODES = ("none", "blocks")
PRECISIONS = ("fp32", "bf16", "fp16")
# ZeRO stages the runtime enacts: 0 (optimizer state replicated over dp), 1 (sharded over dp:
# gradients reduce-scattered, updated parameters all-gathered; codegen/runtime/data_parallel/dist_optimizer.py) or
# 3 (parameters too, gathered per bucket before use and kept until the backward; param_shards.py)
ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every decision for one model on one World; see the module docstring."""

    schema_version: int = SCHEMA_VERSION
    fingerprint: str  # passes/analysis/fingerprint.py graph_fingerprint of the traced graph
    world: World
    mesh: Mesh
    micro_batch: int  # samples per micro-batch on one dp rank
    num_micro_batches: int  # per step and dp rank (with dp_shares: the busiest dp rank's)
    global_batch: int  # dp * micro_batch * num_micro_batches, or sum(dp_shares)
    schedule: str
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved only)
    recompute: str = "none"
    offload: str = "none"
    # the residual stream may be split along the sequence on tp (Korthikanti et al. 2022): the split
    # ILP was offered those layouts (placements say where it took them)
    sequence_parallel: bool = False
    # tp collectives overlapped with compute (passes/lowering/overlap_tp.py): 0 off, or the number of
    # chunks each linear is cut into against its sequence all-gather / reduce-scatter (needs sp, tp > 1)
    tp_overlap: int = 0
    precision: str = "fp32"
    grad_reduce_dtype: str = "fp32"
    zero_stage: int = 0  # ZERO_STAGES; 1 and 3 need dp > 1 and list each bucket's reduce-scatter and all-gather
    # expert parallelism priced with the most-loaded ep rank's routed rows this many times the mean
    # (passes/planning/expert_costs.py); 1.0 is balanced routing
    routing_imbalance: float = 1.0
    # the expert all-to-alls priced as run under another micro-batch's compute (Megatron-Core's batch-level
    # overlap; passes/planning/expert_costs.py). Xirang's runtime runs them exposed: a pricing assumption
    ep_overlap: bool = False
    # each expert takes at most ceil(rows / experts x capacity_factor) of the rows a rank routes it per
    # micro-batch, the rest dropped (codegen/ops/expert_capacity.py); None: dropless
    capacity_factor: Optional[float] = None
    placements: Mapping[str, NodeStrategy] = field(default_factory=dict)  # node name -> strategy
    stages: tuple[StagePlan, ...]
    # parameter names per gradient bucket, in launch order, each bucket one stage's (collectives "bucket:<k>")
    buckets: tuple[tuple[str, ...], ...] = ()
    fallbacks: tuple[str, ...] = ()  # ops with no sharding rule, run replicated
    # samples per step of each dp rank when they differ (faster devices take more; whole micro-batches
    # of micro_batch samples, so every rank runs the same program); () = global_batch / dp each
    dp_shares: tuple[int, ...] = ()
    collectives: tuple[CollectiveChoice, ...] = ()
    predicted: Prediction
    alternatives: tuple[Alternative, ...] = ()  # other configurations priced, for explain()
    # the model in brief (parameters, ties, inputs, a record per node), so a refusal names what differs
    model_summary: Optional[ModelSummary] = None
    # configurations run for a few steps on the ranks by ``xirang tune`` (ir/plan_trials.py); () untuned
    trials: tuple[Trial, ...] = ()

    def __post_init__(self):
        with errors_at("plan"):
            self._validate()

    def _validate(self):
        if type(self.schema_version) is not int or self.schema_version != SCHEMA_VERSION:
            raise PlanError(f"schema_version is {self.schema_version!r}; this Xirang reads version "
                            f"{SCHEMA_VERSION}", where="schema_version", hint=REPLAN)
        check_str(self.fingerprint, "fingerprint")
        world, mesh = check_type(self.world, World, "world"), check_type(self.mesh, Mesh, "mesh")
        if mesh.size != world.size:
            raise PlanError(f"mesh {mesh} has {mesh.size} ranks but the world has {world.size} devices "
                            f"({world.describe()})", where="mesh",
                            hint=f"choose dp, pp, cp, tp whose product is {world.size}")
        for name in ("micro_batch", "num_micro_batches", "global_batch", "virtual_stages"):
            check_int(getattr(self, name), name)
        object.__setattr__(self, "dp_shares", check_seq(self.dp_shares, "dp_shares", lambda v, w: check_int(v, w)))
        if self.dp_shares:
            self._check_dp_shares(mesh)
        elif mesh.dp * self.micro_batch * self.num_micro_batches != self.global_batch:
            raise PlanError(f"global_batch {self.global_batch} != dp {mesh.dp} x micro_batch {self.micro_batch} "
                            f"x num_micro_batches {self.num_micro_batches} = "
                            f"{mesh.dp * self.micro_batch * self.num_micro_batches}", where="global_batch",
                            hint="make global_batch = dp x micro_batch x num_micro_batches")
        check_choice(self.schedule, SCHEDULES, "schedule")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise PlanError(f"virtual_stages is {self.virtual_stages} but schedule {self.schedule!r} runs one "
                            f"stage per pipeline rank", where="virtual_stages",
                            hint="set virtual_stages to 1, or use schedule 'interleaved'")
        if self.schedule == "interleaved" and any(m % mesh.pp for m in self.micro_batches_per_dp_rank):
            counts = (f"the micro-batches of every dp rank ({', '.join(map(str, self.micro_batches_per_dp_rank))})"
                      if self.dp_shares else f"num_micro_batches ({self.num_micro_batches})")
            raise PlanError(f"schedule 'interleaved' needs {counts} to be a multiple of pp ({mesh.pp})",
                            where="dp_shares" if self.dp_shares else "num_micro_batches",
                            hint=f"use num_micro_batches in {mesh.pp}, {2 * mesh.pp}, ... or schedule '1f1b'")
        check_choice(self.recompute, RECOMPUTE_MODES, "recompute")
        check_choice(self.offload, OFFLOAD_MODES, "offload")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"sequence_parallel is {self.sequence_parallel!r}", where="sequence_parallel",
                            hint="set it to true or false")
        self._check_tp_overlap(mesh)
        if not isinstance(self.ep_overlap, bool) or (self.ep_overlap and mesh.ep == 1):
            raise PlanError(f"ep_overlap is {self.ep_overlap!r} at ep {mesh.ep}; it is true only where expert "
                            f"parallelism exchanges rows (ep > 1)", where="ep_overlap",
                            hint="set ep_overlap to false, or use a plan with ep > 1")
        if self.capacity_factor is not None and (isinstance(self.capacity_factor, bool) or not isinstance(
                self.capacity_factor, (int, float)) or not self.capacity_factor > 0):
            raise PlanError(f"capacity_factor is {self.capacity_factor!r}; give a number > 0 (each expert's rows "
                            f"per micro-batch over the balanced share) or null (dropless)", where="capacity_factor",
                            hint="set capacity_factor to null, or to e.g. 1.0 or 1.25")
        if isinstance(self.routing_imbalance, bool) or not isinstance(self.routing_imbalance, (int, float)) \
                or not self.routing_imbalance >= 1:
            raise PlanError(f"routing_imbalance is {self.routing_imbalance!r}; give a number >= 1 (the most-loaded "
                            f"expert-parallel rank's rows over the mean)", where="routing_imbalance",
                            hint="1.0 for balanced routing")
        check_choice(self.precision, PRECISIONS, "precision")
        check_choice(self.grad_reduce_dtype, PRECISIONS, "grad_reduce_dtype")
        self._check_zero_stage(mesh)
        check_type(self.placements, Mapping, "placements", "mapping node name -> NodeStrategy")
        object.__setattr__(self, "placements", MappingProxyType(
            {check_str(name, "placements key"): check_type(s, NodeStrategy, f"placements[{name!r}]")
             for name, s in self.placements.items()}))
        stages = check_seq(self.stages, "stages", lambda v, w: check_type(v, StagePlan, w))
        if len(stages) != mesh.pp * self.virtual_stages:
            raise PlanError(f"{len(stages)} stages, but pp {mesh.pp} x virtual_stages {self.virtual_stages} "
                            f"needs {mesh.pp * self.virtual_stages}", where="stages",
                            hint="give one stage per pipeline rank and virtual stage")
        for position, stage in enumerate(stages):
            if stage.index != position:
                raise PlanError(f"stage at position {position} has index {stage.index}",
                                where=f"stages[{position}].index", hint="list stages in index order 0, 1, ...")
        check_unique(tuple(u for stage in stages for u in stage.units), "stages[*].units")
        object.__setattr__(self, "stages", stages)
        buckets = check_seq(self.buckets, "buckets", lambda v, w: check_seq(v, w, check_str))
        for i, bucket in enumerate(buckets):
            if not bucket:
                raise PlanError(f"bucket {i} is empty", where=f"buckets[{i}]", hint="drop empty buckets")
            # a name may sit in several buckets: a tied weight read in several stages has a copy per
            # stage, and each copy is all-reduced over dp with its stage's bucket
            check_unique(bucket, f"buckets[{i}]")
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "fallbacks", check_seq(self.fallbacks, "fallbacks", check_str))
        check_unique(self.fallbacks, "fallbacks")
        object.__setattr__(self, "collectives", check_seq(self.collectives, "collectives",
                                                          lambda v, w: check_type(v, CollectiveChoice, w)))
        for position, choice in enumerate(self.collectives):
            if choice.node.startswith("bucket:"):
                index = choice.node.removeprefix("bucket:")
                if not index.isdigit() or int(index) >= len(buckets):
                    raise PlanError(f"collective {choice.node!r} names no gradient bucket ({len(buckets)} buckets)",
                                    where=f"collectives[{position}].node",
                                    hint="bucket:<k> names buckets[k]; re-plan, or fix the edit")
        predicted = check_type(self.predicted, Prediction, "predicted")
        if len(predicted.memory_bytes_per_device) != mesh.pp:
            raise PlanError(f"predicted.memory_bytes_per_device has {len(predicted.memory_bytes_per_device)} "
                            f"entries, one per pipeline rank needs {mesh.pp}",
                            where="predicted.memory_bytes_per_device", hint=REPLAN)
        object.__setattr__(self, "alternatives", check_seq(self.alternatives, "alternatives",
                                                           lambda v, w: check_type(v, Alternative, w)))
        if self.model_summary is not None:
            check_type(self.model_summary, ModelSummary, "model_summary")
        object.__setattr__(self, "trials", check_seq(self.trials, "trials", lambda v, w: check_type(v, Trial, w)))

    def _check_tp_overlap(self, mesh: Mesh) -> None:
        if type(self.tp_overlap) is not int or self.tp_overlap < 0 or self.tp_overlap == 1:
            raise PlanError(f"tp_overlap is {self.tp_overlap!r}; give 0 (off) or the chunks per overlapped "
                            f"linear (2 or more)", where="tp_overlap", hint="set tp_overlap to 0, 2, 4, ...")
        if self.tp_overlap and (mesh.tp == 1 or not self.sequence_parallel):
            raise PlanError(f"tp_overlap {self.tp_overlap} chunks the sequence all-gathers and reduce-scatters "
                            f"of tp, but mesh {mesh} has tp {mesh.tp} and sequence_parallel is "
                            f"{self.sequence_parallel}", where="tp_overlap",
                            hint="use tp_overlap 0, or a plan with tp > 1 and sequence_parallel")

    def _check_zero_stage(self, mesh: Mesh) -> None:
        if type(self.zero_stage) is not int or self.zero_stage not in ZERO_STAGES:
            raise PlanError(f"zero_stage is {self.zero_stage!r}; the runtime enacts ZeRO stages "
                            f"{', '.join(map(str, ZERO_STAGES))}", where="zero_stage",
                            hint="use 0 (replicated optimizer state), 1 (optimizer state sharded over dp) or 3 "
                                 "(parameters sharded too); stage 2 is not implemented")
        if self.zero_stage and mesh.dp == 1:
            raise PlanError(f"zero_stage {self.zero_stage} shards over dp, but mesh {mesh} has dp 1",
                            where="zero_stage", hint="use zero_stage 0, or a mesh with dp > 1")

    def with_zero_stage(self, stage: int) -> "Plan":
        """This plan under ZeRO stage ``stage``: each bucket's all-reduce becomes a reduce-scatter of the
        gradients and an all-gather of the updated parameters (both "ring": flat, over dp; the buffer
        padded to a multiple of dp), except buckets holding a weight tied across pipeline ranks, which
        stay all-reduced (their copies are summed after the dp average; their slices are still
        stepped and all-gathered); and back for stage 0 (a padded size stays padded). The
        prediction is kept and a note says so (``xirang.plan(zero_stage=)`` prices it instead). Stages 1
        and 3 list the same calls: ZeRO-3 gathers each bucket once per step too (kept until the backward)."""
        tied = {choice.node.removeprefix("tied:") for choice in self.collectives if choice.node.startswith("tied:")}
        item = {"fp32": 4, "bf16": 2, "fp16": 2}[self.grad_reduce_dtype]
        param_item, dp = 4, self.mesh.dp  # parameters are stored in fp32 (the graph casts them)
        collectives = []
        for choice in self.collectives:
            node = choice.node
            if not node.startswith("bucket:") or choice.kind == "all_gather":
                if not node.startswith("bucket:"):
                    collectives.append(choice)
                continue
            elements = -(-(choice.nbytes // item) // dp) * dp
            gather = CollectiveChoice(node, "dp", "all_gather", "ring", elements * param_item)
            if stage == 0:
                collectives.append(replace(choice, kind="all_reduce"))  # the all-gather is dropped
            elif tied.intersection(self.buckets[int(node.removeprefix("bucket:"))]):
                collectives += [replace(choice, kind="all_reduce"), gather]  # sharded after the tied sum
            else:
                collectives += [CollectiveChoice(node, "dp", "reduce_scatter", "ring", elements * item), gather]
        note = "zero_stage set after planning: the predicted memory and step are for the plan's own stage"
        notes = tuple(n for n in self.predicted.notes if n != note) + (() if stage == self.zero_stage else (note,))
        return replace(self, zero_stage=stage, collectives=tuple(collectives),
                       predicted=replace(self.predicted, notes=notes))

    # A read-only mapping is neither hashable nor picklable; these restore both.
    def _check_dp_shares(self, mesh: Mesh) -> None:
        shares = self.dp_shares
        if len(shares) != mesh.dp:
            raise PlanError(f"dp_shares lists {len(shares)} shares for dp {mesh.dp}", where="dp_shares",
                            hint=f"give one sample count per dp rank ({mesh.dp}), or none for even shares")
        uneven = [f"dp rank {i}: {n}" for i, n in enumerate(shares) if n % self.micro_batch]
        if uneven:
            raise PlanError(f"every dp share must be whole micro-batches of micro_batch {self.micro_batch}; "
                            f"not {', '.join(uneven)}", where="dp_shares",
                            hint=f"use multiples of {self.micro_batch} (every rank runs the same program, "
                                 f"built for micro-batches of {self.micro_batch})")
        if sum(shares) != self.global_batch:
            raise PlanError(f"dp_shares {list(shares)} sum to {sum(shares)}, not global_batch {self.global_batch}",
                            where="dp_shares", hint="the shares split the global batch: make them sum to it")
        if self.num_micro_batches != max(shares) // self.micro_batch:
            raise PlanError(f"num_micro_batches is {self.num_micro_batches}; with dp_shares it is the busiest dp "
                            f"rank's, {max(shares)} // micro_batch {self.micro_batch} = "
                            f"{max(shares) // self.micro_batch}", where="num_micro_batches",
                            hint="use Plan.with_dp_shares(shares), which sets both")

    @property
    def micro_batches_per_dp_rank(self) -> tuple[int, ...]:
        """Micro-batches each dp rank runs per step (all ``num_micro_batches`` without dp_shares)."""
        if not self.dp_shares:
            return (self.num_micro_batches,) * self.mesh.dp
        return tuple(n // self.micro_batch for n in self.dp_shares)

    def with_dp_shares(self, shares) -> "Plan":
        """This plan with ``shares`` samples per step on each dp rank (``()``: even again). The
        prediction is kept as it was made for even shares, and a note says so."""
        shares = tuple(shares)
        even = not shares
        m = self.global_batch // (self.mesh.dp * self.micro_batch) if even else max(shares) // self.micro_batch
        note = "dp_shares set after planning: the predicted step is for even shares"
        notes = tuple(n for n in self.predicted.notes if n != note) + (() if even else (note,))
        return replace(self, dp_shares=shares, num_micro_batches=m,
                       predicted=replace(self.predicted, notes=notes))

    def __hash__(self) -> int:
        return hash((self.fingerprint, self.world, self.mesh, self.global_batch, self.schedule, self.stages))

    def __reduce__(self):
        return (Plan.from_json, (self.to_json(),))

    def explain(self) -> str:
        """A table of this plan and the alternatives it beat, with the time of each by cause and
        why this one won (rendered from the plan's data by ir/plan_explain.py)."""
        return explain_plan(self)

    def stages_of(self, pp_rank: int) -> tuple[StagePlan, ...]:
        """The stages pipeline rank ``pp_rank`` runs, in order (several when interleaved)."""
        return self.stages[pp_rank::self.mesh.pp]

    def check_matches(self, fingerprint: str, world: World, model: Optional[ModelSummary] = None,
                      describe_node: Optional[Callable[[int], str]] = None) -> None:
        """Refuse this plan for a model whose graph has another fingerprint, or another World. Given
        ``model`` (this model's summary) and ``describe_node`` (its node i in words), a plan that keeps
        its model's summary says what differs first (passes/analysis/fingerprint.check_plan_matches)."""
        problems, hint = [], "re-plan with xirang.plan(...) or pass the matching model/world"
        if fingerprint != self.fingerprint:
            found = None
            if self.model_summary is not None and model is not None:
                found = self.model_summary.first_difference(model, describe_node or (lambda i: f"node {i}"))
            if found:
                problems.append(f"plan was made for a different model: {found[0]} (fingerprint {self.fingerprint}, "
                                f"this model {fingerprint})")
                hint = found[1]
            else:
                problems.append(f"plan was made for a different model (fingerprint {self.fingerprint}, "
                                f"this model {fingerprint})")
        if world != self.world:
            problems.append(f"plan was made for world '{self.world.describe()}' but this world is "
                            f"'{world.describe()}'" + first_difference(self.world.to_json(), world.to_json(),
                                                                       "world"))
        if problems:
            where = [name for name, differs in (("plan.fingerprint", fingerprint != self.fingerprint),
                                                ("plan.world", world != self.world)) if differs]
            raise PlanError("; ".join(problems), where=", ".join(where), hint=hint)

    # --- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "placements":
                value = {name: strategy.to_json() for name, strategy in value.items()}
            elif f.name == "buckets":
                value = [list(bucket) for bucket in value]
            elif isinstance(value, tuple):
                value = [v.to_json() if hasattr(v, "to_json") else v for v in value]
            elif hasattr(value, "to_json"):
                value = value.to_json()
            if (f.name == "model_summary" and value is None) or (f.name == "trials" and not value):
                continue  # a plan made without its model's summary (or untuned) is written as older plans were
            data[f.name] = value
        return data

    @classmethod
    def from_json(cls, data) -> "Plan":
        with errors_at("plan"):
            check_keys(data, tuple(f.name for f in fields(cls)), "plan", required=("schema_version",))
            if type(data["schema_version"]) is not int or data["schema_version"] != SCHEMA_VERSION:
                reason = OLDER_SCHEMAS.get(data["schema_version"], "")
                raise PlanError(f"plan has schema_version {data['schema_version']!r}; this Xirang reads "
                                f"version {SCHEMA_VERSION}" + (f": {reason}" if reason else ""),
                                where="schema_version", hint="re-plan with xirang.plan(...) and save the new plan")
            # alternatives, offload, dp_shares, sequence_parallel, zero_stage, tp_overlap, model_summary,
            # routing_imbalance, ep_overlap and trials came
            # after the first plans were written: optional when reading
            check_keys(data, tuple(f.name for f in fields(cls)), "plan",
                       required=tuple(f.name for f in fields(cls) if f.name not in (
                           "alternatives", "offload", "dp_shares", "sequence_parallel", "zero_stage",
                           "tp_overlap", "model_summary", "routing_imbalance", "ep_overlap", "capacity_factor",
                           "trials")))
            values = dict(data)
            for name, parse in (("world", World.from_json), ("mesh", Mesh.from_json),
                                ("predicted", Prediction.from_json)):
                with errors_at(name):
                    values[name] = parse(data[name])
            for name, parse in (("stages", StagePlan.from_json), ("collectives", CollectiveChoice.from_json),
                                ("alternatives", Alternative.from_json), ("trials", Trial.from_json)):
                if name in data:
                    values[name] = parse_json_list(data[name], name, parse)
            if data.get("model_summary") is not None:
                values["model_summary"] = ModelSummary.from_json(data["model_summary"])
            check_type(data["placements"], dict, "placements", "JSON object node name -> strategy")
            with errors_at("placements"):
                values["placements"] = {name: parse_at(f"[{name!r}]", NodeStrategy.from_json, value)
                                        for name, value in data["placements"].items()}
        return cls(**values)

    def save(self, path) -> None:
        """Write the plan as JSON; small objects stay on one line so the file reads like a table."""
        Path(path).write_text(compact_dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, path) -> "Plan":
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}",
                            where=str(path), hint=REPLAN) from None
        try:
            return cls.from_json(data)
        except PlanError as error:
            raise PlanError(error.what, where=f"{error.where} in {path}", hint=error.hint) from None

