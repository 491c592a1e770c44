"""Lowering pass ``place_random_streams``: every op that draws random numbers draws on a stream the
runtime owns, chosen from the op's layout.

Which ops: every aten op torch tags ``nondeterministic_seeded`` (dropout, native_dropout,
bernoulli, rand, randn, rand_like, randint, normal, uniform, multinomial, scaled dot-product
attention ...), unless its constant arguments say it draws nothing this time (``p`` or
``dropout_p`` 0, ``train`` / ``training`` False). As torch.export traces them: ``nn.Dropout`` is
``aten.dropout(x, p, True)``; attention dropout is ``aten.scaled_dot_product_attention(..., p)``
(HF GPT-2, the in-repo GPT with sdpa) or an ``aten.dropout`` of the probabilities (the in-repo GPT
with eager attention).

Which stream, from the op's ``LAYOUT`` (the tp placement of what it draws): replicated over tp ->
"tp-shared", one stream for the tp group, so every tp rank draws the same mask for the same
activation; tp-sharded -> "tp-rank", a stream per tp rank. What attention draws is its scores
(batch, heads, queries, keys), split as its output is (by batch or heads). A Partial draw is
refused: each rank would hold a different part of a value whose mask must be one. dp ranks and
micro-batches always get distinct streams (the runtime's ``RngContext``); each op runs in one
pipeline stage, so stages differ by the op's index.

The op is rewritten in place (its name, meta and users kept) into a call of
codegen/ops/random_ops.py (``dropout``, ``native_dropout``, ``attention`` or ``draw``) given the
program's ``rng`` attribute (a get_attr, attached by the runtime like ``tp_group``) and the op's
``RandomSite``: its index among the graph's random ops in graph order (which is the order the
model calls them, so an eager reference can number its calls the same way), its stream, its tp
slice, and the full shape of its draw at the global batch, with the dim holding the batch, for
exact replay (``rng="exact"``). Exact replay needs the draw to depend on shapes only, or to be
the same on every rank and micro-batch; where it is not, ``exact`` says why (the runtime refuses
exact mode for such a program, naming the op).
"""
from __future__ import annotations


import sympy
import torch
from torch.fx import Node

from xirang.ir.errors import PlanError
from xirang.ir.facts import RandomSite, TensorInfo, evaluate
from xirang.ir.meta_keys import LAYOUT, RANDOM, RANDOM_SITES, SYMBOLS, TENSOR, TORCH_SYMBOLS, symbol
from xirang.ir.pass_spec import compiler_pass
from xirang.ir.placement import PlanReplicate, PlanShard
from xirang.passes.analysis.tensors import SizeConverter
from xirang.passes.lowering.precision import unified_from

from xirang.codegen.ops import random_ops
from xirang.codegen.ops.collectives import UNATTACHED

aten = torch.ops.aten
DROPOUTS = {aten.dropout: random_ops.dropout, aten.native_dropout: random_ops.native_dropout}
ATTENTION = aten.scaled_dot_product_attention
# draws whose values depend on the shape of their one tensor input, not on its values (bernoulli
# only with a scalar p: bernoulli(x) draws with probabilities x)
SHAPED = {aten.rand_like, aten.randn_like, aten.randint_like, aten.uniform, aten.uniform_, aten.normal_,
          aten.exponential, aten.exponential_, aten.random, aten.random_, aten.cauchy, aten.cauchy_,
          aten.log_normal, aten.log_normal_, aten.geometric, aten.geometric_}
SCALAR_P = {aten.bernoulli, aten.bernoulli_}
_NOTHING_DRAWN = {"p": 0, "dropout_p": 0, "train": False, "training": False}


def _argument(node: Node, name: str, default=None):
    """The value ``node`` passes for its op's argument ``name``: given by position or keyword, else the
    schema's default (an sdpa traced without ``dropout_p`` draws nothing), else ``default``."""
    arguments = node.target._schema.arguments
    names = [a.name for a in arguments]
    if name in node.kwargs:
        return node.kwargs[name]
    position = names.index(name) if name in names else len(node.args)
    if position < len(node.args):
        return node.args[position]
    schema = next((a for a in arguments if a.name == name), None)
    return schema.default_value if schema is not None and schema.has_default_value() else default


