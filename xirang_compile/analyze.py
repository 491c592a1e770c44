"""``xirang.analyze``: trace and analyse a model, and report parameters, FLOPs and memory per block."""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import sympy
import torch

from xirang.ir.facts import evaluate
from xirang.ir.meta_keys import (BLOCK, BLOCK_GRAPH, BLOCK_KINDS, FLOPS, MODULE_PARAMS, MODULE_PATH,
                                 MODULE_TYPE, PARAM_COUNT, SYMBOLS, TRACE_INFO, UNIT, UNPRICED_OPS)
from xirang.ir.pass_spec import CompileContext
from xirang.passes.analysis.saved_storages import live_saved_bytes

from xirang.pass_manager import PassManager, PassTiming, lint_graph
from xirang.pipeline import ANALYSIS_PASSES


@dataclass(frozen=True)
class BlockRow:
    """One repeated block, or one stretch of ops outside blocks (embedding, head, loss)."""

    name: str
    kind: str  # structural hash for blocks, "-" outside blocks
    module_type: str
    params: int
    flops: sympy.Expr  # forward + backward, per step, symbolic in batch/seq
    activation_bytes: sympy.Expr  # saved for backward: the storages the unit keeps, each once


@dataclass(frozen=True)
class BlockKind:
    kind: str
    module_type: str
    count: int
    example: str  # path of the first block of this kind


@dataclass
class AnalysisReport:
    total_params: int
    rows: list[BlockRow]
    kinds: list[BlockKind]
    symbols: dict[str, int]  # value of each symbol in the example inputs
    total_flops: sympy.Expr
    trace: dict
    unpriced_ops: tuple[str, ...] = ()  # ops with no FLOP rule, counted as 0
    timings: list[PassTiming] = field(default_factory=list)
    graph_module: object = None
    _run_dtypes: dict = field(default_factory=dict, repr=False, compare=False)  # by precision, made once

    def run_dtypes(self, precision: str):
        """The graph's dtypes at run time in ``precision`` (``saved_storages.RunDtypes``: the lowering's,
        passes/lowering/compute_dtypes.py), derived once per precision for planning, the dry run and
        lowering alike; None in fp32, where the traced dtypes hold."""
        from xirang.passes.lowering.compute_dtypes import run_dtypes
        from xirang.passes.lowering.precision import COMPUTE_DTYPES
        dtype = COMPUTE_DTYPES.get(precision, torch.float32)
        if dtype == torch.float32:
            return None
        if precision not in self._run_dtypes:
            self._run_dtypes[precision] = run_dtypes(self.graph_module, dtype)
        return self._run_dtypes[precision]

    def flops_at(self, **symbols: int) -> int:
        """Forward+backward FLOPs per step at other symbol values, e.g. ``flops_at(batch=8, seq=4096)``."""
        return evaluate(self.total_flops, {**self.symbols, **symbols})

    @property
    def flops(self) -> int:
        return self.flops_at()

    def __str__(self) -> str:
        return format_report(self)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off for the block (restored as it was after). Tracing and planning
    build hundreds of thousands of long-lived objects (fx nodes, sympy expressions, fake tensors), and
    each full collection walks all of them: on Llama-3-405B it cost ~0.75 s of a ~5.8 s plan, while
    the cycles it would have freed hold under 10 MB. Usable as a decorator."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@gc_paused()
def analyze(model, example_inputs=(), example_kwargs=None, *, symbolic_dims=None, fold_repeats=True,
            dump_dir=None, lint_each_pass: bool = False) -> AnalysisReport:
    """Trace ``model`` on fake tensors and annotate it; return the per-block report.

    ``example_inputs`` are positional arguments of ``model.forward`` (a tensor or a tuple), and
    ``example_kwargs`` keyword arguments; they may live on the ``meta`` device. ``symbolic_dims``
    overrides which input dims are the batch and sequence, e.g. ``{"x": {0: "batch"}}``.
    The graph is linted (fx's lint, every meta key declared and of its type) once, after the last
    pass; ``lint_each_pass=True`` (or a ``dump_dir``) lints after every pass, naming the pass that
    broke it (each lint walks every node's meta: a third of the analysis time of an 80-layer model).
    """
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    ctx = CompileContext(model=model, example_args=tuple(example_inputs), example_kwargs=dict(example_kwargs or {}),
                         symbolic_dims=symbolic_dims, fold_repeats=fold_repeats)
    each = lint_each_pass or dump_dir is not None
    run = PassManager(ANALYSIS_PASSES, lint=each, dump_dir=dump_dir).run(None, ctx)
    if not each:
        lint_graph(run.gm, ANALYSIS_PASSES[-1], [p.name for p in ANALYSIS_PASSES[:-1]])
    return build_report(run.gm, run.timings)


