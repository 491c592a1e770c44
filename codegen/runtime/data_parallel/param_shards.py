"""ZeRO-3: each dp rank holds only its 1/dp slice of every gradient bucket's parameters between steps.

    compiled = xirang.compile(model, ..., zero_stage=3)   # parameters(): the shard parameters, as ZeRO-1
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)

Built on ZeRO-1 (codegen/runtime/data_parallel/dist_optimizer.py, whose shard parameters, reduce-scattered gradients,
clipping and checkpoint views it keeps): the parameters of a bucket become views of one flat buffer of
the bucket's padded size, whose storage is freed (``untyped_storage().resize_(0)``, as FSDP does) at
rest, so between steps a rank holds its fp32 shard parameters only. Rajbhandari et al. 2020 (P_os+g+p);
Zhao et al. 2023 (PyTorch FSDP: flat parameters, storage freed and re-allocated, forward prefetch).

When a bucket is gathered: just before its first use in a step. Each stage module this rank runs is
copied with a gate call before the first node that reads a parameter of each bucket (``gate_stage``:
an FX rewrite of the stage graph when the runtime binds it). The gate of bucket k issues, in the
rank's fixed bucket order (the order of first use over the schedule's forwards), every gather up to
the next bucket's (the prefetch, asynchronous on the dp group), then waits for bucket k's own. The
first bucket's gather is therefore exposed, the others overlap the previous bucket's forward.

When it is freed: after the step's last backward (its gradient reduce-scatter) and the tied sums,
at the end of ``train_step``. This is the "kept until the backward" variant: one gather per bucket per
step, the parameters resident through every micro-batch's forward and backward (torchtitan keeps
them so under pipelining; re-gathering per micro-batch would multiply the gathers by the micro-batches).
So the peak holds whole parameters as ZeRO-1 does; what ZeRO-3 saves is memory between steps.

Why an FX rewrite here and not a declared lowering pass: the wait points depend only on the bound
tensors (which parameter is in which of this rank's buckets, a runtime fact under ``bucket_bytes=``),
and a pass would need a meta key, an entry in the pass list and emitted-code changes for a call the
runtime alone can answer; the rewrite is confined to the modules this rank runs (``code()`` prints the
program without the gates).

Anything that reads the parameters between steps (``full_state_dict``, ``load_full_state_dict``,
checkpoints) does so inside ``parameters_resident()``: every bucket gathered, freed again after. At
rest each parameter is a NaN expanded to its shape (one element, stride 0), so code that reads it
outside that context sees NaN and code that writes it fails loudly, instead of touching freed storage.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.fx as fx

from xirang.codegen.ops.collectives import all_gather_flat
from xirang.codegen.ops.comm_counter import record_call
from xirang.codegen.runtime.data_parallel.dist_optimizer import ZeroOneShards
from xirang.ir.schedules import Forward

GATE_PREFIX = "xr_gather_bucket_"


class BucketGate(torch.nn.Module):
    """The call a gated stage graph makes before its first read of one bucket's parameters."""

    def __init__(self, owner: "ZeroThreeShards", shard: int):
        super().__init__()
        self.owner, self.shard = owner, shard

    def forward(self) -> None:
        self.owner.ensure(self.shard)


