"""How one tensor is laid out along one mesh axis: sharded on a tensor dim, replicated, or partial.

A tensor's full layout on the mesh is one placement per mesh axis (dp, pp, tp); this file only
knows about a single axis. "dim" is always a tensor dimension, "axis" always a mesh axis.

Placements are small frozen values so they can be dict keys in the sharding-rule table and compared
by the ILP layer; their JSON form is plain (``{"shard": 0}``, ``{"shard": 2, "chunks": 3}``,
``"replicate"``, ``{"partial": "sum"}``) so a person can edit a plan file by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union
from xirang.ir.errors import InvalidValue, InvalidType

PARTIAL_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class PlanShard:
    """Each rank of the axis holds one contiguous slice of tensor dim ``dim``.

    ``dim`` is non-negative: rules normalise ``-1`` against the tensor's rank before building a
    placement, so two spellings of the same layout never compare unequal.

    ``chunks`` > 1: the dim is ``chunks`` equal contiguous pieces, each split evenly across the
    ranks, and a rank holds its slice of every piece, concatenated. That is Megatron's layout of a
    fused ``[q | k | v]`` projection (Shoeybi et al. 2019): a rank's columns of the fused weight
    are its heads of q, of k and of v, so splitting the output into three pieces gives each rank a
    per-head shard of each. A plain contiguous slice (chunks 1) would give rank 0 all of q instead.
    The local shape is the same either way.
    """

    dim: int
    chunks: int = 1

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise InvalidValue(f"PlanShard(dim={self.dim!r}): dim must be a non-negative int "
                             f"(normalise negative dims with dim % ndim first)")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise InvalidValue(f"PlanShard(dim={self.dim}, chunks={self.chunks!r}): chunks must be a positive int "
                             f"(1 for one contiguous slice per rank, k for a fused projection of k pieces)")

    def __str__(self) -> str:
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim}, {self.chunks} chunks)"

    def to_json(self) -> dict:
        return {"shard": self.dim} if self.chunks == 1 else {"shard": self.dim, "chunks": self.chunks}


@dataclass(frozen=True)
class PlanReplicate:
    """Every rank of the axis holds the full tensor."""

    def __str__(self) -> str:
        return "R"

    def to_json(self) -> str:
        return "replicate"


@dataclass(frozen=True)
class PlanPartial:
    """Every rank holds a full-shape tensor; the true value is the reduction ``op`` over the axis.

    This is what a row-parallel matmul produces before its all-reduce, and what gradients are on
    the dp axis before the gradient all-reduce ("avg" there).
    """

    op: str = "sum"

    def __post_init__(self):
        if self.op not in PARTIAL_OPS:
            raise InvalidValue(f"PlanPartial(op={self.op!r}): op must be one of {', '.join(PARTIAL_OPS)}")

    def __str__(self) -> str:
        return f"P({self.op})"

    def to_json(self) -> dict:
        return {"partial": self.op}


Placement = Union[PlanShard, PlanReplicate, PlanPartial]


def placement_from_json(data: Any) -> Placement:
    """Inverse of ``placement.to_json()``; a malformed value raises ValueError naming it."""
    if data == "replicate":
        return PlanReplicate()
    if isinstance(data, dict) and set(data) in ({"shard"}, {"shard", "chunks"}):
        return PlanShard(data["shard"], data.get("chunks", 1))
    if isinstance(data, dict) and len(data) == 1:
        (kind, value), = data.items()
        if kind == "partial":
            return PlanPartial(value)
    raise InvalidValue(f"bad placement {data!r}: expected {{\"shard\": <dim>}} (optionally with "
                     f"\"chunks\": <pieces>), \"replicate\" or {{\"partial\": <{'|'.join(PARTIAL_OPS)}>}}")


def local_shape(shape: tuple, placement: Placement, axis_size: int) -> tuple:
    """Shape one rank of a mesh axis of ``axis_size`` ranks holds under ``placement``.

    A sharded dim is split with ceiling division, ``ceil(n / axis_size)`` per rank: an uneven
    dim is padded at its end up to ``axis_size * ceil(n / axis_size)`` so every rank holds the
    same local shape (static shapes for send/recv and collectives). The padding therefore sits on
    the last rank, or the last few when n is small (n=5 on 4 ranks: 2, 2, 1+1 pad, 0+2 pad).
    Sizes may be ints or sympy expressions in the batch/seq symbols.
    Replicate and Partial keep the full shape.
    """
    if isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1:
        raise InvalidValue(f"axis_size must be a positive int, got {axis_size!r}")
    shape = tuple(shape)
    if isinstance(placement, (PlanReplicate, PlanPartial)):
        return shape
    if not isinstance(placement, PlanShard):
        raise InvalidType(f"not a placement: {placement!r} (expected PlanShard, PlanReplicate or PlanPartial)")
    if placement.dim >= len(shape):
        raise InvalidValue(f"{placement} is out of range for a tensor of shape {shape} "
                         f"(valid dims 0..{len(shape) - 1})" if shape else
                         f"{placement} cannot shard a 0-dim tensor")
    n = shape[placement.dim]
    local = -(-n // axis_size)  # ceiling division; for sympy n this is ceiling(n / axis_size)
    return shape[:placement.dim] + (local,) + shape[placement.dim + 1:]
