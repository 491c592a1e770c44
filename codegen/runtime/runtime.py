"""The compiled object one rank holds: its program, its local parameters, and ``train_step``.

    compiled = xirang.compile(model, world=4, example_kwargs=batch, global_batch=8, tp=2)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    for batch in loader:
        loss = compiled.train_step(**batch)   # forward + backward + dp gradient averaging
        optimizer.step()                      # the user's optimizer, on local shards
        optimizer.zero_grad()

``train_step`` takes the GLOBAL batch on every rank (``pre_sharded=True``: this dp rank's share,
already split by a data loader), runs the plan's micro-batches (gradient accumulation, dp
all-reduce only after the last, in buckets overlapped with its backward) and returns the loss:
each micro-batch's mean, averaged over micro-batches and dp ranks. That is the single-device mean
over the global batch whenever every micro-batch counts the same number of loss terms; with
``ignore_index`` labels spread unevenly it is the mean of the per-share means instead (a
per-share weighting would need the global count of kept labels before the backward).

Optimizer: any torch optimizer over ``parameters()``; tp-sharded parameters are updated shard by
shard, which is exact for element-wise optimizers (SGD, Adam, AdamW), not for ones that read a
whole tensor (LAMB's trust ratio, gradient clipping by total norm: use ``grad_norm`` below).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import ROLE, SYMBOL_DIMS

from xirang.codegen.emit import attach, emit_rank_program, rank_source
from xirang.codegen.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradientBuckets
from xirang.codegen.runtime.shard_params import full_tensor, load_local, local_state, param_shards

REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class CompiledModel:
    """One rank's compiled training program (see the module docstring)."""

    def __init__(self, model, gm, plan, groups, *, device="cpu", bucket_bytes: Optional[int] = None,
                 counter=None, event_log: Optional[list] = None):
        self.plan, self.groups, self.device = plan, groups, torch.device(device)
        self.rank, self._gm, self._model_forward = groups.rank, gm, model.forward
        self.tp_rank, self.tp = groups.axis_index("tp"), groups.axis_size("tp")
        self.dp_rank, self.dp = groups.axis_index("dp"), groups.axis_size("dp")
        self.counter = counter
        self.program = attach(emit_rank_program(gm, plan, rank=self.rank, device=self.device),
                              tp_group=groups.tp, counter=counter)
        self.shards = param_shards(gm, plan.placements)
        self._state = local_state(model, self.shards, tp_rank=self.tp_rank, tp=self.tp, device=self.device)
        self._inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and ROLE.get(n, None) == "input"]
        self._batch_dims = {name: next((d for d, s in dims.items() if s == "batch"), None)
                            for name, dims in SYMBOL_DIMS.get(gm, {}).items()}
        self.grad_sync = GradientBuckets(self.parameters(), groups.dp,
                                         bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                         reduce_dtype=REDUCE_DTYPES[plan.grad_reduce_dtype],
                                         event_log=event_log, counter=counter)

    # --- parameters --------------------------------------------------------------------------------

    def named_parameters(self):
        """(FQN, local shard) of every trainable parameter, in forward order."""
        return [(s.name, self._state[s.placeholder]) for s in self.shards
                if s.role == "parameter" and self._state[s.placeholder].requires_grad]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def local_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def full_state_dict(self) -> dict:
        """FQN -> full tensor (gathered over tp, padding stripped), tied weights under every alias.
        Collective over the tp group: call it on every rank."""
        found = {}
        for shard in self.shards:
            full = full_tensor(self._state[shard.placeholder], shard, self.groups.tp)
            for alias in shard.aliases:
                found[alias] = full
        return found

    def full_gradients(self) -> dict:
        """FQN -> full gradient (after ``train_step``), gathered like ``full_state_dict``."""
        return {s.name: full_tensor(self._state[s.placeholder].grad, s, self.groups.tp)
                for s in self.shards if s.role == "parameter" and self._state[s.placeholder].grad is not None}

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Copy each rank's piece of the full tensors in place (optimizers keep their references)."""
        for shard in self.shards:
            name = next((a for a in shard.aliases if a in state_dict), None)
            if name is None:
                raise XirangError(f"the state dict has no entry for {shard.name}", where="load_full_state_dict",
                                  hint=f"pass a full state dict of the model (keys like {shard.name!r})")
            load_local(self._state[shard.placeholder], state_dict[name], shard, tp_rank=self.tp_rank, tp=self.tp)

    # --- programs ----------------------------------------------------------------------------------

    def code(self, rank: Optional[int] = None) -> str:
        """Python source of rank ``rank``'s program (default: this rank's)."""
        return rank_source(self._gm, self.plan, self.rank if rank is None else rank, self.device)

    # --- a step ------------------------------------------------------------------------------------

    def train_step(self, *args, pre_sharded: bool = False, **kwargs) -> torch.Tensor:
        """Forward and backward over the batch, gradients averaged over dp; returns the loss."""
        from xirang.passes.analysis.trace_inputs import name_inputs
        named = name_inputs(_Signature(self._model_forward), args, kwargs)
        missing = [name for name in self._inputs if name not in named]
        if missing:
            raise XirangError(f"train_step is missing the input(s) {missing}", where="train_step",
                              hint="pass the same inputs as the example the model was compiled with")
        share = named if pre_sharded else {n: self._split(n, named[n], self.dp, self.dp_rank) for n in self._inputs}
        micro = self.plan.num_micro_batches
        for param in self.parameters():
            param.grad = None  # each step computes fresh gradients
        total = torch.zeros((), device=self.device)
        for index in range(micro):
            inputs = {n: self._split(n, share[n], micro, index) for n in self._inputs}
            last = index == micro - 1
            with (self.grad_sync.no_sync() if not last else nullcontext()):
                (loss,) = self.program(*self._arguments(inputs))
                (loss / micro).backward()
            total += loss.detach() / micro
        self.grad_sync.wait()
        if self.dp > 1:  # the reported loss only: not a gradient, not counted on the counter
            dist.all_reduce(total, group=self.groups.dp)
            total /= self.dp
        return total

    def _arguments(self, inputs: dict) -> list:
        return [self._state[n.name] if n.name in self._state else inputs[n.name]
                for n in self.program.graph.nodes if n.op == "placeholder"]

    def _split(self, name: str, value, parts: int, index: int):
        dim = self._batch_dims.get(name)
        if parts == 1 or dim is None or not isinstance(value, torch.Tensor):
            return value
        if value.shape[dim] % parts:
            raise XirangError(f"input {name!r} has {value.shape[dim]} samples on its batch dim {dim}, which do not "
                              f"split into {parts} equal shares", where="train_step",
                              hint=f"pass a batch that is a multiple of dp x micro-batches "
                                   f"({self.dp} x {self.plan.num_micro_batches})")
        return value.chunk(parts, dim=dim)[index]


class _Signature:
    """Lets ``name_inputs`` bind arguments to a forward's parameter names without the module."""

    def __init__(self, forward):
        self.forward = forward
