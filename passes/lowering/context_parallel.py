"""Lowering pass ``split_sequence``: under context parallelism (mesh cp > 1) each rank of a cp group runs
the model on its slice of every sequence, and attention reads the whole sequence by ring or all-to-all.

The runtime gives each rank its two chunks of every input's ``seq`` dim (the load-balanced layout of
codegen/ops/context_attention_layout.py: 2·cp chunks, rank r holding r and 2·cp−1−r;
codegen/runtime/data/sequence_cut.py), and this pass makes the program right for that slice:

- sizes: the graph's ``seq`` symbol is set to seq / cp, so every op outside attention (embeddings, norms,
  MLPs, the LM head, what crosses a pipeline cut) is built for the local tokens;
- attention: each ``aten.scaled_dot_product_attention`` becomes ``ring_attention_call`` (default),
  ``ulysses_attention_call`` or ``usp_attention_call``, as the plan's method says (ir/context_method.py,
  ``with_context_method``), with its mask as global positions: ``is_causal`` is causal (causal_masks.py
  folded proved-causal masks already), a mask the model builds from sizes alone is evaluated here and taken
  when it is a causal sliding window (Mistral), and no mask is bidirectional. A mask that reads an input
  (Hugging Face's ``attention_mask``) is taken where evaluation proves it the causal (or sliding-window)
  mask & keep[b, j]: on probe padding patterns P the subgraph gives base & P[b, j] != 0, base its value at
  no padding (``_padding_mask``; a mask that also hides padded queries, or reads the input otherwise, is
  refused); the call then reads that input, whose chunks the runtime cuts like the ids, and gathers its bits
  over cp (``key_keep``); rows that see no key (left padding) get output 0, as SDPA gives them. A Hugging
  Face ``repeat_kv`` (expand and reshape of the kv heads) is looked through, so the ring passes the kv heads
  only. Any other mask, dropout inside attention, or a fused variant is refused;
- positions: an ``arange`` of seq elements (HF's ``cache_position`` / ``position_ids``, learned position
  ids) becomes ``sequence_arange``: the global positions of this rank's tokens;
- the label shift: ``pad(labels, (0, 1), value)`` sliced from 1 on the sequence dim (HF's
  ``ForCausalLMLoss``) becomes ``shift_sequence_left``, which takes the next chunk's first label from the
  rank holding it; any other slice or pad along the sequence would mix chunks and is refused;
- the loss: the cross-entropy mean (aten's, or the vocabulary-parallel one under tp) becomes a sum over
  this rank's tokens followed by ``token_mean``, the mean over the whole sequence's tokens on every cp
  rank (its gradient this rank's share: the runtime sums gradients over dp x cp and divides by dp).

What runs beside cp and what is refused: codegen/emit.py ``check_context_parallel``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import sympy
import torch
from torch.fx import Node
from torch.fx.node import map_arg

from xirang.codegen.ops.collectives import UNATTACHED
from xirang.codegen.ops.context_attention_layout import chunk_length
from xirang.codegen.ops.context_attention_sequence import (ring_attention_call, sequence_arange,
                                                           shift_sequence_left, token_mean, ulysses_attention_call,
                                                           usp_attention_call)
from xirang.codegen.ops.context_attention_ulysses import kv_head_repeats
from xirang.codegen.ops.vocab_parallel import vocab_parallel_cross_entropy
from xirang.ir.context_method import a2a_degree, is_method_choice, method_choice, recorded_method, usp_a2a
from xirang.ir.errors import PassFailure, XirangError
from xirang.ir.meta_keys import REQUIRES_GRAD, SOURCE, SYMBOLS, TENSOR, TORCH_SYMBOLS, symbol
from xirang.ir.pass_spec import compiler_pass
from xirang.passes.lowering.inserted import place_inserted
from xirang.passes.lowering.precision import unified_from

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CROSS_ENTROPY = aten.cross_entropy_loss.default
CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
FULL_SLICE = 2 ** 62  # a slice's end of sys.maxsize: to the end
MEAN, SUM = 1, 2  # torch's reduction enum, as aten.cross_entropy_loss takes it
GROUP_ATTRS = ("cp_group", "cp_a2a_group", "cp_ring_group", "comm_counter")  # what the runtime attaches


def with_context_method(plan, method: str):
    """``plan`` with its context-parallel attention run by ``method`` ("ring", the default, "all_to_all" or
    "usp:A"): recorded as a collective choice on the cp axis (ir/context_method.py ``method_choice``),
    so plans keep their schema; a method the plan's cp cannot run is refused."""
    try:
        if plan.mesh.cp > 1:
            a2a_degree(method, plan.mesh.cp)  # refuses a split this cp cannot run
        else:
            usp_a2a(method)  # refuses a misspelt method
    except XirangError as error:
        raise XirangError(error.what, where="with_context_method", hint=error.hint) from None
    kept = tuple(c for c in plan.collectives if not is_method_choice(c))
    return replace(plan, collectives=kept + (method_choice(method),))


