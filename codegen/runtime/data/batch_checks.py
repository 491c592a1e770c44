"""What a training step checks of its batch before any rank computes: against the program (input names,
dtypes, ranks, fixed dims, batch and sequence sizes against the plan) and against the other ranks.

The cross-rank check is one small all-reduce (the max of each figure and of its negation) of a few
numbers per input -- shape, dtype and, for global batches, a sampled position-weighted checksum --
so a rank with a bad batch, or ranks given different batches, fail together instead of one raising
while the others wait in a collective.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.passes.planning.step_sync_costs import agreement_width


def batch_layout(batch: dict) -> tuple:
    """What ``BatchChecks.check`` reads of a batch: each name, and for a tensor its dtype and shape."""
    return tuple((name, value.dtype, value.shape) if isinstance(value, torch.Tensor) else (name, None)
                 for name, value in batch.items())


class BatchChecks:
    """The checks of one rank's ``CompiledModel``: ``check`` (this rank's batch against the program)
    and ``agree`` (every rank raises together, and ranks given different batches are refused)."""

    def __init__(self, plan, programs, inputs, batch_dims: dict, symbols: dict, *, rank: int, dp_rank: int,
                 device):
        self.plan, self.programs, self.symbols = plan, programs, symbols
        self._inputs, self._batch_dims = inputs, batch_dims
        self.rank, self.dp_rank, self.device = rank, dp_rank, device
        self._specs = None
        self._passed = None  # (plan, layout) of the last batch that passed: a step's batch is most often like it

    def check(self, batch: dict, pre_sharded: bool) -> None:
        """Refuse a batch the program cannot run (module docstring). The checks read only the plan,
        ``pre_sharded`` and the batch's layout (names, which values are tensors, their dtypes and shapes),
        so a batch laid out like the last one that passed, under the same plan, passes without them."""
        if not isinstance(pre_sharded, bool):
            raise XirangError(f"pre_sharded={pre_sharded!r} must be True or False",
                              where=f"CompiledModel.train_step, rank {self.rank}",
                              hint="pre_sharded=True: this dp rank's share; False: the global batch")
        layout = (pre_sharded, batch_layout(batch))
        passed = self._passed
        if passed is not None and passed[0] is self.plan and passed[1] == layout:
            return
        self._check(batch, pre_sharded)
        self._passed = (self.plan, layout)

    def _check(self, batch: dict, pre_sharded: bool) -> None:
        where = f"CompiledModel.train_step, rank {self.rank}"
        missing = [name for name in self._inputs if name not in batch]
        if missing:
            raise XirangError(f"train_step is missing the input(s) {missing}", where=where,
                              hint=f"pass the model inputs {list(self._inputs)} as keywords")
        # a tensor the program never reads would be dropped silently: the model was traced without it
        unread = sorted(name for name, value in batch.items()
                        if name not in self._inputs and isinstance(value, torch.Tensor) and value.dim() > 0)
        if unread:
            raise XirangError(f"train_step got the input(s) {unread}, which the compiled program does not read: it "
                              f"was traced with the inputs {list(self._inputs)}", where=where,
                              hint="drop them, or compile with example inputs that include them (the program "
                                   "computes only what the example inputs reached)")
        specs = self._input_specs()
        for name in self._inputs:
            value, spec = batch[name], specs.get(name)
            if spec is None:  # a program sent to this process keeps no meta: check the batch dims alone
                for dim, symbol in self._batch_dims.get(name, {}).items():
                    if isinstance(value, torch.Tensor) and dim < value.dim():
                        self._check_size(name, value, dim, symbol, pre_sharded)
                continue
            if not isinstance(value, torch.Tensor):
                raise XirangError(f"input {name!r} is a {type(value).__name__}, but the program was built for a "
                                  f"tensor of dtype {spec.dtype} and {len(spec.shape)} dim(s)", where=where,
                                  hint=f"pass {name} as a torch.Tensor like the example inputs")
            dtype = str(value.dtype).replace("torch.", "")
            if dtype != spec.dtype:
                raise XirangError(f"input {name!r} has dtype {dtype}; the program was built for {spec.dtype}",
                                  where=where, hint=f"convert it ({name}.to(torch.{spec.dtype})), or compile with "
                                                    f"example inputs of dtype {dtype}")
            if value.dim() != len(spec.shape):
                raise XirangError(f"input {name!r} has {value.dim()} dim(s) {tuple(value.shape)}; the program was "
                                  f"built for {len(spec.shape)}: {tuple(str(d) for d in spec.shape)}", where=where,
                                  hint="pass tensors shaped like the example inputs (batch first)")
            dims = self._batch_dims.get(name, {})
            for dim, size in enumerate(spec.shape):
                if dim in dims:
                    self._check_size(name, value, dim, dims[dim], pre_sharded)
                elif str(size).isdigit() and value.shape[dim] != int(str(size)):
                    raise XirangError(f"input {name!r} has size {value.shape[dim]} on dim {dim}; the program was "
                                      f"built for {size} there (shape {tuple(str(d) for d in spec.shape)})",
                                      where=where, hint="pass tensors shaped like the example inputs")

    def agree(self, batch: dict, pre_sharded: bool, problem) -> None:
        """Raise ``problem`` (this rank's) or the other ranks' on every rank together, and refuse ranks
        that passed different batches: one all-reduce (max of each figure and of its negation) of a
        few numbers per input -- shape, dtype and, for global batches, a sampled checksum."""
        distributed = self.plan.mesh.size > 1 and dist.is_available() and dist.is_initialized()
        if not distributed:
            if problem is not None:
                raise problem
            return
        figures = [1.0 if problem is not None else 0.0]
        if problem is None:
            for name in self._inputs:
                value = batch[name]
                if not isinstance(value, torch.Tensor):
                    continue
                shape = list(value.shape)
                if pre_sharded:  # shares may differ per dp rank (dp_shares); check() held each to its own
                    for dim, symbol in self._batch_dims.get(name, {}).items():
                        if symbol == "batch" and dim < len(shape):
                            shape[dim] = 0
                figures += [float(value.dim()), float(zlib.crc32(str(value.dtype).encode())), *map(float, shape)]
                if not pre_sharded:  # every rank passes the same global batch: compare a sample of it
                    flat = value.detach().reshape(-1)
                    sample = flat[::max(1, flat.numel() // 4096)]
                    # position-weighted, so a reordered batch (same values, other samples per rank) differs too
                    weights = torch.arange(sample.numel(), dtype=torch.float64, device=sample.device) % 997 + 1
                    # NaN never equals itself: count non-finite values apart so equal batches compare equal
                    values = sample.to(torch.float64)
                    finite = values.isfinite()
                    figures += [float((values.nan_to_num(0.0, 0.0, 0.0) * weights).sum()), float((~finite).sum())]
        # ranks with a problem send fewer figures: pad to a fixed length so the all-reduce matches
        width = agreement_width(len(self._inputs))  # what the cost model prices (step_sync_costs)
        figures = (figures + [0.0] * width)[:width]
        agreed = torch.tensor(figures + [-f for f in figures], dtype=torch.float64, device=self.device)  # NCCL: on GPU
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        highest, lowest = agreed[:width], -agreed[width:]
        if problem is not None:
            raise problem
        if highest[0] > 0:
            raise XirangError("another rank was given a batch train_step refuses (its error names the input)",
                              where=f"CompiledModel.train_step, rank {self.rank}",
                              hint="fix the batch on that rank; every rank must pass a valid batch each step")
        if not torch.equal(highest, lowest):
            what = "the same global batch" if not pre_sharded else "shares of the same shape and dtype"
            raise XirangError(f"the ranks were given different batches in this step; every rank must pass {what}",
                              where=f"CompiledModel.train_step, rank {self.rank}",
                              hint="give every rank the same global batch (the runtime takes each dp rank's share), "
                                   "or pre_sharded=True with each dp rank's share of the plan's size")

    def _check_size(self, name: str, value, dim: int, symbol: str, pre_sharded: bool) -> None:
        plan = self.plan
        got = value.shape[dim]
        micro_batches = plan.micro_batches_per_dp_rank[self.dp_rank]
        share = micro_batches * plan.micro_batch
        if symbol == "batch" and pre_sharded and got != share:
            split = f"dp_shares {list(plan.dp_shares)}" if plan.dp_shares else f"over dp {plan.mesh.dp}"
            raise XirangError(
                f"input {name!r} has {got} samples on its batch dim {dim}; with pre_sharded=True each dp rank "
                f"passes its share of exactly {share} = {micro_batches} micro-batches x micro_batch "
                f"{plan.micro_batch} (global batch {plan.global_batch} {split})",
                where=f"CompiledModel.train_step(pre_sharded=True), dp rank {self.dp_rank}",
                hint=f"pass this dp rank's {share} samples, or the global batch of {plan.global_batch} with "
                     f"pre_sharded=False")
        if symbol == "batch" and not pre_sharded and got != plan.global_batch and plan.dp_shares:
            raise XirangError(
                f"input {name!r} has a global batch of {got} samples; this plan splits exactly "
                f"{plan.global_batch} as dp_shares {list(plan.dp_shares)}", where="CompiledModel.train_step",
                hint=f"pass {plan.global_batch} samples per step")
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

    def _input_specs(self) -> dict:
        """Input name -> the TensorInfo the stage modules were traced with (shape, dtype)."""
        if self._specs is None:
            specs = {}
            for stage in self.programs:
                placeholders = [n for n in stage.module.graph.nodes if n.op == "placeholder"]
                for name, node in zip(stage.user_inputs, placeholders[len(placeholders) - len(stage.user_inputs):]):
                    info = node.meta.get("xr_tensor")
                    if info is not None and hasattr(info, "shape"):
                        specs.setdefault(name, info)
            self._specs = specs
        return self._specs
