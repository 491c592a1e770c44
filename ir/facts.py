"""Value types stored in node.meta by the analysis passes (data only, no torch graph logic).

Sizes that scale with the batch or the sequence are sympy expressions in the symbols named by
``xirang.ir.meta_keys.symbol`` ('batch', 'seq'), so a plan can be re-priced at another shape
without re-tracing; ``evaluate`` turns them into numbers at given symbol values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
class SavedTensor:
    """One storage an op keeps alive for its backward.

    - ``storage``: which storage, so that two ops keeping the same one count it once: the name of the
      node whose output owns it (views and aliases followed to the tensor they view), or
      ``"<node>:<what>"`` for an intermediate the op makes and keeps itself (a dropout mask, a norm's
      statistics, the log-probabilities of a cross-entropy).
    - ``nbytes``: bytes of the whole storage at the traced dtype (a view keeps all of its base alive).
    - ``floating``: its bytes follow the plan's activation precision; False for masks, indices and the
      float32 statistics, which keep their dtype.
    - ``input``: the position in ``node.all_input_nodes`` of the input whose layout it has on a tp
      rank: the input it is read through, or for an intermediate the op makes from an input, that
      input (a cross-entropy's log-probabilities are sharded as its logits); None: the op's output's.
    """

    storage: str
    nbytes: Size
    floating: bool
    input: int | None = None

    @property
    def producer(self) -> str:
        """Name of the node that makes the storage (an op's own intermediates: the op)."""
        return self.storage.split(":", 1)[0]


@dataclass(frozen=True)
class ByteCount:
    """Memory traffic of one node and what it keeps alive for the backward pass.

    ``saved_for_backward`` is the bytes of the storages in ``saved``, each once and whole; summed over
    several ops it counts a storage two ops keep twice, so memory per unit is the union of their
    ``saved`` by storage (``saved_storages.live_saved_bytes``).
    """

    read: Size
    written: Size
    saved_for_backward: Size
    saved: tuple[SavedTensor, ...] = ()


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
    binds ``shard_of(full, placement, tp_rank, tp)`` and undoes it for ``full_state_dict``.

    ``experts``: for an expert weight under expert parallelism, ``(first, count)``: this rank holds
    experts ``first .. first + count - 1`` of dim 0 (its ep rank's), and the tp placement applies to
    that slice; empty for every other tensor (passes/lowering/expert_parallel.py)."""

    placeholder: str
    name: str
    aliases: tuple
    role: str
    placement: object
    full_shape: tuple
    experts: tuple = ()


class RandomSite(NamedTuple):
    """One op of a rank's program that draws random numbers, as the lowering pass
    ``place_random_streams`` placed it (passes/lowering/random_streams.py); the emitted program
    passes it to the function in codegen/ops/random_ops.py that draws for the op. A NamedTuple,
    so the emitted code spells it out (``RandomSite(3, 'dropout', ...)``).

    - ``index``: the op's position among the graph's random ops, in graph order (the order the
      model calls them): with the compile seed, the step and the ranks of its stream it names the
      draw, so a re-run of a forward draws the same numbers.
    - ``kind``: "dropout" (aten dropout / native_dropout), "attention" (scaled dot-product attention
      with dropout), "factory" (a draw of a given size: rand, randn, randint), "shaped" (a draw
      shaped like its input whose values it ignores: rand_like, bernoulli(x, p), uniform_), or
      "valued" (any other: its draws depend on its input values).
    - ``stream``: "tp-shared" (the op's draw is replicated over tp: one stream for the tp group) or
      "tp-rank" (tp-sharded: a stream per tp rank). dp ranks and micro-batches always differ; each
      op runs in one pipeline stage, so stages differ by ``index``.
    - ``shape``: the full draw at the global batch (for exact replay): the op's output, or the
      attention's scores (batch, heads, queries, keys).
    - ``batch_dim``: the dim of ``shape`` holding the batch (-1: none); ``rows_per_sample`` of it
      per sample (the sequence length where batch and sequence are flattened together).
    - ``shard``: ``()`` or ``(dim, chunks, tp_rank, tp)``: this rank's tp slice of the draw.
    - ``exact``: "" when exact mode can replay the op as one device draws it, else why not.
    - ``node``, ``op``: the graph node and aten op, for messages.
    """

    index: int
    kind: str
    stream: str
    shape: tuple
    batch_dim: int
    rows_per_sample: int
    shard: tuple
    exact: str
    node: str
    op: str
