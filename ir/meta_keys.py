"""Every key a pass may read or write, declared once with the type of its value.

node.meta (and gm.meta for graph-level facts) is the only channel between passes. A key is a small
typed handle: passes call ``SHAPE.get(node)`` / ``SHAPE.set(node, value)`` rather than indexing the
dict with strings, so a typo is an AttributeError at import time and a wrong type is caught by the
pass manager's lint after every pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import sympy

from xirang.ir.facts import BlockInfo, ByteCount, FlopCount, ParamShard, RandomSite, SourceLocation, TensorInfo
from xirang.ir.plan_parts import NodeStrategy

T = TypeVar("T")


@dataclass(frozen=True)
class MetaKey(Generic[T]):
    """A declared entry of ``node.meta`` (scope "node") or ``gm.meta`` (scope "graph")."""

    name: str
    value_type: type | tuple[type, ...]
    doc: str
    scope: str = "node"
    owner: str = "xirang"  # "torch" for keys torch.export writes itself
    # True for node facts only some nodes can have (a parameter's name, a source line): the pass manager
    # then does not insist that a pass providing the key set it on at least one node.
    sparse: bool = False

    def _table(self, holder) -> dict:
        return holder.meta

    def has(self, holder) -> bool:
        return self.name in self._table(holder)

    def get(self, holder, default: Any = ...) -> T:
        table = self._table(holder)
        if default is ...:
            return table[self.name]
        return table.get(self.name, default)

    def set(self, holder, value: T) -> None:
        self._table(holder)[self.name] = value

    def check(self, value: Any) -> bool:
        return isinstance(value, self.value_type)


# --- written by torch.export itself (declared so passes can require them) -----------------------
VAL = MetaKey("val", object, "fake tensor (or SymInt / tuple of them) the node produces", owner="torch")
NN_MODULE_STACK = MetaKey("nn_module_stack", dict, "module path -> (fqn, class) of enclosing modules",
                          owner="torch")

# --- node facts written by Xirang passes ------------------------------------------------------
ROLE = MetaKey("xr_role", str,
               "what a node is: 'parameter', 'buffer', 'constant', 'input', 'activation', 'output'")
PARAM_NAME = MetaKey("xr_param_name", str,
                     "fully qualified name of the parameter/buffer a placeholder binds (first alias)", sparse=True)
PARAM_ALIASES = MetaKey("xr_param_aliases", tuple, "every FQN bound to this tensor (tied weights)", sparse=True)
CONSTANT_VALUE = MetaKey("xr_constant_value", object, "the tensor a constant placeholder binds: made inside forward "
                         "(torch.tensor(...), an index list), so the model does not hold it", sparse=True)
MODULE_PATH = MetaKey("xr_module_path", str, "fully qualified name of the innermost module ('' = root)")
MODULE_TYPE = MetaKey("xr_module_type", str, "class name of the innermost module")
SOURCE = MetaKey("xr_source", SourceLocation, "user source line that produced the node", sparse=True)
TENSOR = MetaKey("xr_tensor", (TensorInfo, tuple),
                 "shape (sympy, in batch/seq symbols), dtype and size of the output; tuple for multi-output")
REQUIRES_GRAD = MetaKey("xr_requires_grad", bool, "output depends differentiably on a trainable parameter")
PARAM_COUNT = MetaKey("xr_param_count", int, "elements of the parameter this placeholder binds", sparse=True)
FLOPS = MetaKey("xr_flops", FlopCount, "forward and backward floating-point operations")
BYTES = MetaKey("xr_bytes", ByteCount, "bytes read, written, and saved for backward")
BLOCK = MetaKey("xr_block", BlockInfo, "repeated block the node belongs to (None outside blocks)")
UNIT = MetaKey("xr_unit", str, "node of the condensed block graph holding this node: 'block:<path>' or "
               "'segment:<k>' (ops between blocks); a placeholder belongs to its first reader's unit")

# --- node facts written by the lowering passes (one rank's program) ------------------------------
LAYOUT = MetaKey("xr_layout", NodeStrategy, "the plan's sharding rule for the node: tp layout of each tensor "
                 "input and output (plan.placements, stamped on by apply_plan)")
RUN_DTYPE = MetaKey("xr_run_dtype", str, "dtype the node's tensor has at run time under the plan's precision "
                    "(differs from TENSOR's traced dtype in half precision)", sparse=True)
PARAM_SHARD = MetaKey("xr_param_shard", ParamShard, "how this rank holds the state a placeholder binds", sparse=True)
INSERTED = MetaKey("xr_inserted", str, "why a lowering pass inserted the node (a resharding collective, a "
                   "precision cast); absent on nodes of the traced graph", sparse=True)
STAGE = MetaKey("xr_stage", int, "pipeline stage (index into plan.stages) the node runs in")
RANDOM = MetaKey("xr_random", RandomSite, "how an op that draws random numbers draws in this rank's program: its "
                 "index, stream (shared by the tp group or per tp rank) and exact-replay shape "
                 "(passes/lowering/random_streams.py)", sparse=True)
RECOMPUTE = MetaKey("xr_recompute", str, "recompute region of the node under plan.recompute: 'full:<unit>' (a "
                   "whole block) or 'selective:<unit>' (its attention core); the region keeps only its inputs and "
                   "runs again in the backward (passes/lowering/recompute.py)", sparse=True)
OFFLOAD = MetaKey("xr_offload", str, "block (its unit) whose saved activations go to host memory after its forward "
                  "and come back, prefetched, before its backward (plan.offload; passes/lowering/offload.py)",
                  sparse=True)

# --- graph facts (gm.meta) --------------------------------------------------------------------
SYMBOLS = MetaKey("xr_symbols", dict, "symbol name -> value at the example inputs (e.g. batch, seq)",
                  scope="graph")
TORCH_SYMBOLS = MetaKey("xr_torch_symbols", dict, "torch shape symbol (e.g. 's72') -> Xirang symbol name",
                        scope="graph")
SYMBOL_DIMS = MetaKey("xr_symbol_dims", dict, "input name -> {tensor dim: symbol name}", scope="graph")
TRACE_INFO = MetaKey("xr_trace", dict, "how the graph was traced: method, fallbacks, folded repeats",
                     scope="graph")
MODULE_PARAMS = MetaKey("xr_module_params", dict, "module FQN -> parameter elements beneath it ('' = model)",
                        scope="graph")
DEPENDENCIES = MetaKey("xr_dependencies", object, "networkx.DiGraph of node names (data dependencies)",
                       scope="graph")
BLOCK_GRAPH = MetaKey("xr_block_graph", object,
                      "networkx.DiGraph condensed to blocks and the segments between them", scope="graph")
UNPRICED_OPS = MetaKey("xr_unpriced_ops", tuple, "ops with no FLOP rule (counted as 0 FLOPs)", scope="graph")
BLOCK_KINDS = MetaKey("xr_block_kinds", dict, "structural hash -> list of block paths of that kind",
                      scope="graph")

RANDOM_SITES = MetaKey("xr_random_sites", tuple, "every RandomSite of the rank's program, in index order "
                       "(empty when the model draws no random numbers)", scope="graph")
STAGE_MODULES = MetaKey("xr_stage_modules", tuple, "the rank's program cut into its pipeline stages: one "
                        "StageModule per plan stage (passes/lowering/split_stages.py)", scope="graph")

NODE_KEYS = tuple(k for k in globals().values() if isinstance(k, MetaKey) and k.scope == "node")
GRAPH_KEYS = tuple(k for k in globals().values() if isinstance(k, MetaKey) and k.scope == "graph")
KEYS_BY_NAME = {k.name: k for k in NODE_KEYS + GRAPH_KEYS}


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol Xirang uses for a dynamic dimension ('batch', 'seq')."""
    return sympy.Symbol(name, integer=True, positive=True)