class ZeroThreeShards(ZeroOneShards):
    """ZeRO-1's shards with the parameters themselves sharded at rest (see the module docstring).

    ``stages``: this rank's {stage index: LocalStage}; ``actions``: this pp rank's schedule actions (the
    order of first use); the rest as ``ZeroOneShards``. ``self.stages`` are the gated LocalStages to run."""

    def __init__(self, grad_buckets: dict, fqn_of: dict, *, stages: dict, actions, **kwargs):
        super().__init__(grad_buckets, fqn_of, **kwargs)
        self.flat_params, self._views = [], []  # per shard: the flat buffer (freed at rest), its parameters' views
        with torch.no_grad():
            for shard in self.shards:
                flat, offset, views = shard.flat(shard.params), 0, []
                for param in shard.params:
                    views.append(flat[offset:offset + param.numel()].view(param.shape))
                    offset += param.numel()
                self.flat_params.append(flat)
                self._views.append(views)
        # at rest a parameter is one NaN expanded to its shape (stride 0): its shape stays, reading it gives
        # NaN and writing it fails, where a view of freed storage would read out of bounds (a crash)
        self._at_rest = {}
        for shard in self.shards:
            key = (shard.param.dtype, shard.param.device)
            self._at_rest.setdefault(key, torch.full((), float("nan"), dtype=key[0], device=key[1]))
        shard_of = {id(param): index for index, shard in enumerate(self.shards) for param in shard.params}
        self.stages, gated = {}, {}
        for index, stage in stages.items():
            module, order = gate_stage(stage.program, [shard_of.get(id(p)) for p in stage.parameters], self)
            self.stages[index] = dataclasses.replace(stage, program=dataclasses.replace(stage.program, module=module))
            gated[index] = order
        # the rank's gather order: buckets by first use over the schedule's forwards; never-read ones last
        first_use = [k for action in actions if isinstance(action, Forward) for k in gated[action.stage]]
        self.order = list(dict.fromkeys(first_use + list(range(len(self.shards)))))
        self._position = {k: i for i, k in enumerate(self.order)}
        self._issued, self._pending, self._ready, self._resident_depth = 0, {}, set(), 0
        self.events: list = []  # ("issue" | "wait", shard) of the gathers since the last release, in order
        self.release()

    # --- a step -------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Nothing to gather up front: the gates gather each bucket at its first use."""

    def after_step(self) -> None:
        """The step's gradients are final: ZeRO-1's collection, then every bucket's parameters freed."""
        super().after_step()
        self.release()

    def ensure(self, shard: int) -> None:
        """Bucket ``shard``'s parameters resident: issue the gathers through the next bucket's, wait for its own."""
        if shard in self._ready:
            return
        self._issue_through(self._position[shard] + 1)
        handle = self._pending.pop(shard, None)
        if handle is not None:
            handle.wait()
        self.events.append(("wait", shard))
        self._ready.add(shard)

    def _issue_through(self, position: int) -> None:
        """Issue the gathers of ``self.order[:position + 1]`` not yet issued, in order (the same on every dp rank)."""
        while self._issued <= min(position, len(self.order) - 1):
            k = self.order[self._issued]
            shard, flat = self.shards[k], self.flat_params[k]
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            for param, view in zip(shard.params, self._views[k]):
                param.data = view
            record_call(self.counter, "all_gather", flat.nbytes, self.dp, shard.label)
            self._pending[k] = all_gather_flat(flat, shard.param.detach(), self.groups.dp, async_op=True)
            self.events.append(("issue", k))
            self._issued += 1

    def release(self) -> None:
        """Free every bucket's full parameters (waiting for a prefetch still in flight)."""
        for handle in self._pending.values():
            handle.wait()
        for shard, flat in zip(self.shards, self.flat_params):
            nan = self._at_rest[(shard.param.dtype, shard.param.device)]
            for param in shard.params:
                param.data = nan.expand(param.shape)
            flat.untyped_storage().resize_(0)
        self._issued, self._pending, self._ready, self.last_events, self.events = 0, {}, set(), self.events, []

    # --- between steps --------------------------------------------------------------------------

    def gather_parameters(self, force: bool = False) -> None:
        """Every bucket's parameters resident and current (collective over dp; see ``parameters_resident``)."""
        for shard in self.order:
            self.ensure(shard)

    @contextmanager
    def parameters_resident(self):
        """The parameters gathered for what reads them between steps, freed again after the outermost
        such context (``load_full_state_dict`` inside a caller's keeps them for the caller)."""
        self.gather_parameters()
        self._resident_depth += 1
        try:
            yield
        finally:
            self._resident_depth -= 1
            if not self._resident_depth:
                self.release()

    def resident_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: the shard parameters, the flat buffers' storage
        and the NaN the parameters expand at rest (one element per dtype)."""
        return storage_bytes([shard.param for shard in self.shards] + self.flat_params + list(self._at_rest.values()))


def gate_stage(program, shard_of_parameter: list, owner: ZeroThreeShards) -> tuple[fx.GraphModule, list]:
    """A copy of ``program``'s module with a ``BucketGate`` call before the first node reading a parameter
    of each bucket (``shard_of_parameter[i]``: the shard index of the i-th parameter placeholder, or None),
    and the buckets in the order the gates come."""
    original = program.module
    module = fx.GraphModule(original, original.graph.__deepcopy__())
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"][:len(program.parameters)]
    bucket_of = {node: k for node, k in zip(placeholders, shard_of_parameter) if k is not None}
    order = []
    for node in list(module.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        for k in dict.fromkeys(bucket_of[arg] for arg in node.all_input_nodes if arg in bucket_of):
            if k in order:
                continue
            order.append(k)
            module.add_submodule(f"{GATE_PREFIX}{k}", BucketGate(owner, k))
            with module.graph.inserting_before(node):
                module.graph.call_module(f"{GATE_PREFIX}{k}")
    module.recompile()
    return module, order


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages ``tensors`` keep alive (a freed storage counts 0): what a rank holds."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() if storage.nbytes() else id(storage)] = storage.nbytes()
    return sum(seen.values())


def zero_shards(plan, grad_buckets: dict, state: dict, *, stages: dict, actions, **kwargs):
    """(the ZeRO shards or None, the LocalStages to run) for ``plan.zero_stage``: None below 1 or without dp
    buckets (dp 1), ``ZeroOneShards`` at 1, ``ZeroThreeShards`` and its gated stages at 3. ``state``: FQN ->
    this rank's tensor; ``kwargs``: ``ZeroOneShards``'s keywords."""
    if not plan.zero_stage or not grad_buckets:
        return None, stages
    fqn_of = {id(t): fqn for fqn, t in state.items()}
    if plan.zero_stage == 1:
        return ZeroOneShards(grad_buckets, fqn_of, **kwargs), stages
    zero = ZeroThreeShards(grad_buckets, fqn_of, stages=stages, actions=actions, **kwargs)
    return zero, zero.stages
