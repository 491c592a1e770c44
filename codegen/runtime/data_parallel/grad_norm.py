"""Clipping by global gradient norm across the mesh, equal to ``torch.nn.utils.clip_grad_norm_`` on one device.

    total_norm = compiled.clip_grad_norm_(1.0)       # collective: every rank calls it
    if step_if_finite(optimizer, total_norm):        # a non-finite norm skips the step
        ...
    optimizer.zero_grad()

The norm is over every element of the whole model's gradients, each counted once. A rank holds
pieces of them: its pipeline stages' parameters, each as its tp shard, and after the dp average the
same gradients as every other dp replica. So each rank sums ``|g|^p`` over the elements it *owns*:

* a tp-sharded parameter: every tp rank owns its slice, minus the zero padding at the end of an
  uneven dim (``codegen/ops/padding.py``: ceil(n / k) per rank, per fused piece);
* a parameter replicated over tp: only tp rank 0 owns it (the others hold the same gradient);
* a weight tied across pipeline ranks (its copies' gradients summed, so equal): only the lowest
  global rank of its tied group owns it;
* dp replicas hold identical gradients, so the sum is not taken over dp at all -- except under
  ZeRO-1, where each dp rank holds only its slice of the averaged gradients (codegen/runtime/
  dist_optimizer.py): there every slice element counts once on its dp rank (``owned_mask`` says
  which elements count at all) and the sums are added over dp too.

The owned sums are added over the tp group, then the pp group (``max`` for the inf-norm), which
gives every rank of the mesh the same total norm ``(sum |g|^p)^(1/p)``. Each local gradient is then
scaled by ``min(1, max_norm / (total + 1e-6))``, torch's coefficient (``max_norm=inf``: the norm only,
nothing scaled). A non-finite total (an inf or nan gradient anywhere) leaves the gradients untouched
and is logged; clipping does not decide the step: ``step_if_finite`` skips it, and
codegen/runtime/numerics/nonfinite.py applies the user's policy (stop, skip, roll back) -- the same
decision on every rank, since every rank holds the same total.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard, piece_blocks, shard_share

LOG = logging.getLogger("xirang.grad_norm")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (total + 1e-6)
# clipping does not decide the step: the caller does (step_if_finite, or numerics/nonfinite.py's policy)
UNCLIPPED = "rank %d: the global gradient norm is %s; the gradients were left unclipped"


def real_elements(local: torch.Tensor, shard, tp_rank: int, tp: int) -> torch.Tensor:
    """The elements of ``local`` (this tp rank's shard under ``shard.placement``) that are in the full
    tensor: the padding rows of an uneven dim dropped, piece by piece for a fused ``PlanShard(dim, chunks)``."""
    placement = getattr(shard, "placement", None)
    if not isinstance(placement, PlanShard) or tp == 1:
        return local
    dim = placement.dim
    if placement.pieces:  # a whole piece is on every tp rank: tp rank 0 counts it
        return torch.cat([local.narrow(dim, at, length) for _, length, at, whole in piece_blocks(placement, tp, tp_rank)
                          if tp_rank == 0 or not whole], dim=dim)
    piece = shard.full_shape[dim] // placement.chunks
    per_rank = shard_share(piece, tp, placement.unit)
    real = max(0, min(per_rank, piece - tp_rank * per_rank))
    if real == per_rank:
        return local
    return torch.cat([part.narrow(dim, 0, real) for part in local.split(per_rank, dim=dim)], dim=dim)


def owned_gradients(named_parameters, *, shards: dict, tied: list, groups) -> list:
    """This rank's gradient elements that count in the global norm (see the module docstring), as a
    list of tensors; parameters without a gradient count as zero, as torch skips them."""
    tp, tp_rank = groups.axis_size("tp"), groups.axis_index("tp")
    tied_owner = {fqn: min(dist.get_process_group_ranks(group)) for fqn, group in tied}
    owned = []
    for fqn, param in named_parameters:
        if param.grad is None:
            continue
        shard = shards.get(fqn)
        sharded = isinstance(getattr(shard, "placement", None), PlanShard) and tp > 1
        if not sharded and tp_rank != 0:
            continue
        if fqn in tied_owner and tied_owner[fqn] != groups.rank:
            continue
        owned.append(real_elements(param.grad.detach(), shard, tp_rank, tp) if sharded else param.grad.detach())
    return owned


def owned_mask(fqn: str, local: torch.Tensor, *, shards: dict, tied: list, groups) -> torch.Tensor:
    """A bool tensor of ``local``'s shape: True where the element counts in the global norm on this
    rank (the rules of ``owned_gradients``, element by element: a tp shard's padding rows are False)."""
    tp, tp_rank = groups.axis_size("tp"), groups.axis_index("tp")
    shard = shards.get(fqn)
    sharded = isinstance(getattr(shard, "placement", None), PlanShard) and tp > 1
    tied_owner = {name: min(dist.get_process_group_ranks(group)) for name, group in tied}
    mask = torch.zeros(local.shape, dtype=torch.bool, device=local.device)
    if (not sharded and tp_rank != 0) or tied_owner.get(fqn, groups.rank) != groups.rank:
        return mask
    if not sharded:
        return mask.fill_(True)
    index = torch.arange(local.numel(), device=local.device).view(local.shape)
    mask.view(-1)[real_elements(index, shard, tp_rank, tp).reshape(-1)] = True
    return mask


def global_grad_norm(owned: list, norm_type: float, groups, device, axes=("tp", "pp")) -> torch.Tensor:
    """``(sum |g|^p)^(1/p)`` over the owned gradients of every rank (max |g| for p = inf), in fp32,
    the same on every rank (collective over each of ``axes``: tp then pp; ZeRO-1 adds dp)."""
    infinite = math.isinf(norm_type)
    if owned:
        norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in owned])
        local = norms.max() if infinite else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    local = local.to(device=device, dtype=torch.float32)
    for axis in axes:
        group = groups.group(axis)
        if group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=group)
    return local if infinite else local.pow(1.0 / norm_type)


