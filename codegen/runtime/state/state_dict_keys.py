"""A full state dict checked against the compiled model's names before ``load_full_state_dict`` copies
anything: torch's strict rule (``nn.Module.load_state_dict``) over the single-device names, tied
weights under any of their aliases, and its ``(missing_keys, unexpected_keys)`` answer."""
from __future__ import annotations

from typing import NamedTuple

import torch

from xirang.ir.errors import XirangError


class LoadResult(NamedTuple):
    """What ``load_full_state_dict`` did not match, as torch's ``load_state_dict`` reports it."""

    missing_keys: list
    unexpected_keys: list


def state_dict_keys(state_dict, aliases: dict, trainable) -> LoadResult:
    """(missing, unexpected) keys of ``state_dict`` against the whole model (every stage, every alias in
    ``aliases``: FQN -> its names); parameters (``trainable``) must be there, buffers may be."""
    if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
        raise XirangError(f"load_full_state_dict needs a mapping name -> tensor, got {type(state_dict).__name__}",
                          where="CompiledModel.load_full_state_dict", hint="pass model.state_dict()")
    not_tensors = [k for k in state_dict if not isinstance(state_dict[k], torch.Tensor)]
    if not_tensors:
        raise XirangError(f"load_full_state_dict: the entries {not_tensors[:8]} are not tensors "
                          f"({type(state_dict[not_tensors[0]]).__name__})",
                          where=f"load_full_state_dict[{not_tensors[0]!r}]",
                          hint="pass a state dict of tensors, as model.state_dict() returns (an optimizer's or "
                               "a checkpoint's outer dict is not one: take its 'model' entry)")
    known = {alias for fqn, names in aliases.items() for alias in (fqn, *names)}
    unexpected = sorted(k for k in state_dict if k not in known)
    # what must be there: every parameter (under any of its tied names). Buffers are loaded when
    # present but not required: full_state_dict(), the usual source, holds parameters only
    required = [fqn for fqn in aliases if fqn in trainable]
    missing = sorted(fqn for fqn in required if not any(name in state_dict for name in (fqn, *aliases.get(fqn, ()))))
    return LoadResult(missing, unexpected)


def refuse_mismatch(result: LoadResult, rank: int) -> None:
    """``strict=True``'s refusal, naming the keys (the first eight of each kind)."""
    missing, unexpected = result
    if not (missing or unexpected):
        return

    def shown(keys):
        return ", ".join(repr(k) for k in keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")
    problems = ([f"missing keys: {shown(missing)}"] if missing else []) + \
               ([f"unexpected keys (no tensor of the model has these names): {shown(unexpected)}"]
                if unexpected else [])
    raise XirangError("load_full_state_dict: the state dict does not match the model: " + "; ".join(problems),
                      where=f"CompiledModel.load_full_state_dict, rank {rank}",
                      hint="pass the full model's state_dict() (keys as model.state_dict() names them), "
                           "or strict=False to load only the keys that match")
