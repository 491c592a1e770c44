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

    ``pieces`` (sizes, summing to the dim) with ``whole`` (indices into them): the dim is pieces of
    these sizes; a rank holds its even slice of every piece not in ``whole`` and all of each piece in
    ``whole``, in piece order. That is a fused projection whose pieces differ in size or cannot all be
    split: Falcon-7B's multi-query ``[q (heads) | k (1 head) | v (1 head)]`` at tp 2 is
    ``PlanShard(0, pieces=(4 * d, d, d), whole=(1, 2))``: each rank holds its two query heads and the
    one kv head (sharding_rules_pieces). A whole piece's gradient is whole on every rank too.

    ``unit`` > 1: the dim is split in whole units of ``unit`` elements (a head's width), so each rank
    holds ``ceil(n / (unit * ranks))`` units and the end is padded (``shard_share``). That is an uneven
    split that keeps heads whole: 6 heads of 16 (a dim of 96) on 4 ranks are 2 heads (32 elements) a rank,
    the last rank all padding, where the plain shard (unit 1) would give 24 elements, a head and a half.
    Rules write the smallest unit with the same share (``sharding_rules_padded.padded_shard``), so one
    layout has one spelling; a unit is never written where the split is even.
    """

    dim: int
    chunks: int = 1
    pieces: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()
    unit: int = 1

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise InvalidValue(f"PlanShard(dim={self.dim!r}): dim must be a non-negative int "
                             f"(normalise negative dims with dim % ndim first)")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise InvalidValue(f"PlanShard(dim={self.dim}, chunks={self.chunks!r}): chunks must be a positive int "
                             f"(1 for one contiguous slice per rank, k for a fused projection of k pieces)")
        object.__setattr__(self, "pieces", tuple(self.pieces))
        object.__setattr__(self, "whole", tuple(self.whole))
        if self.pieces and (self.chunks != 1 or len(self.pieces) < 2 or
                            not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.pieces)):
            raise InvalidValue(f"{self!r}: pieces must be two or more positive int sizes, with chunks 1")
        if self.whole and (not self.pieces or sorted(set(self.whole)) != list(self.whole)
                           or not all(isinstance(j, int) and 0 <= j < len(self.pieces) for j in self.whole)):
            raise InvalidValue(f"{self!r}: whole must list distinct piece indices in increasing order")
        if self.pieces and len(self.whole) == len(self.pieces):
            raise InvalidValue(f"{self!r}: every piece is whole: that is PlanReplicate()")
        if isinstance(self.unit, bool) or not isinstance(self.unit, int) or self.unit < 1 or \
                (self.unit > 1 and not self.plain_cut):
            raise InvalidValue(f"{self!r}: unit must be a positive int, and above 1 only on a plain shard "
                               f"(no chunks, no pieces)")

    def __str__(self) -> str:
        if self.pieces:
            listed = "|".join(f"{n}" + (" whole" if j in self.whole else "") for j, n in enumerate(self.pieces))
            return f"S({self.dim}, pieces {listed})"
        if self.unit > 1:
            return f"S({self.dim}, units of {self.unit})"
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim}, {self.chunks} chunks)"

    def to_json(self) -> dict:
        if self.pieces:
            return {"shard": self.dim, "pieces": list(self.pieces), "whole": list(self.whole)}
        if self.unit > 1:
            return {"shard": self.dim, "unit": self.unit}
        return {"shard": self.dim} if self.chunks == 1 else {"shard": self.dim, "chunks": self.chunks}

    @property
    def plain_cut(self) -> bool:
        """One contiguous slice per rank, whatever its unit (no chunks, no pieces)."""
        return self.chunks == 1 and not self.pieces

    @property
    def plain(self) -> bool:
        """One contiguous slice per rank in single elements (no chunks, no pieces, no unit)."""
        return self.plain_cut and self.unit == 1


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
    if isinstance(data, dict) and set(data) == {"shard", "unit"}:
        return PlanShard(data["shard"], unit=data["unit"])
    if isinstance(data, dict) and set(data) == {"shard", "pieces", "whole"}:
        return PlanShard(data["shard"], pieces=tuple(data["pieces"]), whole=tuple(data["whole"]))
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
    local = shard_share(n, axis_size, placement.unit)
    if placement.pieces:
        local = pieces_local_size(placement, axis_size)
    return shape[:placement.dim] + (local,) + shape[placement.dim + 1:]


def held_fraction(placement: Placement, axis_size: int, size=None) -> float:
    """Share of a tensor one rank of an axis of ``axis_size`` ranks holds at ``placement`` (what ``local_shape``
    gives over the whole): all of a replicated or partial tensor; of a shard, its slice of every split piece
    and all of each whole one (``pieces``), or ``shard_share`` of a dim of ``size`` elements over ``size``, the
    padding included (6 heads on 4 ranks: 2 a rank, a third, not a quarter). ``size`` may be an int or a sympy
    expression; 1/axis_size where it is not a known integer (a sequence dim, which splits evenly)."""
    if not isinstance(placement, PlanShard):
        return 1.0
    if placement.pieces:
        return pieces_local_size(placement, axis_size) / sum(placement.pieces)
    known = isinstance(size, int) and not isinstance(size, bool) or getattr(size, "is_Integer", False)
    if not known or int(size) < 1:
        return 1.0 / axis_size
    return shard_share(int(size), axis_size, placement.unit) / int(size)


def shard_share(n, axis_size: int, unit: int = 1):
    """Elements of a dim of ``n`` one rank holds when it is split over ``axis_size`` ranks in whole units
    of ``unit`` elements: ``ceil(n / (unit * axis_size)) * unit``, the end padded (rank r holds elements
    ``[r * share, (r + 1) * share)`` of the padded dim). Unit 1 is the plain ceiling split; for a sympy
    ``n`` this is ``ceiling(n / axis_size)``."""
    return -(-n // (unit * axis_size)) * unit


def real_share(n: int, axis_size: int, rank: int, unit: int = 1) -> int:
    """Elements of ``shard_share`` that are real (not padding) on rank ``rank``."""
    share = shard_share(n, axis_size, unit)
    return max(0, min(share, n - rank * share))


def pieces_local_size(placement: PlanShard, axis_size: int) -> int:
    """Elements of the sharded dim one rank holds under ``PlanShard(pieces=..., whole=...)``."""
    return sum(n if j in placement.whole else n // axis_size for j, n in enumerate(placement.pieces))


def piece_blocks(placement: PlanShard, axis_size: int, rank: int) -> list[tuple[int, int, int, bool]]:
    """(global start, length, local start, whole) of each block rank ``rank`` holds along the sharded
    dim of ``PlanShard(pieces=...)``, in local order: its slice of each split piece, each whole piece."""
    blocks, start, local = [], 0, 0
    for j, n in enumerate(placement.pieces):
        whole = j in placement.whole
        length = n if whole else n // axis_size
        blocks.append((start if whole else start + rank * length, length, local, whole))
        start, local = start + n, local + length
    return blocks
