"""One rank's pipeline-parallel (dp x pp x tp) training program, from a model and its Plan.

    # inside each launched rank (codegen/launch.py or torchrun)
    runtime = PipelineRuntime(model, plan, example_kwargs=batch)
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-3)
    loss = runtime.train_step(**global_batch)   # every rank passes the same global batch
    optimizer.step(); optimizer.zero_grad()       # (pre_sharded=True: this dp rank's share)

Construction: trace and analyse the model (or take ``graph_module``), refuse a stale plan, build
the mesh groups, split the graph at the plan's cuts (codegen/split_stages.py, sizes at one
micro-batch), build and check the schedule, and bind this rank's stages to copies of the model's
tensors (codegen/pipeline_state.py, which also loads and gathers them). A step: this dp rank's
share of the batch, cut into the plan's micro-batches, goes through the executor
(codegen/pipeline_executor.py); then the gradients of tied parameters are summed over the ranks
that hold them, and the loss -- the mean over the global batch, as on one device when every
micro-batch counts the same number of loss terms -- is given to every rank.

Tied parameters: a tensor read by stages on different pipeline ranks (a token embedding tied to
the LM head) is a copy on each. Each copy gets the gradient of its own uses only; summing them
over a "tied" group (one per dp and tp index, the ranks holding the copies) gives every copy the
full gradient, so the same optimizer step keeps them equal (Megatron-LM's embedding group). The
sum runs after the dp average; both are linear, so the order does not matter.

Tensor parallelism (tp > 1): the stages are cut from this rank's tp-rewritten program
(codegen/compose_3d.py), the program carries each parameter's tp placement (``shards``), and
every bound tensor is this tp rank's shard of it; tied copies are matching shards (same tp index)
on the first and last stage. ``full_state_dict``/``full_gradients`` gather over tp, then pp.

Half precision (plan precision bf16/fp16): the stages are cut from the emitted program, whose casts
read the fp32 master weights in the compute dtype, also at tp = 1; what crosses a cut travels in
the dtype it has at run time (codegen/compose_3d.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import PARAM_ALIASES, PARAM_NAME, ROLE, SYMBOL_DIMS, SYMBOLS

from xirang.codegen.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradientBuckets
from xirang.codegen.runtime.pipeline_executor import LocalStage, PipelineExecutor, StepRecord
from xirang.codegen.runtime.pipeline_state import bind_state, gather_full, load_full_state, tied_groups
from xirang.codegen.runtime.process_groups import build_mesh_groups
from xirang.codegen.runtime.schedule_check import check_schedule
from xirang.ir.schedules import Backward, BackwardWeight, build_schedule
from xirang.passes.lowering.split_stages import split_stages


@dataclass(frozen=True)
class PipelineProgram:
    """Everything a rank needs from the traced graph, picklable (stage GraphModules keep no node
    meta), so it can be built once and sent to launched ranks instead of each rank re-tracing."""

    stages: tuple  # StageModule per stage, from split_stages
    symbols: dict  # size symbol -> value the stages were built for (batch = one micro-batch)
    batch_dims: dict  # user input name -> {dim: symbol}
    inputs: tuple  # user input names the stages read
    aliases: dict  # FQN -> every FQN bound to that tensor (tied weights)
    trainable: frozenset  # FQNs of parameters (buffers and constants are bound but not trained)
    shards: dict = field(default_factory=dict)  # FQN -> ParamShard (tp placement); absent: replicated


def build_pipeline_program(graph_module, plan, *, verify_plan: bool = True) -> PipelineProgram:
    """Split ``graph_module`` at ``plan``'s cuts. ``verify_plan`` first refuses a plan made for
    another graph (fingerprint); pass False for a graph rewritten after tracing (a per-rank tp
    rewrite keeps the ``UNIT`` meta the split reads, but not the traced graph's fingerprint)."""
    if verify_plan:
        from xirang.passes.analysis.fingerprint import graph_fingerprint
        plan.check_matches(graph_fingerprint(graph_module), plan.world)
    symbols = {**SYMBOLS.get(graph_module), "batch": plan.micro_batch}
    stages = split_stages(graph_module, plan.stages, symbols)
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    return PipelineProgram(
        stages=stages, symbols=symbols,
        batch_dims={name: dict(dims) for name, dims in SYMBOL_DIMS.get(graph_module, {}).items()},
        inputs=tuple(dict.fromkeys(name for stage in stages for name in stage.user_inputs)),
        aliases={PARAM_NAME.get(n): tuple(PARAM_ALIASES.get(n, (PARAM_NAME.get(n),)))
                 for n in placeholders if PARAM_NAME.get(n, None) is not None},
        trainable=frozenset(PARAM_NAME.get(n) for n in placeholders if ROLE.get(n, None) == "parameter"))

_REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # plan.grad_reduce_dtype


class PipelineRuntime:
    """This rank's stages of ``model`` under ``plan``; see the module docstring.

    ``model``: the module, or its ``state_dict(keep_vars=True)``-like mapping FQN -> tensor when
    ``program`` is given (a rank then needs neither the model class nor a trace). ``program``: a
    ``build_pipeline_program`` result to reuse (for tp > 1: ``compose_3d.rank_pipeline_program``
    of this rank's tp index); without it the model is traced here with ``example_kwargs``.
    ``counter``: a ``CommCounter`` the tp collectives record on."""

    def __init__(self, model, plan, *, example_kwargs: Optional[dict] = None,
                 program: Optional[PipelineProgram] = None, groups=None, bucket_bytes: Optional[int] = None,
                 device="cpu", counter=None, event_log: Optional[list] = None):
        self.groups = groups or build_mesh_groups(plan.mesh)
        self.tp, self.tp_rank = self.groups.axis_size("tp"), self.groups.axis_index("tp")
        if program is None:
            if example_kwargs is None:
                raise XirangError("PipelineRuntime needs example_kwargs= to trace the model, or a program=",
                                  where="PipelineRuntime", hint="pass the example inputs the plan was made with")
            from xirang.analyze import analyze  # the public API sits above codegen; imported on use
            gm = analyze(model, example_kwargs=example_kwargs).graph_module
            if self.tp > 1 or plan.precision != "fp32":  # a tp rewrite, or precision casts: emit first
                from xirang.codegen.runtime.compose_3d import rank_pipeline_program  # builds on this module
                from xirang.passes.analysis.fingerprint import graph_fingerprint
                plan.check_matches(graph_fingerprint(gm), plan.world)
                program = rank_pipeline_program(gm, plan, rank=self.groups.rank, device=device)
            else:
                program = build_pipeline_program(gm, plan)
        if (self.tp > 1 or plan.precision != "fp32") and not program.shards:
            raise XirangError(f"the plan has mesh {plan.mesh} and precision {plan.precision} but the program has no "
                              f"tp placements or precision casts: it was split from the traced graph, not from a "
                              f"rank's emitted program", where="PipelineRuntime(program=)",
                              hint="build it with xirang.codegen.runtime.compose_3d.rank_pipeline_program for this rank")
        for stage in program.stages:  # the stage modules read the tp group as an attribute
            stage.module.tp_group, stage.module.comm_counter = self.groups.tp, counter
        self.plan, self.device, self.program = plan, torch.device(device), program
        self.dp, self.dp_rank = self.groups.axis_size("dp"), self.groups.axis_index("dp")
        self.pp, self.pp_rank = self.groups.axis_size("pp"), self.groups.axis_index("pp")
        self.symbols, self.programs = program.symbols, program.stages
        self.schedule = build_schedule(plan.schedule, self.pp, plan.num_micro_batches, plan.virtual_stages)
        check_schedule(self.schedule)
        self._batch_dims, self._inputs = program.batch_dims, program.inputs
        self._aliases, self._trainable = program.aliases, program.trainable

        local = self.schedule.stages_of(self.pp_rank)
        self._state = bind_state(model, [self.programs[i] for i in local], self._trainable, self.device,
                                 shards=program.shards, tp_rank=self.tp_rank, tp=self.tp)
        stages = {i: LocalStage(self.programs[i], [self._state[fqn] for fqn in self.programs[i].parameter_names])
                  for i in local}
        self._tied = tied_groups(self.programs, plan.mesh, self.groups, self._trainable)
        self._counter, self._event_log = counter, event_log
        buckets = self._grad_buckets(stages, bucket_bytes or DEFAULT_BUCKET_BYTES) if self.dp > 1 else None
        self.executor = PipelineExecutor(
            self.schedule, self.pp_rank, stages, peers=self.groups.pp_ranks, device=self.device,
            tensors_per_cut=max((len(p.crossing_in) for p in self.programs), default=1) or 1,
            grad_buckets=buckets)
        self.last_step: Optional[StepRecord] = None

    def _grad_buckets(self, stages: dict, bucket_bytes: int) -> dict:
        """One GradientBuckets per local stage; a parameter two local stages read belongs to the
        one whose last backward comes last, so its dp all-reduce sees every contribution."""
        last = {}
        for position, action in enumerate(self.schedule.ranks[self.pp_rank]):
            if isinstance(action, (Backward, BackwardWeight)):
                last[action.stage] = position
        owner = {}
        for index in sorted(stages, key=lambda i: last[i]):
            for fqn in stages[index].program.parameter_names:
                owner[fqn] = index
        return {index: GradientBuckets([self._state[fqn] for fqn in stage.program.parameter_names
                                        if owner[fqn] == index and fqn in self._trainable],
                                       self.groups.dp, bucket_bytes=bucket_bytes,
                                       reduce_dtype=_REDUCE_DTYPES[self.plan.grad_reduce_dtype],
                                       event_log=self._event_log, counter=self._counter)
                for index, stage in stages.items()}

    # --- parameters ------------------------------------------------------------------------------

    def named_parameters(self) -> list:
        """(FQN, tensor) of this rank's trainable parameters, each once, in forward order."""
        return [(fqn, tensor) for fqn, tensor in self._state.items()
                if fqn in self._trainable and tensor.requires_grad]

    def parameters(self) -> list:
        return [tensor for _, tensor in self.named_parameters()]

    def local_param_bytes(self) -> int:
        """Bytes of the trainable tensors this rank holds (its stages' tp shards)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def full_state_dict(self) -> dict:
        """FQN -> parameter of the whole model, tied weights under every alias. Collective over the
        tp and pp groups: call it on every rank."""
        return self._gather({fqn: t.detach() for fqn, t in self.named_parameters()})

    def full_gradients(self) -> dict:
        """FQN -> gradient after ``train_step``, gathered like ``full_state_dict``."""
        return self._gather({fqn: t.grad for fqn, t in self.named_parameters() if t.grad is not None})

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Copy this rank's piece of the full tensors in place (optimizers keep their references):
        each rank loads only its stages' tensors, tied copies each from the same entry. Every rank
        passes the same full state dict (``pipeline_state.load_full_state``)."""
        load_full_state(self._state, state_dict, aliases=self._aliases, trainable=self._trainable,
                        shards=self.program.shards, tp_rank=self.tp_rank, tp=self.tp,
                        where=f"pp rank {self.pp_rank} (stages {list(self.schedule.stages_of(self.pp_rank))})")

    def _gather(self, local: dict) -> dict:
        return gather_full(local, shards=self.program.shards, groups=self.groups, aliases=self._aliases)

    # --- a step ----------------------------------------------------------------------------------

    def train_step(self, *, pre_sharded: bool = False, **batch) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss over the global batch.
        ``batch``: the global batch, or with ``pre_sharded=True`` this dp rank's share of it."""
        micro_batches = self._micro_batches(batch, pre_sharded)
        for param in self.parameters():
            param.grad = None  # each step computes fresh gradients
        if self.groups.pp is not None:
            dist.barrier(group=self.groups.pp)  # one clock for the timestamps of the pp ranks
        origin = time.perf_counter()
        record = self.executor.run(micro_batches)
        record.timestamps = [(rank, action, start - origin, end - origin)
                             for rank, action, start, end in record.timestamps]
        self.last_step = record
        for fqn, group in self._tied:
            param = self._state[fqn]
            if param.grad is None:  # every holder must join the sum, used this step or not
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
        return self._step_loss(record)

    def _step_loss(self, record: StepRecord) -> torch.Tensor:
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        loss = torch.zeros((), device=self.device)
        if self.pp_rank == last_rank:
            loss = torch.stack(record.losses).mean()
            if self.groups.dp is not None:
                dist.all_reduce(loss, group=self.groups.dp)
                loss /= self.dp
        if self.groups.pp is not None:
            dist.broadcast(loss, src=self.groups.pp_ranks[last_rank], group=self.groups.pp)
        return loss

    def _micro_batches(self, batch: dict, pre_sharded: bool) -> list:
        missing = [name for name in self._inputs if name not in batch]
        if missing:
            raise XirangError(f"train_step is missing the input(s) {missing}", where="PipelineRuntime.train_step",
                              hint=f"pass the model inputs {list(self._inputs)} as keywords")
        m = self.plan.num_micro_batches
        shares = {}
        for name in self._inputs:
            value, dims = batch[name], self._batch_dims.get(name, {})
            for dim, symbol in dims.items():
                self._check_size(name, value, dim, symbol, pre_sharded)
            batch_dim = next((d for d, s in dims.items() if s == "batch"), None)
            if batch_dim is None:
                shares[name] = [value] * m
                continue
            share = value if pre_sharded else value.chunk(self.dp, dim=batch_dim)[self.dp_rank]
            shares[name] = list(share.chunk(m, dim=batch_dim))
        return [{name: shares[name][mb] for name in self._inputs} for mb in range(m)]

    def _check_size(self, name: str, value, dim: int, symbol: str, pre_sharded: bool) -> None:
        plan = self.plan
        got = value.shape[dim]
        share = plan.num_micro_batches * plan.micro_batch
        if symbol == "batch" and pre_sharded and got != share:
            raise XirangError(
                f"input {name!r} has {got} samples on its batch dim {dim}; with pre_sharded=True each dp rank "
                f"passes its share of exactly {share} = {plan.num_micro_batches} micro-batches x micro_batch "
                f"{plan.micro_batch} (global batch {plan.global_batch} over dp {plan.mesh.dp})",
                where=f"PipelineRuntime.train_step(pre_sharded=True), dp rank {self.dp_rank}",
                hint=f"pass this dp rank's {share} samples, or the global batch of {plan.global_batch} with "
                     f"pre_sharded=False")
        if symbol == "batch" and not pre_sharded and got != plan.global_batch:
            per = plan.mesh.dp * plan.num_micro_batches
            raise XirangError(
                f"input {name!r} has a global batch of {got} samples; this plan splits exactly "
                f"{plan.global_batch} = dp {plan.mesh.dp} x {plan.num_micro_batches} micro-batches x "
                f"micro_batch {plan.micro_batch}", where="PipelineRuntime.train_step",
                hint=f"pass {plan.global_batch} samples per step, or re-plan (xirang.plan(..., global_batch=N)) for "
                     f"another N; with dp x micro-batches = {per} the valid global batches are "
                     f"{', '.join(str(per * k) for k in range(1, 4))}, ... (micro_batch 1, 2, 3, ...)")
        if symbol != "batch" and symbol in self.symbols and got != self.symbols[symbol]:
            raise XirangError(
                f"input {name!r} has {symbol} {got} on dim {dim}; the stages were built for "
                f"{symbol} {self.symbols[symbol]}", where="PipelineRuntime.train_step",
                hint=f"pass inputs of {symbol} {self.symbols[symbol]}, or build the runtime with example inputs "
                     f"of the new shape (stage buffers have static shapes)")

    def gather_timestamps(self) -> list:
        """Every pp rank's (pp rank, action, start, end) of the last step, on every rank (collective
        over the pp group); feed it to ``schedule_sim.idle_fractions``."""
        mine = list(self.last_step.timestamps) if self.last_step else []
        if self.groups.pp is None:
            return mine
        pieces = [None] * self.pp
        dist.all_gather_object(pieces, mine, group=self.groups.pp)
        return [entry for piece in pieces for entry in piece]
