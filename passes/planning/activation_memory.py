"""Activation bytes of one transformer layer by Korthikanti et al. 2022, Table 2 (the published formulas).

"Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023, arXiv:2205.05198) counts
the bytes one layer keeps for its backward, activations in 16 bits and dropout masks in 1 byte, for a
sequence of ``s`` tokens, micro-batch ``b``, hidden size ``h``, ``a`` attention heads, tp degree ``t``:

    no parallelism                          s·b·h·(34 + 5·a·s/h)
    tensor parallel                         s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel              s·b·h·(34/t + 5·a·s/(h·t))
    tensor parallel + selective recompute   s·b·h·(10 + 24/t)
    tensor + sequence + selective recompute s·b·h·34/t
    full recompute                          s·b·h·2            (the layer's input only)

Where the 34 comes from: 11·sbh in attention (Q, K, V input 2, the QKᵀ operands 4, V 2, the
projection input 2, its dropout mask 1), 19·sbh in the MLP (input 2, the 4h activations 8 + 8, the
dropout mask 1), 4·sbh in the two layer norms; 5·a·s² · b in attention (softmax 2, its dropout mask
1, the dropout output 2). Without sequence parallelism the 10 outside the tp regions (the norms, the
dropouts, the attention and MLP inputs) stays whole on every rank; sequence parallelism splits it
over t along the sequence.

This is the reference the planner's own count is compared against (the planner prices the storages
the traced ops keep, ``plan_splits_costs``); nothing here plans.
"""
from __future__ import annotations

from xirang.ir.errors import InvalidValue

LAYOUTS = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")


def layer_activation_bytes(layout: str, *, s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """Bytes one layer keeps for its backward under ``layout`` (one of ``LAYOUTS``), by Table 2."""
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(f"layer_activation_bytes: {name} must be a positive int, got {value!r}")
    sbh, attention = s * b * h, 5 * a * s / h  # attention: the a·s² terms per s·b·h
    formulas = {
        "none": sbh * (34 + attention),
        "tp": sbh * (10 + 24 / t + attention / t),
        "tp+sp": sbh * (34 / t + attention / t),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": sbh * 2,
    }
    if layout not in formulas:
        raise InvalidValue(f"layer_activation_bytes: unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return formulas[layout]
