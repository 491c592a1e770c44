"""What an emitted program calls to manage its activations: a region recomputed in the backward, a
block whose saved activations go to host memory. Each is a small module around a sub-GraphModule
(``inner``) that ``split_stages`` outlined (passes/lowering/regions.py); the stage module calls it
like any op: ``recompute_0 = self.recompute_0(x, p_w, tp_group, comm_counter)``.

- ``Recomputed``: ``torch.utils.checkpoint.checkpoint(inner, *inputs, use_reentrant=False)``. The
  forward keeps only the region's inputs; the backward reruns the region (RNG state restored, so a
  dropout draws the same mask) and differentiates the rerun. The non-reentrant form supports
  ``torch.autograd.grad`` with ``retain_graph`` and ``backward(inputs=...)``, which the executor's
  split backward (BackwardInput, then BackwardWeight) uses: each of the two recomputes the region.
- ``OffloadedBlock``: runs ``inner`` through the runtime's ``ActivationOffload``
  (codegen/runtime/memory/offload.py), which the runtime attaches per process like the tp group
  (``activation_offload``; ``None`` until then: the block runs as it is, keeping its activations).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class Recomputed(torch.nn.Module):
    """A region that keeps only its inputs and runs again in the backward."""

    def __init__(self, inner: torch.nn.Module, region: str):
        super().__init__()
        self.inner, self.region = inner, region

    def forward(self, *inputs):
        return checkpoint(self.inner, *inputs, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"region={self.region!r}"


class OffloadedBlock(torch.nn.Module):
    """A block whose saved activations the attached ``ActivationOffload`` sends to host memory."""

    def __init__(self, inner: torch.nn.Module, block: str):
        super().__init__()
        self.inner, self.block = inner, block
        self.activation_offload = None  # codegen/runtime/memory/offload.ActivationOffload, attached per process

    def forward(self, *inputs):
        if self.activation_offload is None:
            return self.inner(*inputs)
        return self.activation_offload.run_block(self.block, self.inner, inputs)

    def extra_repr(self) -> str:
        return f"block={self.block!r}"
