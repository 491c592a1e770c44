"""The device mesh: global ranks as a grid of named axes, and the expert axes folded over it.

Four axes size the ranks (``world = pp * dp * cp * tp``); listed outermost to innermost
(``RANK_AXES``, the default ``order``), the layout is row-major with tp innermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

This is Megatron-Core's order ``tp-cp-ep-dp-pp`` (its ``parallel_state`` module, written innermost
first). Why each place: ranks are numbered node by node (``xirang.ir.world``), so the innermost
axes ride the intra-node links (NVLink) and the outermost ones the slower network.

- **tp** innermost: tensor parallelism all-reduces (or all-gathers and reduce-scatters)
  activations in every layer, forward and backward, the heaviest and least overlappable traffic;
  a tp group is a run of consecutive ranks and stays in one node whenever tp divides the devices
  per node (Narayanan et al. 2021, section 3, takeaway #1).
- **cp** next: context parallelism passes key/value blocks around its group in every attention
  layer (ring) or swaps heads and sequence (all-to-all), second only to tp.
- **dp** next: data parallelism all-reduces the gradients once per step, overlapped with the
  backward; large but once.
- **pp** outermost: pipeline parallelism sends one activation per stage boundary and
  micro-batch, point to point, the lightest traffic, so it crosses nodes first.

**ep** sizes no ranks of its own: it is folded over the ``dp * cp`` ranks of each (pp, tp) place,
as Megatron-Core's "parallel folding" does (Liu et al. 2025, MoE Parallel Folding). Those ranks,
taken in (dp, cp) order (``f = dp_index * cp + cp_index``), are regrouped for the experts as
``edp x ep`` with ep innermost:

    ep_index = f % ep,   edp_index = f // ep,   edp = dp * cp / ep

so an ep group (the ranks that hold different experts and exchange tokens by all-to-all) is ep
consecutive (dp, cp) places, as close as the dense layout allows, and an expert-data-parallel group
``edp`` (the ranks that hold the same experts and all-reduce their gradients) is the rest. ep must
divide ``dp * cp``. Experts keep tp as their tensor-parallel axis (Megatron-Core's separate expert
tensor parallelism is not modelled).

The order is a mesh's own (``Mesh.order``, written in plan JSON): pp outermost by default, or dp
outermost (Megatron-Core's ``tp-cp-ep-pp-dp``), where a pipeline's stages are better kept on one node
or a data-parallel replica is better kept on one kind of device. Either way tp is innermost and cp
next to it; ep folds over dp x cp in (dp, cp) order in both.

"axis" here always means a mesh axis; a tensor dimension is a "dim".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from xirang.ir.errors import InvalidValue

RANK_AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost: they size and number the ranks
# the rank orders a mesh may take (``Mesh.order``): Megatron-Core's default, and its "tp-cp-ep-pp-dp"
ORDERS = (RANK_AXES, ("dp", "pp", "cp", "tp"))
FOLDED_AXES = ("edp", "ep")  # the dp x cp ranks of one (pp, tp) place, regrouped for the experts
AXES = RANK_AXES + FOLDED_AXES  # every named axis, in the order process groups are created
SIZE_AXES = ("pp", "dp", "cp", "tp", "ep")  # the sizes a mesh is given (edp follows), as JSON writes them
# what each axis of a mesh is for, in the words errors and explain use
AXIS_NAMES = {"pp": "pipeline", "dp": "data", "cp": "context", "tp": "tensor", "ep": "expert",
              "edp": "expert-data"}


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValue(f"Mesh {name} ({AXIS_NAMES[name]}-parallel degree) must be a positive int, "
                           f"got {value!r}", where=f"Mesh({name}=...)",
                           hint=f"give a degree of 1 or more (1: no {AXIS_NAMES[name]} parallelism)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class Mesh:
    """Sizes of the named mesh axes; ``pp * dp * cp * tp`` is the number of ranks, ep is folded over
    ``dp * cp`` (see the module docstring). ``Mesh(dp=, pp=, tp=)`` is a mesh without cp or ep."""

    dp: int
    pp: int
    tp: int
    cp: int = field(default=1, kw_only=True)
    ep: int = field(default=1, kw_only=True)
    order: tuple = field(default=RANK_AXES, kw_only=True)  # the rank axes, outermost first (ORDERS)

    def __post_init__(self):
        for axis in SIZE_AXES:
            _check_positive_int(axis, getattr(self, axis))
        order = tuple(self.order) if isinstance(self.order, (tuple, list)) else self.order
        if order not in ORDERS:
            raise InvalidValue(f"Mesh order {self.order!r} is not a rank order Xirang lays out",
                               where="Mesh(order=...)",
                               hint=" or ".join(repr(o) for o in ORDERS) + " (outermost first: pp or dp outermost, "
                                    "tp innermost, cp next to it)")
        object.__setattr__(self, "order", order)
        if (self.dp * self.cp) % self.ep:
            raise InvalidValue(f"Mesh ep={self.ep} does not divide dp x cp = {self.dp} x {self.cp} = "
                               f"{self.dp * self.cp}: the expert axis is folded over the data- and "
                               f"context-parallel ranks", where="Mesh(ep=...)",
                               hint=f"choose ep among the divisors of dp x cp ({_divisors(self.dp * self.cp)}), "
                                    f"or a dp x cp that ep={self.ep} divides")

    def __str__(self) -> str:
        """``dp=2 x pp=2 x tp=2``; cp and ep are shown where they are more than 1."""
        shown = ("dp", "pp") + (("cp",) if self.cp > 1 else ()) + ("tp",)
        text = " x ".join(f"{axis}={getattr(self, axis)}" for axis in shown)
        return (text + (f", ep={self.ep}" if self.ep > 1 else "")
                + (f" ({self.order[0]} outermost)" if self.order != RANK_AXES else ""))

    def describe(self) -> str:
        """Every named axis and the rank layout, for explain and inspect."""
        order = " x ".join(f"{axis}={getattr(self, axis)}" for axis in self.order)
        return (f"{order} (ranks laid out {self.order[0]} outermost, tp innermost); ep={self.ep} folded over "
                f"dp x cp, edp={self.edp}")

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Size of the expert-data-parallel axis: the ``dp * cp`` ranks one expert is replicated on."""
        return self.dp * self.cp // self.ep

    @property
    def gradient_axis(self) -> str:
        """The axis whose groups sum the gradients of every parameter but the experts': dp, or under cp > 1
        the dp x cp ranks (edp, ep being 1 beside cp), since cp ranks hold replicas as dp ranks do. The
        planner prices the buckets' all-reduce on it, the runtime builds their (two-level) groups on it."""
        return "edp" if self.cp > 1 else "dp"

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the rank axes in the mesh's ``order`` (outermost first)."""
        return tuple(getattr(self, axis) for axis in self.order)

    def axis_size(self, axis: str) -> int:
        if axis not in AXES:
            raise InvalidValue(f"unknown mesh axis {axis!r}; valid axes are {', '.join(AXES)}")
        return getattr(self, axis)

    def _check_rank(self, rank) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise InvalidValue(f"rank {rank!r} is out of range for mesh {self} "
                               f"(valid ranks 0..{self.size - 1})")

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of a global rank over the rank axes ``pp, dp, cp, tp`` (``index`` gives ep, edp)."""
        self._check_rank(rank)
        result = {}
        for axis in reversed(self.order):  # innermost first: peel each index off the low end
            rank, result[axis] = divmod(rank, getattr(self, axis))
        return {axis: result[axis] for axis in RANK_AXES}

    def index(self, axis: str, rank: int) -> int:
        """``rank``'s position along any named axis, the folded ep and edp included."""
        self.axis_size(axis)
        coords = self.coords(rank)
        if axis in RANK_AXES:
            return coords[axis]
        folded = coords["dp"] * self.cp + coords["cp"]
        return folded % self.ep if axis == "ep" else folded // self.ep

    def rank_of(self, **coords: int) -> int:
        """Global rank at ``pp=, dp=, cp=, tp=``; an axis of size 1 may be left out (index 0)."""
        unknown = sorted(set(coords) - set(RANK_AXES))
        missing = [axis for axis in RANK_AXES if axis not in coords and getattr(self, axis) > 1]
        if unknown or missing:
            raise InvalidValue(f"rank_of needs the rank axes {', '.join(RANK_AXES)} (those of size 1 may be "
                               f"left out); unknown {unknown}, missing {missing}"
                               + ("; ep and edp regroup those ranks: use group('ep', rank)"
                                  if set(unknown) & set(FOLDED_AXES) else ""))
        rank = 0
        for axis in self.order:
            index, size = coords.get(axis, 0), getattr(self, axis)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise InvalidValue(f"{axis}={index!r} is out of range for mesh {self} "
                                   f"(valid {axis} indices 0..{size - 1})")
            rank = rank * size + index
        return rank

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except ``axis``, in axis order.

        This is the process group along ``axis`` that ``rank`` belongs to, e.g. the tp group
        whose members all-reduce a row-parallel matmul's output together. For ep and edp, the
        (dp, cp) places of ``rank``'s (pp, tp) place that share its edp (resp. ep) index.
        """
        size = self.axis_size(axis)
        coords = self.coords(rank)
        if axis in RANK_AXES:  # row-major: a step along ``axis`` is the product of the inner axes' sizes
            stride = self._stride(axis)
            base = rank - coords[axis] * stride
            return tuple(base + i * stride for i in range(size))
        # the (dp, cp) place f of this (pp, tp) place, moved to along each axis's stride
        folded = coords["dp"] * self.cp + coords["cp"]
        ep_index, edp_index = folded % self.ep, folded // self.ep
        places = (range(edp_index * self.ep, (edp_index + 1) * self.ep) if axis == "ep"
                  else range(ep_index, self.dp * self.cp, self.ep))
        dp_stride, cp_stride = self._stride("dp"), self._stride("cp")
        return tuple(rank + (f // self.cp - coords["dp"]) * dp_stride + (f % self.cp - coords["cp"]) * cp_stride
                     for f in places)

    def _stride(self, axis: str) -> int:
        inner = self.order[self.order.index(axis) + 1:]
        stride = 1
        for other in inner:
            stride *= getattr(self, other)
        return stride

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
        """Every named size, outermost rank axis first, ep last (edp follows from them), and the order."""
        return {**{axis: getattr(self, axis) for axis in SIZE_AXES}, "order": list(self.order)}

    @classmethod
    def from_json(cls, data: dict) -> "Mesh":
        if isinstance(data, dict) and set(data) == {"dp", "pp", "tp"}:
            raise InvalidValue(f"mesh {data!r} was written by an older Xirang (axes dp, pp, tp only, ranks laid "
                               f"out dp outermost); this one names {', '.join(SIZE_AXES)} and lays ranks out pp "
                               f"outermost", where="mesh", hint="re-plan with xirang.plan(...) and save the new plan")
        if not isinstance(data, dict) or set(data) != {*SIZE_AXES, "order"}:
            raise InvalidValue(f"bad mesh {data!r}: expected an object with exactly the keys "
                               f"{', '.join(SIZE_AXES)} (positive ints) and order (the rank axes, outermost first)")
        return cls(**{axis: data[axis] for axis in SIZE_AXES}, order=data["order"])
