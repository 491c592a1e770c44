"""Context parallelism's cut of the inputs: each cp rank takes its two chunks of every input's sequence dim.

The runtime cuts the batch into this dp rank's share and its micro-batches (compiled_model.py); under cp > 1
every micro-batch's input with a dim the program names ``seq`` (``Program.batch_dims``) is then cut into
2·cp equal chunks, and this rank keeps chunks r and 2·cp−1−r (``shard_sequence``, the load-balanced layout
of codegen/ops/context_attention_layout.py), which is what the program built by
passes/lowering/context_parallel.py is sized for. An input without a seq dim is passed whole. The labels
are cut like the ids: the program shifts them across the chunks itself (``shift_sequence_left``).
"""
from __future__ import annotations

from xirang.codegen.ops.context_attention_layout import shard_sequence


def sequence_dims(batch_dims: dict) -> dict:
    """Input name -> its seq dim, for the inputs that have one."""
    return {name: dim for name, dims in batch_dims.items() for dim, symbol in dims.items() if symbol == "seq"}


def cut_sequences(micro_batches: list, batch_dims: dict, group) -> list:
    """Each micro-batch with its inputs' seq dims cut to this cp rank's chunks (module docstring)."""
    dims = sequence_dims(batch_dims)
    return [{name: shard_sequence(value, dims[name], group) if name in dims else value
             for name, value in micro_batch.items()} for micro_batch in micro_batches]
