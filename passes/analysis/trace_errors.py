"""Turn a tracer's exception into an error that names the module, the source line and a remedy."""
from __future__ import annotations

import contextlib
import logging
import re
import traceback

import torch
from torch.autograd import Function

from xirang.ir.errors import TraceError

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s+(?P<code>[^\n]*)')
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]
_XIRANG_DIR = __file__.rsplit("/", 3)[0]  # the repository root (this is passes/analysis/): not user code


def user_frames(text: str) -> list[tuple[str, int, str]]:
    """(file, line, code) of every stack frame quoted in ``text`` that is not inside torch."""
    return [(m["file"], int(m["line"]), m["code"].strip()) for m in _FRAME.finditer(text)
            if not m["file"].startswith((_TORCH_DIR, _XIRANG_DIR + "/passes", _XIRANG_DIR + "/xirang_compile"))]


class ModuleCallTracker:
    """Records which submodule's forward is running, so a failure can name its module path; and every
    custom ``torch.autograd.Function`` the model applies: export traces through its forward and keeps
    no trace of its backward, so the gradient Xirang trains with is autograd's of the forward ops
    (``unsupported``: one line each, with the module and source line)."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None
        self.unsupported: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name, type(module).__name__)))
            self._handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name, cls):
        def hook(module, args):
            self.stack.append((name, cls))
        return hook

    def _leave(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def remove(self):
        for handle in self._handles:
            handle.remove()

    def _applied(self, function: type) -> None:
        frames = user_frames("".join(traceback.format_stack()))
        module = f"module '{self.stack[-1][0]}' ({self.stack[-1][1]})" if self.stack else "the model's forward"
        line = f", {frames[-1][0]}:{frames[-1][1]} `{frames[-1][2]}`" if frames else ""
        note = (f"custom autograd Function {function.__qualname__} in {module}{line}: its backward is not traced; "
                f"gradients are autograd's of its forward ops (write it with differentiable ops, or register it "
                f"as a torch.library custom op with its autograd)")
        if note not in self.unsupported:
            self.unsupported.append(note)

    @contextlib.contextmanager
    def watching(self):
        self.stack.clear()
        original = Function.__dict__["apply"]  # a classmethod; put back as it was

        def apply(function, *args, **kwargs):
            if not function.__module__.startswith("torch."):  # torch's own Functions keep their semantics
                self._applied(function)
            return original.__func__(function, *args, **kwargs)
        Function.apply = classmethod(apply)
        try:
            yield self
        except BaseException:
            self.failed_in = self.stack[-1] if self.stack else ("", "")
            raise
        finally:
            Function.apply = original
            self.remove()


@contextlib.contextmanager
def quiet_torch_logs():
    """torch logs whole graphs at WARNING when a guard fails; the TraceError we raise says it better."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
             "torch._dynamo", "torch.fx.experimental.recording"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _is_data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("data-dependent", "GuardOnDataDependent", "DataDependentOutput",
                                   "data dependent", "cannot be used as inputs to control flow"))


def explain_trace_failure(model, exc: BaseException, failed_in, fallback_exc=None) -> TraceError:
    """Build the TraceError for an export failure (and the fx fallback's failure, if tried)."""
    module_path, module_cls = failed_in or ("", "")
    module_text = f"module '{module_path or '<root>'}' ({module_cls or type(model).__name__})"
    frames = user_frames(str(exc)) or user_frames("".join(_format_tb(exc)))
    source = f", {frames[-1][0]}:{frames[-1][1]} `{frames[-1][2]}`" if frames else ""
    where = module_text + source
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _is_data_dependent(exc):
        return TraceError(
            "the model has Python control flow that depends on tensor values, which are unknown "
            f"while tracing on fake tensors ({first_line})",
            where=where,
            hint="make the branch independent of tensor values (torch.where, masking, or torch.cond), "
                 "or move the check out of forward; shapes and config values may be branched on freely")
    if "not a known type" in str(exc) and "Cache" in str(exc):
        return TraceError(
            "the model returns a key/value cache object, which is not a tensor",
            where=where, hint="build the model with use_cache=False (training does not need the cache)")
    fallback = f"; torch.fx.symbolic_trace also failed: {fallback_exc}" if fallback_exc else ""
    return TraceError(
        f"torch.export could not trace the model: {type(exc).__name__}: {first_line}{fallback}",
        where=where,
        hint="check that forward runs on the example inputs on the 'meta' device; see the chained "
             "exception for torch's full message")


def _format_tb(exc):
    import traceback
    return traceback.format_exception(type(exc), exc, exc.__traceback__)