def context_method(plan) -> str:
    """The method the plan's collectives record ("ring" where none does)."""
    return recorded_method(plan.collectives)


def _where(node: Node) -> str:
    source = SOURCE.get(node, None)
    return f"node {node.name} ({getattr(node.target, '__name__', node.target)})" + (f", {source}" if source else "")


def _refuse(node: Node, what: str, hint: str):
    raise PassFailure(f"context parallelism: {what}", where=_where(node), hint=hint)


def _is_seq(size) -> bool:
    return sympy.sympify(size) == symbol("seq")


def _has_seq(size) -> bool:
    return symbol("seq") in sympy.sympify(size).free_symbols


def _shape(node) -> Optional[tuple]:
    # a bf16/fp16 program reads the attention's mixed inputs through a dtype unification with no shape facts
    info = TENSOR.get(unified_from(node), None) if isinstance(node, Node) else None
    return tuple(info.shape) if info is not None and hasattr(info, "shape") else None


# --- attention masks ---------------------------------------------------------------------------------

def _ancestors(node: Node, found: Optional[set] = None) -> set:
    """``node`` and every node it reads, directly or not, added to ``found`` (returned); a node already in
    ``found`` is not walked again, its ancestors being there too."""
    found = set() if found is None else found
    todo = [node]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo.extend(current.all_input_nodes)
    return found


def _evaluate(mask: Node, sizes: dict, given: Optional[dict] = None) -> torch.Tensor:
    """The mask's value on the CPU with the graph's size symbols at ``sizes`` (Xirang names) and the input
    placeholders in ``given`` (node -> tensor) at those values; raises ``LookupError(node)`` where it reads a
    tensor it does not make and is not given (an input's values: a padding mask)."""
    values: dict = dict(given or {})

    def value_of(node: Node):
        if node in values:
            return values[node]
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = val.node.expr
            result = int(expr.xreplace({s: sympy.Integer(sizes[s.name]) for s in expr.free_symbols}))
        elif node.op != "call_function":
            raise LookupError(node)
        else:
            def on_cpu(value):
                return torch.device("cpu") if isinstance(value, torch.device) else value
            args = tuple(on_cpu(v) for v in map_arg(node.args, value_of))
            kwargs = {k: on_cpu(v) for k, v in map_arg(node.kwargs, value_of).items()}
            result = node.target(*args, **kwargs)
        values[node] = result
        return result
    return value_of(mask)


def _allowed(value: torch.Tensor) -> Optional[torch.Tensor]:
    """A mask as bool, True where a key is seen: a boolean mask itself, an additive one where it is 0 (its
    blocked entries at the dtype's lowest value, or -inf); None for an additive mask of other values."""
    if value.dtype == torch.bool:
        return value
    if not bool(((value == 0) | (value <= torch.finfo(value.dtype).min)).all()):
        return None
    return value == 0


