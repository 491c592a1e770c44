"""3D composition: this rank's tp-rewritten program, cut into its pipeline stages, run under dp.

    program = rank_pipeline_program(gm, plan, rank=r, tp_group=groups.tp)   # emit, then split
    runtime = PipelineRuntime(state, plan, program=program, groups=groups)   # executor, dp, tied

The order is emit first, split second: the tp rewrite (codegen/emit.py) sees the whole graph, so
every collective it inserts sits next to the node it serves, and the split (codegen/split_stages.py)
then cuts a graph of local tensors, so what crosses a cut is sent at its LOCAL shape: the hidden
state between blocks is replicated on tp (full shape), a tensor the plan keeps sharded there
travels as this rank's shard. Each tp rank of a stage exchanges with the same tp index of the
neighbour stages (the pp group of ``build_mesh_groups`` holds one dp and tp index).

The rewrite builds a fresh graph and keeps only names, roles and parameter names; the split also
reads the analysis meta (``UNIT``, ``TENSOR``, ``REQUIRES_GRAD``, the graph's symbols).
``keep_split_meta`` restores it on the program:

- a node that the rewrite kept (same name, same op, or its vocabulary-parallel replacement) gets
  the traced node's meta, its ``TENSOR`` shape made local by the plan's output placement;
- an inserted node (a collective, a local size) gets the ``UNIT`` of the first node that reads it,
  so a resharding runs in the consumer's stage (an f before a block runs with the block, and the
  replicated residual is what crosses, once), its shape from the input's by the collective's rule;
  one computed from parameters alone (a bf16 cast) is copied into every unit that reads it, so a
  tied weight is bound on both its stages rather than its cast sent across the pipeline.

In half precision (``plan.precision`` bf16/fp16) the traced dtypes are not the program's: a kept
node's ``TENSOR`` dtype is the one it has at run time (codegen/compute_dtypes.py), so a cut
sends the bf16 hidden state as bf16 and an fp32 one (Llama's rotary cos/sin) as fp32.

``PipelinedModel`` wraps the runtime in the API of ``CompiledModel`` (``xirang.compile``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from xirang.ir.errors import XirangError
from xirang.ir.facts import TensorInfo
from xirang.ir.meta_keys import REQUIRES_GRAD, ROLE, TENSOR, UNIT
from xirang.ir.placement import Replicate, Shard, local_shape

from xirang.codegen.ops import collectives, local_ops
from xirang.passes.lowering.compute_dtypes import compute_dtypes
from xirang.codegen.emit import COMPUTE_DTYPES, emit_rank_program
from xirang.codegen.runtime.pipeline_runtime import PipelineProgram, PipelineRuntime, build_pipeline_program
from xirang.codegen.runtime.shard_params import param_shards
from xirang.passes.lowering.vocab_calls import VOCAB_PARALLEL_OPS

# Inserted call -> how its output shape follows from its input's (x, group, ...) at tp ranks.
_SAME_SHAPE = (collectives.copy_to_group, collectives.reduce_from_group, local_ops.partial_from_replicate)
_SHARDS_DIM = (collectives.scatter_to_group, collectives.reduce_scatter_to_group, local_ops.scatter_chunks)
_GATHERS_DIM = (collectives.gather_from_group, local_ops.gather_chunks)


def rank_pipeline_program(gm, plan, *, rank: int, device="cpu", tp_group=None, counter=None) -> PipelineProgram:
    """Global rank ``rank``'s program under ``plan`` split into the plan's stages (see the module
    docstring). ``gm``: the analysed graph the plan was made for. The program depends on the
    rank's tp index only; ``tp_group``/``counter`` become the stage modules' attributes."""
    program = emit_rank_program(gm, plan, rank=rank, device=device, tp_group=tp_group, counter=counter)
    dtype = COMPUTE_DTYPES[plan.precision]
    dtypes = compute_dtypes(gm, dtype) if dtype != torch.float32 else {}
    keep_split_meta(gm, program, plan.placements, plan.mesh.tp, dtypes)
    split = build_pipeline_program(program, plan, verify_plan=False)
    shards = {shard.name: shard for shard in param_shards(gm, plan.placements)}
    return replace(split, shards=shards)


def attach_groups(program: PipelineProgram, *, tp_group=None, counter=None) -> PipelineProgram:
    """Point every stage module at this process's live tp group and counter (a program built in
    another process, or for another rank's tp index, carries ``None``)."""
    for stage in program.stages:
        stage.module.tp_group, stage.module.comm_counter = tp_group, counter
    return program