def draws_random(node: Node) -> bool:
    """``node`` is an aten op torch tags as drawing random numbers, and its constant arguments do
    not switch the draw off."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = {a.name for a in target._schema.arguments}
    for name, off in _NOTHING_DRAWN.items():
        if name in names:
            value = _argument(node, name)
            if value is not None and not isinstance(value, Node) and value == off:
                return False
    return True


def _kind(node: Node) -> str:
    packet = node.target.overloadpacket
    if packet in DROPOUTS:
        return "dropout"
    if packet is ATTENTION:
        return "attention"
    arguments = node.target._schema.arguments
    if any(a.name == "size" for a in arguments):
        return "factory"
    tensors = [a.name for a in arguments if isinstance(a.type, torch.TensorType)]
    scalar_p = packet in SCALAR_P and any(a.name == "p" and isinstance(a.type, torch.FloatType) for a in arguments)
    return "shaped" if (packet in SHAPED or scalar_p) and tensors == ["self"] else "valued"


def _tensor_of(value) -> object:
    return value[0] if isinstance(value, (tuple, list)) else value


class _Sites:
    """Builds the RandomSite of each random node of one rank's program."""

    def __init__(self, gm, ctx):
        self.plan, self.tp, self.tp_rank = ctx.plan, ctx.plan.mesh.tp, ctx.coords["tp"]
        self.symbols = {**SYMBOLS.get(gm, {}), "batch": ctx.plan.global_batch}
        self.batch_symbolic = "batch" in SYMBOLS.get(gm, {})
        self.sizes = SizeConverter(TORCH_SYMBOLS.get(gm, {}))

    def site(self, node: Node, index: int) -> RandomSite:
        kind = _kind(node)
        placement = self._placement(node, kind)
        shape = self._full_shape(node, kind)
        batch_dim, rows, why = self._batch(shape)
        shard = ()
        if isinstance(placement, PlanShard) and self.tp > 1:
            shard = (placement.dim, placement.chunks, self.tp_rank, self.tp)
        if not why and kind == "valued" and (batch_dim >= 0 or shard):
            why = ("its draws depend on its input values, which this rank holds only a piece of "
                   f"({'the batch' if batch_dim >= 0 else 'a tp shard'})")
        values = tuple(evaluate(size, self.symbols) for size in shape)
        return RandomSite(index=index, kind=kind, stream="tp-rank" if shard else "tp-shared", shape=values,
                          batch_dim=batch_dim, rows_per_sample=rows, shard=shard, exact=why, node=node.name,
                          op=str(node.target))

    def _placement(self, node: Node, kind: str):
        strategy = LAYOUT.get(node, None)
        placement = strategy.outputs[0].tp if strategy is not None and strategy.outputs else PlanReplicate()
        if not isinstance(placement, (PlanShard, PlanReplicate)):
            raise PlanError(f"{node.name} ({node.target}) draws random numbers into a {placement} value: each tp "
                            f"rank would hold a part of a value whose random draw must be one",
                            where=f"plan.placements[{node.name!r}]",
                            hint="re-plan, or edit the plan to keep this op replicated or sharded")
        if kind == "attention" and isinstance(placement, PlanShard) and placement.dim >= len(_tensor_of(
                node.meta["val"]).shape) - 1:
            return PlanReplicate()  # split by value columns: every rank draws the whole scores
        return placement

    def _full_shape(self, node: Node, kind: str) -> tuple:
        out = self.sizes.tensor_info(_tensor_of(node.meta["val"])).shape
        if kind != "attention":
            return tuple(out)
        key = unified_from(node.args[1])  # its sequence dim is never split (sharding_rules._attention)
        info = TENSOR.get(key, None)
        source = info.shape[-2] if isinstance(info, TensorInfo) else \
            self.sizes.size(_tensor_of(key.meta["val"]).shape[-2])
        return tuple(out[:-1]) + (source,)

    def _batch(self, shape: tuple) -> tuple[int, int, str]:
        """(dim holding the batch or -1, its elements per sample, why exact replay cannot slice it)."""
        if not self.batch_symbolic:
            return -1, 1, "the trace fixed the batch size, so the one-device draw's shape is unknown"
        batch = symbol("batch")
        dims = [d for d, size in enumerate(shape) if batch in sympy.sympify(size).free_symbols]
        if not dims:
            return -1, 1, ""
        per_sample = sympy.simplify(sympy.sympify(shape[dims[0]]) / batch)
        if len(dims) > 1 or batch in per_sample.free_symbols:
            return -1, 1, f"its draw of shape {shape} holds the batch in a way the runtime cannot slice"
        return dims[0], evaluate(per_sample, self.symbols), ""


@compiler_pass(requires=(LAYOUT, TENSOR), provides=(RANDOM, RANDOM_SITES))
def place_random_streams(gm, ctx):
    """Rewrite every op that draws random numbers into a draw on its runtime-owned stream."""
    nodes = [node for node in gm.graph.nodes if draws_random(node)]
    RANDOM_SITES.set(gm, ())
    if not nodes:
        return gm
    gm.rng = UNATTACHED  # this process's RngContext is attached by the runtime
    first = next(node for node in gm.graph.nodes if node.op != "placeholder")
    with gm.graph.inserting_before(first):
        rng = gm.graph.create_node("get_attr", "rng")  # not a module, parameter or buffer: no get_attr check
    sites, builder = [], _Sites(gm, ctx)
    for index, node in enumerate(nodes):
        site = builder.site(node, index)
        RANDOM.set(node, site)
        sites.append(site)
        packet = node.target.overloadpacket
        if site.kind in ("dropout", "attention"):
            function = DROPOUTS.get(packet, random_ops.attention)
            node.args = (rng, site) + tuple(node.args)
        else:
            function = random_ops.draw
            node.args = (rng, site, node.target) + tuple(node.args)
        node.target = function
    RANDOM_SITES.set(gm, tuple(sites))
    gm.recompile()
    return gm
