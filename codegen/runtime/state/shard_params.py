"""Glue a rank's parameter shards back into full tensors, and load full tensors into shards.

Each tp rank holds a parameter as ``shard_of(full, placement, tp_rank, tp)`` (codegen/ops/padding:
a slice of every fused piece, padded at the end where a dim does not divide). ``ParamShard``
(ir/facts.py, written by the lowering pass ``shard_parameters``) keeps what undoing that needs:
the placement and the full shape.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.facts import ParamShard
from xirang.ir.placement import PlanShard

from xirang.codegen.ops.collectives import group_size
from xirang.codegen.ops.padding import shard_of, unshard


def full_tensor(local: torch.Tensor, shard: ParamShard, tp_group) -> torch.Tensor:
    """The full tensor from every tp rank's ``local`` (collective over ``tp_group`` when sharded)."""
    tp = group_size(tp_group)
    if not isinstance(shard.placement, PlanShard) or tp == 1:
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
