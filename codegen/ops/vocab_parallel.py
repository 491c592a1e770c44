"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM, Shoeybi et al. 2019, sec. 3).

The vocabulary is the largest dim of a language model's first and last layers, so tensor
parallelism splits it: rank r of k holds rows [r * ceil(V / k), (r + 1) * ceil(V / k)) of the
embedding table and the same columns of the logits, the last rank's range padded beyond V
(``xirang.ir.placement.local_shape``; GPT-2's 50257 on 8 ranks is 6283 per rank, 7 padding).

- Embedding: each rank looks up only the ids in its range and writes zeros for the rest, so the
  output is a Partial(sum) that one all-reduce completes (``sharding_rules._embedding``). The
  backward needs no communication: the gradient of a Partial(sum) is the replicated gradient.
- Cross-entropy: the loss needs three numbers per row that span the whole vocabulary — the row
  max (for a stable softmax), the target's logit and the sum of exp(logit - max) — so three
  all-reduces of one float32 per row (``sharding_rules._cross_entropy``), instead of gathering
  N x V logits. The backward is local: d loss / d logits = softmax - onehot, and every rank holds
  its columns of both.

``group`` is a process group or ``None`` for "this rank alone" (``process_groups``), where the
functions reduce to ``F.embedding`` and ``F.cross_entropy``. Neither function checks that ids or
targets are inside the vocabulary: that needs a device-to-host read every step. An id outside it
looks up zeros; a target outside it (and not ``ignore_index``) gives a wrong loss, not an error.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from xirang.ir.errors import XirangError

from xirang.codegen.ops.collectives import group_rank, group_size, reduce_from_group
from xirang.codegen.ops.comm_counter import CommCounter, record_call

REDUCTIONS = ("none", "mean", "sum")


def vocab_shard_range(vocab_size: int, group) -> tuple:
    """``(vocab_start, local_rows)`` of this rank's slice of a vocabulary split over ``group``."""
    local_rows = -(-vocab_size // group_size(group))  # ceiling split, as local_shape does
    return group_rank(group) * local_rows, local_rows


# --- embedding ---------------------------------------------------------------------------------

def vocab_parallel_embedding(ids: torch.Tensor, local_weight: torch.Tensor, *, vocab_start: int,
                             vocab_size: int, group, counter: Optional[CommCounter] = None,
                             padding_idx: Optional[int] = None, scale_grad_by_freq: bool = False,
                             sparse: bool = False) -> torch.Tensor:
    """This rank's Partial(sum) part of ``embedding(ids, weight)``: rows for the ids it holds.

    ``local_weight`` holds global rows [vocab_start, vocab_start + local_weight.shape[0]); rows
    at or beyond ``vocab_size`` are padding and are never read. ``padding_idx`` follows
    ``aten.embedding``: a global row whose gradient stays zero (``None`` or aten's -1: none).
    Nothing is communicated (``counter`` is accepted so call sites stay uniform).
    """
    where = f"vocab_parallel_embedding(ids {tuple(ids.shape)}, local_weight " \
            f"{tuple(local_weight.shape)}, vocab_start={vocab_start}, vocab_size={vocab_size})"
    _check_embedding_args(ids, local_weight, vocab_start, vocab_size, padding_idx,
                          scale_grad_by_freq, sparse, group, where)
    local_rows = local_weight.shape[0]
    # Ids another rank holds, and padding rows, look up row 0 and are zeroed after: masking the
    # output (not the weight) keeps their gradient out of row 0 (Megatron's VocabParallelEmbedding).
    foreign = (ids < vocab_start) | (ids >= min(vocab_start + local_rows, vocab_size))
    local_ids = (ids - vocab_start).masked_fill(foreign, 0)
    local_padding_idx = None
    if padding_idx is not None and padding_idx >= 0 and 0 <= padding_idx - vocab_start < local_rows:
        local_padding_idx = padding_idx - vocab_start
    looked_up = F.embedding(local_ids, local_weight, padding_idx=local_padding_idx)
    # In place is safe (embedding's backward keeps only the ids) and saves a copy of the output.
    return looked_up.masked_fill_(foreign.unsqueeze(-1), 0.0)


def vocab_parallel_embedding_reduced(ids: torch.Tensor, local_weight: torch.Tensor, *,
                                     vocab_start: int, vocab_size: int, group,
                                     counter: Optional[CommCounter] = None,
                                     padding_idx: Optional[int] = None,
                                     scale_grad_by_freq: bool = False,
                                     sparse: bool = False) -> torch.Tensor:
    """``embedding(ids, weight)`` replicated on every rank: the Partial(sum) part, all-reduced
    (Megatron's "g": all-reduce forward, identity backward)."""
    partial = vocab_parallel_embedding(ids, local_weight, vocab_start=vocab_start,
                                       vocab_size=vocab_size, group=group, counter=counter,
                                       padding_idx=padding_idx,
                                       scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
    return reduce_from_group(partial, group, counter=counter)


def _check_embedding_args(ids, local_weight, vocab_start, vocab_size, padding_idx,
                          scale_grad_by_freq, sparse, group, where) -> None:
    if scale_grad_by_freq:
        raise XirangError("scale_grad_by_freq=True is not supported by the vocabulary-parallel "
                          "embedding", where=where,
                          hint="set scale_grad_by_freq=False on the nn.Embedding, or plan this "
                               "embedding without the vocab_parallel strategy")
    if sparse:
        raise XirangError("sparse=True is not supported: gradients are reduced as dense tensors "
                          "across ranks", where=where,
                          hint="set sparse=False on the nn.Embedding")
    if local_weight.dim() != 2:
        raise XirangError(f"local_weight must be a 2-d table [rows, hidden], got shape "
                          f"{tuple(local_weight.shape)}", where=where,
                          hint="pass this rank's PlanShard(0) slice of the embedding weight")
    if ids.dtype not in (torch.int32, torch.int64):
        raise XirangError(f"ids must be int32 or int64, got {ids.dtype}", where=where,
                          hint="pass token ids, not one-hot or float tensors")
    _check_vocab(local_weight.shape[0], vocab_start, vocab_size, group, "rows", where)
    if padding_idx is not None and not (padding_idx == -1 or 0 <= padding_idx < vocab_size):
        raise XirangError(f"padding_idx {padding_idx} is not a row of a vocabulary of "
                          f"{vocab_size}", where=where,
                          hint="pass aten.embedding's padding_idx: a row in 0..vocab_size-1, or "
                               "-1 / None for none (F.embedding turns a negative padding_idx p "
                               "into vocab_size + p before aten sees it)")


def _check_vocab(local, vocab_start, vocab_size, group, what, where) -> None:
    k = group_size(group)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise XirangError(f"vocab_size must be a positive int, got {vocab_size!r}", where=where,
                          hint="pass the true (unpadded) vocabulary size")
    if not isinstance(vocab_start, int) or vocab_start < 0:
        raise XirangError(f"vocab_start must be a non-negative int, got {vocab_start!r}",
                          where=where, hint="use vocab_shard_range(vocab_size, group)")
    if local * k < vocab_size:
        raise XirangError(f"{k} rank(s) holding {local} {what} each cover {local * k} of a "
                          f"vocabulary of {vocab_size}", where=where,
                          hint=f"each rank must hold ceil({vocab_size}/{k}) = "
                               f"{-(-vocab_size // k)} {what} (shard_of pads the last rank)")


# --- cross-entropy -----------------------------------------------------------------------------

def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, *,
                                 vocab_start: int, vocab_size: int, group,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 counter: Optional[CommCounter] = None) -> torch.Tensor:
    """``F.cross_entropy(logits, target)`` from this rank's columns of the class dim; the loss is
    replicated on every rank.

    ``local_logits`` is [N, C_local], [N, C_local, d1, ...] (class dim 1) or [C_local] as
    ``F.cross_entropy`` takes them, holding classes [vocab_start, vocab_start + C_local); classes
    at or beyond ``vocab_size`` are padding and count as logit -inf. Statistics are fp32 whatever
    the logits' dtype, so the all-reduces are N float32 each; loss and gradient come back in it.
    """
    where = f"vocab_parallel_cross_entropy(local_logits {tuple(local_logits.shape)}, target " \
            f"{tuple(target.shape)}, vocab_start={vocab_start}, vocab_size={vocab_size})"
    if reduction not in REDUCTIONS:
        raise XirangError(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}",
                          where=where, hint="use F.cross_entropy's reduction names")
    if target.dtype not in (torch.int32, torch.int64):
        raise XirangError(f"target must hold class indices (int64), got {target.dtype}",
                          where=where, hint="soft (probability) targets need more reductions "
                                            "than the vocabulary-parallel loss has; plan the "
                                            "loss replicated")
    unbatched = local_logits.dim() == 1
    logits = local_logits.unsqueeze(0) if unbatched else local_logits
    if local_logits.dim() == 0 or target.shape != (logits.shape[:1] + logits.shape[2:])[unbatched:]:
        raise XirangError(f"target shape {tuple(target.shape)} does not match logits shape "
                          f"{tuple(local_logits.shape)} without its class dim", where=where,
                          hint="logits [N, C] take target [N]; [N, C, d1, ...] take [N, d1, ...]")
    _check_vocab(logits.shape[1], vocab_start, vocab_size, group, "classes", where)
    # As aten.cross_entropy_loss sees it after a reshape: rows of classes.
    rows = logits.movedim(1, -1).reshape(-1, logits.shape[1])
    loss = _VocabParallelCrossEntropy.apply(rows, target.reshape(-1), vocab_start, vocab_size,
                                            ignore_index, reduction, group, counter)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _all_reduce_inplace(x: torch.Tensor, op, group, counter, label) -> None:
    if group_size(group) == 1:  # this rank alone: the local value is the total, nothing is sent
        return
    record_call(counter, "all_reduce", x.nbytes, group_size(group), label)
    dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: an all-reduce (max) of one fp32 per row, then one (sum) of two: the target logit and
    the sum of exp are independent once the max is known, so they travel in one call (Megatron-LM
    issues three; the third only pays another latency). Backward: softmax - onehot, local."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, ignore_index, reduction, group,
                counter):
        local_classes = logits.shape[1]
        logits32 = logits.float()
        real_classes = max(0, min(local_classes, vocab_size - vocab_start))
        if real_classes < local_classes:  # padding columns hold whatever the padded weight
            logits32 = logits32.clone()   # produced: -inf makes them add 0 to every sum of exp
            logits32[:, real_classes:] = float("-inf")

        # A rank whose columns are all padding has local max -inf; the all-reduce max fixes it.
        row_max = logits32.amax(dim=1)
        _all_reduce_inplace(row_max, dist.ReduceOp.MAX, group, counter,
                            "vocab_parallel_cross_entropy.row_max")
        shifted = logits32 - row_max.unsqueeze(1)

        counted = target != ignore_index
        local_target = target - vocab_start
        here = counted & (local_target >= 0) & (local_target < local_classes)
        local_target = local_target.masked_fill(~here, 0)
        target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1)
        target_logit = target_logit.masked_fill(~here, 0.0)  # only the owning rank contributes

        # In place from here: of the N x C_local temporaries only the softmax outlives forward.
        exp_shifted = shifted.exp_()
        sums = torch.stack([target_logit, exp_shifted.sum(dim=1)])
        _all_reduce_inplace(sums, dist.ReduceOp.SUM, group, counter,
                            "vocab_parallel_cross_entropy.target_logit_and_sum_exp")
        target_logit, sum_exp = sums[0], sums[1]

        # log softmax of the target = target_logit - log(sum_exp); ignored rows lose 0.
        per_row = (sum_exp.log() - target_logit).masked_fill(~counted, 0.0)
        softmax = exp_shifted.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(softmax, local_target, here, counted)
        ctx.reduction, ctx.logits_dtype = reduction, logits.dtype
        if reduction == "none":
            loss = per_row
        elif reduction == "sum":
            loss = per_row.sum()
        else:  # mean over counted rows, as F.cross_entropy (0 / 0 = nan when all are ignored)
            loss = per_row.sum() / counted.sum()
        return loss.to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        softmax, local_target, here, counted = ctx.saved_tensors
        # d loss_row / d logits = softmax - onehot(target); onehot only on the owning rank.
        grad = softmax.scatter_add(1, local_target.unsqueeze(1),
                                   -here.to(softmax.dtype).unsqueeze(1))
        grad_loss = grad_loss.float()
        if ctx.reduction == "none":
            scale = grad_loss
        elif ctx.reduction == "sum":
            scale = grad_loss.expand(softmax.shape[0])
        else:
            scale = (grad_loss / counted.sum()).expand(softmax.shape[0])
        # where, not a product: with every row ignored the mean's scale is inf, and 0 * inf = nan
        # where F.cross_entropy's gradient is 0.
        scale = torch.where(counted, scale, torch.zeros_like(scale))
        grad = grad * scale.unsqueeze(1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None, None
