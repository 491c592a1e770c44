"""What a model's traced graph must be before Xirang plans or compiles a training program for it.

One place per concept, called by ``xirang.plan``, ``xirang.compile`` and the CLI before any slow or
distributed work, so a model that cannot train correctly is refused at the start with what to do:

- ``check_scalar_loss``: the first output is the loss, a scalar that needs gradients (the runtime
  calls its backward; a model returning logits would otherwise pass analysis, planning and
  compilation and crash in ``train_step``).
- ``check_positions``: a position table (an embedding indexed by ``arange(seq)``) has a row for
  every position of the example inputs (fake tensors never index, so ``--seq 100`` on a 64-position
  model would trace and plan and only crash on real data).
- ``check_plan_batch_split``: a layer normalising with batch statistics (BatchNorm in training)
  sees the whole global batch on one device; a plan splitting the batch over dp ranks or
  micro-batches would compute other statistics than one device, silently.
- ``check_placements``: the plan's placements name nodes of this graph and shard dims its tensors
  have (a hand-edited plan keeps the fingerprint, so ``Plan.check_matches`` cannot see it).
"""
from __future__ import annotations

import torch
from torch import fx

from xirang.ir.errors import PlanError, XirangError
from xirang.ir.meta_keys import MODULE_PATH, REQUIRES_GRAD, SOURCE, TENSOR
from xirang.ir.plan_checks import check_placement_ranks

# aten ops that pass their (first) input's index values through unchanged (views, broadcasts)
_INDEX_PRESERVING = ("view", "unsqueeze", "expand", "reshape", "_unsafe_view", "clone", "contiguous", "to",
                     "_to_copy", "slice", "alias", "squeeze", "repeat", "expand_as")
LOSS_HINT = ("make forward return the loss first, a scalar that needs grad: pass the labels (e.g. labels= for a "
             "Hugging Face model), reduce it (reduction='mean', .mean()), compute it from the trainable "
             "parameters, and return (loss, ...) or an object with .loss")


def _where(node: fx.Node) -> str:
    path = MODULE_PATH.get(node, "") if MODULE_PATH.has(node) else ""
    source = SOURCE.get(node, None) if SOURCE.has(node) else None
    parts = [f"node {node.name} ({node.target})"]
    if path:
        parts.append(f"module {path}")
    if source is not None:
        parts.append(str(source))
    return ", ".join(parts)


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(node for node in gm.graph.nodes if node.op == "output")


def check_scalar_loss(gm: fx.GraphModule) -> None:
    """The graph's first output is a floating scalar that depends on a trainable parameter."""
    result = _output_node(gm).args[0]
    first = result[0] if isinstance(result, (tuple, list)) and result else result
    value = first.meta.get("val") if isinstance(first, fx.Node) else first
    if not isinstance(value, torch.Tensor):
        raise XirangError(f"the model's first output is {type(value).__name__} {value!r}, not a loss tensor "
                          f"(a model without labels returns no loss)", where="the model's forward output",
                          hint=LOSS_HINT)
    shape = tuple(_hint_int(d) or d for d in value.shape)  # the example's sizes, not torch's symbols
    if value.dim() != 0:
        raise XirangError(f"the model's first output has shape {shape}, not a scalar loss: it looks like logits "
                          f"or a per-sample loss (reduction='none')", where=_where(first) + ", the forward output",
                          hint=LOSS_HINT)
    if not value.dtype.is_floating_point:
        raise XirangError(f"the model's first output is a {value.dtype} scalar, not a floating loss",
                          where=_where(first), hint=LOSS_HINT)
    if not _reaches_trainable(first):
        raise XirangError("the model's loss does not depend on any trainable parameter, so there is nothing to "
                          "train (all parameters frozen, or the loss computed under no_grad / from detached "
                          "tensors)", where=_where(first),
                          hint="leave requires_grad=True on the parameters to train and compute the loss from "
                               "the model's outputs without .detach() or torch.no_grad()")


_NO_GRADIENT = ("detach", "alias_copy_detach")  # ops whose output carries no gradient to their input


