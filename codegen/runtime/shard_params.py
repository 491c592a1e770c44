"""Bind a rank's program to its local parameter shards, and glue the shards back into full tensors.

A parameter placeholder of the traced graph (``PARAM_NAME`` meta) is held by each tp rank as
``shard_of(full, placement, tp_rank, tp)`` (codegen/padding: a slice of every fused piece, padded
at the end where a dim does not divide). ``ParamShard`` keeps what ``full_state_dict`` needs to
undo that: the placement and the full shape. Buffers and lifted constants are bound the same way
(they are replicated in practice) but are never trained.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import PARAM_ALIASES, PARAM_NAME, ROLE
from xirang.ir.placement import Replicate, Shard

from xirang.codegen.ops.collectives import group_size
from xirang.codegen.ops.padding import shard_of, unshard

BOUND_ROLES = ("parameter", "buffer", "constant")


@dataclass(frozen=True)
class ParamShard:
    """One placeholder bound to model state: its FQN (and tied aliases), role, tp placement and the
    full (unsharded) shape."""

    placeholder: str
    name: str
    aliases: tuple
    role: str
    placement: object
    full_shape: tuple


def param_shards(gm, placements) -> list:
    """A ``ParamShard`` per state placeholder of ``gm``, in placeholder (forward) order."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or ROLE.get(node, None) not in BOUND_ROLES:
            continue
        strategy = placements.get(node.name)
        placement = strategy.outputs[0].tp if strategy is not None and strategy.outputs else Replicate()
        name = PARAM_NAME.get(node, node.name)
        found.append(ParamShard(node.name, name, tuple(PARAM_ALIASES.get(node, (name,))), ROLE.get(node),
                                placement, tuple(int(s) for s in node.meta["val"].shape)))
    return found


def _model_state(model: torch.nn.Module) -> dict:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    return state


def local_state(model: torch.nn.Module, shards: list, *, tp_rank: int, tp: int, device) -> dict:
    """Placeholder name -> this rank's local tensor: ``nn.Parameter`` (a copy, so the model is left
    untouched) for parameters, plain tensors for buffers and constants."""
    state, bound = _model_state(model), {}
    for shard in shards:
        full = state.get(shard.name)
        if full is None:
            raise XirangError(f"the traced graph reads {shard.role} {shard.name!r}, which the model does not have",
                              where=f"placeholder {shard.placeholder}",
                              hint="compile the same model object that was traced and planned")
        if full.is_meta:
            raise XirangError(f"{shard.role} {shard.name!r} is on the meta device: it has no values to train",
                              where=f"placeholder {shard.placeholder}",
                              hint="plan on the meta device if you like, but compile a model with real "
                                   "tensors (build it on 'cpu' or load a checkpoint into it)")
        local = shard_of(full.detach(), shard.placement, tp_rank, tp).to(device).clone()
        bound[shard.placeholder] = (torch.nn.Parameter(local, requires_grad=full.requires_grad)
                                    if shard.role == "parameter" else local)
    return bound


def full_tensor(local: torch.Tensor, shard: ParamShard, tp_group) -> torch.Tensor:
    """The full tensor from every tp rank's ``local`` (collective over ``tp_group`` when sharded)."""
    tp = group_size(tp_group)
    if not isinstance(shard.placement, Shard) or tp == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    return unshard(parts, shard.placement, shard.full_shape[shard.placement.dim])


def load_local(local: torch.Tensor, full: torch.Tensor, shard: ParamShard, *, tp_rank: int, tp: int) -> None:
    """Copy this rank's piece of ``full`` into ``local`` in place (optimizers keep their references)."""
    if tuple(full.shape) != shard.full_shape:
        raise XirangError(f"{shard.name} has shape {tuple(full.shape)} in the state dict, the model's is "
                          f"{shard.full_shape}", where=f"load_full_state_dict[{shard.name!r}]",
                          hint="load a state dict saved from the same model configuration")
    with torch.no_grad():
        local.copy_(shard_of(full.to(local.device, local.dtype), shard.placement, tp_rank, tp))
