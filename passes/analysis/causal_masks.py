"""Attention masks that are exactly the causal triangle become ``is_causal=True``.

Why: Hugging Face models build their attention mask inside ``forward``. Run eagerly on a GPU they skip it
when it is plain causal and call ``scaled_dot_product_attention(..., is_causal=True)``; traced (by
torch.export, on any device) they cannot look at its values, so the graph materialises a boolean
batch x 1 x seq x seq mask and hands it to every attention call. On a GPU each call then converts it to an
additive mask in the compute dtype and the fused kernel keeps it for the backward: 32 MiB per layer and
micro-batch at seq 4096 in bf16, 128 MiB at 8192, which the full-scale check measured and no eager run
holds; and flash attention, which takes no mask, is ruled out.

What is proved, per attention call whose mask is a graph value:
- the mask depends on sizes only: every tensor it reads is made inside the subgraph that computes it
  (``arange``, ``ones``, comparisons), and inputs reach it only through their sizes (``sym_size``);
- evaluated twice on CPU, with the batch at 2 and 3 and every other size symbol at its own value above
  every integer the subgraph holds (a sliding window of 4096 equals the causal triangle at any sequence up
  to 4096, so it must be seen longer than that), it is the lower triangle ``key <= query`` over square
  query x key, broadcast over batch and heads: ``True`` where attention is allowed for a boolean mask, ``0``
  there and at most the dtype's lowest value elsewhere for an additive one (``exp`` of either is exactly 0,
  as under ``is_causal``).
The graph is symbolic in its sizes, so a subgraph of sizes alone computes one function of them; past its
constants a mask built from comparisons of positions is the same shape at every size, and two evaluations
guard against a size-dependent branch the trace folded in. Anything else keeps its mask: a padding mask
from the inputs, a window the evaluation shows, a subgraph whose constants would need a sequence over
``MAX_EVALUATED`` to see past, a size that will not evaluate.

The rewrite runs right after the trace, so the plan, the analysis and every rank's program see the same
graph; the unused mask nodes are removed.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_map

from xirang.ir.meta_keys import TORCH_SYMBOLS, VAL
from xirang.ir.pass_spec import compiler_pass

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MASK, _CAUSAL = 3, 5  # positions of attn_mask and is_causal in aten.scaled_dot_product_attention
BATCHES = (2, 3)  # the batch symbol's value in each evaluation (it only broadcasts)
OFFSETS = ((3, 5, 7), (11, 13, 17))  # other symbols: past the subgraph's largest integer, distinct per symbol
SLICE_TO_END = 2 ** 62  # a slice's end of sys.maxsize means "to the end", not a size
MAX_EVALUATED = 8192  # a longer sequence is not evaluated (a bool seq x seq mask of 64 MiB here)


class _NotSizesOnly(Exception):
    """The mask reads a tensor it does not make (an input's values, a buffer): it may be anything."""


def _attention_mask(node: Node):
    if len(node.args) > _MASK:
        return node.args[_MASK]
    return node.kwargs.get("attn_mask")


def _is_causal(node: Node) -> bool:
    if len(node.args) > _CAUSAL:
        return bool(node.args[_CAUSAL])
    return bool(node.kwargs.get("is_causal", False))


def _symbolic_int(value) -> bool:
    return isinstance(value, torch.SymInt)


def _to_cpu(value):
    if isinstance(value, torch.device):
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _evaluate(mask: Node, size_of) -> torch.Tensor:
    """The mask's value when each free symbol of the sizes it reads takes ``size_of(symbol, index)`` (index:
    how many symbols came before it); raises ``_NotSizesOnly`` where it reads a tensor it does not make."""
    symbols: dict = {}
    values: dict[Node, object] = {}

    def value_of(node: Node):
        if node in values:
            return values[node]
        val = node.meta.get("val")
        if _symbolic_int(val):  # a size (an input's, or arithmetic on sizes): from the symbols alone
            expr = val.node.expr
            for symbol in sorted(expr.free_symbols, key=str):
                symbols.setdefault(symbol, size_of(str(symbol), len(symbols)))
            result = int(expr.subs(symbols))
        elif node.op != "call_function":
            raise _NotSizesOnly(node.name)
        else:
            args = map_arg(node.args, value_of)
            kwargs = map_arg(node.kwargs, value_of)
            result = node.target(*_to_cpu(args), **_to_cpu(kwargs))
        values[node] = result
        return result

    return value_of(mask)


def _causal(value) -> bool:
    """Is ``value`` (a mask's evaluation) the causal triangle over square query x key (module docstring)?"""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return False
    n = value.shape[-1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == allowed).all())
    if not value.is_floating_point():
        return False
    lowest = torch.finfo(value.dtype).min
    blocked = value <= lowest
    return bool(((value == 0) == allowed).all()) and bool((blocked == ~allowed).all())


def _largest_integer(mask: Node) -> int:
    """The largest absolute integer an op of the mask's subgraph is given (a window, an offset, a dim; not a
    slice's open end)."""
    found = [0]

    def visit(value):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < SLICE_TO_END:
            found.append(abs(value))
        return value

    for node in _ancestors(mask):
        if node.op == "call_function":
            tree_map(visit, (node.args, node.kwargs))
    return max(found)


def _proved_causal(mask: Node, torch_symbols: dict) -> bool:
    base = _largest_integer(mask) + 1
    if base + max(max(o) for o in OFFSETS) > MAX_EVALUATED:
        return False

    def sizes(batch: int, offsets: tuple):
        return lambda symbol, index: batch if torch_symbols.get(symbol) == "batch" else base + offsets[index % 3]

    try:
        return all(_causal(_evaluate(mask, sizes(batch, offsets))) for batch, offsets in zip(BATCHES, OFFSETS))
    except _NotSizesOnly:
        return False
    except Exception:  # noqa: BLE001 - a size the model refuses, an op that will not run eagerly: keep the mask
        return False


def _drop_unused(graph, nodes) -> None:
    """Remove ``nodes`` that nothing reads any more: one pass in reverse graph order meets a node's users
    before the node, so a chain left unread goes whole."""
    for node in reversed(list(graph.nodes)):
        if node in nodes and node.op == "call_function" and not node.users:
            graph.erase_node(node)


def _ancestors(node: Node) -> set:
    found, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        todo.extend(current.all_input_nodes)
    return found


@compiler_pass(requires=(VAL, TORCH_SYMBOLS))
def fold_causal_masks(gm: GraphModule, ctx) -> GraphModule:
    """Attention masks proved to be the causal triangle become is_causal=True (module docstring)."""
    folded = 0
    torch_symbols = TORCH_SYMBOLS.get(gm, {})
    proved: dict[Node, bool] = {}
    mask_nodes: set = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA or _is_causal(node):
            continue
        mask = _attention_mask(node)
        if not isinstance(mask, Node):
            continue
        if mask not in proved:
            proved[mask] = _proved_causal(mask, torch_symbols)
        if not proved[mask]:
            continue
        args = list(node.args) + [None, 0.0, False][max(0, len(node.args) - _MASK):]
        args[_MASK], args[_CAUSAL] = None, True
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "is_causal", "dropout_p")}
        if "dropout_p" in node.kwargs:
            args[_MASK + 1] = node.kwargs["dropout_p"]
        node.args, node.kwargs = tuple(args[:_CAUSAL + 1]), kwargs
        mask_nodes |= {n for n in _ancestors(mask) if n.op == "call_function"}
        folded += 1
    if folded:
        _drop_unused(gm.graph, mask_nodes)
        gm.recompile()
    return gm