def _reaches_trainable(loss: fx.Node) -> bool:
    """Whether a gradient flows from ``loss`` to a trainable parameter: a path of floating tensors
    not cut by ``detach`` (the analysis' requires-grad facts do not see detach, so walk it here)."""
    seen, stack = set(), [loss]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node.meta.get("xr_role") == "parameter" and REQUIRES_GRAD.get(node, False):
                return True
            continue
        name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
        if name in _NO_GRADIENT:
            continue
        for source in node.all_input_nodes:
            value = source.meta.get("val")
            if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point:
                continue  # integer and bool tensors carry no gradient
            stack.append(source)
    return False


def _hint_int(size) -> int | None:
    """The example value of a (possibly symbolic) size, or None when it has none."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)  # a SymInt remembers its example value
    return int(hint) if isinstance(hint, int) else None


def _arange_source(node: fx.Node, depth: int = 8):
    """The ``aten.arange`` the index values of ``node`` come from unchanged, or None."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", str(node.target))
        if name.startswith("arange"):
            return node
        if name not in _INDEX_PRESERVING or not node.args:
            return None
        node = node.args[0]
    return None


def check_positions(gm: fx.GraphModule) -> None:
    """Every embedding indexed by positions (``arange``) has a row for the largest position used."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or "embedding" not in str(node.target) or len(node.args) < 2:
            continue
        weight, indices = node.args[0], node.args[1]
        arange = _arange_source(indices)
        table = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        values = arange.meta.get("val") if arange is not None else None
        if not isinstance(table, torch.Tensor) or not isinstance(values, torch.Tensor) or values.dim() != 1:
            continue
        count = _hint_int(values.shape[0])
        start = arange.args[0] if len(arange.args) > 1 and "start" in str(arange.target) else 0
        start = _hint_int(start) if not isinstance(start, fx.Node) else _hint_int(start.meta.get("val"))
        rows = _hint_int(table.shape[0])
        if count is None or start is None or rows is None or start + count <= rows:
            continue
        raise XirangError(f"the inputs have {start + count} positions but the position table has {rows} rows",
                          where=_where(node),
                          hint=f"use a sequence length of at most {rows} (--seq {rows} or less, or shorter "
                               f"example inputs), or a model with more positions")


def batch_statistics_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes normalising with the statistics of their batch: batch norms run in training mode."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or "batch_norm" not in str(node.target):
            continue
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        if "training" not in names:
            continue
        position = names.index("training")
        training = node.kwargs.get("training", node.args[position] if position < len(node.args) else False)
        if training is True:
            found.append(node)
    return found


def check_plan_batch_split(gm: fx.GraphModule, dp: int, num_micro_batches: int, where: str) -> None:
    """Refuse splitting the batch (dp > 1 or micro-batches > 1) of a model with batch statistics."""
    if dp * num_micro_batches == 1:
        return
    nodes = batch_statistics_nodes(gm)
    if not nodes:
        return
    paths = sorted({MODULE_PATH.get(n, "") or n.name for n in nodes})
    raise PlanError(f"the model normalises with batch statistics ({len(nodes)} batch norm layer(s) in training "
                    f"mode: {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}), and this plan splits "
                    f"each step's batch into dp {dp} x {num_micro_batches} micro-batch(es): every piece would "
                    f"be normalised by its own mean and variance, not the global batch's, so training would "
                    f"silently differ from one device", where=f"{where} ({_where(nodes[0])})",
                    hint="plan with dp=1 and micro_batch=global_batch (the planner does so when unpinned), "
                         "or replace BatchNorm by LayerNorm/GroupNorm (per-sample statistics), or put the model "
                         "in eval mode for its norms")


def tensor_ranks(gm: fx.GraphModule) -> dict:
    """Node name -> (rank of each input (None: not a tensor), rank of each output), for the plan check."""
    def ranks(node) -> tuple:
        info = TENSOR.get(node, None) if TENSOR.has(node) else None
        if info is None:
            return (None,)
        infos = info if isinstance(info, tuple) else (info,)
        return tuple(len(i.shape) if hasattr(i, "shape") else None for i in infos)
    return {node.name: (tuple(ranks(x)[0] for x in node.all_input_nodes), ranks(node))
            for node in gm.graph.nodes}


def check_placements(plan, gm: fx.GraphModule) -> None:
    """The plan's placements fit this graph: known nodes, shard dims below each tensor's rank."""
    check_placement_ranks(plan.placements, tensor_ranks(gm))


def check_trainable(gm: fx.GraphModule) -> None:
    """What every training program needs of its graph: a scalar loss and positions the tables hold."""
    check_scalar_loss(gm)
    check_positions(gm)
