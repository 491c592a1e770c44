"""The one runtime: one rank's compiled dp x pp x tp training program (pp = 1 is a one-stage pipeline).

    # inside each launched rank (codegen/runtime/launch.py or torchrun); xirang.compile builds it
    compiled = xirang.compile(model, world=8, example_kwargs=batch, global_batch=64)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    loss = compiled.train_step(**global_batch)    # every rank passes the same global batch
    optimizer.step(); optimizer.zero_grad()       # (pre_sharded=True: this dp rank's share)

Construction takes the rank's ``Program`` (codegen/emit.py, made by the lowering passes), builds
and checks the schedule, and binds this rank's stages to copies of the model's tensors
(codegen/runtime/pipeline_state.py, which also loads and gathers them), each the rank's tp shard.
A step: this dp rank's share of the batch, cut into the plan's micro-batches, goes through the
executor (codegen/runtime/pipeline_executor.py); data-parallel gradients are averaged in buckets
launched during each stage's last backward (codegen/runtime/grad_sync.py); then the gradients of
tied parameters are summed over the ranks that hold them, and the loss -- the mean over the global
batch, as on one device when every micro-batch counts the same number of loss terms (with
``ignore_index`` labels spread unevenly it is the mean of the per-share means) -- is given to every
rank.

Tied parameters: a tensor read by stages on different pipeline ranks (a token embedding tied to
the LM head) is a copy on each. Each copy gets the gradient of its own uses only; summing them
over a "tied" group (one per dp and tp index, the ranks holding the copies) gives every copy the
full gradient, so the same optimizer step keeps them equal (Megatron-LM's embedding group). The
sum runs after the dp average; both are linear, so the order does not matter.

Optimizer: any torch optimizer over ``parameters()``; tp-sharded parameters are updated shard by
shard, which is exact for element-wise optimizers (SGD, Adam, AdamW), not for ones that read a
whole tensor (LAMB's trust ratio, clipping by total norm).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from xirang.passes.lowering.precision import COMPUTE_DTYPES
from xirang.codegen.emit import Program, attach, program_source
from xirang.ir.errors import XirangError

from xirang.codegen.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradientBuckets
from xirang.codegen.runtime.offload import attach_offload
from xirang.codegen.runtime.pipeline_executor import LocalStage, PipelineExecutor, StepRecord
from xirang.codegen.runtime.pipeline_state import bind_state, gather_full, load_full_state, tied_groups
from xirang.codegen.runtime.process_groups import build_mesh_groups
from xirang.codegen.runtime.rng_streams import make_rng
from xirang.codegen.runtime.schedule_check import check_schedule
from xirang.ir.schedules import Backward, BackwardWeight, build_schedule
from xirang.passes.analysis.trace_inputs import bind_inputs




def reduce_dtype(name: str):
    """The dtype dp gradients are reduced in (``plan.grad_reduce_dtype``): None keeps fp32 gradients as they are."""
    return None if name == "fp32" else COMPUTE_DTYPES[name]


class CompiledModel:
    """One rank's compiled training program (see the module docstring).

    ``model``: the module, or a mapping FQN -> tensor like its ``state_dict(keep_vars=True)`` (a rank
    then needs neither the model class nor a trace). ``program``: this rank's ``Program``.
    ``groups``: the mesh's process groups (``build_mesh_groups(plan.mesh)`` by default).
    ``counter``: a ``CommCounter`` every collective records on; ``event_log``: receives the dp
    buckets' launch/wait events. ``source_of``: rank -> that rank's program source, for ``code(rank)``
    of other ranks (given by ``xirang.compile``, which can lower the model for any rank). ``seed``
    and ``rng`` ("streams" or "exact"): the random ops' streams (codegen/runtime/rng_streams.py).
    """

    def __init__(self, model, plan, program: Program, *, groups=None, bucket_bytes: Optional[int] = None,
                 device="cpu", counter=None, event_log: Optional[list] = None,
                 source_of: Optional[Callable[[int], str]] = None, seed: Optional[int] = None,
                 rng: str = "streams"):
        self.groups = groups or build_mesh_groups(plan.mesh)
        self.rank = self.groups.rank
        self.tp, self.tp_rank = self.groups.axis_size("tp"), self.groups.axis_index("tp")
        # random ops draw on streams the runtime owns: one seed, the step and micro-batch it runs
        self.rng = make_rng(program, plan, seed=seed, mode=rng, dp_rank=self.groups.axis_index("dp"))
        attach(program, tp_group=self.groups.tp, counter=counter, rng=self.rng)
        # plan.offload: the program's offloaded blocks share one ActivationOffload (None: no block offloads)
        self.activation_offload = attach_offload(program, device)
        self._forward = model.forward if isinstance(model, torch.nn.Module) else None
        self._source_of = source_of
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
        self.grad_buckets = buckets or {}  # local stage -> its dp GradientBuckets
        self.executor = PipelineExecutor(
            self.schedule, self.pp_rank, stages, peers=self.groups.pp_ranks, device=self.device,
            tensors_per_cut=max((len(p.crossing_in) for p in self.programs), default=1) or 1,
            grad_buckets=buckets, offload=self.activation_offload, rng=self.rng)
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
                                       reduce_dtype=reduce_dtype(self.plan.grad_reduce_dtype),
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

    # --- randomness --------------------------------------------------------------------------------

    def rng_state(self) -> dict:
        """What a checkpoint saves of the randomness: ``{"seed", "step", "mode"}`` (draws are
        counter-based: the seed and the next step fix every future draw; codegen/ops/random_ops.py)."""
        return self.rng.state()

    def load_rng_state(self, state: dict) -> None:
        """Continue from a checkpoint's ``rng_state()``: the next step draws as it would have."""
        self.rng.load_state(state)

    # --- a step ----------------------------------------------------------------------------------

    def code(self, rank: Optional[int] = None) -> str:
        """Python source of the stage modules rank ``rank`` (default: this one) runs."""
        rank = self.rank if rank is None else rank
        if rank == self.rank:
            return program_source(self.program, self.plan, rank, self.schedule.stages_of(self.pp_rank))
        if self._source_of is None:
            raise XirangError(f"this CompiledModel cannot print rank {rank}'s program: it was built from a "
                              f"program alone", where="CompiledModel.code", hint="build it with xirang.compile")
        return self._source_of(rank)

    def train_step(self, *args, pre_sharded: bool = False, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch through the schedule, gradients averaged over dp
        and summed over tied copies; returns the mean loss of the global batch. The inputs are the
        model's (positional or by name): the global batch on every rank, or with ``pre_sharded=True``
        this dp rank's share (every pp and tp rank of one dp index passes the same share)."""
        batch = bind_inputs(self._forward, args, kwargs) if args else kwargs
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
        self.rng.step += 1  # the next step draws anew
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
            raise XirangError(f"train_step is missing the input(s) {missing}", where="CompiledModel.train_step",
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
                where=f"CompiledModel.train_step(pre_sharded=True), dp rank {self.dp_rank}",
                hint=f"pass this dp rank's {share} samples, or the global batch of {plan.global_batch} with "
                     f"pre_sharded=False")
        if symbol == "batch" and not pre_sharded and got != plan.global_batch:
            per = plan.mesh.dp * plan.num_micro_batches
            raise XirangError(
                f"input {name!r} has a global batch of {got} samples; this plan splits exactly "
                f"{plan.global_batch} = dp {plan.mesh.dp} x {plan.num_micro_batches} micro-batches x "
                f"micro_batch {plan.micro_batch}", where="CompiledModel.train_step",
                hint=f"pass {plan.global_batch} samples per step, or re-plan (xirang.plan(..., global_batch=N)) for "
                     f"another N; with dp x micro-batches = {per} the valid global batches are "
                     f"{', '.join(str(per * k) for k in range(1, 4))}, ... (micro_batch 1, 2, 3, ...)")
        if symbol != "batch" and symbol in self.symbols and got != self.symbols[symbol]:
            raise XirangError(
                f"input {name!r} has {symbol} {got} on dim {dim}; the stages were built for "
                f"{symbol} {self.symbols[symbol]}", where="CompiledModel.train_step",
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
