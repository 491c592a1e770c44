"""The one runtime: one rank's compiled dp x pp x tp training program (pp = 1 is a one-stage pipeline).

    # inside each launched rank (codegen/runtime/launch/launcher.py or torchrun); xirang.compile builds it
    compiled = xirang.compile(model, world=8, example_kwargs=batch, global_batch=64)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    loss = compiled.train_step(**global_batch)    # every rank passes the same global batch
    optimizer.step(); optimizer.zero_grad()       # (pre_sharded=True: this dp rank's share)

Construction takes the rank's ``Program`` (codegen/emit.py, made by the lowering passes), builds and checks the
schedule, and binds this rank's stages to copies of the model's tensors (state/pipeline_state.py, which also loads
and gathers them), each the rank's tp shard. A step: this dp rank's share of the batch, cut into the plan's
micro-batches, goes through the executor (executor/pipeline_executor.py); data-parallel gradients are averaged in
buckets launched during each stage's last backward (data_parallel/grad_sync.py); then the gradients of tied
parameters are summed over the ranks that hold them, and the loss -- the mean over the global batch, as on one device
when every micro-batch counts the same number of loss terms (with ``ignore_index`` labels spread unevenly it is the
mean of the per-share means) -- is given to every rank.

Tied parameters: a tensor read by stages on different pipeline ranks (a token embedding tied to the LM head) is a copy
on each. Each copy gets the gradient of its own uses only; summing them over a "tied" group (one per dp and tp index,
the ranks holding the copies) gives every copy the full gradient, so the same optimizer step keeps them equal
(Megatron-LM's embedding group). The sum runs after the dp average; both are linear, so the order does not matter.

Optimizer: any torch optimizer over ``parameters()``; tp-sharded parameters are updated shard by shard, which is exact
for element-wise optimizers (SGD, Adam, AdamW), not for ones that read a whole tensor (LAMB's trust ratio); clipping
by total norm is ``clip_grad_norm_`` (grad_norm.py).
ZeRO-1 and 3 (plan.zero_stage, dp > 1): ``parameters()`` and ``named_parameters()`` are the
shard pieces of dist_optimizer.py, each under its model parameter's name; under 3 the model's parameters
(``named_model_parameters()``) are freed between steps (param_shards.py).
"""
from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.distributed as dist

from xirang.passes.lowering.precision import COMPUTE_DTYPES
from xirang.codegen.emit import (Program, attach, check_context_parallel, check_context_parallel_program,
                                 check_enacted_axes, check_expert_parallel, program_source)
from xirang.codegen.runtime.data_parallel.expert_grads import StageBuckets
from xirang.ir.errors import XirangError
from xirang.codegen.ops.comm_counter import record_call
from xirang.codegen.runtime.data.batch_checks import BatchChecks
from xirang.codegen.runtime.data.sequence_cut import cut_sequences
from xirang.codegen.runtime.data_parallel.grad_norm import clip_grad_norm
from xirang.codegen.runtime.data_parallel.grad_sync import (DEFAULT_BUCKET_BYTES, GradientBuckets,
                                                            plan_bucket_algorithms, planned_buckets)
from xirang.codegen.runtime.memory.offload import attach_offload
from xirang.codegen.runtime.data_parallel.param_shards import zero_shards
from xirang.codegen.runtime.executor.pipeline_executor import LocalStage, PipelineExecutor, StepRecord
from xirang.codegen.runtime.state.pipeline_state import bind_state, gather_full, load_full_state, tied_groups
from xirang.codegen.runtime.launch.process_groups import (ContextGroups, build_context_groups, build_mesh_groups,
                                                           build_two_level_groups)
from xirang.codegen.runtime.state.optimizer_check import OptimizerCheck
from xirang.codegen.runtime.state.rng_streams import make_rng
from xirang.codegen.runtime.executor.schedule_check import check_schedule
from xirang.codegen.runtime.state.state_dict_keys import refuse_mismatch, state_dict_keys
from xirang.ir.context_method import a2a_degree, recorded_method
from xirang.ir.schedules import Backward, BackwardWeight, build_schedule
from xirang.passes.analysis.trace_inputs import bind_inputs


