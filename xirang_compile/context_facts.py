"""What the planner needs to know to offer context parallelism for a traced model (``ContextFacts``).

The facts come from the lowering itself, so the planner offers cp > 1 exactly where it would run:

- the attention calls: every ``aten.scaled_dot_product_attention`` with its unit, query heads, key/value
  heads (before a Hugging Face ``repeat_kv``: what the ring passes) and head dim, read off the shapes
  ``split_sequence`` rewrites at a trial cp of 2, and whether it takes a key padding mask;
- why cp would be refused (``refusal``): ``split_sequence`` (passes/lowering/context_parallel.py) run on a
  copy of the graph at cp = 2, its ``PassFailure`` (a mask other than causal, sliding-window and key
  padding, attention dropout, a fused variant, a slice that mixes chunks) in words; random ops, which the
  runtime refuses beside cp (codegen/emit.py ``check_context_parallel_program``), found by the lowering's
  own ``draws_random``;
- tied weights (a parameter bound to several names), which the runtime refuses beside cp across
  pipeline ranks: the search then offers cp > 1 at pp = 1 only.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from xirang.codegen.ops.context_attention_sequence import ring_attention_call
from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import PARAM_ALIASES, SYMBOLS, TENSOR, UNIT
from xirang.ir.mesh import Mesh
from xirang.passes.lowering.apply_plan import copy_graph_module
from xirang.passes.lowering.context_parallel import split_sequence
from xirang.passes.lowering.random_streams import draws_random
from xirang.passes.planning.context_parallel_cost import AttentionCall, ContextFacts

SDPA = torch.ops.aten.scaled_dot_product_attention.default
TRIAL_CP = 2  # the degree split_sequence is tried at: every refusal it makes holds at any cp > 1
PADDING_ARG = 8  # ring_attention_call's argument after q, k, v, group, counter, causal, window, scale


def context_facts(gm) -> ContextFacts:
    """The ``ContextFacts`` of a traced, analysed graph (module docstring); ``gm`` is not changed."""
    tied = any(len(PARAM_ALIASES.get(n, ()) or ()) > 1 for n in gm.graph.nodes if n.op == "placeholder")
    attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]
    if not attention:
        return ContextFacts(tied_weights=tied)
    random = sorted({str(n.target) for n in gm.graph.nodes if draws_random(n)})
    if random:
        return ContextFacts(refusal=f"context parallelism does not run beside random ops ({', '.join(random[:3])}): "
                                    f"their draws are not split by sequence chunk", tied_weights=tied)
    seq = SYMBOLS.get(gm, {}).get("seq")
    if seq is None or seq % (2 * TRIAL_CP):
        return ContextFacts(refusal=f"the traced sequence ({seq} tokens) is not a multiple of {2 * TRIAL_CP}, the "
                                    f"fewest load-balanced chunks cp = {TRIAL_CP} cuts it into", tied_weights=tied)
    trial = copy_graph_module(gm)  # the graph copied, the parameters shared (the lowering's first step)
    # metadata checks only (a meta trace of HF's masks keeps a packed-sequence test feeding one): the ops
    # only they read decide nothing the lowering would refuse
    for node in [n for n in trial.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]:
        trial.graph.erase_node(node)
    trial.graph.eliminate_dead_code()
    plan = SimpleNamespace(mesh=Mesh(dp=1, pp=1, tp=1, cp=TRIAL_CP), collectives=())
    try:
        split_sequence(trial, SimpleNamespace(plan=plan))
    except XirangError as error:
        return ContextFacts(refusal=f"{error.what} ({error.where})", tied_weights=tied)
    calls = [n for n in trial.graph.nodes if n.op == "call_function" and n.target is ring_attention_call]
    found = []
    for call in calls:  # copies of the graph's nodes, their meta with them
        q, k = (TENSOR.get(arg).shape for arg in call.args[:2])
        found.append(AttentionCall(unit=UNIT.get(call, None) or "", q_heads=int(str(q[1])), kv_heads=int(str(k[1])),
                                   head_dim=int(str(q[-1])), padding=len(call.args) > PADDING_ARG))
    return ContextFacts(calls=tuple(found), tied_weights=tied)
