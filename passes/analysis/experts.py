"""Mixture-of-Experts modules traced as one graph on every device.

Hugging Face's experts modules (transformers >= 5, ``@use_experts_implementation``: Mixtral,
Qwen-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, Llama 4, ...) choose their kernels by device and option:
the default loops over the experts a batch routes to (data-dependent control flow), "grouped_mm"
picks ``torch._grouped_mm`` or a fallback op and the dtype of its histogram by device type. A model
built on ``meta`` therefore traces to another graph than the same model on a CPU or a GPU, and a plan
made on ``meta`` would not fit the program a rank builds.

While tracing, Xirang calls every such module through ``captured_forward`` instead: the same
computation written once, in the interface's own terms (``has_gate``, ``_apply_gate``, ``act_fn``,
``has_bias``, ``is_transposed``, ``has_post_expert_norm``), with the two expert matmuls as
``xirang::expert_linear`` (passes/analysis/expert_ops.py):

    rows  = each token repeated top_k times            (S = tokens * top_k rows)
    ids   = the expert of each row                     (top_k_index flattened)
    up    = expert_linear(rows, ids, gate_up_proj [, bias])
    act   = module._apply_gate(up)  or  module.act_fn(up)
    down  = expert_linear(act, ids, down_proj [, bias])   (then post_expert_norm, if any)
    out   = sum over top_k of down * top_k_weights     (in the hidden states' dtype)

which is Hugging Face's "batched_mm"/"grouped_mm" arithmetic. The router, top-k, normalisation and
auxiliary losses stay the model's own code, traced as written. Everything between the two
``expert_linear`` calls is row-local, so expert parallelism can send rows to the rank holding their
expert before the first and back after the second (passes/lowering/expert_parallel.py).
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from xirang.passes.analysis import expert_ops  # noqa: F401  (registers torch.ops.xirang.expert_linear)

INTERFACE = ("has_gate", "has_bias", "is_transposed", "_apply_gate", "down_proj")


def is_experts_module(module: torch.nn.Module) -> bool:
    """A Hugging Face experts module: the interface's flags and 3-d expert weights."""
    if not all(hasattr(module, name) for name in INTERFACE):
        return False
    up = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    return isinstance(up, torch.Tensor) and up.dim() == 3 and module.down_proj.dim() == 3


def _routing(module, args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) whatever the family names them (GPT-OSS:
    router_indices, routing_weights), by position in the original forward's signature."""
    signature = inspect.signature(type(module).forward)
    bound = signature.bind(module, *args, **kwargs)
    values = list(bound.arguments.values())[1:]
    if len(values) < 3 or any(v is None for v in values[:3]):
        names = list(signature.parameters)[1:4]
        raise TypeError(f"{type(module).__name__}.forward called without {', '.join(names)}")
    return values[0], values[1], values[2]


def captured_forward(module, *args, **kwargs):
    hidden, top_k_index, top_k_weights = _routing(module, args, kwargs)
    top_k, hidden_dim = top_k_index.shape[-1], hidden.shape[-1]
    ids = top_k_index.reshape(-1)
    rows = hidden.unsqueeze(-2).expand(*hidden.shape[:-1], top_k, hidden_dim).reshape(-1, hidden_dim)
    linear = torch.ops.xirang.expert_linear
    if module.has_gate:
        up = linear(rows, ids, module.gate_up_proj, module.gate_up_proj_bias if module.has_bias else None,
                    module.is_transposed)
        act = module._apply_gate(up)
    else:
        up = linear(rows, ids, module.up_proj, module.up_proj_bias if module.has_bias else None, module.is_transposed)
        act = module.act_fn(up)
    down = linear(act, ids, module.down_proj, module.down_proj_bias if module.has_bias else None,
                  module.is_transposed)
    if getattr(module, "has_post_expert_norm", False):
        down = module.post_expert_norm(down)
    weighted = down * top_k_weights.reshape(-1, 1)
    return weighted.view(*hidden.shape[:-1], top_k, hidden_dim).sum(dim=-2).to(hidden.dtype)


@contextlib.contextmanager
def captured_experts(model: torch.nn.Module):
    """Route every experts module of ``model`` through ``captured_forward`` while the block runs;
    yields the module paths captured."""
    captured = [(name, module) for name, module in model.named_modules() if is_experts_module(module)]
    own = {id(module): module.__dict__["forward"] for _, module in captured if "forward" in module.__dict__}
    for _, module in captured:
        module.forward = captured_forward.__get__(module)
    try:
        yield [name for name, _ in captured]
    finally:
        for _, module in captured:
            if id(module) in own:  # a forward the instance had of its own (a hook library's) comes back
                module.forward = own[id(module)]
            else:
                del module.forward