def reduce_dtype(name: str):
    """The dtype dp gradients are reduced in (``plan.grad_reduce_dtype``): None keeps fp32 gradients as they are."""
    return None if name == "fp32" else COMPUTE_DTYPES[name]


class CompiledModel:
    """One rank's compiled training program (see the module docstring).

    ``model``: the module, or a mapping FQN -> tensor like its ``state_dict(keep_vars=True)`` (a rank then needs
    neither the model class nor a trace). ``program``: this rank's ``Program``. ``groups``: the mesh's process
    groups (``build_mesh_groups(plan.mesh)`` by default). ``counter``: a ``CommCounter`` every collective records
    on; ``event_log``: receives the dp buckets' launch/wait events. ``source_of``: rank -> that rank's program
    source, for ``code(rank)`` of other ranks (given by ``xirang.compile``, which can lower the model for any
    rank). ``seed`` and ``rng`` ("streams" or "exact"): the random ops' streams (codegen/runtime/state/rng_streams.py).
    A module built on ``meta`` is initialised per tensor from ``seed`` (``init``: per-module init function;
    codegen/runtime/state/weight_init.py). No reference to ``model`` is kept: only its forward's signature.
    """

    def __init__(self, model, plan, program: Program, *, groups=None, bucket_bytes: Optional[int] = None,
                 device="cpu", counter=None, event_log: Optional[list] = None,
                 source_of: Optional[Callable[[int], str]] = None, seed: Optional[int] = None,
                 rng: str = "streams", init: Optional[Callable] = None):
        check_enacted_axes(plan.mesh, "CompiledModel(plan=...)")  # a hand-made runtime too, before any group
        check_expert_parallel(plan)
        check_context_parallel(plan)
        self.groups = groups or build_mesh_groups(plan.mesh)
        self.rank = self.groups.rank
        self.tp, self.tp_rank = self.groups.axis_size("tp"), self.groups.axis_index("tp")
        # random ops draw on streams the runtime owns: one seed, the step and micro-batch it runs
        self.rng = make_rng(program, plan, seed=seed, mode=rng, dp_rank=self.groups.axis_index("dp"))
        attach(program, tp_group=self.groups.tp, ep_group=self.groups.ep, cp_group=self.groups.cp, counter=counter,
               rng=self.rng, context_groups=self._context_groups(plan))
        # plan.offload: the program's offloaded blocks share one ActivationOffload (None: no block offloads)
        self.activation_offload = attach_offload(program, device)
        self._forward = inspect.signature(model.forward) if isinstance(model, torch.nn.Module) else None
        self._optimizer_check = OptimizerCheck(model)  # the first step refuses an optimizer of other tensors
        self._source_of = source_of
        self.plan, self.device, self.program = plan, torch.device(device), program
        self.dp, self.dp_rank = self.groups.axis_size("dp"), self.groups.axis_index("dp")
        self.pp, self.pp_rank = self.groups.axis_size("pp"), self.groups.axis_index("pp")
        self.symbols, self.programs = program.symbols, program.stages
        self.extra_warmup: tuple = ()  # more 1F1B warm-up forwards per pp rank (set_extra_warmup)
        self.schedule = self._build_schedule(plan)
        self._batch_dims, self._inputs = program.batch_dims, program.inputs
        # input name -> its batch dim (None: not split over dp ranks and micro-batches)
        self._batch_dim_of = {name: next((d for d, s in dims.items() if s == "batch"), None)
                              for name, dims in program.batch_dims.items()}
        self._aliases, self._trainable = program.aliases, program.trainable

        local = self.schedule.stages_of(self.pp_rank)
        self._state = bind_state(model, [self.programs[i] for i in local], self._trainable, self.device,
                                 shards=program.shards, tp_rank=self.tp_rank, tp=self.tp,
                                 seed=self.rng.seed, init=init)
        self._stages = stages = {i: LocalStage(self.programs[i], [self._state[fqn] for fqn in
                                                                 self.programs[i].parameter_names]) for i in local}
        check_context_parallel_program(program, plan)  # before tied_groups, whose groups ignore cp
        self._tied = tied_groups(self.programs, plan.mesh, self.groups, self._trainable)
        self._counter, self._event_log = counter, event_log
        self.cp = self.groups.axis_size("cp")
        buckets = self._grad_buckets(stages, bucket_bytes) if self.dp * self.cp > 1 else None
        self.grad_buckets = buckets or {}  # local stage -> its dp GradientBuckets
        # ZeRO-1 and 3: the optimizer's shards (3: the parameters freed at rest, stages gated), or None
        self.zero, self._stages = zero_shards(plan, self.grad_buckets, self._state, stages=stages,
                                              actions=self.schedule.ranks[self.pp_rank], tied=self._tied,
                                              shards=program.shards, groups=self.groups, counter=counter)
        self.executor = self._build_executor()
        self.last_step: Optional[StepRecord] = None
        self.rebalancer = None  # a data_parallel/dp_balance.DpRebalancer moves dp shares between steps
        self.injection = None  # an executor/injection.AdaptiveInjection deepens 1F1B warm-ups between steps
        self._batch_checks = BatchChecks(plan, self.programs, self._inputs, self._batch_dims, self.symbols,
                                         rank=self.rank, dp_rank=self.dp_rank, device=self.device)
        self._weigh_share()

    def _context_groups(self, plan) -> Optional[ContextGroups]:
        """USP attention's all-to-all and ring sub-groups of the cp group (ir/context_method.py), made on every
        rank at the same point; None for any other method."""
        if plan.mesh.cp == 1:
            return None
        a2a = a2a_degree(recorded_method(plan.collectives), plan.mesh.cp)
        return build_context_groups(plan.mesh, a2a, self.rank) if 1 < a2a < plan.mesh.cp else None

    def _build_schedule(self, plan):
        schedule = build_schedule(plan.schedule, self.pp, plan.micro_batches_per_dp_rank[self.dp_rank],
                                  plan.virtual_stages, self.extra_warmup)
        check_schedule(schedule)
        return schedule

    def _build_executor(self) -> PipelineExecutor:
        cut, groups = max((len(p.crossing_in) for p in self.programs), default=1) or 1, self.groups
        return PipelineExecutor(self.schedule, self.pp_rank, self._stages, peers=groups.pp_ranks, device=self.device,
                                tensors_per_cut=cut, grad_buckets=self.grad_buckets or None, rng=self.rng,
                                offload=self.activation_offload, down_group=groups.pp_down,
                                recast_weights=self.plan.precision != "fp32")

    def _weigh_share(self) -> None:
        """This dp rank's weight in the step's averages (loss and gradients): n_i * dp / N for its
        n_i of the N samples, 1 with even shares; and where its samples start (exact randomness)."""
        plan, shares = self.plan, self.dp_shares
        self.share_weight = 1.0 if not plan.dp_shares else shares[self.dp_rank] * self.dp / plan.global_batch
        for buckets in self.grad_buckets.values():
            buckets.share_weight = self.share_weight
        self.rng.share_start = sum(shares[:self.dp_rank])
        self._batch_checks.plan = plan

    @property
    def dp_shares(self) -> tuple:
        """Samples per step of each dp rank now (the plan's, or as rebalancing moved them)."""
        plan = self.plan
        return plan.dp_shares or (plan.global_batch // self.dp,) * self.dp

    def set_dp_shares(self, shares) -> None:
        """Give each dp rank ``shares[i]`` samples from the next step on (whole micro-batches, summing
        to the global batch; every rank must call it with the same shares). The program is unchanged:
        a rank runs more or fewer micro-batches, and the averages weigh each rank by its share."""
        plan = self.plan.with_dp_shares(shares)
        check_expert_parallel(plan)  # an ep group's ranks must run as many micro-batches
        check_context_parallel(plan)
        self.schedule = self._build_schedule(plan)
        self.plan = plan
        self.executor = self._build_executor()
        self._weigh_share()

    def set_extra_warmup(self, extra_warmup) -> None:
        """Run ``extra_warmup[r]`` more forwards in pipeline rank r's 1F1B warm-up from the next step on
        (codegen/runtime/executor/injection.py; every rank of the pp group must call it with the same values)."""
        self.extra_warmup = tuple(extra_warmup)
        self.schedule = self._build_schedule(self.plan)
        self.executor = self._build_executor()

    def _grad_buckets(self, stages: dict, bucket_bytes: Optional[int]) -> dict:
        """One GradientBuckets per local stage, with the plan's buckets and algorithms (or, given
        ``bucket_bytes``, buckets of that size, all flat); a parameter two local stages read belongs to
        the one whose last backward comes last, so its dp all-reduce sees every contribution."""
        last = {}
        for position, action in enumerate(self.schedule.ranks[self.pp_rank]):
            if isinstance(action, (Backward, BackwardWeight)):
                last[action.stage] = position
        owner = {}
        for index in sorted(stages, key=lambda i: last[i]):
            for fqn in stages[index].program.parameter_names:
                owner[fqn] = index
        follow_plan = bucket_bytes is None and bool(self.plan.buckets)
        algorithms = plan_bucket_algorithms(self.plan) if follow_plan else {}
        hierarchy = None
        if "hierarchical" in algorithms.values():  # the same on every rank: new_group is collective
            # on the group the buckets all-reduce over (dp x cp under cp): its sub-groups must sum the same ranks
            hierarchy = build_two_level_groups(self.plan.mesh, self.plan.world, self.plan.mesh.gradient_axis,
                                               self.rank)
        found = {}
        shards = self.program.shards
        for index, stage in stages.items():
            names = [fqn for fqn in stage.program.parameter_names if owner[fqn] == index and fqn in self._trainable]
            experts = [fqn for fqn in names if fqn in shards and shards[fqn].experts]
            names = [fqn for fqn in names if fqn not in experts]
            planned = (planned_buckets(self.plan, stage.program.parameter_names, names, self._state, algorithms)
                       if follow_plan else None)
            # cp ranks hold the same parameters, each a share of the global mean's gradient (context_parallel.py):
            # summed over dp x cp (the edp group at ep = 1), divided by dp
            group = getattr(self.groups, self.plan.mesh.gradient_axis)
            divisor = self.dp if self.cp > 1 else None
            found[index] = GradientBuckets([self._state[fqn] for fqn in names], group, divisor=divisor,
                                           buckets=planned, hierarchy=hierarchy,
                                           bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                           reduce_dtype=reduce_dtype(self.plan.grad_reduce_dtype),
                                           event_log=self._event_log, counter=self._counter)
            if experts:  # expert weights: summed over their edp group, averaged over dp (expert_grads.py)
                found[index] = StageBuckets(found[index], GradientBuckets(
                    [self._state[fqn] for fqn in experts], self.groups.edp,
                    bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                    reduce_dtype=reduce_dtype(self.plan.grad_reduce_dtype), event_log=self._event_log,
                    counter=self._counter, divisor=self.dp * self.groups.axis_size("cp")))
        return found

    # --- parameters ------------------------------------------------------------------------------

    def named_parameters(self) -> list:
        """(FQN, tensor) pairs the optimizer steps, under the single-device model's names: this rank's
        trainable parameters (each its tp shard, once, in forward order), or under ZeRO-1 and 3 the shard
        pieces of this dp rank (data_parallel/dist_optimizer.py), so optimizer groups chosen by name train
        as ``parameters()`` does whatever the stage."""
        return self.zero.named_parameters() if self.zero else self.named_model_parameters()

    def parameters(self) -> list:
        """What the optimizer steps (``named_parameters()``'s tensors)."""
        return [tensor for _, tensor in self.named_parameters()]

    def named_model_parameters(self) -> list:
        """(FQN, tensor) of the program's bound parameters, each its tp shard, once, in forward order: what
        the stages read. Without ZeRO these are what the optimizer steps; under ZeRO they are refreshed from
        the shard pieces (ZeRO-3: freed at rest, read them inside ``parameters_resident()``)."""
        return [(fqn, tensor) for fqn, tensor in self._state.items()
                if fqn in self._trainable and tensor.requires_grad]

    def parameters_resident(self):
        """A context in which ``named_parameters()`` hold their values between steps: under ZeRO-3 they are
        gathered for it and freed after (at rest each is a NaN expanded to its shape); else nothing to do."""
        return self.zero.parameters_resident() if self.zero else nullcontext()

    def local_param_bytes(self) -> int:
        """Bytes of the trainable tensors this rank holds (its stages' tp shards)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients (every element once);
        returns the total norm. Collective; a non-finite norm clips nothing (data_parallel/grad_norm.py)."""
        if self.zero:
            return self.zero.clip_grad_norm_(max_norm, norm_type)
        return clip_grad_norm(self.named_model_parameters(), max_norm, norm_type, shards=self.program.shards,
                              tied=self._tied, groups=self.groups, device=self.device)

    def full_state_dict(self) -> dict:
        """FQN -> parameter of the whole model, tied weights under every alias. Collective over the
        tp and pp groups: call it on every rank."""
        if not self.zero:
            return self._gather({fqn: t.detach() for fqn, t in self.named_model_parameters()})
        with self.zero.parameters_resident():  # the optimizer's updates (ZeRO-3: freed again after, so copied)
            return self._gather({fqn: t.detach().clone() for fqn, t in self.named_model_parameters()})

    def full_gradients(self) -> dict:
        """FQN -> gradient after ``train_step``, gathered like ``full_state_dict`` (ZeRO-1: from the shards)."""
        named = self.named_model_parameters()
        grads = self.zero.full_gradients() if self.zero else {id(t): t.grad for _, t in named}
        return self._gather({fqn: grads[id(t)] for fqn, t in named if grads.get(id(t)) is not None})

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Copy this rank's piece of the full tensors in place (optimizers keep their references):
        each rank loads only its stages' tensors, tied copies each from the same entry. Every rank
        passes the same full state dict (``pipeline_state.load_full_state``).

        ``strict`` (default, as ``torch.nn.Module.load_state_dict``): a key naming no tensor of the
        model, or a missing parameter, is refused with the keys named, before anything is copied
        (buffers are loaded when present, not required: ``full_state_dict()`` holds parameters
        only). ``strict=False`` loads what matches and returns ``(missing_keys, unexpected_keys)``
        as torch does."""
        result = state_dict_keys(state_dict, self._aliases, self._trainable)
        if strict:
            refuse_mismatch(result, self.rank)
        state = self._state
        if not strict:  # load only this rank's tensors the state dict has (under any alias)
            state = {fqn: t for fqn, t in state.items()
                     if any(name in state_dict for name in (fqn, *self._aliases.get(fqn, ())))}
        with self.parameters_resident():  # ZeRO-3: freed at rest
            load_full_state(state, state_dict, aliases=self._aliases, trainable=self._trainable,
                            shards=self.program.shards, tp_rank=self.tp_rank, tp=self.tp,
                            where=f"pp rank {self.pp_rank} (stages {list(self.schedule.stages_of(self.pp_rank))})")
            if self.zero:
                self.zero.refresh_from_parameters()
        return result

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
        this dp rank's share (every pp and tp rank of one dp index passes the same share).

        Gradients accumulate as ``loss.backward()``'s do: a step adds its gradients to those already
        in ``.grad``, so two steps before ``optimizer.step()`` sum two batches' gradients, and
        ``optimizer.zero_grad()`` starts afresh. The batch is checked against the program first
        (names, tensor kinds, dtypes, ranks, sizes against the plan) and, on more than one rank,
        against the other ranks (one small all-reduce), so a bad batch fails on every rank at once
        instead of training wrongly or leaving the other ranks waiting."""
        try:
            batch = bind_inputs(self._forward, args, kwargs) if args else kwargs
        except XirangError as error:  # its words are about example inputs: say it of this step's
            raise XirangError(f"train_step's inputs do not match the model's forward: "
                              f"{error.what.rsplit(': ', 1)[-1]}", where=f"CompiledModel.train_step, rank {self.rank}",
                              hint=f"pass the inputs the model's forward takes, by name: {list(self._inputs)}"
                              ) from None
        problem = None
        try:
            self._batch_checks.check(batch, pre_sharded)
        except XirangError as error:
            problem = error
        # an optimizer over tensors the runtime does not step: refused on every rank at once, with the batch's
        problem = problem or self._optimizer_check.problem(self.named_parameters(), self.named_model_parameters(),
                                                           self.zero is not None, self.rank)
        entered = time.perf_counter()
        self._batch_checks.agree(batch, pre_sharded, problem)
        origin = time.perf_counter()  # every rank leaves the agreement together: this step's common clock
        micro_batches = self._micro_batches(batch, pre_sharded)
        if self.zero:
            self.zero.before_step()  # ZeRO-1: the last optimizer step's slices into every replica (3: at first use)
        # this step's gradients are computed afresh; what was in .grad (not yet zeroed, or zeroed in place)
        # is added back after, as autograd would. A bucket slot is copied out: this step writes into it.
        earlier = {param: param.grad.clone() if any(b.holds(param.grad) for b in self.grad_buckets.values())
                   else param.grad for param in self.parameters() if param.grad is not None}
        for param in earlier:
            param.grad = None
        record = self.executor.run(micro_batches)
        record.timestamps = [(rank, action, start - origin, end - origin)
                             for rank, action, start, end in record.timestamps]
        self.last_step = record
        self.rng.step += 1  # the next step draws anew
        for fqn, group in self._tied:
            param = self._state[fqn]
            if param.grad is None:  # every holder must join the sum, used this step or not
                param.grad = torch.zeros_like(param)
            record_call(self._counter, "all_reduce", param.grad.nbytes, dist.get_world_size(group), f"tied:{fqn}")
            dist.all_reduce(param.grad, group=group)
        record.finished = time.perf_counter() - origin  # gradients final: the exposed sync ends here
        if self.zero:
            self.zero.after_step()  # the whole buckets' slices to the shards; ZeRO-3 frees the parameters
        for param, grad in earlier.items():
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        loss = self._step_loss(record)
        record.outside = origin - entered + time.perf_counter() - origin - record.finished  # agreement, loss
        for controller in (self.rebalancer, self.injection):  # they change shares or warm-ups between steps
            if controller is not None:
                controller.after_step()
        return loss

    # --- the batch against the program and the other ranks ----------------------------------------

    def _step_loss(self, record: StepRecord) -> torch.Tensor:
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        if len(record.losses) == 1 and self.groups.dp is None and self.groups.pp is None:
            return record.losses[0]  # the mean of one value is that value, bit for bit; no collective runs on it
        loss = torch.zeros((), device=self.device)
        if self.pp_rank == last_rank:
            loss = torch.stack(record.losses).mean()
            if self.share_weight != 1.0:
                loss = loss * self.share_weight
            if self.groups.dp is not None:
                dist.all_reduce(loss, group=self.groups.dp)
                loss /= self.dp
        if self.groups.pp is not None:
            dist.broadcast(loss, src=self.groups.pp_ranks[last_rank], group=self.groups.pp)
        return loss

    def _micro_batches(self, batch: dict, pre_sharded: bool) -> list:
        m, sizes = self.schedule.num_micro_batches, self.dp_shares
        if m == 1 and (pre_sharded or self.dp == 1) and self.cp == 1:  # the one micro-batch is the batch itself
            return [{name: batch[name] for name in self._inputs}]
        shares = {}
        start = sum(sizes[:self.dp_rank])
        for name in self._inputs:
            value, batch_dim = batch[name], self._batch_dim_of.get(name)
            if batch_dim is None:
                shares[name] = [value] * m
                continue
            # views, never copies (at m = 1 the micro-batch is the share)
            share = value if pre_sharded or self.dp == 1 else value.narrow(batch_dim, start, sizes[self.dp_rank])
            shares[name] = [share] if m == 1 else list(share.chunk(m, dim=batch_dim))
        micro_batches = [{name: shares[name][mb] for name in self._inputs} for mb in range(m)]
        return cut_sequences(micro_batches, self._batch_dims, self.groups.cp) if self.cp > 1 else micro_batches

    def measured_costs(self):
        """The last step's measured stage and sync seconds, gathered from every rank (collective over the
        world; ``calibration/step_costs.measure_step``): what ``xirang.reprice`` corrects the plan with."""
        from xirang.codegen.runtime.calibration.step_costs import measure_step
        return measure_step(self)

    def gather_timestamps(self) -> list:
        """Every pp rank's (pp rank, action, start, end) of the last step, on every rank (collective
        over the pp group); feed it to ``schedule_sim.idle_fractions``."""
        mine = list(self.last_step.timestamps) if self.last_step else []
        if self.groups.pp is None:
            return mine
        pieces = [None] * self.pp
        dist.all_gather_object(pieces, mine, group=self.groups.pp)
        return [entry for piece in pieces for entry in piece]
