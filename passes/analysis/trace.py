"""Capture the model as a training (pre-dispatch aten) graph on fake tensors, batch and seq symbolic.

torch.export in non-strict mode runs the model's Python on fake tensors, so a model built on the
``meta`` device traces with no real memory. Parameters are lifted to placeholders named after their
FQN; tied weights become one placeholder. Where the symbolic trace fails, a static trace is tried,
then torch.fx.symbolic_trace followed by export; the method used and every fallback are recorded in
``gm.meta['xr_trace']`` so nothing is silently different.
"""
from __future__ import annotations

import contextlib
import sys
import time
import traceback

import torch
import torch.fx.proxy as fx_proxy
from torch.export.graph_signature import InputKind

from xirang.ir.errors import TraceError
from xirang.ir.meta_keys import (CONSTANT_VALUE, MODULE_PATH, MODULE_TYPE, NN_MODULE_STACK, PARAM_ALIASES,
                                 PARAM_NAME, ROLE, SOURCE, SYMBOL_DIMS, SYMBOLS, TORCH_SYMBOLS, TRACE_INFO, VAL)
from xirang.ir.facts import SourceLocation
from xirang.ir.pass_spec import compiler_pass

from xirang.passes.analysis.experts import captured_experts
from xirang.passes.analysis.fold_repeats import CannotFold, folded_repeats
from xirang.passes.analysis.trace_normalize import canonical_graph
from xirang.passes.analysis.trace_errors import ModuleCallTracker, explain_trace_failure, quiet_torch_logs, user_frames
from xirang.passes.analysis.trace_inputs import (check_symbolic_dims, default_symbolic_dims, export_dynamic_shapes,
                           name_inputs, symbol_values, widen_unit_dims)

_ROLE_OF_KIND = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                 InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}


@compiler_pass(provides=(VAL, NN_MODULE_STACK, ROLE, PARAM_NAME, PARAM_ALIASES, CONSTANT_VALUE, MODULE_PATH,
                         MODULE_TYPE, SOURCE, SYMBOLS, SYMBOL_DIMS, TORCH_SYMBOLS, TRACE_INFO))
def trace_model(gm, ctx):
    """Capture ctx.model as an aten training graph on fake tensors, with batch/seq symbols."""
    model = ctx.model
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"expected a torch.nn.Module, got {type(model).__name__}",
                         hint="pass the model object itself (an nn.Module)")
    named = name_inputs(model, tuple(ctx.example_args), dict(ctx.example_kwargs or {}))
    symbolic_dims = (check_symbolic_dims(named, ctx.symbolic_dims) if ctx.symbolic_dims is not None
                     else default_symbolic_dims(named))
    values = symbol_values(named, symbolic_dims)
    info = {"method": None, "fallbacks": [], "seconds": 0.0, "folded": None}
    cpu_start = time.process_time()  # the whole pass's CPU time, beside the wall time of the trace itself

    start = time.perf_counter()
    gm = _trace_folded(model, named, symbolic_dims, info, fold=ctx.fold_repeats)
    gm = canonical_graph(gm)  # the same names and ops for one model on meta, CPU or GPU
    info["seconds"] = time.perf_counter() - start
    _annotate_locations(gm)
    torch_symbols, specialised = _map_symbols(gm, symbolic_dims)
    for name in specialised:
        info["fallbacks"].append(f"{name} is a constant in the traced graph: the model fixes it")
        values.pop(name, None)
    SYMBOLS.set(gm, values)
    SYMBOL_DIMS.set(gm, symbolic_dims)
    TORCH_SYMBOLS.set(gm, torch_symbols)
    info["cpu_seconds"] = time.process_time() - cpu_start
    TRACE_INFO.set(gm, info)
    return gm  # its code is generated on first use (canonical_graph)


