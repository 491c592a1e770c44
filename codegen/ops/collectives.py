"""Autograd-aware collectives on one process group, each named after what it does forward/backward.

Every collective here is a small ``torch.autograd.Function`` whose backward is the dual of its
forward, so a rewritten graph can call them like ordinary ops and ``loss.backward()`` (or
``torch.autograd.grad``) produces the right gradients on every rank (Megatron-LM, Shoeybi et al.
2019, section 3, the f and g operators; the picotron layout of one class per collective):

    copy_to_group            identity         | all-reduce (sum)     Megatron "f"
    reduce_from_group        all-reduce (sum) | identity             Megatron "g"
    gather_from_group        all-gather dim   | take the local slice
    gather_summing_grad      all-gather dim   | reduce-scatter dim   (a sequence shard read whole)
    scatter_to_group         take the slice   | all-gather dim
    reduce_scatter_to_group  reduce-scatter   | all-gather dim
    all_to_all               Shard(gather_dim) -> Shard(scatter_dim) | the reverse

``group`` is a ``torch.distributed`` process group, or ``None`` meaning *this rank alone* (a mesh
axis of size 1, or a one-rank world without ``init_process_group``): then every collective is the
identity. This deliberately differs from ``torch.distributed``, where ``None`` is the world group.

Uneven dims follow ``xirang.ir.placement.local_shape``: a sharded dim of n elements on k ranks
holds ceil(n / k) per rank, padded with zeros at the end of the full tensor. Functions that produce
a full dim take its true size (``full_size``) and strip the padding; functions that shard pad first.
Padding is sent like data and counted as such by a ``CommCounter``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xirang.codegen.ops.comm_counter import CommCounter, record_call
from xirang.ir.errors import InvalidValue, XirangError
from xirang.ir.placement import shard_share


class Unattached:
    """What a lowered program holds as its process group and counter until the runtime attaches this
    process's (``codegen.emit.attach``): a program can be built, printed and sent anywhere, and one
    run unattached fails naming the fix instead of silently running as one rank."""

    def __repr__(self) -> str:
        return "<unattached>"


UNATTACHED = Unattached()


def _live(group):
    if isinstance(group, Unattached):
        raise XirangError("a lowered program ran a collective before it was attached to a process group",
                          where="the program's tp_group attribute",
                          hint="run programs through CompiledModel, or call xirang.codegen.emit.attach(program, "
                               "tp_group=...) first")
    return group


def group_size(group) -> int:
    return 1 if _live(group) is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if _live(group) is None else dist.get_rank(group)


def _pad_to_multiple(x: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """Zero-pad dim ``dim`` at its end up to a multiple of ``k`` (local_shape's ceiling split)."""
    extra = -x.shape[dim] % k
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]  # F.pad lists dims last-first
    return F.pad(x, pad)


def _local_slice(full: torch.Tensor, dim: int, group, unit: int = 1) -> torch.Tensor:
    k = group_size(group)
    padded = _pad_to_multiple(full, dim, k * unit)  # whole units a rank (ir/placement.shard_share)
    return padded.chunk(k, dim=dim)[group_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group, counter, label) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce into a tensor autograd or the caller still holds
    record_call(counter, "all_reduce", out.nbytes, group_size(group), label)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, counter, label, size: Optional[int] = None) -> torch.Tensor:
    """Concatenate every rank's (equal-shaped) ``x`` along ``dim``, padding included; ``size``: its first ``size``
    elements along ``dim`` only (the padding stripped, not kept alive behind a view)."""
    k = group_size(group)
    # The flat collective gathers along dim 0: move ``dim`` first, gather, move it back.
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((k * local.shape[0],) + tuple(local.shape[1:]))
    record_call(counter, "all_gather", out.nbytes, k, label)
    all_gather_flat(out, local, group)
    moved = out.movedim(0, dim)
    # contiguous in ``x``'s layout: a moved view would make every op after it keep that layout (elementwise
    # ops follow their input's strides), and each linear reading it would copy it into a matrix, a copy it
    # keeps for its backward; one copy here, freed with the flat buffer, instead
    return (moved.narrow(dim, 0, size) if size is not None else moved).contiguous()


def all_gather_flat(out: torch.Tensor, local: torch.Tensor, group, *, async_op: bool = False):
    """torch's all-gather of ``local`` into ``out`` (dim 0 concatenated), under the name this torch has
    (2.13 renamed all_gather_into_tensor to all_gather_single and deprecated the old one). Returns
    the Work handle when ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, local, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group, *, async_op: bool = False):
    """torch's reduce-scatter (sum) of ``full`` into this rank's dim-0 slice ``out``, under the name
    this torch has (reduce_scatter_single in 2.13, reduce_scatter_tensor before)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, full, group=group, async_op=async_op)


