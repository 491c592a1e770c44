"""Whether to overlap a plan's sequence-parallel tp collectives with their linears (``Plan.tp_overlap``),
and what it saves.

The collective matmuls (codegen/ops/collective_matmul.py) cut each fused collective and the matmul
beside it into C chunks: a gathered matmul waits for its first chunk's all-gather, then chunk i+1's
gather runs while chunk i is multiplied; a matmul-reduce-scatter leaves its last chunk's reduce-scatter
exposed. Both are ZeRO-3's prefetch recurrence (``cost_model.exposed_prefetched_gathers``) with C equal
chunks: exposed = g + (C - 1) max(0, g - f), g one chunk's collective (its own alpha included, so
chunking pays C latencies), f one chunk's matmul, i.e. max(0, comm - overlappable matmul) plus the
first chunk's comm, up to the per-chunk latencies. Per fused pair and micro-batch, forward (the
collective, the linear's forward matmul) and backward (its dual, the input-gradient matmul: the weight
gradient is computed after the loop). Unfused collectives (vocabulary all-reduces, all-to-alls, f's
all-reduces) are not changed.

Where the World's calibration says a collective in flight slows compute (``comm_overlaps_compute``
False: gloo's threads share the CPU cores with the ranks' compute), or an uncalibrated World is of CPU
devices, nothing is hidden and the planner
never picks it. Elsewhere it picks the chunk count in ``CHUNK_CHOICES`` that hides the most, if that
beats ``MIN_SAVING`` of the predicted step, and takes the saving off the prediction (``tp_comm``) with a
note. The saving is priced for the plan the search chose, per pipeline stage as the stage's share
(1/pp) of the fused pairs: the degree search itself does not price overlap (it would rank candidates
with large tp collectives a little too low).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from xirang.ir.errors import XirangError
from xirang.ir.facts import evaluate
from xirang.ir.meta_keys import FLOPS, TENSOR
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.cost_model import compute_time, exposed_prefetched_gathers
from xirang.passes.planning.plan_splits_costs import FLOAT_BYTES

LINEAR = torch.ops.aten.linear.default
CHUNK_CHOICES = (2, 4, 8)
MIN_SAVING = 0.002  # of the predicted step: below it the chunked kernels' own costs are not worth a plan change


@dataclasses.dataclass(frozen=True)
class FusedPair:
    """One linear and the sequence collective the lowering fuses with it (forward kind, full bytes)."""

    linear: str  # the (first) linear
    kind: str  # "all_gather" before the linear, "reduce_scatter" after it
    nbytes: float  # the collective's full buffer at the plan's sizes (the comm counter's convention)
    matmul_seconds: float  # the forward matmul on one tp rank (of every linear reading one gather)


def _is_seq_shard(strategy) -> bool:
    return strategy is not None and strategy.strategy.startswith("seq ") and bool(strategy.outputs) \
        and isinstance(strategy.outputs[0].tp, PlanShard)


def fused_pairs(gm, plan, seq: int) -> list[FusedPair]:
    """The (linear, collective) pairs ``passes/lowering/overlap_tp.py`` fuses under ``plan``, priced at
    one micro-batch of ``plan.micro_batch`` samples of ``seq`` tokens: a sequence shard gathered for
    linears only (one gather, their matmuls together), a partial linear output reduce-scattered."""
    sizes = {"batch": plan.micro_batch, "seq": seq}
    device = plan.world.device_of(0)

    def matmul(node) -> float:
        flops = FLOPS.get(node, None)
        if flops is None:
            return 0.0
        return compute_time(evaluate(flops.forward, sizes) / plan.mesh.tp, 0.0, device, plan.precision)

    def column_parallel(node) -> bool:
        strategy = plan.placements.get(node.name)
        return node.target is LINEAR and strategy is not None and bool(strategy.inputs) \
            and strategy.inputs[0].tp == PlanReplicate()
    pairs = []
    for node in gm.graph.nodes:
        readers = list(node.users)
        if _is_seq_shard(plan.placements.get(node.name)) and readers and all(
                column_parallel(user) and user.args[0] is node for user in readers):
            pairs.append(FusedPair(readers[0].name, "all_gather", _nbytes(node, sizes, plan),
                                   math.fsum(matmul(user) for user in readers)))
        strategy = plan.placements.get(node.name)
        if node.target is LINEAR and strategy is not None and strategy.outputs \
                and isinstance(strategy.outputs[0].tp, PlanPartial) and len(readers) == 1:
            reads = plan.placements.get(readers[0].name)
            position = readers[0].all_input_nodes.index(node)
            if reads is not None and position < len(reads.inputs) and isinstance(reads.inputs[position].tp, PlanShard) \
                    and reads.strategy.startswith("seq "):
                pairs.append(FusedPair(node.name, "reduce_scatter", _nbytes(node, sizes, plan), matmul(node)))
    return pairs


def _nbytes(node, sizes: dict, plan) -> float:
    return evaluate(TENSOR.get(node).numel, sizes) * FLOAT_BYTES[plan.precision]


def exposed_seconds(pair: FusedPair, chunks: int, group: tuple, world) -> tuple[float, float]:
    """(exposed unchunked, exposed with ``chunks``) seconds of ``pair``'s collectives in one micro-batch's
    forward and backward (the backward runs the dual kind on the same bytes)."""
    plain = chunked = 0.0
    for kind in (pair.kind, "reduce_scatter" if pair.kind == "all_gather" else "all_gather"):
        plain += collective_cost(kind, pair.nbytes, group, world).seconds
        piece = collective_cost(kind, pair.nbytes / chunks, group, world).seconds
        chunked += exposed_prefetched_gathers([piece] * chunks, [pair.matmul_seconds / chunks] * chunks)
    return plain, chunked


def overlaps_compute(world) -> bool:
    """Uncalibrated, a World of CPU devices is taken as calibration finds CPU ranks: gloo's threads share
    the cores the ranks compute on, so a collective in flight does not run beside compute for free."""
    return not any(node.device.is_cpu for node in world.nodes)


def tp_overlap_saving(gm, plan, seq: int, chunks: int) -> float:
    """Seconds per step ``chunks``-way overlap takes off the plan's critical pipeline stage (0 where the
    World's collectives slow compute down)."""
    calibration = plan.world.calibration
    if calibration is not None and not calibration.comm_overlaps_compute or not overlaps_compute(plan.world):
        return 0.0
    group = plan.mesh.group("tp", 0)
    saved = math.fsum(plain - hidden for plain, hidden in
                      (exposed_seconds(pair, chunks, group, plan.world) for pair in fused_pairs(gm, plan, seq)))
    return saved / plan.mesh.pp * plan.num_micro_batches