def _window_of(value: torch.Tensor) -> Optional[tuple]:
    """(causal, window) when ``value`` (boolean, or additive with the dtype's lowest value as blocked) is a
    causal mask, windowed or not, the same over batch and heads; None for anything else."""
    allowed = _allowed(value)
    if allowed is None or allowed.dim() < 2 or allowed.shape[-1] != allowed.shape[-2]:
        return None
    flat = allowed.reshape(-1, *allowed.shape[-2:])
    if not bool((flat == flat[:1]).all()):
        return None
    n = allowed.shape[-1]
    window = int(flat[0, n - 1].sum())
    positions = torch.arange(n)
    diff = positions[:, None] - positions[None, :]
    want = (diff >= 0) & (diff < window)
    if not bool((flat[0] == want).all()):
        return None
    return True, (None if window >= n else window)


def _probes(batch: int, length: int, dtype) -> list:
    """Padding patterns (batch, length) of 0/1 a key padding mask is checked on: every sample left-padded by
    a different count, right-padded alike, and seeded random bits (a pattern no construction special-cases)."""
    rows = torch.arange(length)[None, :]
    counts = (torch.arange(batch)[:, None] * 3 + 1) % length
    random = torch.rand(batch, length, generator=torch.Generator().manual_seed(length)) < 0.6
    return [(rows >= counts).to(dtype), (rows < length - counts).to(dtype), random.to(dtype)]


def _padding_mask(node: Node, mask: Node, padding: Node, sizes: dict, shape: tuple, torch_names: dict) -> tuple:
    """(causal, window) of a mask that reads the input ``padding``, proved by evaluation to be the causal (or
    sliding-window) mask and the key padding mask: on every probe pattern P (``_probes``) the mask equals
    base & P[b, j] != 0 broadcast over heads and queries, where base is the mask at P all ones and is itself
    causal, windowed or not (``_window_of``); ``shape`` is (batch, seq) at ``sizes``. Hugging Face's
    ``sdpa_mask`` (causal_mask_function and padding_mask_function) is such a mask; one that reads the padding
    by query as well is refused. Probes, not a symbolic proof: three patterns per length, at two lengths, each
    with every sample padded differently, which a mask of another form would have to match by accident."""
    val = padding.meta.get("val")
    names = [torch_names.get(str(size)) for size in getattr(val, "shape", ())]
    if names != ["batch", "seq"]:
        _refuse(node, f"the attention mask reads the input {padding.name} of shape {tuple(getattr(val, 'shape', ()))}"
                      f", not a (batch, seq) padding mask", "plan with cp=1 for this model")
    try:
        base = _evaluate(mask, sizes, {padding: torch.ones(shape, dtype=val.dtype)})
        found = _window_of(base) if isinstance(base, torch.Tensor) else None
        if found is None:
            _refuse(node, "the attention mask at no padding is neither causal nor a causal sliding window",
                    "plan with cp=1 for this model")
        for probe in _probes(*shape, val.dtype):
            allowed = _allowed(_evaluate(mask, sizes, {padding: probe}))
            want = _allowed(base) & (probe != 0)[:, None, None, :]
            if allowed is None or allowed.shape != want.shape or not bool((allowed == want).all()):
                _refuse(node, f"the attention mask reads the input {padding.name} other than as a key padding "
                              f"mask (causal & {padding.name}[b, j] != 0)", "plan with cp=1 for this model")
    except LookupError as error:
        _refuse(node, f"the attention mask reads the values of {error.args[0].name} besides {padding.name}",
                "plan with cp=1 for this model")
    return found


