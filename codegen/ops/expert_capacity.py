"""Token dropping: each expert takes at most ``capacity`` of the rows a rank routes to it in one forward.

With a capacity factor ``f`` (``Plan.capacity_factor``), a rank whose experts call has ``S`` rows (its
tokens times top k) for ``E`` experts gives each expert

    capacity = ceil(S / E * f)

rows, Megatron-Core's ``get_capacity`` (in its MoE utilities) over the rows the rank
routes: the tokens of this rank's micro-batch, before any exchange. An expert routed more rows keeps the
first ``capacity`` of them in row order (token order, then the top-k slot: Megatron's "position" drop
policy) and drops the rest: a dropped row is never computed or sent, and its result is zero, so the
token's output lacks that expert's term (weighted by the router's score, which then gets no gradient),
and the residual stream carries the token on as the model's own dropping would.

    rows', ids', kept = drop_over_capacity(rows, ids, experts, factor)   # before the first expert_linear
    ... dispatch_rows(rows', ids', ...) ... expert_linear ... combine_rows(...) ...
    out = restore_dropped(out', kept, rows)                              # after the last

On fake tensors (the full-scale check) the routing is unknown: nothing is taken to drop, the balanced
routing's answer for ``f >= 1``.
"""
from __future__ import annotations

import math

import torch


def capacity(rows: int, experts: int, factor: float) -> int:
    """Rows each expert takes of ``rows`` routed rows: ceil(rows / experts * factor)."""
    return math.ceil(rows / experts * factor)


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(x, FakeTensor) or x.device.type == "meta"


def kept_rows(ids: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Indices (ascending) of the rows kept: for each expert the first ``capacity`` rows routed to it."""
    if _is_fake(ids):
        return torch.arange(ids.shape[0], device=ids.device)
    limit = capacity(ids.shape[0], experts, factor)
    order = torch.argsort(ids, stable=True)  # rows grouped by expert, row order kept within each
    counts = torch.bincount(ids, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(ids.shape[0], device=ids.device) - starts[ids[order]]  # a row's place in its expert's
    keep = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    keep[order] = place < limit
    return keep.nonzero().squeeze(1)


def drop_over_capacity(rows: torch.Tensor, ids: torch.Tensor, experts: int, factor: float):
    """(the rows kept, their expert ids, their indices among ``rows``); see the module docstring."""
    kept = kept_rows(ids, experts, factor)
    if kept.shape[0] == rows.shape[0]:
        return rows, ids, kept
    return rows.index_select(0, kept), ids.index_select(0, kept), kept


def restore_dropped(out: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The kept rows' results at their places among all of ``rows``, zero for the dropped ones."""
    if out.shape[0] == rows.shape[0]:
        return out
    return out.new_zeros((rows.shape[0],) + tuple(out.shape[1:])).index_copy(0, kept, out)
