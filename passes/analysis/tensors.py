"""Annotate every node's output with its shape (sympy, in batch/seq), dtype and element size.

Layers stamped out by ``fold_repeats`` share their template's fake tensors, so each fake tensor is
converted once and its (frozen) ``TensorInfo`` shared: reading a SymInt's expression is the slow part.
"""
from __future__ import annotations

import sympy
import torch

from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import TENSOR, TORCH_SYMBOLS, VAL, symbol
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(VAL, TORCH_SYMBOLS), provides=(TENSOR,))
def annotate_tensors(gm, ctx):
    """Record shape, dtype and itemsize of each node's output tensor(s) in Xirang's symbols."""
    to_sympy = SizeConverter(TORCH_SYMBOLS.get(gm))
    converted: dict[int, tuple] = {}  # id(fake tensor) -> (the tensor, kept alive so ids stay unique; its info)

    def info(tensor):
        if id(tensor) not in converted:
            converted[id(tensor)] = (tensor, to_sympy.tensor_info(tensor))
        return converted[id(tensor)][1]

    for node in gm.graph.nodes:
        value = VAL.get(node, None)
        if isinstance(value, torch.Tensor):
            TENSOR.set(node, info(value))
        elif isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            TENSOR.set(node, tuple(info(v) if isinstance(v, torch.Tensor) else None for v in value))
    return gm


class SizeConverter:
    """torch sizes (int or SymInt over torch's symbols s0, s1, ...) -> sympy over 'batch', 'seq'.

    A symbol Xirang did not ask for (e.g. an unbacked size from a data-dependent op) is replaced by
    the value it had while tracing, so every size stays evaluable.
    """

    def __init__(self, torch_symbols: dict[str, str]):
        self.torch_symbols = torch_symbols
        self._cache: dict = {}

    def size(self, size) -> sympy.Expr:
        if isinstance(size, int):
            return sympy.Integer(size)
        expr = size.node.expr
        if expr in self._cache:
            return self._cache[expr]
        shape_env = size.node.shape_env
        replace = {}
        for sym in expr.free_symbols:
            if str(sym) in self.torch_symbols:
                replace[sym] = symbol(self.torch_symbols[str(sym)])
            else:
                replace[sym] = sympy.Integer(int(shape_env.var_to_val.get(sym, size.node.hint)))
        converted = sympy.sympify(expr.xreplace(replace))
        self._cache[expr] = converted
        return converted

    def tensor_info(self, tensor: torch.Tensor) -> TensorInfo:
        return TensorInfo(shape=tuple(self.size(s) for s in tensor.shape),
                          dtype=str(tensor.dtype).removeprefix("torch."),
                          itemsize=tensor.dtype.itemsize)
