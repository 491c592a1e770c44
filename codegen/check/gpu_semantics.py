"""Where a GPU's answer differs from the fakes' and the dry run must take the GPU's.

A GPU plan's program runs on ``meta`` fakes (xirang_compile/check_api.py says why).
``aten.scaled_dot_product_attention`` picks its kernel by device. On CUDA it runs a flash or
memory-efficient kernel, which keeps for the backward only q, k, v, the output and a log-sum-exp (the
analysis prices it so: passes/analysis/attention_core.py). On meta it decomposes into the math path,
which keeps the seq x seq scores and probabilities: at Llama-2-70B's sequence of 4096 about 8 GiB a layer
and micro-batch, more than a GPU holds. ``FusedAttention`` sends each call to the memory-efficient
kernel's own op (``_scaled_dot_product_efficient_attention``: a causal flag and an additive mask, as CUDA
runs it), so the ops, what autograd saves and the peak are the GPU's. A call with dropout is left alone
(the runtime's random streams own its draws), and grouped-query calls (``enable_gqa``) have k and v
repeated to the query's heads first, as the CUDA kernels without native GQA do.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


class FusedAttention(TorchFunctionMode):
    """Runs every scaled-dot-product attention without dropout as CUDA's memory-efficient kernel (module docstring)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not _SDPA:
            return func(*args, **kwargs)
        bound = {**dict(zip(_ARGUMENTS, args)), **kwargs}
        if bound.get("dropout_p", 0.0):
            return func(*args, **kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        if bound.get("enable_gqa") and key.size(-3) != query.size(-3):
            repeat = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
        mask = bound.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:  # the kernel takes an additive bias
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        self.calls += 1
        output, *_ = _EFFICIENT(query, key, value, mask, query.requires_grad or key.requires_grad, 0.0,
                                bool(bound.get("is_causal", False)), scale=bound.get("scale"))
        return output