def clip_grad_norm(named_parameters, max_norm: float, norm_type: float = 2.0, *, shards: dict, tied: list,
                   groups, device="cpu") -> torch.Tensor:
    """Scale this rank's gradients so the whole model's gradient norm is at most ``max_norm``; returns the
    total norm before clipping (a 0-d fp32 tensor, the same on every rank). Collective: every rank calls it.
    A non-finite total leaves the gradients as they are (logged): skip the optimizer step
    (``step_if_finite``)."""
    where = "CompiledModel.clip_grad_norm_"
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise XirangError(f"{name} must be a positive number, got {value!r}", where=where,
                              hint="pass e.g. clip_grad_norm_(1.0) or norm_type=float('inf')")
    named_parameters = list(named_parameters)
    experts = [(fqn, param) for fqn, param in named_parameters if fqn in shards and shards[fqn].experts]
    dense = [(fqn, param) for fqn, param in named_parameters if not (fqn in shards and shards[fqn].experts)]
    owned = owned_gradients(dense, shards=shards, tied=tied, groups=groups)
    total = global_grad_norm(owned, float(norm_type), groups, device)
    if groups.axis_size("ep") > 1:  # each ep rank owns other experts: their part is summed over ep too
        held = owned_gradients(experts, shards=shards, tied=tied, groups=groups)
        part = global_grad_norm(held, float(norm_type), groups, device, axes=("tp", "pp", "ep"))
        total = torch.maximum(total, part) if math.isinf(norm_type) else \
            (total.pow(norm_type) + part.pow(norm_type)).pow(1.0 / norm_type)
    if not torch.isfinite(total):
        if not math.isinf(max_norm):  # the norm alone was asked for: the caller's guard reports it
            LOG.warning(UNCLIPPED, groups.rank, total.item())
        return total
    if math.isinf(max_norm):  # the norm only: scaling by 1 would be a pass over every gradient for nothing
        return total
    coefficient = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    for _, param in named_parameters:
        if param.grad is not None:
            param.grad.detach().mul_(coefficient.to(param.grad.device, param.grad.dtype))
    return total


def step_if_finite(optimizer, total_norm: torch.Tensor) -> bool:
    """``optimizer.step()`` when ``total_norm`` (from ``clip_grad_norm_``) is finite; otherwise no
    step (the parameters keep their values, the bad gradients are the caller's to zero). Returns
    whether it stepped; every rank decides alike, since every rank holds the same total."""
    if not torch.isfinite(torch.as_tensor(total_norm)):
        LOG.warning("optimizer step skipped: the gradient norm is %s", float(total_norm))
        return False
    optimizer.step()
    return True