def attention_mask(node: Node, mask, causal: bool, gm) -> tuple:
    """(causal, window, padding) of an SDPA call's mask (module docstring), ``padding`` the input placeholder
    of a key padding mask (None: none), or refused naming the call."""
    if mask is None:
        return causal, None, None
    if causal:
        _refuse(node, "attention with both a mask and is_causal", "report this model")
    torch_names = TORCH_SYMBOLS.get(gm, {})
    integers = [abs(a) for n in _ancestors(mask) if n.op == "call_function"
                for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)
                and abs(a) < FULL_SLICE]
    base = max(integers, default=0) + 1
    found, padding = set(), None
    for batch, length in ((2, base + 3), (3, base + 11)):  # past every window the subgraph holds, twice
        sizes = {name: batch if torch_names.get(name) == "batch" else length for name in torch_names}
        try:
            value = _evaluate(mask, sizes)
        except LookupError as error:
            padding = error.args[0]
            found.add(_padding_mask(node, mask, padding, sizes, (batch, length), torch_names))
            continue
        except Exception as error:  # noqa: BLE001 - an op that will not run eagerly: say so
            _refuse(node, f"the attention mask could not be evaluated to read its shape ({error})",
                    "plan with cp=1, or report this model")
        shape = _window_of(value) if isinstance(value, torch.Tensor) else None
        if shape is None:
            _refuse(node, "the attention mask is neither causal nor a causal sliding window",
                    "plan with cp=1 for this model")
        found.add(shape)
    if len(found) != 1:
        _refuse(node, f"the attention mask changes with the sequence length ({sorted(map(str, found))})",
                "plan with cp=1 for this model")
    return (*found.pop(), padding)


def _kv_source(node: Node, q_heads: int):
    """The (B, Hkv, S, d) tensor a Hugging Face ``repeat_kv`` (unsqueeze 2, expand, reshape) read, else
    ``node`` itself: the ring passes kv heads, not their repeats."""
    if not (isinstance(node, Node) and node.target in (aten.reshape.default, aten.view.default)):
        return node
    expanded = node.args[0]
    if not (isinstance(expanded, Node) and expanded.target == aten.expand.default):
        return node
    current, unsqueezed = expanded.args[0], False
    while isinstance(current, Node):
        if current.target == aten.slice.Tensor and tuple(current.args[2:3]) in ((), (0,)) \
                and (len(current.args) < 4 or (isinstance(current.args[3], int) and current.args[3] >= FULL_SLICE)):
            current = current.args[0]  # a whole-dim slice: HF's [:, :, None, :, :] indexing
        elif current.target == aten.unsqueeze.default and current.args[1] == 2 and not unsqueezed:
            unsqueezed, current = True, current.args[0]
        else:
            break
    shape = _shape(current)
    if not unsqueezed or shape is None or len(shape) != 4 or not str(shape[1]).isdigit() \
            or q_heads % int(str(shape[1])):
        return node
    return current


# --- the pass ------------------------------------------------------------------------------------------

def _get_attr(graph, name: str) -> Node:
    """The graph's one read of ``self.<name>`` (a group or the counter the runtime attaches), made before its
    first op."""
    found = next((node for node in graph.nodes if node.op == "get_attr" and node.target == name), None)
    if found is None:
        first = next(node for node in graph.nodes if node.op != "placeholder")
        with graph.inserting_before(first):
            found = graph.create_node("get_attr", name)
    return found


def _get_attrs(graph):
    """The reads of ``self.cp_group`` and ``self.comm_counter``."""
    return _get_attr(graph, "cp_group"), _get_attr(graph, "comm_counter")


