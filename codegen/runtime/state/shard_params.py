"""Glue a rank's parameter shards back into full tensors, and load full tensors into shards.

Each tp rank holds a parameter as ``shard_of(full, placement, tp_rank, tp)`` (codegen/ops/padding:
a slice of every fused piece, padded at the end where a dim does not divide). ``ParamShard``
(ir/facts.py, written by the lowering pass ``shard_parameters``) keeps what undoing that needs:
the placement and the full shape. Under expert parallelism an expert weight is first cut to this ep
rank's experts (``ParamShard.experts``, dim 0), then tp-sharded like any tensor (``local_of``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.facts import ParamShard
from xirang.ir.placement import PlanShard

from xirang.codegen.ops.collectives import group_size
from xirang.codegen.ops.padding import shard_of, unshard


def expert_piece(full: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This ep rank's experts of ``full`` (dim 0), or ``full`` for a tensor not cut by experts."""
    if not shard.experts:
        return full
    first, count = shard.experts
    return full.narrow(0, first, count)


def local_of(full: torch.Tensor, shard: ParamShard, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's piece of ``full``: its experts (expert parallelism), then its tp shard."""
    return shard_of(expert_piece(full, shard), shard.placement, tp_rank, tp)


def full_tensor(local: torch.Tensor, shard: ParamShard, tp_group, ep_group=None) -> torch.Tensor:
    """The full tensor from every tp rank's ``local`` (collective over ``tp_group`` when sharded), and
    for an expert weight from every ep rank's experts (collective over ``ep_group``)."""
    tp = group_size(tp_group)
    if not isinstance(shard.placement, PlanShard) or tp == 1:
        mine = local.detach().clone()
    else:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
        mine = unshard(parts, shard.placement, shard.full_shape[shard.placement.dim])
    if not shard.experts or group_size(ep_group) == 1:
        return mine
    experts = [torch.empty_like(mine) for _ in range(group_size(ep_group))]
    dist.all_gather(experts, mine.contiguous(), group=ep_group)
    return torch.cat(experts, dim=0)


def load_local(local: torch.Tensor, full: torch.Tensor, shard: ParamShard, *, tp_rank: int, tp: int) -> None:
    """Copy this rank's piece of ``full`` into ``local`` in place (optimizers keep their references)."""
    if tuple(full.shape) != shard.full_shape:
        raise XirangError(f"{shard.name} has shape {tuple(full.shape)} in the state dict, the model's is "
                          f"{shard.full_shape}", where=f"load_full_state_dict[{shard.name!r}]",
                          hint="load a state dict saved from the same model configuration")
    with torch.no_grad():
        local.copy_(local_of(full.to(local.device, local.dtype), shard, tp_rank, tp))
