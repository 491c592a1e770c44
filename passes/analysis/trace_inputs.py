"""Name a model's example inputs and choose which tensor dims are traced as batch / seq symbols."""
from __future__ import annotations

import inspect

import torch

from xirang.ir.errors import TraceError


def name_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, object]:
    """Bind positional and keyword example inputs to the names of ``model.forward``'s parameters."""
    return bind_inputs(model.forward, args, kwargs, owner=type(model).__name__)


def bind_inputs(forward, args: tuple, kwargs: dict, owner: str = "the model") -> dict[str, object]:
    """Bind positional and keyword inputs to the names of the parameters of ``forward`` (the function,
    or its ``inspect.Signature``: what a runtime keeps without keeping the model)."""
    if forward is None:
        raise TraceError("positional inputs need the model's forward to name them", where="train_step",
                         hint="pass the inputs by name (train_step(input_ids=..., labels=...))")
    try:
        signature = forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise TraceError(
            f"the example inputs do not match {owner}.forward: {exc}",
            hint="pass example_inputs as the positional arguments and example_kwargs as the keyword "
                 "arguments you would give the model's forward",
        ) from None
    named = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    return named


def default_symbolic_dims(named_inputs: dict[str, object]) -> dict[str, dict[int, str]]:
    """Dim 0 of every tensor input is the batch; dim 1 of an integer tensor (token ids, labels,
    masks) is the sequence. Float inputs keep their other dims static (images, features)."""
    dims: dict[str, dict[int, str]] = {}
    for name, value in named_inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        dims[name] = {0: "batch"}
        if value.dim() >= 2 and not value.is_floating_point():
            dims[name][1] = "seq"
    return dims


def check_symbolic_dims(named_inputs: dict, symbolic_dims: dict) -> dict[str, dict[int, str]]:
    """Validate a user-given ``symbolic_dims`` mapping against the example inputs."""
    checked: dict[str, dict[int, str]] = {}
    for name, dims in symbolic_dims.items():
        value = named_inputs.get(name)
        if not isinstance(value, torch.Tensor):
            raise TraceError(f"symbolic_dims names input {name!r}, which is not a tensor input",
                             hint=f"tensor inputs are: {sorted(_tensor_names(named_inputs))}")
        for dim in dims:
            if not -value.dim() <= dim < value.dim():
                raise TraceError(f"symbolic_dims[{name!r}] names dim {dim}, but {name} has shape "
                                 f"{tuple(value.shape)}", hint="use a dim index inside the shape")
        checked[name] = {d % value.dim(): s for d, s in dims.items()}
    return checked


def _tensor_names(named_inputs: dict) -> list[str]:
    return [n for n, v in named_inputs.items() if isinstance(v, torch.Tensor)]


def symbol_values(named_inputs: dict, symbolic_dims: dict) -> dict[str, int]:
    """The value each symbol has in the example inputs; inputs must agree on a shared symbol."""
    values: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, dims in symbolic_dims.items():
        for dim, symbol_name in dims.items():
            size = int(named_inputs[name].shape[dim])
            if symbol_name in values and values[symbol_name] != size:
                raise TraceError(
                    f"inputs disagree on {symbol_name!r}: {where[symbol_name]} has {values[symbol_name]}"
                    f" but {name}.shape[{dim}] is {size}",
                    hint="give example inputs with one batch size and one sequence length, or set "
                         "symbolic_dims to say which dims vary together")
            values[symbol_name] = size
            where[symbol_name] = f"{name}.shape[{dim}]"
    return values


def widen_unit_dims(named_inputs: dict, symbolic_dims: dict) -> dict[str, object]:
    """torch.export specialises a dim of size 1 to a constant, so trace such a dim at size 2; the
    symbolic graph is valid for every size and is evaluated at the user's value afterwards."""
    widened = dict(named_inputs)
    for name, dims in symbolic_dims.items():
        value = named_inputs[name]
        shape = list(value.shape)
        if all(shape[d] != 1 for d in dims):
            continue
        for d in dims:
            shape[d] = max(shape[d], 2)
        widened[name] = torch.zeros(shape, dtype=value.dtype, device=value.device)
    return widened


def export_dynamic_shapes(named_inputs: dict, symbolic_dims: dict) -> dict:
    """The ``dynamic_shapes`` argument of torch.export for the chosen symbolic dims."""
    auto = torch.export.Dim.AUTO  # AUTO: a dim the model pins to a constant is specialised, not an error
    return {name: ({d: auto for d in symbolic_dims[name]} if name in symbolic_dims else None)
            if isinstance(value, torch.Tensor) else None
            for name, value in named_inputs.items()}
