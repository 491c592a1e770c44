"""Collective matmuls: a linear fused with the tp collective before or after it, chunked so that the
collective of one chunk is in flight while another chunk's matmul runs (Wang et al. 2023, "Overlap
communication with dependent computation via decomposition"; PyTorch's async-TP "collective
matmul" in torchtitan). Forward | backward:

    gather_linear          all-gather(x) -> linear        | matmul-reduce-scatter of grad x (and dW, db)
    gather_linears         the same, x read by several linears (their weights stacked)
    linear_reduce_scatter  linear -> reduce-scatter       | all-gather-matmul of grad y (and dW, db)

Both chunk along the sharded dim ``dim`` of the activation (the sequence under sequence parallelism),
which is a row dim of the matmul, never the contracted last dim: every output row is the same dot
products as in the unchunked op, so the result equals it up to the BLAS kernel's row blocking (fp32
rounding; bit-for-bit where the kernel is row-independent).

Gathered matmul: this rank's shard (n rows along ``dim``) is cut into ``chunks`` pieces; piece i of
every rank is all-gathered (``async_op=True``) while piece i-1's matmul runs. Matmul-reduce-scatter:
the full rows are k rank blocks of n; chunk i takes rows [s_i, s_i + l_i) of every block, its matmul
result is reduce-scattered asynchronously while chunk i+1 is computed, and this rank keeps its rows.
Each chunk's call is one ``CommRecord`` with ``chunks`` set, so a step's bytes per kind equal the
unchunked op's (the plan's count) and the call count shows the chunking.

Weight and bias gradients are computed once on the whole tensors after the loop (exact, and what
``aten.linear``'s backward computes); the overlap covers the activation's matmuls. The same code runs
on gloo (CPU) and NCCL (CUDA): only ``torch.distributed`` async handles are used. ``group`` None (one
rank) runs the plain linear.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from xirang.codegen.ops.collectives import (all_gather_flat, group_size, reduce_scatter_flat,
                                            start_all_reduce_slice)
from xirang.codegen.ops.comm_counter import CommCounter, record_call
from xirang.ir.errors import InvalidValue


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of ``chunks`` near-equal pieces of ``rows`` (fewer when rows < chunks)."""
    count = max(1, min(chunks, rows))
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for i in range(count):
        length = base + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def gathered_matmul(local: torch.Tensor, compute: Callable, group, chunks: int, counter, label: str):
    """(gathered input, compute(gathered input)), both with dim 0 the k ranks' n rows each, rank-major,
    as one all-gather of ``local`` then ``compute`` would give: piece i+1's gather is in flight while
    piece i is computed."""
    k = group_size(group)
    bounds = chunk_bounds(local.shape[0], chunks)
    pieces, results = [], []

    def start(i):
        begin, length = bounds[i]
        piece = local[begin:begin + length].contiguous()
        out = piece.new_empty((k * length,) + tuple(piece.shape[1:]))
        record_call(counter, "all_gather", out.nbytes, k, label, chunks=len(bounds))
        return out, all_gather_flat(out, piece, group, async_op=True)

    in_flight = start(0)
    for i in range(len(bounds)):
        gathered, work = in_flight
        if i + 1 < len(bounds):
            in_flight = start(i + 1)  # issued before this piece's matmul, so it runs beside it
        work.wait()
        pieces.append(gathered)
        results.append(compute(gathered))
    return _rank_major(pieces, bounds, k), _rank_major(results, bounds, k)