def choose_tp_overlap(gm, plan, seq: int, *, pinned: Optional[int] = None):
    """``plan`` with ``tp_overlap`` set where it pays (or as ``pinned``: 0 off, C chunks on) and its
    prediction lowered by what it hides."""
    if pinned is not None:
        if pinned and (plan.mesh.tp == 1 or not plan.sequence_parallel):
            raise XirangError(f"tp_overlap={pinned} overlaps sequence-parallel tp collectives, but the plan has "
                              f"tp {plan.mesh.tp} and sequence_parallel {plan.sequence_parallel}",
                              where="xirang.plan(tp_overlap=...)",
                              hint="pin tp > 1 and sequence_parallel=True too, or leave tp_overlap unset")
        options = (pinned,) if pinned else ()
    elif plan.mesh.tp == 1 or not plan.sequence_parallel:
        return plan
    else:
        options = CHUNK_CHOICES
    best, saving = 0, 0.0
    for chunks in options:
        found = tp_overlap_saving(gm, plan, seq, chunks)
        if pinned or found > saving:
            best, saving = chunks, found
    predicted = plan.predicted
    if not best or (pinned is None and saving < MIN_SAVING * predicted.step_seconds):
        return plan
    step = max(predicted.step_seconds - saving, 1e-12)
    breakdown = dict(predicted.breakdown)
    breakdown["tp_comm"] = max(0.0, breakdown.get("tp_comm", 0.0) - saving)
    note = (f"tp_overlap: sequence all-gathers / reduce-scatters chunked {best} ways against their linears "
            f"hide {saving:.4g} s per step (step {predicted.step_seconds:.4g} -> {step:.4g} s)")
    made = dataclasses.replace(predicted, step_seconds=step, breakdown=breakdown, notes=predicted.notes + (note,),
                               tflops_per_device=predicted.tflops_per_device * predicted.step_seconds / step)
    return dataclasses.replace(plan, tp_overlap=best, predicted=made)
