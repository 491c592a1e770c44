"""Half-precision copies of the weights are made again in the backward, not kept from the forward.

A half-precision program reads every fp32 parameter through a cast to the compute dtype
(passes/lowering/precision.py). The ops that read the copy save it for their backward (a matmul
keeps its weight operand to compute the input's gradient), so without this module each micro-batch
in flight would hold a half-precision copy of every weight of its stage: 2 bytes per parameter per
micro-batch in flight, more than the weights themselves under a deep pipeline. Megatron-LM holds its
weights in bf16 and saves no copy; here the weights stay fp32 (the optimizer's dtype) and a saved
copy is replaced by a recipe, the parameter and the view of the copy, which the backward makes again
(one cast per weight per micro-batch's backward, bit for bit the forward's copy).

A saved tensor is such a copy when autograd made it by ``_to_copy`` straight from a leaf parameter
(its ``grad_fn`` is ``ToCopyBackward0`` whose input is the parameter's ``AccumulateGrad``) into
another floating dtype, or is a view of one. Read from autograd's own graph, so the emitted program is
unchanged and a model's own casts of its parameters are caught too.

Every saved-tensor hook of the runtime consults ``recipe_of`` first (PyTorch uses only the innermost
pair of hooks): the executor's stage forward (``saved_tensors``, which passes the rest to an observer
such as the memory probe), offload's block hooks (codegen/runtime/memory/offload.py). Inside a recomputed
region torch's checkpoint keeps nothing, so nothing is to be done there.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


class Recast:
    """A saved half-precision view of a parameter, made again when the backward reads it."""

    __slots__ = ("parameter", "dtype", "size", "stride", "offset")

    def __init__(self, parameter: torch.Tensor, dtype: torch.dtype, view: torch.Tensor):
        self.parameter, self.dtype = parameter, dtype
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def fetch(self) -> torch.Tensor:
        with torch.no_grad():
            copy = self.parameter.to(self.dtype)  # preserves the parameter's strides, as the forward's cast did
        return copy.as_strided(self.size, self.stride, self.offset)


def recipe_of(tensor: torch.Tensor) -> Optional[Recast]:
    """A ``Recast`` when ``tensor`` is (a view of) a cast of a leaf parameter to another floating dtype."""
    base = tensor._base if tensor._is_view() else tensor
    if base is None or not base.is_floating_point():
        return None
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return None
    source = node.next_functions[0][0] if node.next_functions else None
    parameter = getattr(source, "variable", None)  # AccumulateGrad of a leaf
    if parameter is None or parameter.dtype == base.dtype or parameter.shape != base.shape \
            or parameter.stride() != base.stride():
        return None
    return Recast(parameter, base.dtype, tensor)


def unpack(packed):
    return packed.fetch() if isinstance(packed, Recast) else packed


@contextmanager
def saved_tensors(observer=None):
    """Saved weight copies become recipes; every other saved tensor goes to ``observer`` (an object with
    ``pack`` and ``unpack``, e.g. the memory probe) or is kept as is."""
    def pack(tensor):
        recast = recipe_of(tensor)
        if recast is not None:
            return recast
        # Detached: a saved output returned with its grad_fn would hold that grad_fn in a cycle through
        # its own saved variable, which nothing frees (the memory probe detaches for the same reason).
        return observer.pack(tensor) if observer is not None else tensor.detach()

    def unpack_any(packed):
        if isinstance(packed, Recast):
            return packed.fetch()
        return observer.unpack(packed) if observer is not None else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack_any):
        yield