def _trace_folded(model, named, symbolic_dims, info, fold: bool):
    """Export with runs of identical layers folded to three, then stamp the rest out; if the traced
    layers do not repeat cleanly, export the whole model instead."""
    aliases_of = _aliases_by_name(model)
    with folded_repeats(model, enabled=fold) as folding, captured_experts(model) as experts:
        exported = _export_with_fallbacks(model, named, symbolic_dims, info)
    if experts:
        info["experts"] = len(experts)  # modules traced through passes/analysis/experts.py
    gm = exported.graph_module
    _annotate_placeholders(gm, exported.graph_signature, aliases_of, exported.constants)
    if not folding.runs:
        return gm
    try:
        info["folded"] = folding.expand(gm, aliases_of.get)
        return gm
    except CannotFold as reason:
        info["fallbacks"].append(f"layers not folded: {reason}")
        info["folded"] = None
        return _trace_folded(model, named, symbolic_dims, info, fold=False)


def _aliases_by_name(model) -> dict[str, tuple[str, ...]]:
    """FQN -> every FQN bound to the same tensor (tied weights share one tensor)."""
    by_tensor: dict[int, list[str]] = {}
    for fqn, tensor in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        by_tensor.setdefault(id(tensor), []).append(fqn)
    return {fqn: tuple(fqns) for fqns in by_tensor.values() for fqn in fqns}


def _export_with_fallbacks(model, named, symbolic_dims, info):
    attempts = [("export-symbolic", symbolic_dims), ("export-static", {})] if symbolic_dims else \
        [("export-static", {})]
    first_failure = failed_in = None
    for method, dims in attempts:
        inputs = widen_unit_dims(named, dims)
        tracker = ModuleCallTracker(model)
        try:
            with quiet_torch_logs(), tracker.watching(), _uncached_fake_dispatch(), forward_frames_only():
                exported = torch.export.export(model, (), inputs, strict=False,
                                               dynamic_shapes=export_dynamic_shapes(inputs, dims) if dims else None)
            info["method"] = method
            info["unsupported"] = tracker.unsupported  # constructs traced with other semantics: plan notes say so
            info["fallbacks"] += tracker.unsupported
            return exported
        except Exception as exc:  # noqa: BLE001 - every failure is reported, see explain_trace_failure
            if first_failure is None:
                first_failure, failed_in = exc, tracker.failed_in
            info["fallbacks"].append(f"{method} failed: {type(exc).__name__}: {_first_line(exc)}")
    try:
        exported = _export_through_fx(model, named)
        info["method"] = "fx-symbolic-trace+export-static"
        return exported
    except Exception as fx_exc:  # noqa: BLE001
        raise explain_trace_failure(model, first_failure, failed_in, fx_exc) from first_failure


def _export_through_fx(model, named):
    """torch.fx's tracer can capture some models export cannot (it skips non-tensor Python values);
    the fx GraphModule keeps the module hierarchy, so exporting it gives the usual graph."""
    fx_module = torch.fx.symbolic_trace(model, concrete_args={k: v for k, v in named.items()
                                                              if not isinstance(v, torch.Tensor)})
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    with quiet_torch_logs():
        return torch.export.export(fx_module, (), tensors, strict=False)