def keep_split_meta(gm, program, placements, tp: int, dtypes: Optional[dict] = None) -> None:
    """Put the meta ``split_stages`` reads on ``program``'s nodes and graph (module docstring).
    ``dtypes``: node name -> run-time dtype in half precision (empty: the traced dtypes hold)."""
    program.meta.update({key: value for key, value in gm.meta.items() if key.startswith("xr_")})
    original = {node.name: node for node in gm.graph.nodes}
    inserted = []
    for node in program.graph.nodes:
        source = original.get(node.name)
        if node.op == "placeholder" and source is not None:
            node.meta.update({k: v for k, v in source.meta.items() if k not in node.meta})
        elif node.op == "call_function" and source is not None and (
                source.target == node.target or source.target in VOCAB_PARALLEL_OPS):
            _copy_kept(source, node, placements, tp, (dtypes or {}).get(node.name))
        elif node.op == "call_function":
            _describe_inserted(node, tp)
            inserted.append(node)
    order = {node: position for position, node in enumerate(program.graph.nodes)}
    for node in reversed(inserted):  # users before producers: a chain of insertions takes its reader's unit
        readers = sorted((user for user in node.users if UNIT.has(user)), key=order.get)
        producers = [arg for arg in node.all_input_nodes if UNIT.has(arg)]
        unit = readers[0] if readers else producers[0] if producers else None
        if unit is None:
            raise XirangError(f"the rewritten node {node.name} ({node.target}) has no stage: neither what it reads "
                              f"nor what reads it belongs to a unit", where=f"rank program node {node.name}",
                              hint="report this model; as a workaround plan with pp=1")
        UNIT.set(node, UNIT.get(unit))
    for node in inserted:
        _one_per_reading_unit(program.graph, node)
    program.recompile()


def _one_per_reading_unit(graph, node) -> None:
    """Give each unit that reads ``node`` its own copy when ``node`` computes from bound state only
    (the half-precision cast of a parameter): each stage then computes it from its own copy of the
    parameter, instead of receiving it across every cut in between. A tied embedding's bf16 cast
    would otherwise travel from the first stage to the last, a vocabulary x hidden tensor on every
    link each micro-batch and its gradient back, where fp32 needs one tied-gradient sum per step."""
    if not node.all_input_nodes or any(arg.op != "placeholder" for arg in node.all_input_nodes):
        return
    if not all(UNIT.has(user) for user in node.users):
        return  # read outside every unit (not seen in practice): left to the split to place
    by_unit: dict = {}
    for user in node.users:
        by_unit.setdefault(UNIT.get(user), []).append(user)
    first, *others = by_unit
    UNIT.set(node, first)
    for unit in others:
        with graph.inserting_after(node):
            copy = graph.node_copy(node)  # copies the meta too: TENSOR, REQUIRES_GRAD
        UNIT.set(copy, unit)
        for user in by_unit[unit]:
            user.replace_input_with(node, copy)


def _copy_kept(source, node, placements, tp: int, dtype: Optional[torch.dtype]) -> None:
    for key in (UNIT, REQUIRES_GRAD):
        if key.has(source):
            key.set(node, key.get(source))
    if "val" in source.meta:
        node.meta["val"] = source.meta["val"]  # SymInt sizes: split_stages folds them
    info = TENSOR.get(source, None)
    if isinstance(info, TensorInfo):
        strategy = placements.get(source.name)
        placement = strategy.outputs[0].tp if strategy is not None and strategy.outputs else Replicate()
        name, itemsize = (str(dtype).removeprefix("torch."), dtype.itemsize) if dtype else (info.dtype, info.itemsize)
        TENSOR.set(node, TensorInfo(local_shape(info.shape, placement, tp), name, itemsize))
    elif info is not None:
        TENSOR.set(node, info)


