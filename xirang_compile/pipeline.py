"""The compiler, as one list of passes. Read top to bottom: each line is one pass file in passes/.

The pass manager checks this order against what each pass requires and provides before running it.
"""
from __future__ import annotations

from xirang.passes.analysis.blocks import find_blocks
from xirang.passes.analysis.dependencies import build_dependencies
from xirang.passes.analysis.flops import count_flops
from xirang.passes.analysis.gradients import mark_requires_grad
from xirang.passes.analysis.memory_traffic import count_bytes
from xirang.passes.analysis.parameters import count_parameters
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model

ANALYSIS_PASSES = [
    trace_model,          # model -> aten training graph on fake tensors; batch/seq symbolic
    annotate_tensors,     # shapes (sympy), dtypes
    mark_requires_grad,   # which outputs need gradients
    count_parameters,     # parameter elements per placeholder and per module
    count_flops,          # forward/backward FLOPs per op, symbolic in batch/seq
    count_bytes,          # bytes read/written, bytes saved for backward
    find_blocks,          # repeated blocks and their structural kinds
    build_dependencies,   # networkx dependency graph, condensed to blocks
]