def _uncached_fake_dispatch():
    """FakeTensor's dispatch cache costs more than it saves on symbolic shapes: making an entry and
    each hit rebuild the output's sizes and strides as SymInts (~40% of exporting three Llama layers
    went there; ~20% of the export is saved without it). The graph is the same either way."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


class ForwardFrames:
    """What ``torch.fx.proxy`` asks of ``CapturedTraceback`` (``extract().summary()``), keeping only the
    frames export's tracer keeps: those of a ``forward``, of torch/__init__.py, or of a registered
    anchor (its ``_record_forward_stack_traces_only`` filter). torch symbolised and looked up the source
    line of every frame of a ~100-frame stack for each node (~10% of exporting three Llama layers) only
    to drop all but a few; walking the frames here gives the same kept frames, so the same
    ``stack_trace`` text, at a fraction of the cost."""

    def __init__(self, frames: list[tuple[str, int, str]]):
        self.frames = frames  # (file, line, function), innermost first

    @staticmethod
    def extract(*, script=False, cpp=False, skip=0):
        anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", ())
        kept, frame = [], sys._getframe(1 + skip)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "forward" or code.co_filename.endswith("torch/__init__.py") \
                    or (code.co_filename, code.co_name) in anchors:
                kept.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        return ForwardFrames(kept)

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([traceback.FrameSummary(file, line, name)
                                                 for file, line, name in reversed(self.frames)])


@contextlib.contextmanager
def forward_frames_only():
    """Within the block, export's tracer captures each node's stack with ``ForwardFrames``; if a
    torch release no longer reads ``CapturedTraceback`` there, nothing changes but the speed."""
    original = getattr(fx_proxy, "CapturedTraceback", None)
    if original is None:
        yield
        return
    fx_proxy.CapturedTraceback = ForwardFrames
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = original


def _first_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _annotate_placeholders(gm, signature, aliases_of: dict[str, tuple[str, ...]], constants: dict):
    """Role and FQN of every placeholder; tied parameters (one tensor, several FQNs) are merged into
    one placeholder so the graph shows the tie that pipeline and gradient sync must respect."""

    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    kept_for_tensor: dict[tuple, torch.fx.Node] = {}
    for spec in signature.input_specs:
        node = placeholders.get(spec.arg.name) if hasattr(spec.arg, "name") else None
        if node is None:
            continue
        ROLE.set(node, _ROLE_OF_KIND.get(spec.kind, "input"))
        if spec.kind == InputKind.CONSTANT_TENSOR and spec.target in constants:  # the runtime binds it
            CONSTANT_VALUE.set(node, constants[spec.target])
        if spec.target is None:
            continue
        PARAM_NAME.set(node, spec.target)
        tensor_id = aliases_of.get(spec.target)
        PARAM_ALIASES.set(node, tensor_id or (spec.target,))
        if tensor_id is not None and tensor_id in kept_for_tensor:
            node.replace_all_uses_with(kept_for_tensor[tensor_id])
            gm.graph.erase_node(node)
        elif tensor_id is not None:
            kept_for_tensor[tensor_id] = node
    for node in gm.graph.nodes:
        if node.op == "output":
            ROLE.set(node, "output")
        elif not ROLE.has(node):
            ROLE.set(node, "activation" if node.op != "placeholder" else "input")


def _annotate_locations(gm):
    """Innermost module path and class, and the user source line, of every op."""
    source_cache: dict[str, SourceLocation | None] = {}
    for node in gm.graph.nodes:
        stack = {key: entry for key, entry in (NN_MODULE_STACK.get(node, None) or {}).items()
                 if not str(entry[0]).startswith("_empty_nn_module_stack")}  # export's placeholder entry
        NN_MODULE_STACK.set(node, stack)
        path, cls = ("", "")
        if stack:
            path, cls = list(stack.values())[-1]
            path = path if isinstance(path, str) else ""
        MODULE_PATH.set(node, path)
        MODULE_TYPE.set(node, cls.rsplit(".", 1)[-1] if isinstance(cls, str) else type(cls).__name__)
        trace = node.meta.get("stack_trace")
        if trace:
            if trace not in source_cache:
                frames = user_frames(trace)
                source_cache[trace] = SourceLocation(*frames[-1]) if frames else None
            if source_cache[trace] is not None:
                SOURCE.set(node, source_cache[trace])


def user_inputs(gm) -> dict:
    """The traced graph's placeholders that are the model's inputs (not its parameters or buffers), by name."""
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and ROLE.get(n) == "input"}


def _map_symbols(gm, symbolic_dims):
    """torch's shape symbols (s72, s70, ...) -> Xirang's names ('batch', 'seq')."""
    inputs = user_inputs(gm)
    torch_symbols: dict[str, str] = {}
    specialised = set()
    for name, dims in symbolic_dims.items():
        node = inputs.get(name)
        if node is None:
            continue
        for dim, symbol_name in dims.items():
            size = VAL.get(node).shape[dim]
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                torch_symbols[str(size.node.expr)] = symbol_name
            else:
                specialised.add(symbol_name)
    return torch_symbols, specialised - set(torch_symbols.values())