def _rewrite_attention(gm, cp: int, method: str) -> set:
    """Every SDPA call as ring or all-to-all attention; returns what to drop where nothing reads it any more
    (``_drop_unread``): the ancestors of each call's mask, keys and values. The rewritten calls no longer read
    the masks or the kv heads' repeats, so those end with no reader; every other ancestor keeps one (it leads
    to a call's inputs), so the set may hold them all, and is walked once however many calls share them."""
    graph, unread = gm.graph, set()
    fused = [n for n in graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)
             and n.target is not SDPA]
    if fused:
        _refuse(fused[0], "a fused attention variant is not rewritten to ring or all-to-all attention",
                "report this model; plan with cp=1 meanwhile")
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is SDPA]:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args), **node.kwargs)
        if given.get("dropout_p", 0.0):
            _refuse(node, f"attention dropout ({given['dropout_p']}) is not run inside ring or all-to-all "
                          f"attention", "set the model's attention dropout to 0, or plan with cp=1")
        causal, window, padding = attention_mask(node, given.get("attn_mask"), bool(given.get("is_causal", False)),
                                                 gm)
        if isinstance(given.get("attn_mask"), Node):
            _ancestors(given["attn_mask"], unread)
        q = given["query"]
        q_heads = int(str(_shape(q)[1]))
        k, v = _kv_source(given["key"], q_heads), _kv_source(given["value"], q_heads)
        if _shape(k)[1] != _shape(v)[1]:
            k, v = given["key"], given["value"]
        a2a = a2a_degree(method, cp)
        if a2a > 1:
            try:
                kv_head_repeats(q_heads, int(str(_shape(k)[1])), a2a)
            except XirangError as error:
                raise PassFailure(f"context parallelism by {method}: {error.what}", where=_where(node),
                                  hint=error.hint) from None
        _ancestors(given["key"], unread)
        _ancestors(given["value"], unread)
        group, counter = _get_attrs(graph)
        mask_args = (causal, window, given.get("scale")) + ((padding,) if padding is not None else ())
        if a2a == 1:
            node.target, node.args = ring_attention_call, (q, k, v, group, counter, *mask_args)
        elif a2a == cp:
            node.target, node.args = ulysses_attention_call, (q, k, v, group, counter, *mask_args)
        else:
            node.target = usp_attention_call
            node.args = (q, k, v, _get_attr(graph, "cp_a2a_group"), _get_attr(graph, "cp_ring_group"), counter,
                         *mask_args) + ((group,) if padding is not None else ())
        node.kwargs = {}
    return unread


def _drop_unread(graph, nodes: set) -> None:
    """Remove ``nodes`` nothing reads any more (and the metadata asserts on them): one pass in reverse order."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function":
            continue
        if node.target == aten._assert_tensor_metadata.default and node.all_input_nodes \
                and all(arg in nodes and len(arg.users) == 1 for arg in node.all_input_nodes):
            graph.erase_node(node)
        elif node in nodes and not node.users:
            graph.erase_node(node)


def _rewrite_positions(gm) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or "arange" not in str(node.target):
            continue
        shape = _shape(node)
        if shape is None or len(shape) != 1 or not _has_seq(shape[0]):
            continue
        if node.target != aten.arange.default or not _is_seq(shape[0]):
            _refuse(node, f"an arange of {shape[0]} elements along the sequence is not read as positions",
                    "make positions with arange(seq) (or pass position_ids), or plan with cp=1")
        group, _ = _get_attrs(graph)
        node.target, node.args = sequence_arange, (node.args[0], 0, group)


def _rewrite_label_shift(gm) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.slice.Tensor:
            continue
        padded = node.args[0]
        if not (isinstance(padded, Node) and padded.target in (aten.pad.default, aten.constant_pad_nd.default)):
            continue
        x, pad = padded.args[0], list(padded.args[1])
        value = padded.args[3] if padded.target == aten.pad.default and len(padded.args) > 3 else \
            padded.kwargs.get("value", padded.args[2] if padded.target == aten.constant_pad_nd.default
                              and len(padded.args) > 2 else 0)
        shape = _shape(x)
        dim = node.args[1] % len(shape) if shape else None
        end = node.args[3] if len(node.args) > 3 else FULL_SLICE
        if shape is None or pad != [0, 1] or dim != len(shape) - 1 or not _is_seq(shape[dim]) \
                or node.args[2] != 1 or end < FULL_SLICE or len(padded.users) != 1:
            continue
        group, counter = _get_attrs(graph)
        node.target, node.args, node.kwargs = shift_sequence_left, (x, dim, value, group, counter), {}
        graph.erase_node(padded)


def _refuse_sequence_mixing(gm) -> None:
    """A slice or pad along the sequence that is left would read the local chunks as if they were the sequence."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        shape = _shape(node.args[0]) if node.args else None
        if shape is None:
            continue
        if node.target == aten.slice.Tensor:
            dim = node.args[1] % len(shape) if len(node.args) > 1 else 0
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else FULL_SLICE
            full = start in (0, None) and (end is None or (isinstance(end, int) and end >= FULL_SLICE))
            if _has_seq(shape[dim]) and not full:
                _refuse(node, f"a slice [{start}:{end}] along the sequence (dim {dim} of {shape}) would cut the "
                              f"local chunks, not the sequence",
                        "shift labels with Hugging Face's pad-and-slice (or outside the model), or plan with cp=1")
        elif node.target in (aten.pad.default, aten.constant_pad_nd.default, aten.cumsum.default,
                             aten.roll.default, aten.flip.default):
            if any(_has_seq(size) for size in shape[-2:]):
                _refuse(node, f"{node.target} along the sequence reads across the local chunks",
                        "plan with cp=1 for this model")


