"""Lowering passes ``assign_stages`` and ``split_stages``: a rank's program cut into one GraphModule
per pipeline stage (pp = 1 is a one-stage pipeline: the whole program is stage 0).

``assign_stages`` gives every computing node the ``STAGE`` of its ``UNIT`` (passes/analysis/
dependencies.py) in the plan's ``StagePlan.units`` (contiguous in execution order); a cast computed
from parameters alone is copied into every stage that reads it (below). ``split_stages`` then builds
for stage ``i`` a module called as

    stage_i(*parameters, *crossing_in, *user_inputs) -> tuple(crossing_out)   # (loss,) on the last

- ``parameters``: the parameter/buffer/constant placeholders stage i reads, by the model FQN in
  ``PARAM_NAME``. A parameter read by two stages (GPT's token embedding tied to the LM head) is a
  placeholder of both; the runtime keeps the copies equal by all-reducing their gradients between
  the ranks that own them after the backward (``tied_parameters``; Megatron-LM's "embedding group").
- ``crossing_in``: every tensor produced by an earlier stage that stage i *or a later stage* reads,
  in graph order; ``crossing_out`` the same for the next cut. A tensor produced in stage 0 and read
  in stage 3 thus passes through stages 1 and 2 (sent along each cut) rather than skipping ranks:
  every transfer stays between neighbour stages, the only pairing a pipeline schedule lists.
- ``user_inputs``: the model inputs (``input_ids``, ``labels``) the stage reads; each rank is given
  the batch, so a stage never receives them from a neighbour.

A tp rank's program splits the same way: its collectives carry the ``UNIT`` of the node they feed
(passes/lowering/inserted.py), and its ``get_attr`` nodes (the tp group, the communication
counter) are module attributes every stage that reads them gets. What crosses a cut is sent at its
LOCAL shape: the hidden state between blocks is replicated on tp (full shape), a tensor the plan
keeps sharded there travels as this rank's shard; each tp rank of a stage exchanges with the same
tp index of the neighbour stages. In half precision what crosses travels in its run-time dtype.

A node computed from bound state only (the half-precision cast of a parameter) is copied into each
unit that reads it, so each stage computes it from its own copy of the parameter instead of
receiving it across every cut in between: a tied embedding's bf16 cast would otherwise travel from
the first stage to the last, a vocabulary x hidden tensor on every link each micro-batch and its
gradient back, where fp32 needs one tied-gradient sum per step.

Recompute and offload: the nodes ``mark_recompute`` and ``mark_offload`` (passes/lowering/
recompute.py, offload.py) put in a region are outlined into a sub-module the stage calls
(passes/lowering/regions.py): a checkpointed region, a block whose saved activations go to host
memory. A stage with no region is built exactly as before (golden files unchanged).

Symbolic sizes: shapes are static per plan (micro-batch and sequence fixed), so every SymInt node
(``aten.sym_size.int`` and arithmetic on it) is folded to a Python int evaluated at ``symbols``.
That removes the scalar from the cut altogether: no stage needs an input only to read its size, and
receive buffers of known shapes can be allocated before the step. The price is that a stage set is
built for one (micro-batch, seq); another shape needs another split (cheap: no re-trace).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from xirang.ir.errors import XirangError
from xirang.ir.facts import TensorInfo, evaluate
from xirang.ir.meta_keys import (CONSTANT_VALUE, INSERTED, OFFLOAD, PARAM_NAME, RECOMPUTE, REQUIRES_GRAD, ROLE,
                                 STAGE, STAGE_MODULES, SYMBOLS, TENSOR, TORCH_SYMBOLS, UNIT)
from xirang.ir.pass_spec import compiler_pass

from xirang.codegen.ops.local_ops import local_size
from xirang.passes.lowering.regions import copy_with_regions, has_regions

BOUND_ROLES = ("parameter", "buffer", "constant")
# Pure int -> int functions a tp rank's program applies to sizes; folded like the sizes they read.
INT_FUNCTIONS = (local_size,)
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
            torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}


@dataclass(frozen=True)
class CrossingTensor:
    """A tensor that crosses a cut: the producing node's name, its shape (sympy, in the graph's
    symbols) and that shape at the split's symbols, its dtype, and whether a gradient flows back."""

    name: str
    symbolic_shape: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class StageModule:
    """One stage's GraphModule and its calling convention (see the module docstring)."""

    index: int
    module: fx.GraphModule
    parameters: tuple[tuple[str, str], ...]  # (placeholder name, model FQN), in call order
    crossing_in: tuple[CrossingTensor, ...]
    user_inputs: tuple[str, ...]
    crossing_out: tuple[CrossingTensor, ...]  # empty on the last stage
    returns_loss: bool
    constants: dict = field(default_factory=dict)  # FQN -> value of a tensor made inside forward (no model has it)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(fqn for _, fqn in self.parameters)

    def __call__(self, parameters, crossing_in, user_inputs):
        return self.module(*parameters, *crossing_in, *user_inputs)