def start_all_reduce_slice(full: torch.Tensor, group):
    """The emulated reduce-scatter of ``full`` (dim 0) launched asynchronously: an all-reduce whose
    result keeps this rank's rows; returns a function that waits and gives them (see ``_reduce_scatter``)."""
    summed = full.clone()
    work = dist.all_reduce(summed, group=group, async_op=True)

    def finish():
        work.wait()
        return summed.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()
    return finish


def _reduce_scatter(x: torch.Tensor, dim: int, group, counter, label) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice of ``dim`` (``x`` already padded)."""
    k = group_size(group)
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // k,) + tuple(full.shape[1:]))
    try:
        reduce_scatter_flat(out, full, group)
        emulated = False
    except (RuntimeError, NotImplementedError):
        # Older gloo builds have no reduce_scatter on CPU. Every rank runs the same build, so they
        # all fail here before communicating and fall back together: all-reduce, keep our slice
        # (k/2 times the ring traffic of a real reduce-scatter; fine for CPU development runs).
        summed = full.clone()
        dist.all_reduce(summed, group=group)
        out = summed.chunk(k, dim=0)[group_rank(group)].contiguous()
        emulated = True
    record_call(counter, "reduce_scatter", full.nbytes, k, label, emulated)
    return out.movedim(0, dim).contiguous()  # in ``x``'s layout, as ``_all_gather``'s result


class CopyToGroup(torch.autograd.Function):
    """Forward: identity (input replicated on the group). Backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.counter, "copy_to_group.backward"), None, None


class ReduceFromGroup(torch.autograd.Function):
    """Forward: all-reduce (sum of partials). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group, counter):
        return _all_reduce(x, group, counter, "reduce_from_group.forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather along ``dim``, strip to ``full_size``. Backward: take the local slice."""

    @staticmethod
    def forward(ctx, x, dim, full_size, group, counter, unit):
        ctx.dim, ctx.group, ctx.unit = dim, group, unit
        return _all_gather(x, dim, group, counter, "gather_from_group.forward", full_size)

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.dim, ctx.group, ctx.unit), None, None, None, None, None


class GatherSummingGrad(torch.autograd.Function):
    """Forward: all-gather along ``dim``, strip to ``full_size``. Backward: reduce-scatter the gradient,
    which is partial (each rank's reader of the whole tensor gives one part of it): the all-gather of
    a sequence shard before a column-parallel linear (Korthikanti et al. 2022), where an all-reduce
    then a slice would move twice the bytes."""

    @staticmethod
    def forward(ctx, x, dim, full_size, group, counter):
        ctx.dim, ctx.group, ctx.counter = dim, group, counter
        return _all_gather(x, dim, group, counter, "gather_summing_grad.forward", full_size)

    @staticmethod
    def backward(ctx, grad):
        padded = _pad_to_multiple(grad, ctx.dim, group_size(ctx.group))
        return _reduce_scatter(padded, ctx.dim, ctx.group, ctx.counter,
                               "gather_summing_grad.backward"), None, None, None, None


class ScatterToGroup(torch.autograd.Function):
    """Forward: pad and take the local slice of ``dim``. Backward: all-gather, strip padding."""

    @staticmethod
    def forward(ctx, x, dim, group, counter, unit):
        ctx.dim, ctx.size, ctx.group, ctx.counter = dim, x.shape[dim], group, counter
        return _local_slice(x, dim, group, unit)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter, "scatter_to_group.backward", ctx.size), \
            None, None, None, None