def _describe_inserted(node, tp: int) -> None:
    """TENSOR and REQUIRES_GRAD of a call the rewrite inserted, from its first argument's."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return
    grads = any(REQUIRES_GRAD.get(arg, False) or ROLE.get(arg, None) == "parameter" for arg in node.all_input_nodes)
    REQUIRES_GRAD.set(node, grads)
    info = TENSOR.get(first, None)
    if not isinstance(info, TensorInfo):
        return  # not a tensor (a local size): folded by the split, or refused there if it crosses
    shape = list(info.shape)
    if node.target in _SAME_SHAPE:
        pass
    elif node.target in _SHARDS_DIM:
        shape[node.args[2]] = local_shape(tuple(shape), Shard(node.args[2]), tp)[node.args[2]]
    elif node.target in _GATHERS_DIM:
        full = node.kwargs.get("full_size")
        shape[node.args[2]] = full if full is not None else shape[node.args[2]] * tp
    elif node.target is collectives.all_to_all:
        scatter, gather = node.kwargs["scatter_dim"], node.kwargs["gather_dim"]
        size = node.kwargs.get("gather_size")
        shape[gather] = size if size is not None else shape[gather] * tp
        shape[scatter] = local_shape(tuple(shape), Shard(scatter), tp)[scatter]
    elif node.target is torch.ops.aten._to_copy.default and "dtype" in node.kwargs:
        dtype = node.kwargs["dtype"]
        TENSOR.set(node, TensorInfo(tuple(shape), str(dtype).removeprefix("torch."), dtype.itemsize))
        return
    else:
        return  # unknown: a cut through it is refused by the split with the node's name
    TENSOR.set(node, TensorInfo(tuple(shape), info.dtype, info.itemsize))


class PipelinedModel:
    """One rank's compiled 3D program with the API of ``runtime.CompiledModel`` (what
    ``xirang.compile`` returns for pp > 1): ``train_step`` on the global batch (or, ``pre_sharded``,
    this dp rank's share), ``parameters``, ``full_state_dict``, ``load_full_state_dict``,
    ``full_gradients``, ``code``, ``local_param_bytes``."""

    def __init__(self, model, gm, plan, groups, *, device="cpu", bucket_bytes: Optional[int] = None,
                 counter=None, event_log: Optional[list] = None):
        self.plan, self.groups, self.device = plan, groups, torch.device(device)
        self.rank, self._gm, self._model_forward = groups.rank, gm, model.forward
        program = rank_pipeline_program(gm, plan, rank=self.rank, device=self.device, tp_group=groups.tp,
                                        counter=counter)
        self.runtime = PipelineRuntime(model, plan, program=program, groups=groups, bucket_bytes=bucket_bytes,
                                       device=self.device, counter=counter, event_log=event_log)

    def named_parameters(self):
        return self.runtime.named_parameters()

    def parameters(self):
        return self.runtime.parameters()

    def local_param_bytes(self) -> int:
        return self.runtime.local_param_bytes()

    def full_state_dict(self) -> dict:
        """FQN -> full tensor (gathered over tp and pp). Collective: call it on every rank."""
        return self.runtime.full_state_dict()

    def full_gradients(self) -> dict:
        return self.runtime.full_gradients()

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Copy this rank's piece of each full tensor in place (optimizers keep their references): the
        tensors of its stages only, as its tp shards; tied copies each load the same entry."""
        self.runtime.load_full_state_dict(state_dict)

    def code(self, rank: Optional[int] = None) -> str:
        """Python source of the stage modules rank ``rank`` (default: this one) runs."""
        rank = self.rank if rank is None else rank
        coords = self.plan.mesh.coords(rank)
        program = rank_pipeline_program(self._gm, self.plan, rank=rank, device=self.device)
        parts = [f"# Xirang program of rank {rank}: mesh {self.plan.mesh}, dp {coords['dp']} pp {coords['pp']} "
                 f"tp {coords['tp']}, precision {self.plan.precision}, schedule {self.plan.schedule}\n"]
        for index in self.runtime.schedule.stages_of(coords["pp"]):
            stage = program.stages[index]
            parts.append(f"# stage {index}: receives {[c.name for c in stage.crossing_in]}, sends "
                         f"{[c.name for c in stage.crossing_out] or ['the loss']}\n"
                         + stage.module.code.lstrip("\n"))
        return "\n".join(parts)

    def train_step(self, *args, pre_sharded: bool = False, **kwargs) -> torch.Tensor:
        """Forward and backward of the plan's micro-batches through the pipeline schedule, gradients
        averaged over dp and summed over tied copies; returns the mean loss of the global batch.
        The batch is the global one on every rank, or with ``pre_sharded=True`` this dp rank's share
        (every pp and tp rank of one dp index passes the same share)."""
        from xirang.passes.analysis.trace_inputs import name_inputs
        from xirang.codegen.runtime.runtime import _Signature
        named = name_inputs(_Signature(self._model_forward), args, kwargs)
        return self.runtime.train_step(pre_sharded=pre_sharded,
                                       **{name: named[name] for name in self.runtime._inputs if name in named})

    @property
    def last_step(self):
        return self.runtime.last_step