def build_report(gm, timings=()) -> AnalysisReport:
    """Rows in execution order: the stretches of ops between blocks, and every block."""
    groups: dict[str, list] = {}
    for node in gm.graph.nodes:
        if UNIT.has(node):
            groups.setdefault(UNIT.get(node), []).append(node)
    units = sorted(groups, key=lambda u: BLOCK_GRAPH.get(gm).nodes[u]["order"])
    # Blocks of one kind have identical per-node facts, so sum one representative per kind.
    totals_of_kind: dict[str, tuple] = {}
    rows = []
    for unit in units:
        nodes = groups[unit]
        block = BLOCK.get(next(n for n in nodes if n.op != "placeholder"), None)
        kind = block.kind if block is not None else "-"
        if kind == "-" or kind not in totals_of_kind:
            totals = _sum_facts(nodes)
            if kind != "-":
                totals_of_kind[kind] = totals
        else:
            totals = totals_of_kind[kind]
        name = block.path if block is not None else _segment_name(nodes)
        rows.append(BlockRow(name=name, kind=kind, module_type=_block_type(nodes, name) if block else "",
                             params=totals[0], flops=totals[1], activation_bytes=totals[2]))
    kinds = [BlockKind(kind=k, module_type=next(r.module_type for r in rows if r.name == paths[0]),
                       count=len(paths), example=paths[0]) for k, paths in BLOCK_KINDS.get(gm).items()]
    total_flops = sympy.expand(sympy.Add(*[r.flops for r in rows]))
    return AnalysisReport(total_params=MODULE_PARAMS.get(gm)[""], rows=rows, kinds=kinds,
                          symbols=dict(SYMBOLS.get(gm)), total_flops=total_flops, trace=dict(TRACE_INFO.get(gm)),
                          unpriced_ops=UNPRICED_OPS.get(gm, ()), timings=list(timings), graph_module=gm)


def _segment_name(nodes) -> str:
    """Ops outside blocks, named by the modules they run in: '(wte, wpe, drop)'."""
    paths = []
    for node in nodes:
        path = MODULE_PATH.get(node, "")
        short = path.rsplit(".", 1)[-1] if path else ""
        if short and short not in paths:
            paths.append(short)
    return "(" + ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "") + ")" if paths else "(top level)"


def _sum_facts(nodes) -> tuple[int, sympy.Expr, sympy.Expr]:
    params = sum(PARAM_COUNT.get(n, 0) for n in nodes)
    flops = sympy.Add(*[FLOPS.get(n).total for n in nodes if FLOPS.has(n)])
    saved = live_saved_bytes(nodes)  # each storage the unit keeps once
    return params, sympy.expand(flops), sympy.expand(saved)


def _block_type(nodes, name: str) -> str:
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for fqn, cls in stack.values():
            if fqn == name:
                return str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return MODULE_TYPE.get(nodes[-1], "")


def format_report(report: AnalysisReport) -> str:
    """A table: one line per block (runs of one kind collapse to one line with ×count)."""
    values = report.symbols
    header = f"{'block':<28} {'kind':<12} {'type':<22} {'params':>14} {'GFLOP fwd+bwd':>15} {'act MiB':>10}"
    lines = [header, "-" * len(header)]
    collapsed: list[tuple[BlockRow, int, str]] = []
    for row in report.rows:
        if collapsed and row.kind != "-" and collapsed[-1][0].kind == row.kind:
            first, count, _ = collapsed[-1]
            collapsed[-1] = (first, count + 1, row.name)
        else:
            collapsed.append((row, 1, row.name))
    for row, count, last in collapsed:
        name = row.name if count == 1 else f"{row.name} .. {last.rsplit('.', 1)[-1]}"
        times = f" x{count}" if count > 1 else ""
        lines.append(f"{name[:28]:<28} {row.kind:<12} {(row.module_type + times)[:22]:<22} "
                     f"{row.params:>14,} {evaluate(row.flops, values) / 1e9:>15,.2f} "
                     f"{evaluate(row.activation_bytes, values) / 2**20:>10,.1f}")
    lines.append("-" * len(header))
    shape = ", ".join(f"{k}={v}" for k, v in values.items()) or "static shapes"
    lines.append(f"total parameters {report.total_params:,}; fwd+bwd {report.flops / 1e12:,.3f} TFLOP per step "
                 f"at {shape}; {len(report.kinds)} distinct block kind(s): "
                 + ", ".join(f"{k.module_type} x{k.count}" for k in report.kinds))
    lines.append(f"FLOPs = {report.total_flops}")
    lines.append(f"traced by {report.trace.get('method')} in {report.trace.get('seconds', 0):.2f} s"
                 + (f"; folded {report.trace['folded']}" if report.trace.get("folded") else "")
                 + "".join(f"\n  note: {f}" for f in report.trace.get("fallbacks", [])))
    if report.unpriced_ops:
        lines.append("ops with no FLOP rule (counted as 0): " + ", ".join(report.unpriced_ops))
    return "\n".join(lines)
