"""The device a traced op names, moved to the device the program runs on.

A trace records the device of every op that makes or moves a tensor inside forward: the device the
model was traced on. A model planned on ``meta`` (as users plan large models) traces
``arange(..., device=meta)``, and Hugging Face's rotary tables ``inv_freq.to(x.device)``, which export
records as ``aten.to.device(inv_freq, meta, ...)`` with the device positional; a model traced on the
CPU (or on cuda:0) and run on a rank's GPU traces ``device=cpu`` (or cuda:0) there. A rank's program
runs on one device, so every lowering step that runs or emits such an op reads its arguments through
``on_device``, positional and keyword alike, and every device the trace named becomes the rank's: no
program and no fake run is left holding ``meta``, nor the trace's CPU on a GPU rank.
"""
from __future__ import annotations

import torch
from torch.fx.node import map_aggregate


def on_device(value, device: torch.device):
    """``value`` (an op's args tuple, kwargs dict, or one argument) with every device it names (the
    trace's: ``meta``, ``cpu``, ``cuda:0``) replaced by ``device``; anything else unchanged."""
    return map_aggregate(value, lambda v: device if isinstance(v, torch.device) else v)