class ReduceScatterToGroup(torch.autograd.Function):
    """Forward: pad ``dim``, reduce-scatter (sum). Backward: all-gather, strip padding."""

    @staticmethod
    def forward(ctx, x, dim, group, counter, unit):
        ctx.dim, ctx.size, ctx.group, ctx.counter = dim, x.shape[dim], group, counter
        padded = _pad_to_multiple(x, dim, group_size(group) * unit)
        return _reduce_scatter(padded, dim, group, counter, "reduce_scatter_to_group.forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter, "reduce_scatter_to_group.backward", ctx.size), \
            None, None, None, None


def _all_to_all(x, scatter_dim, gather_dim, gather_size, group, counter, label):
    """Split padded ``scatter_dim`` into k chunks, chunk i to rank i; concat received on
    ``gather_dim`` and strip it to ``gather_size``."""
    k = group_size(group)
    chunks = _pad_to_multiple(x, scatter_dim, k).chunk(k, dim=scatter_dim)
    send = torch.stack(chunks).contiguous()  # [k, ...]: the flat op splits dim 0 evenly
    recv = torch.empty_like(send)
    record_call(counter, "all_to_all", send.nbytes, k, label)
    dist.all_to_all_single(recv, send, group=group)
    out = torch.cat(recv.unbind(0), dim=gather_dim)
    # stripped of its padding as a tensor of its own: a narrowed view would keep the padding's storage
    return out.narrow(gather_dim, 0, gather_size).contiguous() if gather_size is not None else out


class AllToAll(torch.autograd.Function):
    """Forward: Shard(gather_dim) -> Shard(scatter_dim). Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, gather_size, group, counter):
        ctx.args = (gather_dim, scatter_dim, x.shape[scatter_dim], group, counter)
        return _all_to_all(x, scatter_dim, gather_dim, gather_size, group, counter,
                           "all_to_all.forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args, "all_to_all.backward"), None, None, None, None, None


# --- the functional API the rewritten graphs call ----------------------------------------------

def _norm_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not -x.dim() <= dim < x.dim():  # a 0-dim tensor has no dim to split or gather
        raise IndexError(f"{name}: dim {dim} is out of range for a tensor of shape "
                         f"{tuple(x.shape)} (valid dims {-x.dim()}..{x.dim() - 1}; "
                         f"a 0-dim tensor cannot be sharded, reshape it to 1-d)")
    return dim % x.dim()


def _check_full_size(x, dim, full_size, k, name, unit: int = 1) -> None:
    """A dim of ``full_size`` on k ranks is held as ceil(full_size / k) per rank (local_shape), in whole
    units of ``unit`` elements where the split keeps units whole (ir/placement.shard_share)."""
    if full_size is not None and shard_share(full_size, k, unit) != x.shape[dim]:
        units = f" units of {unit}" if unit > 1 else ""
        raise InvalidValue(f"{name}: a dim of {full_size} elements on {k} ranks is held as "
                         f"ceil({full_size}/{k}){units} = {shard_share(full_size, k, unit)} per rank, "
                         f"but this "
                         f"rank's input has {x.shape[dim]} along dim {dim} (shape "
                         f"{tuple(x.shape)}); pass the true full size of that dim")


def copy_to_group(x, group, *, counter: Optional[CommCounter] = None):
    return x if group_size(group) == 1 else CopyToGroup.apply(x, group, counter)


def reduce_from_group(x, group, *, counter: Optional[CommCounter] = None):
    return x if group_size(group) == 1 else ReduceFromGroup.apply(x, group, counter)


def gather_from_group(x, group, dim: int, *, full_size: Optional[int] = None,
                      counter: Optional[CommCounter] = None, unit: int = 1):
    """All-gather ``x`` (this rank's padded shard of ``dim``, in whole units of ``unit`` elements);
    ``full_size`` strips padding."""
    dim = _norm_dim(x, dim, "gather_from_group")
    _check_full_size(x, dim, full_size, group_size(group), "gather_from_group", unit)
    if group_size(group) == 1:
        return x  # one rank holds the whole dim: ceil(n / 1) = n, no padding to strip
    return GatherFromGroup.apply(x, dim, full_size, group, counter, unit)


def gather_summing_grad(x, group, dim: int, *, full_size: Optional[int] = None,
                        counter: Optional[CommCounter] = None):
    """All-gather ``x`` as ``gather_from_group``; its gradient, a partial sum on each rank, is
    reduce-scattered back to this rank's shard (``GatherSummingGrad``)."""
    dim = _norm_dim(x, dim, "gather_summing_grad")
    _check_full_size(x, dim, full_size, group_size(group), "gather_summing_grad")
    if group_size(group) == 1:
        return x
    return GatherSummingGrad.apply(x, dim, full_size, group, counter)


def scatter_to_group(x, group, dim: int, *, counter: Optional[CommCounter] = None, unit: int = 1):
    """This rank's slice of replicated ``x`` along ``dim`` (padded at the end if uneven, in whole units
    of ``unit`` elements)."""
    dim = _norm_dim(x, dim, "scatter_to_group")
    return x if group_size(group) == 1 else ScatterToGroup.apply(x, dim, group, counter, unit)


def reduce_scatter_to_group(x, group, dim: int, *, counter: Optional[CommCounter] = None, unit: int = 1):
    """Sum partial ``x`` over the group, keep this rank's (padded, in units of ``unit``) slice of ``dim``."""
    dim = _norm_dim(x, dim, "reduce_scatter_to_group")
    return x if group_size(group) == 1 else ReduceScatterToGroup.apply(x, dim, group, counter, unit)


def all_to_all(x, group, *, scatter_dim: int, gather_dim: int, gather_size: Optional[int] = None,
               counter: Optional[CommCounter] = None):
    """Re-shard from ``gather_dim`` to ``scatter_dim`` (e.g. sequence to heads in Ulysses
    attention); ``gather_size`` is the true length of ``gather_dim`` once gathered."""
    scatter_dim = _norm_dim(x, scatter_dim, "all_to_all")
    gather_dim = _norm_dim(x, gather_dim, "all_to_all")
    if scatter_dim == gather_dim:
        raise InvalidValue(f"all_to_all: scatter_dim and gather_dim are both {scatter_dim}; "
                         f"an exchange between one dim and itself moves nothing, use the tensor")
    _check_full_size(x, gather_dim, gather_size, group_size(group), "all_to_all")
    if group_size(group) == 1:
        return x
    return AllToAll.apply(x, scatter_dim, gather_dim, gather_size, group, counter)
