"""Value types stored in node.meta by the analysis passes (data only, no torch graph logic).

Sizes that scale with the batch or the sequence are sympy expressions in the symbols named by
``xirang.ir.meta_keys.symbol`` ('batch', 'seq'), so a plan can be re-priced at another shape
without re-tracing; ``evaluate`` turns them into numbers at given symbol values.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

Size = sympy.Expr  # an integer, or an expression in the batch/seq symbols


def evaluate(expr, values: dict[str, int]) -> int:
    """Value of a size expression at ``{symbol name: value}``."""
    expr = sympy.sympify(expr)
    if expr.is_Number:
        return int(expr)
    subs = {s: values[s.name] for s in expr.free_symbols}
    return int(expr.xreplace(subs))


@dataclass(frozen=True)
class SourceLocation:
    """Where in user code a node came from."""

    file: str
    line: int
    code: str = ""

    def __str__(self) -> str:
        text = f"{self.file}:{self.line}"
        return f"{text}  `{self.code}`" if self.code else text


@dataclass(frozen=True)
class TensorInfo:
    """Shape (sympy sizes), dtype name and element size of one tensor a node produces."""

    shape: tuple[Size, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> Size:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> Size:
        return self.numel * self.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True)
class FlopCount:
    """Floating-point operations of one node: forward, and backward for the gradients it needs.

    One multiply-add counts as two FLOPs (the convention of Narayanan et al. 2021).
    """

    forward: Size
    backward: Size

    @property
    def total(self) -> Size:
        return self.forward + self.backward


@dataclass(frozen=True)
class ByteCount:
    """Memory traffic of one node and what it keeps alive for the backward pass."""

    read: Size
    written: Size
    saved_for_backward: Size


@dataclass(frozen=True)
class BlockInfo:
    """A node's place in a repeated block: the block instance, its kind, and its position."""

    path: str  # module FQN of the block instance, e.g. "model.layers.17"
    index: int  # position among the blocks of the model, in execution order
    kind: str  # short structural hash shared by all blocks of the same kind


@dataclass(frozen=True)
class ParamShard:
    """How a rank holds one placeholder bound to model state: its FQN (and tied aliases), role
    ('parameter', 'buffer', 'constant'), tp placement and the full (unsharded) shape. The runtime
    binds ``shard_of(full, placement, tp_rank, tp)`` and undoes it for ``full_state_dict``."""

    placeholder: str
    name: str
    aliases: tuple
    role: str
    placement: object
    full_shape: tuple
