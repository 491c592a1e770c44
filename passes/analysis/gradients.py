"""Mark which nodes' outputs need a gradient: those that depend differentiably on a parameter."""
from __future__ import annotations

import torch

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import PARAM_ALIASES, REQUIRES_GRAD, ROLE, TENSOR
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(ROLE, TENSOR), provides=(REQUIRES_GRAD,))
def mark_requires_grad(gm, ctx):
    """Propagate requires-grad forward from trainable parameters through floating-point outputs.

    torch.export's fake values carry no autograd state, so this is recomputed: an output needs a
    gradient when it is floating point and some input does. Integer and boolean outputs (masks,
    indices, argmax) never do.
    """
    trainable = _trainable_parameter_names(ctx.model)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            needs = ROLE.get(node) == "parameter" and _is_trainable(node, trainable)
        elif node.op in ("call_function", "call_method", "call_module"):
            needs = _is_floating(TENSOR.get(node, None)) and any(
                REQUIRES_GRAD.get(arg, False) for arg in node.all_input_nodes)
        else:
            needs = any(REQUIRES_GRAD.get(arg, False) for arg in node.all_input_nodes)
        REQUIRES_GRAD.set(node, bool(needs))
    return gm


def _trainable_parameter_names(model) -> set[str] | None:
    if not isinstance(model, torch.nn.Module):
        return None
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _is_trainable(node, trainable: set[str] | None) -> bool:
    if trainable is None:
        return True
    return any(name in trainable for name in PARAM_ALIASES.get(node, ()))


def _is_floating(info) -> bool:
    if isinstance(info, TensorInfo):
        return info.is_floating
    if isinstance(info, tuple):
        return any(isinstance(i, TensorInfo) and i.is_floating for i in info)
    return False