def _rewrite_loss(gm, cp: int) -> None:
    """The loss's cross-entropy made a sum over this rank's tokens, and ``token_mean`` put after it."""
    graph = gm.graph
    output = next(node for node in graph.nodes if node.op == "output")
    loss = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    node = loss
    while isinstance(node, Node) and node.target in CASTS:
        node = node.args[0]
    if isinstance(node, Node) and node.target == CROSS_ENTROPY:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        given = {"weight": None, "reduction": MEAN, "ignore_index": -100, "label_smoothing": 0.0,
                 **dict(zip(names, node.args)), **node.kwargs}
        if given["weight"] is not None or given["reduction"] != MEAN:
            _refuse(node, "a weighted or non-mean cross-entropy", "use the mean over tokens, or plan with cp=1")
        node.args, node.kwargs = tuple(given[name] for name in names[:3]) + (SUM,) + tuple(
            given[name] for name in names[4:]), {}
    elif isinstance(node, Node) and node.target is vocab_parallel_cross_entropy \
            and node.kwargs.get("reduction", "mean") == "mean":
        given = {"target": node.args[1], "ignore_index": node.kwargs.get("ignore_index", -100)}
        node.kwargs = {**node.kwargs, "reduction": "sum"}
    else:
        _refuse(loss, "the loss is not a cross-entropy mean over tokens, which cp averages over the whole sequence",
                "return the loss of a causal LM (labels given), or plan with cp=1")
    group, counter = _get_attrs(graph)
    with graph.inserting_after(node):
        mean = graph.call_function(token_mean, (node, given["target"], given["ignore_index"], group, counter))
    node.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
    for key in (TENSOR, REQUIRES_GRAD):
        if key.has(node):
            key.set(mean, key.get(node))
    place_inserted(graph, [mean], f"cp: the loss's mean over the whole sequence (cp={cp})")


@compiler_pass(requires=(TENSOR, REQUIRES_GRAD), provides=())
def split_sequence(gm, ctx):
    """cp > 1: the program runs on this rank's chunks of each sequence, attention over the whole (module docstring)."""
    cp = ctx.plan.mesh.cp
    if cp == 1:
        return gm
    symbols = SYMBOLS.get(gm, {})
    if "seq" not in symbols:
        raise PassFailure("context parallelism needs a sequence dim, and no input of this model has one",
                          where="the traced inputs", hint="plan with cp=1")
    seq = symbols["seq"]
    chunk_length(seq, cp, f"the traced sequence of {seq} tokens")
    for name in GROUP_ATTRS:  # this process's cp groups and counter are attached by the runtime (codegen/emit.attach)
        if name != "comm_counter" or not hasattr(gm, name):  # a GraphModule keeps only what its graph read
            setattr(gm, name, UNATTACHED)
    _drop_unread(gm.graph, _rewrite_attention(gm, cp, context_method(ctx.plan)))
    _rewrite_positions(gm)
    _rewrite_label_shift(gm)
    _refuse_sequence_mixing(gm)
    _rewrite_loss(gm, cp)
    SYMBOLS.set(gm, {**symbols, "seq": seq // cp})  # every size is this rank's share of the sequence
    gm.graph.lint()
    gm.recompile()
    return gm