def _rank_major(pieces: list, bounds: list, k: int) -> torch.Tensor:
    """Piece i holds rows [s_i, s_i + l_i) of every rank's block; put each rank's block back together."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([piece[r * length:(r + 1) * length] for r in range(k)
                      for piece, (_, length) in zip(pieces, bounds)])


def matmul_reduce_scattered(full: torch.Tensor, compute: Callable, group, chunks: int, counter,
                            label: str) -> torch.Tensor:
    """This rank's block of the sum over the group of ``compute(full)`` (dim 0: k blocks of n rows), as
    ``compute`` then one reduce-scatter would give: chunk i's reduce-scatter is in flight while chunk
    i+1 is computed."""
    k = group_size(group)
    rows = full.shape[0] // k
    blocks = full.unflatten(0, (k, rows))
    bounds = chunk_bounds(rows, chunks)
    waiting = []
    for begin, length in bounds:
        part = compute(blocks[:, begin:begin + length].flatten(0, 1)).contiguous()
        waiting.append(_start_reduce_scatter(part, group, counter, label, len(bounds)))
    return torch.cat([finish() for finish in waiting]) if len(waiting) > 1 else waiting[0]()


def _start_reduce_scatter(part: torch.Tensor, group, counter, label: str, chunks: int):
    """Launch the reduce-scatter of ``part``; returns a function that waits and gives this rank's rows."""
    k = group_size(group)
    out = part.new_empty((part.shape[0] // k,) + tuple(part.shape[1:]))
    try:
        work = reduce_scatter_flat(out, part, group, async_op=True)
    except (RuntimeError, NotImplementedError):  # a gloo build without reduce-scatter: as collectives.py
        record_call(counter, "reduce_scatter", part.nbytes, k, label, True, chunks=chunks)
        return start_all_reduce_slice(part, group)
    record_call(counter, "reduce_scatter", part.nbytes, k, label, chunks=chunks)

    def finish():
        work.wait()
        return out
    return finish


def _weight_grads(grad_rows: torch.Tensor, input_rows: torch.Tensor, needs: tuple):
    """dW = grad^T @ input and db = sum of grad over rows, on the rows flattened (as aten.linear's)."""
    grad_2d, input_2d = grad_rows.flatten(0, -2), input_rows.flatten(0, -2)
    grad_weight = grad_2d.t() @ input_2d if needs[1] else None
    grad_bias = grad_2d.sum(0) if needs[2] else None
    return grad_weight, grad_bias


class GatherLinear(torch.autograd.Function):
    """Forward: all-gather ``x`` along ``dim`` (strip to ``full_size``), linear. Backward: the input's
    partial gradient matmul-reduce-scattered back to this rank's shard; dW, db from the gathered input."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, full_size, chunks, group, counter):
        k = group_size(group)
        local = x.movedim(dim, 0)
        gathered, out = gathered_matmul(local, lambda rows: F.linear(rows, weight, bias), group, chunks,
                                        counter, "gather_linear.forward")
        if full_size is not None:
            gathered, out = gathered.narrow(0, 0, full_size), out.narrow(0, 0, full_size)
        ctx.save_for_backward(gathered, weight)
        ctx.dim, ctx.chunks, ctx.group, ctx.counter, ctx.rows = dim, chunks, group, counter, k * local.shape[0]
        ctx.has_bias = bias is not None
        return out.movedim(0, dim).contiguous()  # in the input's layout (collectives._all_gather says why)

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad_rows = grad.movedim(ctx.dim, 0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            padded = F.pad(grad_rows, [0, 0] * (grad_rows.dim() - 1) + [0, ctx.rows - grad_rows.shape[0]])
            grad_x = matmul_reduce_scattered(padded, lambda rows: rows @ weight, ctx.group, ctx.chunks,
                                             ctx.counter, "gather_linear.backward").movedim(0, ctx.dim)
        grad_weight, grad_bias = _weight_grads(grad_rows, gathered, ctx.needs_input_grad)
        return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None, None


class LinearReduceScatter(torch.autograd.Function):
    """Forward: linear, reduce-scatter (sum) the partial result along ``dim``. Backward: the gradient
    all-gathered chunk by chunk, each chunk's input gradient computed while the next one arrives."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, chunks, group, counter):
        k = group_size(group)
        rows = x.movedim(dim, 0)
        if rows.shape[0] % k:
            # uneven: the padding rows of the result must be zeros, not bias; one padded reduce-scatter
            full = F.linear(rows, weight, bias)
            full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, -full.shape[0] % k])
            out = matmul_reduce_scattered(full, lambda part: part, group, 1, counter,
                                          "linear_reduce_scatter.forward")
        else:
            out = matmul_reduce_scattered(rows, lambda part: F.linear(part, weight, bias), group, chunks,
                                          counter, "linear_reduce_scatter.forward")
        ctx.save_for_backward(rows, weight)
        ctx.dim, ctx.chunks, ctx.group, ctx.counter = dim, chunks, group, counter
        ctx.has_bias = bias is not None
        return out.movedim(0, dim).contiguous()  # in the input's layout (collectives._all_gather says why)

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        compute = (lambda part: part @ weight) if ctx.needs_input_grad[0] else (lambda part: part[..., :0])
        grad_full, grad_x = gathered_matmul(grad.movedim(ctx.dim, 0).contiguous(), compute, ctx.group,
                                            ctx.chunks, ctx.counter, "linear_reduce_scatter.backward")
        grad_full, grad_x = grad_full[:rows.shape[0]], grad_x[:rows.shape[0]]  # strip the padding rows
        grad_weight, grad_bias = _weight_grads(grad_full, rows, ctx.needs_input_grad)
        grad_x = grad_x.movedim(0, ctx.dim) if ctx.needs_input_grad[0] else None
        return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


