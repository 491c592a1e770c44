"""An optimizer that holds tensors the runtime does not step, found at the first ``train_step`` and refused.

    optimizer = torch.optim.AdamW(model.parameters())   # the single-device model's: trains nothing
    compiled.train_step(**batch)                          # refused, naming the tensor and what to pass

The runtime steps exactly ``compiled.named_parameters()``: the program's parameters, or under ZeRO their
shard pieces (data_parallel/dist_optimizer.py). An optimizer built over anything else of this model --
the single-device module's parameters (the rank binds its own copies), or under ZeRO the whole
parameters (``named_model_parameters()``: their gradients go to the pieces, so they never get one) --
steps nothing, and the loss stays where it was with no word. The user builds the optimizer and the
compiled model is never handed it, so at its first step the runtime looks for it: every live
``torch.optim.Optimizer`` (``gc.get_objects``, once per model) that holds any tensor of this model is
checked, and one holding a tensor the runtime does not step is refused. An optimizer that holds none of
this model's tensors (another model's) is none of its business. The walk costs a pass over the process's
objects (0.1-0.3 s with torch loaded), once; a program on fake or meta tensors (the dry run of
codegen/check/) skips it.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

from xirang.ir.errors import XirangError


class OptimizerCheck:
    """What the first ``train_step`` checks (see the module docstring). ``original``: the module the model
    was compiled from (None: a state mapping), whose parameters are remembered by weak reference only."""

    def __init__(self, original):
        self.done = False
        self._original = {}
        if isinstance(original, torch.nn.Module):
            for name, param in original.named_parameters():
                self._original[id(param)] = (name, weakref.ref(param))

    def problem(self, stepped: list, model_parameters: list, zero: bool, rank: int):
        """The refusal (a XirangError, not raised) for the first optimizer holding a tensor the runtime does
        not step, else None; checked once. ``stepped``/``model_parameters``: (FQN, tensor) pairs."""
        if self.done:
            return None
        self.done = True
        sample = next((t for _, t in stepped), None)
        if sample is None or sample.is_meta or is_fake(sample):  # a dry run (codegen/check/) has no user optimizer
            return None
        steps = {id(t) for _, t in stepped}
        bound = {id(t): name for name, t in model_parameters}
        for optimizer in _live_optimizers():
            held = [p for group in optimizer.param_groups for p in group["params"]]
            if not any(id(p) in steps or id(p) in bound or self._original_name(p) for p in held):
                continue
            for index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    if id(param) not in steps:
                        return self._refusal(optimizer, index, param, bound, zero, rank)
        return None

    def _original_name(self, param):
        found = self._original.get(id(param))
        return found[0] if found is not None and found[1]() is param else None

    def _refusal(self, optimizer, group: int, param, bound: dict, zero: bool, rank: int) -> XirangError:
        if id(param) in bound:
            what = (f"{bound[id(param)]!r}, the model's whole parameter: under ZeRO its gradient goes to this "
                    f"rank's shard pieces, so it never gets one" if zero else f"{bound[id(param)]!r}")
        elif self._original_name(param):
            what = (f"{self._original_name(param)!r} of the single-device model: the compiled model trains its "
                    f"own copies, so it never gets a gradient")
        else:
            what = f"a tensor of shape {tuple(param.shape)} that is not one of this model's"
        return XirangError(
            f"the {type(optimizer).__name__} holds {what}; the runtime steps only compiled.named_parameters(), "
            f"so this optimizer would train nothing of it",
            where=f"CompiledModel.train_step (first step), rank {rank}, optimizer param group {group}",
            hint="build the optimizer over compiled.parameters(), or groups chosen by name from "
                 "compiled.named_parameters() (e.g. no weight decay where 'bias' in name)")


def _live_optimizers() -> list:
    """Every torch optimizer alive in this process (one walk of the collector's objects)."""
    optimizer = torch.optim.Optimizer  # type(), not isinstance: a deprecated module object warns when asked
    return [obj for obj in gc.get_objects() if issubclass(type(obj), optimizer)]