@compiler_pass(requires=(UNIT,), provides=(STAGE,))
def assign_stages(gm, ctx):
    """Give every computing node the pipeline stage of its unit under the plan's cuts."""
    for node in [node for node in gm.graph.nodes if INSERTED.has(node)]:
        _one_per_reading_unit(gm.graph, node)
    for node, stage in _stage_of_nodes(gm, ctx.plan.stages).items():
        STAGE.set(node, stage)
    gm.recompile()
    return gm


@compiler_pass(requires=(STAGE, TENSOR, REQUIRES_GRAD, RECOMPUTE, OFFLOAD), provides=(STAGE_MODULES,))
def split_stages(gm, ctx):
    """Cut the program into one module per stage (regions outlined, sizes fixed at one micro-batch)."""
    symbols = {**SYMBOLS.get(gm, {}), "batch": ctx.plan.micro_batch}
    STAGE_MODULES.set(gm, build_stage_modules(gm, len(ctx.plan.stages), symbols))
    return gm


def build_stage_modules(gm: fx.GraphModule, num_stages: int, symbols: dict) -> tuple[StageModule, ...]:
    """One ``StageModule`` per stage of ``gm``'s ``STAGE`` meta (see the module docstring).

    ``symbols``: value of each size symbol for ONE micro-batch, e.g. ``{"batch": 2, "seq": 16}``.
    """
    stage_of = {node: STAGE.get(node) for node in gm.graph.nodes if STAGE.has(node)}
    folded = _fold_symbolic_ints(gm, symbols)
    loss = _loss_node(gm)
    last = num_stages - 1
    if stage_of.get(loss) != last:
        raise XirangError(f"the loss ({loss.name}) is computed in stage {stage_of.get(loss)}, not the last stage "
                          f"{last}", where=f"unit {UNIT.get(loss, '?')}",
                          hint="the plan's last stage must hold the loss: put the final units in it")
    cuts = [_crossing(gm, stage_of, folded, cut, symbols) for cut in range(last)]
    built = []
    for index in range(num_stages):
        crossing_in = cuts[index - 1] if index > 0 else ()
        crossing_out = cuts[index] if index < last else ()
        built.append(_build_stage(gm, index, stage_of, folded, crossing_in, crossing_out,
                                  loss if index == last else None))
    return tuple(built)


def tied_parameters(stages) -> dict[str, tuple[int, ...]]:
    """FQN -> the stages that read it, for every parameter read by more than one stage."""
    readers: dict[str, list[int]] = {}
    for stage in stages:
        for fqn in stage.parameter_names:
            readers.setdefault(fqn, []).append(stage.index)
    return {fqn: tuple(found) for fqn, found in readers.items() if len(found) > 1}


# --- which stage each node runs in ---------------------------------------------------------------

def _stage_of_nodes(gm, stages) -> dict:
    """Node -> stage index for every computing node (placeholders are bound per reader instead)."""
    stage_of_unit = {unit: stage.index for stage in stages for unit in stage.units}
    stage_of = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue  # get_attr (a tp rank's process group) is copied into each stage that reads it
        unit = UNIT.get(node, None)
        if unit not in stage_of_unit:
            raise XirangError(f"node {node.name} belongs to unit {unit!r}, which no stage of the plan lists",
                              where=f"node {node.name} ({node.target})",
                              hint="make the plan for this graph (xirang.plan on the same model and inputs); "
                                   f"the plan's units are {sorted(stage_of_unit)}")
        stage = stage_of_unit[unit]
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and source in stage_of:
            stage = stage_of[source]  # a tuple never crosses a cut: its items go with the producer
        stage_of[node] = stage
        for arg in node.all_input_nodes:
            if stage_of.get(arg, -1) > stage:
                raise XirangError(f"node {node.name} in stage {stage} reads {arg.name} from the later stage "
                                  f"{stage_of[arg]}", where=f"unit {unit}",
                                  hint="a plan's stages must hold units in execution order; re-plan")
    return stage_of


def _one_per_reading_unit(graph, node) -> None:
    """Copy ``node`` into each unit that reads it when it computes from bound state only (module
    docstring)."""
    if not node.all_input_nodes or any(arg.op != "placeholder" for arg in node.all_input_nodes):
        return
    if not all(UNIT.has(user) for user in node.users):
        return  # read outside every unit (not seen in practice): left where it is
    by_unit: dict = {}
    for user in node.users:
        by_unit.setdefault(UNIT.get(user), []).append(user)
    first, *others = by_unit
    UNIT.set(node, first)
    for unit in others:
        with graph.inserting_after(node):
            copy = graph.node_copy(node)  # copies the meta too: TENSOR, REQUIRES_GRAD, INSERTED
        UNIT.set(copy, unit)
        for user in by_unit[unit]:
            user.replace_input_with(node, copy)


def _loss_node(gm) -> fx.Node:
    output = next(node for node in gm.graph.nodes if node.op == "output")
    result = output.args[0]
    first = result[0] if isinstance(result, (tuple, list)) else result
    if not isinstance(first, fx.Node):
        raise XirangError("the traced graph's first output is not a tensor, so there is no loss to train",
                          where="graph output", hint="make the model return the loss first (pass labels)")
    return first


