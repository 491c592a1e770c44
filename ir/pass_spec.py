"""What a pass is: a plain function ``(gm, ctx) -> gm`` declared with the meta keys it needs and adds.

The declaration lives beside the function (``@compiler_pass(requires=..., provides=...)``), so the
pass manager can check a whole pass list before running anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Any, Callable

from xirang.ir.meta_keys import MetaKey


@dataclass(frozen=True)
class CompileContext:
    """Read-only inputs every pass may consult. Facts found by passes go to node.meta, not here."""

    model: Any = None  # the user's torch.nn.Module
    example_args: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    # input name -> {tensor dim: symbol name}; None lets the tracer choose (dim 0 batch, dim 1 seq)
    symbolic_dims: dict | None = None
    # trace a few of each run of identical layers and replicate them (see passes/analysis/fold_repeats.py)
    fold_repeats: bool = True


@dataclass(frozen=True)
class LoweringContext:
    """What the lowering passes turn an analysed graph into: ``rank``'s program under ``plan``
    (a ``xirang.ir.plan.Plan``), its tensors on ``device``. ``shared``: facts a pass derives from the
    analysed graph and the plan alone, the same for every rank, kept by a caller that lowers many ranks of
    one plan (``xirang.check``) so they are derived once; None derives them each time."""

    plan: Any
    rank: int
    device: Any = "cpu"
    shared: Optional[dict] = None

    @property
    def coords(self) -> dict:
        return self.plan.mesh.coords(self.rank)


@dataclass(frozen=True)
class Pass:
    fn: Callable
    name: str
    requires: tuple[MetaKey, ...]
    provides: tuple[MetaKey, ...]
    doc: str

    def __call__(self, gm, ctx):
        return self.fn(gm, ctx)

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


def compiler_pass(*, requires: tuple[MetaKey, ...] = (), provides: tuple[MetaKey, ...] = ()):
    """Declare a function as a compiler pass with the meta keys it requires and provides."""

    def wrap(fn: Callable) -> Pass:
        doc = (fn.__doc__ or "").strip().splitlines()
        return Pass(fn=fn, name=fn.__name__, requires=tuple(requires), provides=tuple(provides),
                    doc=doc[0] if doc else "")

    return wrap
