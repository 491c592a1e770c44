"""Which memory a tensor is, told the same way on real and on fake tensors.

The runtime asks "is this gradient still its bucket slot?", "is this saved tensor a parameter or a received
input?", "is this the same storage?". ``data_ptr()`` answers on a real device, but every fake tensor's is
0 (and torch deprecates reading it), so the dry run (codegen/check/) would take other branches than a
GPU does. ``storage_key`` is the storage itself (its StorageImpl, the same for every view of it, unique
while it lives) and ``element_key`` adds where the tensor starts in it: together what ``data_ptr()`` told.
"""
from __future__ import annotations

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage: equal for every view of one storage, on real and fake tensors."""
    return tensor.untyped_storage()._cdata


def element_key(tensor: torch.Tensor) -> tuple:
    """Where ``tensor``'s first element is: its storage and its offset into it (what ``data_ptr()`` locates)."""
    return storage_key(tensor), tensor.storage_offset()
