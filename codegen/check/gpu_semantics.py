"""Where a GPU's answer differs from the fakes' and the dry run must take the GPU's.

A GPU plan's program runs on ``meta`` fakes (xirang_compile/check_api.py says why).
``aten.scaled_dot_product_attention`` picks its kernel by device. On CUDA it runs a flash or
memory-efficient kernel, which keeps for the backward only q, k, v, the output and a log-sum-exp (the
analysis prices it so: passes/analysis/attention_core.py). On meta it decomposes into the math path,
which keeps the seq x seq scores and probabilities: at Llama-2-70B's sequence of 4096 about 8 GiB a layer
and micro-batch, more than a GPU holds. ``fuse_attention`` points each call at the memory-efficient
kernel's own op (``_scaled_dot_product_efficient_attention``: a causal flag and an additive mask, as CUDA
runs it), so the ops, what autograd saves and the peak are the GPU's. Attention with dropout is the
runtime's random op (codegen/ops/random_ops.py ``attention``): under random streams it calls the fused
kernel under its site's seed, so on a GPU it keeps no seq x seq tensor either and is pointed at the same
kernel (with its dropout); in exact mode it writes attention out with this rank's piece of the full mask on
any device, and is left alone. Grouped-query calls (``enable_gqa``) have k and v repeated to the query's
heads first, as the CUDA kernels without native GQA do.

Activation offload copies what a block saves to host memory on a GPU (pinned, on a side stream), freeing
the device's copy; on the fakes' device the CPU path would clone it on the device. ``HostCopies`` copies to
host memory and back, in order, so the device's peak drops as a GPU's does and the host's holds them.
"""
from __future__ import annotations

import torch
from torch import fx

from xirang.codegen.ops import random_ops
from xirang.codegen.runtime.memory.offload import Ready

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default


def efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                        enable_gqa=False):
    """``scaled_dot_product_attention`` as CUDA's memory-efficient kernel runs it (module docstring)."""
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float("-inf"))
    output, *_ = _EFFICIENT(query, key, value, attn_mask, query.requires_grad or key.requires_grad,
                            float(dropout_p), bool(is_causal), scale=scale)
    return output


def efficient_random_attention(rng, site, query, key, value, attn_mask=None, dropout_p: float = 0.0,
                               is_causal: bool = False, *, scale=None, enable_gqa: bool = False):
    """The runtime's attention with dropout as a GPU runs it: the fused kernel under random streams, the
    written-out attention in exact mode (module docstring)."""
    if dropout_p and getattr(rng, "mode", None) == "exact":
        return random_ops.attention(rng, site, query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                    enable_gqa=enable_gqa)
    return efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def fuse_attention(program) -> int:
    """Point every attention node of ``program``'s stage modules (and the recompute and offload regions
    outlined in them) at ``efficient_attention``; returns how many. The rewrite is of the graph, not a mode,
    so a recomputation in the backward runs the same kernel as the forward did."""
    count = 0
    for stage in program.stages:
        for module in stage.module.modules():
            if not isinstance(module, fx.GraphModule):
                continue
            found = [node for node in module.graph.nodes if node.op == "call_function"
                     and node.target in (_SDPA, random_ops.attention)]
            for node in found:
                node.target = efficient_attention if node.target is _SDPA else efficient_random_attention
            if found:
                module.recompile()
                count += len(found)
    return count


class HostCopies:
    """The offload engine's copies as a GPU makes them (module docstring): out to host memory, back to the device.
    The step runs on meta tensors without memory (rank_step.py), so a host copy is a meta tensor too, made
    inside the recorder's ``on_host`` (counted as host memory), and the copy back a new device storage."""

    def __init__(self, recorder):
        self.recorder = recorder

    def to_host(self, tensor):
        with self.recorder.on_host():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        host.copy_(tensor.detach())
        return Ready(host)

    def to_device(self, host, device):
        host = host.wait()
        back = torch.empty(host.shape, dtype=host.dtype, device=device)  # a new storage: ``to`` would be a no-op
        back.copy_(host)
        return Ready(back)
