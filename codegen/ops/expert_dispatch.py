"""Expert parallelism: rows sent to the rank that holds their expert, and their results sent back.

An experts module is captured as rows (each token once per chosen expert), their expert ids, and two
``xirang::expert_linear`` calls with the row-local gate between them (passes/analysis/experts.py).
Under ep > 1 each rank of an ep group holds ``experts / ep`` consecutive experts (rank i: experts
``i * local .. (i + 1) * local - 1``; passes/lowering/expert_parallel.py shards their weights) and
the rank's program reads

    rows, local_ids, route = dispatch_rows(rows, ids, experts, ep_group)   # before the first expert_linear
    ...  expert_linear(rows, local_ids, local weights) ... gate ... expert_linear(...)
    out = combine_rows(out, route)                                      # after the last

``dispatch_rows`` sorts the rows by the rank holding their expert, exchanges the per-rank row
counts (an all-to-all of ep integers: the sizes are known on every rank before the rows move, one
host read), then sends the rows and their ids by ``all_to_all_single`` with those split sizes:
dropless, every row reaches its expert (torchtitan's and Megatron-Core's all-to-all dispatcher).
``combine_rows`` is the same exchange reversed and the sort undone, so row ``s`` of its output is
the result for row ``s`` of the input of ``dispatch_rows``; the router's weights are applied after,
on the rank that routed the token, as the model does. Backward: each exchange's gradient travels
the reverse exchange; an expert weight's gradient gathers every ep rank's rows routed to it, and
the runtime reduces it over the expert-data-parallel group only (codegen/runtime/compiled_model.py).

``group`` None is one rank (ep = 1): nothing moves. On fake tensors (the full-scale check,
codegen/check) the counts cannot be read: each rank is taken to send an equal share of its rows to
every rank (the balanced routing), and the exchanges are recorded at that size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from xirang.codegen.ops.collectives import group_rank, group_size
from xirang.codegen.ops.comm_counter import record_call
from xirang.ir.errors import XirangError


@dataclass
class Route:
    """How one dispatch moved rows, for the combine that brings them back."""

    order: torch.Tensor  # the permutation that sorted this rank's rows by destination rank
    sent: list  # rows this rank sent to each ep rank
    received: list  # rows this rank received from each ep rank
    group: object
    counter: object


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(x, FakeTensor) or x.device.type == "meta"


def _exchange(x: torch.Tensor, send: list, receive: list, group, counter, label: str) -> torch.Tensor:
    out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
    record_call(counter, "all_to_all", x.nbytes, len(send), label)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Forward: rows exchanged with split sizes ``send``/``receive``. Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, receive, group, counter, label):
        ctx.args = (receive, send, group, counter, label)
        return _exchange(x, send, receive, group, counter, label + ".forward")

    @staticmethod
    def backward(ctx, grad):
        receive, send, group, counter, label = ctx.args
        return _exchange(grad, receive, send, group, counter, label + ".backward"), None, None, None, None, None


def _counts(destination: torch.Tensor, ep: int, group, counter) -> tuple[list, list]:
    """Rows this rank sends to each ep rank, and receives from each (an all-to-all of the counts)."""
    if _is_fake(destination):
        rows = destination.shape[0]
        balanced = [rows // ep + (1 if i < rows % ep else 0) for i in range(ep)]
        return balanced, list(balanced)
    sent = torch.bincount(destination, minlength=ep)
    received = torch.empty_like(sent)
    record_call(counter, "all_to_all", sent.nbytes, ep, "expert counts")
    dist.all_to_all_single(received, sent, group=group)
    return sent.tolist(), received.tolist()


def dispatch_rows(rows: torch.Tensor, ids: torch.Tensor, experts: int, group, *, counter=None):
    """(rows received, their ids among this rank's experts, the Route back); see the module docstring."""
    ep = group_size(group)
    if ep == 1:
        return rows, ids, None
    if experts % ep:
        raise XirangError(f"{experts} experts cannot be split evenly over ep={ep} ranks",
                          where="dispatch_rows (expert parallelism)",
                          hint=f"plan with an ep that divides {experts}")
    local = experts // ep
    destination = torch.div(ids, local, rounding_mode="floor")
    order = torch.argsort(destination, stable=True)
    sent, received = _counts(destination, ep, group, counter)
    route = Route(order, sent, received, group, counter)
    moved = _Exchange.apply(rows[order], sent, received, group, counter, "expert dispatch")
    their_ids = _exchange(ids[order], sent, received, group, None, "expert dispatch ids")
    return moved, their_ids - group_rank(group) * local, route


def combine_rows(out: torch.Tensor, route: Optional[Route]) -> torch.Tensor:
    """The results of the rows ``dispatch_rows`` received, back on the ranks and in the order they came from."""
    if route is None:
        return out
    back = _Exchange.apply(out, route.received, route.sent, route.group, route.counter, "expert combine")
    return torch.empty_like(back).index_copy(0, route.order, back)
