"""The device mesh: global ranks arranged as a dp x pp x tp grid.

Ranks are laid out row-major over the axes ("dp", "pp", "tp"), tp innermost:

    rank = (dp_index * pp + pp_index) * tp + tp_index

so a tp group is a run of consecutive ranks, and with ranks numbered node by node (see
``xirang.ir.world``) it stays inside one node whenever tp divides the devices per node. Tensor
parallelism all-reduces activations in every layer, forward and backward, so its traffic is the
heaviest and must ride the intra-node links (NVLink). Pipeline parallelism sends one activation
per stage boundary and micro-batch, and data parallelism all-reduces gradients once per step,
overlapped with the backward; both tolerate the slower inter-node network, dp most of all, so dp
is outermost (Megatron-LM's layout; Narayanan et al. 2021, section 3, takeaway #1: tensor
parallelism up to the GPUs of one server, pipeline parallelism across servers).

"axis" here always means a mesh axis; a tensor dimension is a "dim".
"""
from __future__ import annotations

from dataclasses import dataclass
from xirang.ir.errors import InvalidValue

AXES = ("dp", "pp", "tp")  # outermost to innermost


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValue(f"Mesh {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the three mesh axes; ``dp * pp * tp`` is the number of ranks."""

    dp: int
    pp: int
    tp: int

    def __post_init__(self):
        for axis in AXES:
            _check_positive_int(axis, getattr(self, axis))

    def __str__(self) -> str:
        return " x ".join(f"{axis}={self.axis_size(axis)}" for axis in AXES)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """Axis sizes in ``AXES`` order."""
        return (self.dp, self.pp, self.tp)

    def axis_size(self, axis: str) -> int:
        if axis not in AXES:
            raise InvalidValue(f"unknown mesh axis {axis!r}; valid axes are {', '.join(AXES)}")
        return getattr(self, axis)

    def _check_rank(self, rank) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise InvalidValue(f"rank {rank!r} is out of range for mesh {self} "
                             f"(valid ranks 0..{self.size - 1})")

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of a global rank."""
        self._check_rank(rank)
        rest, tp_index = divmod(rank, self.tp)
        dp_index, pp_index = divmod(rest, self.pp)
        return {"dp": dp_index, "pp": pp_index, "tp": tp_index}

    def rank_of(self, **coords: int) -> int:
        """Global rank at ``dp=, pp=, tp=`` (all three are required)."""
        unknown = sorted(set(coords) - set(AXES))
        missing = [axis for axis in AXES if axis not in coords]
        if unknown or missing:
            raise InvalidValue(f"rank_of needs exactly the axes {', '.join(AXES)}; "
                             f"unknown {unknown}, missing {missing}")
        for axis in AXES:
            index, size = coords[axis], self.axis_size(axis)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise InvalidValue(f"{axis}={index!r} is out of range for mesh {self} "
                                 f"(valid {axis} indices 0..{size - 1})")
        return (coords["dp"] * self.pp + coords["pp"]) * self.tp + coords["tp"]

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except ``axis``, in axis order.

        This is the process group along ``axis`` that ``rank`` belongs to, e.g. the tp group
        whose members all-reduce a row-parallel matmul's output together.
        """
        size = self.axis_size(axis)
        coords = self.coords(rank)
        return tuple(self.rank_of(**{**coords, axis: i}) for i in range(size))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every process group along ``axis``, ordered by their lowest rank.

        They partition the ranks; ``torch.distributed.new_group`` must be called for all of them
        on every rank, in the same order, which is why the order is fixed here.
        """
        self.axis_size(axis)
        seen: set[int] = set()
        result = []
        for rank in range(self.size):
            if rank not in seen:
                members = self.group(axis, rank)
                seen.update(members)
                result.append(members)
        return tuple(result)

    def to_json(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    @classmethod
    def from_json(cls, data: dict) -> "Mesh":
        if not isinstance(data, dict) or set(data) != set(AXES):
            raise InvalidValue(f"bad mesh {data!r}: expected an object with exactly the keys "
                             f"{', '.join(AXES)} (positive ints)")
        return cls(**{axis: data[axis] for axis in AXES})