# --- the functional API the rewritten graphs call (passes/lowering/overlap_tp.py) ---------------

def _check(x: torch.Tensor, dim: int, chunks: int, name: str) -> int:
    if not 0 <= dim < x.dim() - 1 and not -x.dim() <= dim < -1:
        raise InvalidValue(f"{name}: dim {dim} of a tensor of shape {tuple(x.shape)} is not a row dim "
                           f"(the last dim is the one the matmul contracts); chunk along another dim")
    if type(chunks) is not int or chunks < 1:
        raise InvalidValue(f"{name}: chunks is {chunks!r}; give a positive int (plan.tp_overlap)")
    return dim % x.dim()


def gather_linear(x, weight, bias, group, dim: int, *, chunks: int, full_size: Optional[int] = None,
                  counter: Optional[CommCounter] = None):
    """``F.linear(gather_summing_grad(x, group, dim, full_size=...), weight, bias)`` in ``chunks``
    overlapped pieces (forward all-gather, backward reduce-scatter, as ``gather_summing_grad``)."""
    dim = _check(x, dim, chunks, "gather_linear")
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return GatherLinear.apply(x, weight, bias, dim, full_size, chunks, group, counter)


def gather_linears(x, weights: tuple, biases: tuple, group, dim: int, *, chunks: int,
                   full_size: Optional[int] = None, counter: Optional[CommCounter] = None) -> tuple:
    """One gathered input read by several linears (q, k and v; gate and up): ``gather_linear`` of the
    weights stacked along their output dim, split back per linear. Each output column is the same dot
    product as in its own linear; the stacking is one copy of the weights per call."""
    weight = torch.cat(weights)
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    out = gather_linear(x, weight, bias, group, dim, chunks=chunks, full_size=full_size, counter=counter)
    return out.split([w.shape[0] for w in weights], dim=-1)


def linear_reduce_scatter(x, weight, bias, group, dim: int, *, chunks: int,
                          counter: Optional[CommCounter] = None):
    """``reduce_scatter_to_group(F.linear(x, weight, bias), group, dim)`` in ``chunks`` overlapped
    pieces (forward reduce-scatter, backward all-gather, as ``reduce_scatter_to_group``)."""
    dim = _check(x, dim, chunks, "linear_reduce_scatter")
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return LinearReduceScatter.apply(x, weight, bias, dim, chunks, group, counter)
