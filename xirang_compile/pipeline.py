"""The compiler, as one list of passes. Read top to bottom: each line is one pass file in passes/.

The pass manager checks each list's order against what each pass requires and provides before
running it. Analysis runs once per model; lowering runs once per rank, on a copy of the analysed
graph, after the plan is made (xirang_compile/lower.py).
"""
from __future__ import annotations

from xirang.passes.analysis.blocks import find_blocks
from xirang.passes.analysis.causal_masks import fold_causal_masks
from xirang.passes.analysis.dependencies import build_dependencies
from xirang.passes.analysis.flops import count_flops
from xirang.passes.analysis.gradients import mark_requires_grad
from xirang.passes.analysis.memory_traffic import count_bytes
from xirang.passes.analysis.parameters import count_parameters
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model
from xirang.passes.lowering.apply_plan import apply_plan
from xirang.passes.lowering.compute_dtypes import plan_run_dtypes
from xirang.passes.lowering.context_parallel import split_sequence
from xirang.passes.lowering.offload import mark_offload
from xirang.passes.lowering.overlap_tp import overlap_tp_collectives
from xirang.passes.lowering.precision import insert_precision_casts
from xirang.passes.lowering.random_streams import place_random_streams
from xirang.passes.lowering.recompute import mark_recompute
from xirang.passes.lowering.rewrite_tp import insert_collectives
from xirang.passes.lowering.expert_capacity import drop_over_capacity
from xirang.passes.lowering.expert_parallel import dispatch_experts
from xirang.passes.lowering.shard_parameters import shard_parameters
from xirang.passes.lowering.split_stages import assign_stages, split_stages

ANALYSIS_PASSES = [
    trace_model,          # model -> aten training graph on fake tensors; batch/seq symbolic
    fold_causal_masks,    # attention masks proved causal -> is_causal=True (no seq x seq mask kept)
    annotate_tensors,     # shapes (sympy), dtypes
    mark_requires_grad,   # which outputs need gradients
    count_parameters,     # parameter elements per placeholder and per module
    count_flops,          # forward/backward FLOPs per op, symbolic in batch/seq
    count_bytes,          # bytes read/written, bytes saved for backward
    find_blocks,          # repeated blocks and their structural kinds
    build_dependencies,   # networkx dependency graph, condensed to blocks
]

# (planning sits between the two lists: xirang.plan reads the analysed graph and returns a Plan)

LOWERING_PASSES = [
    apply_plan,              # copy of the analysed graph, the plan's layout on every node
    plan_run_dtypes,         # run-time dtype of every tensor in half precision
    shard_parameters,        # the shard of each parameter/buffer this rank binds
    insert_collectives,      # this tp rank's program: local shapes, collectives on the edges
    drop_over_capacity,      # plan.capacity_factor: rows over each expert's capacity dropped (zero result)
    dispatch_experts,        # ep > 1: rows to the ranks holding their experts and back (all-to-all)
    insert_precision_casts,  # fp32 master weights read in the compute dtype, fp32 loss
    split_sequence,          # cp > 1: this rank's sequence chunks, ring/all-to-all attention, global positions, loss
    overlap_tp_collectives,  # plan.tp_overlap: sequence all-gather / reduce-scatter chunked against their linear
    place_random_streams,    # random ops draw on runtime-owned streams (tp-shared or per tp rank)
    assign_stages,           # pipeline stage of every node (pp = 1: one stage)
    mark_recompute,          # regions the backward recomputes (plan.recompute: blocks or attention cores)
    mark_offload,            # blocks whose saved activations go to host memory (plan.offload)
    split_stages,            # one module per stage, sizes fixed at one micro-batch
]

ANALYSIS_PROVIDES = tuple(key for compiler_pass in ANALYSIS_PASSES for key in compiler_pass.provides)