def _fold_symbolic_ints(gm, symbols: dict) -> dict:
    """Node -> int for every node producing a SymInt (or int), evaluated at ``symbols``."""
    torch_names = TORCH_SYMBOLS.get(gm, {})
    folded = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in INT_FUNCTIONS and node.all_input_nodes \
                and all(arg in folded for arg in node.all_input_nodes):
            # a tp rank's local share of a folded size (codegen/ops/local_ops.local_size): fold it too
            folded[node] = node.target(*fx.node.map_arg(node.args, lambda arg: folded[arg]))
            continue
        value = node.meta.get("val")
        if node.op == "placeholder" or not isinstance(value, (torch.SymInt, int)) or isinstance(value, bool):
            continue
        if isinstance(value, int):
            folded[node] = value
            continue
        expr = value.node.expr
        try:
            folded[node] = int(expr.xreplace({s: sympy.Integer(symbols[torch_names.get(s.name, s.name)])
                                              for s in expr.free_symbols}))
        except (KeyError, TypeError) as error:
            raise XirangError(f"cannot evaluate the size {node.name} = {expr} at {symbols}",
                              where=f"node {node.name} ({node.target})",
                              hint=f"give a value for every size symbol ({sorted(torch_names.values())})") from error
    return folded


# --- what crosses each cut -----------------------------------------------------------------------

def _crossing(gm, stage_of, folded, cut: int, symbols) -> tuple[CrossingTensor, ...]:
    """Tensors produced in stages <= cut and read by a stage > cut, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node not in stage_of or node in folded or stage_of[node] > cut:
            continue
        if any(stage_of.get(user, -1) > cut for user in node.users):
            found.append(_describe(node, symbols))
    return tuple(found)


def _describe(node, symbols) -> CrossingTensor:
    info = TENSOR.get(node, None)
    if not isinstance(info, TensorInfo):
        raise XirangError(f"{node.name} crosses a pipeline cut but is not a single tensor ({info!r})",
                          where=f"node {node.name} ({node.target}), unit {UNIT.get(node, '?')}",
                          hint="cut the pipeline elsewhere (pin other stage units) or report this model")
    if info.dtype not in _DTYPES:
        raise XirangError(f"{node.name} crosses a pipeline cut with dtype {info.dtype}, which the pipeline "
                          f"cannot send", where=f"node {node.name}", hint=f"supported: {sorted(_DTYPES)}")
    shape = tuple(evaluate(size, symbols) for size in info.shape)
    return CrossingTensor(node.name, tuple(info.shape), shape, _DTYPES[info.dtype],
                          bool(REQUIRES_GRAD.get(node, False)) and info.is_floating)


# --- building one stage's graph -------------------------------------------------------------------

def _build_stage(gm, index, stage_of, folded, crossing_in, crossing_out, loss) -> StageModule:
    graph = fx.Graph()
    env: dict = dict(folded)  # folded sizes become plain ints in every stage
    own = [node for node in gm.graph.nodes if stage_of.get(node) == index and node not in folded]
    reads = {arg for node in own for arg in node.all_input_nodes}
    parameters, user_inputs = [], []
    # Placeholders in the calling order: parameters, crossing tensors, user inputs.
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in reads and ROLE.get(node, None) in BOUND_ROLES:
            env[node] = _copy_placeholder(graph, node, node.name)
            parameters.append((node.name, PARAM_NAME.get(node, node.name)))
    by_name = {node.name: node for node in gm.graph.nodes}
    for crossing in crossing_in:
        env[by_name[crossing.name]] = _copy_placeholder(graph, by_name[crossing.name], crossing.name)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in reads and ROLE.get(node, None) not in BOUND_ROLES:
            env[node] = _copy_placeholder(graph, node, node.name)
            user_inputs.append(node.name)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node in reads:
            env[node] = graph.get_attr(node.target)  # GraphModule(gm, ...) copies the attribute
    modules: dict = {}  # region modules (recompute, offload): passes/lowering/regions.py
    if has_regions(own):
        copy_with_regions(graph, own, env, modules)
    else:
        for node in own:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    if loss is not None:
        graph.output((env[loss],))
    else:
        graph.output(tuple(env[by_name[crossing.name]] for crossing in crossing_out))
    graph.lint()
    if modules:  # the root holds what the graph's get_attr and call_module nodes name
        root = {node.target: getattr(gm, node.target) for node in graph.nodes if node.op == "get_attr"}
        module = fx.GraphModule({**root, **modules}, graph, class_name=f"Stage{index}")
    else:
        module = fx.GraphModule(gm, graph, class_name=f"Stage{index}")
    return StageModule(index=index, module=module, parameters=tuple(parameters), crossing_in=tuple(crossing_in),
                       user_inputs=tuple(user_inputs), crossing_out=tuple(crossing_out),
                       returns_loss=loss is not None,
                       constants={PARAM_NAME.get(n): CONSTANT_VALUE.get(n) for n in reads if CONSTANT_VALUE.has(n)})


def _copy_placeholder(graph, node, name):
    copy = graph.placeholder(name)
    copy.meta = dict(node.meta)  # shapes and roles stay readable on the stage graph
    return copy
