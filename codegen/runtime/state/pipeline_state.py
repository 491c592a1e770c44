"""The model state one pipeline rank holds: its stages' tensors bound, loaded, gathered and tied.

A pp rank holds a copy of every parameter, buffer and constant its stages read -- nothing of the
other stages' -- as its tp rank's shard where the program's ``shards`` give a tp placement:

    bind_state(model, programs, ...)          FQN -> local tensor, from the model (or a state dict)
    load_full_state(state, state_dict, ...)   copy each local piece of full tensors in place
    gather_full(local, ...)                   FQN -> full tensor: over tp, then over pp
    tied_groups(programs, mesh, groups, ...)  the process groups that sum tied copies' gradients

Tied parameters (a token embedding read by the first and the last stage) are a copy on each
pipeline rank that reads them; loading sets both copies from the same entry, and the runtime
keeps them equal by summing their gradients over the tied group (codegen/runtime/compiled_model.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate

from xirang.codegen.runtime.state.shard_params import full_tensor, load_local, local_of
from xirang.codegen.runtime.state.weight_init import TensorInit, has_meta_tensors
from xirang.ir.facts import ParamShard
from torch._subclasses.fake_tensor import FakeTensor

from xirang.passes.lowering.split_stages import tied_parameters


# set (True) on a meta tensor that stands for one with values, as a fake tensor does: the dry run's state
# on plain meta tensors (codegen/check/rank_step.py), bound as a copy, not initialised from scratch
STANDS_FOR_VALUES = "_xirang_stands_for_values"


def _valueless(tensor) -> bool:
    """A tensor on meta holds no values; a fake tensor or one marked STANDS_FOR_VALUES (the dry run's,
    codegen/check/) stands for one that does."""
    return tensor.is_meta and not isinstance(tensor, FakeTensor) and not getattr(tensor, STANDS_FOR_VALUES, False)


def bind_state(model, programs, trainable: frozenset, device, *, shards: dict, tp_rank: int, tp: int,
               seed: Optional[int] = None, init=None) -> dict:
    """FQN -> this rank's copy of every parameter/buffer its stages read; one tensor per FQN even
    when two local stages read it, so their gradients accumulate in one place. ``model`` is the
    module, or a mapping FQN -> tensor (a state dict: what launched ranks can be sent cheaply).
    A tensor with an entry in ``shards`` is bound as this tp rank's shard of it.

    A module built on meta is initialised from scratch, given ``seed`` (and ``init``, the per-module
    init function): each tensor the model holds only on meta is made alone on its own stream
    (codegen/runtime/state/weight_init.py), cut to this rank's shard and dropped, so the rank never holds
    more of the model than its shards and one module's tensors."""
    from_module = isinstance(model, torch.nn.Module)  # a mapping says nothing of frozen parameters
    if from_module:
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
    else:
        state = dict(model)
    initial = TensorInit(model, seed, init).value if from_module and seed is not None and has_meta_tensors(model) \
        else None
    bound = {}
    for program in programs:
        for placeholder, fqn in program.parameters:
            if fqn in bound:
                continue
            held = state.get(fqn, program.constants.get(fqn))  # a tensor made in forward: the trace's
            if held is not None and _valueless(held) and fqn not in state:
                raise XirangError(f"stage {program.index} reads {fqn!r}, a tensor made inside forward, whose value "
                                  f"the trace has only on the meta device", where=f"placeholder {placeholder} of "
                                  f"stage {program.index}", hint="make it on the CPU in forward (not with "
                                  "device= of a meta input), or trace with real example inputs")
            if held is None or (_valueless(held) and initial is None):
                raise XirangError(f"stage {program.index} reads {fqn!r}, which the model "
                                  f"{'has only on the meta device' if held is not None else 'does not have'}",
                                  where=f"placeholder {placeholder} of stage {program.index}",
                                  hint="build the runtime from the model that was planned, with real tensors, "
                                       "or from a module built on meta (initialised from scratch, given a seed)")
            made = _valueless(held)  # made here from scratch: no one else holds it, so no copy is needed
            full = initial(fqn) if made else held.detach()
            local = local_of(full, shards[fqn], tp_rank, tp) if fqn in shards else full
            copy = local.to(device) if made else local.to(device).clone()
            del full, local  # the next tensor's full value is made without this one's: one at a time
            trains = held.requires_grad if from_module else True
            bound[fqn] = torch.nn.Parameter(copy, requires_grad=trains) if fqn in trainable else copy
    return bound


def load_full_state(state: dict, state_dict: dict, *, aliases: dict, trainable: frozenset, shards: dict,
                    tp_rank: int, tp: int, where: str) -> None:
    """Copy this rank's piece of each full tensor in ``state_dict`` into ``state`` (``bind_state``'s
    result) in place, so optimizers keep their references. Every parameter the rank's stages read
    must have an entry, under its FQN or a tied alias; a buffer or constant is loaded when present
    (a non-persistent buffer, such as Llama's rotary ``inv_freq``, is not in ``model.state_dict()``).
    Entries of other stages' tensors are ignored: every rank is given the same full state dict."""
    for fqn, local in state.items():
        shard = shards.get(fqn) or ParamShard(fqn, fqn, aliases.get(fqn, (fqn,)), "parameter", PlanReplicate(),
                                              tuple(local.shape))
        name = next((alias for alias in (fqn, *aliases.get(fqn, ())) if alias in state_dict), None)
        if name is None and fqn in trainable:
            raise XirangError(f"the state dict has no entry for {fqn} (full shape {shard.full_shape}), which "
                              f"{where} holds", where=f"load_full_state_dict[{fqn!r}]",
                              hint=f"pass a full state dict of the model (keys like {fqn!r}), the same on "
                                   f"every rank")
        if name is not None:
            load_local(local, state_dict[name], shard, tp_rank=tp_rank, tp=tp)


def gather_full(local: dict, *, shards: dict, groups, aliases: dict) -> dict:
    """FQN -> full tensor from every rank's ``local`` (FQN -> this rank's tensor), under every tied
    alias. Collective over the tp group, then the pp group."""
    # tp first: every tp rank of this stage holds the same FQNs in the same order.
    mine = {fqn: (full_tensor(tensor, shards[fqn], groups.tp, groups.ep) if fqn in shards else tensor.detach().clone())
            for fqn, tensor in local.items()}
    pieces = [mine]
    if groups.pp is not None:
        pieces = [None] * groups.axis_size("pp")
        dist.all_gather_object(pieces, mine, group=groups.pp)
    found = {}
    for piece in pieces:
        for fqn, tensor in piece.items():
            for alias in aliases.get(fqn, (fqn,)):
                found.setdefault(alias, tensor)
    return found


def tied_groups(programs, mesh, groups, trainable: set) -> list:
    """(FQN, process group) for each parameter this rank shares with other pipeline ranks.

    ``new_group`` is collective over the whole world, so every rank walks every tied set for every
    (dp, tp) index in the same order, keeping the groups it belongs to."""
    pp = mesh.pp
    ranks_of = {fqn: tuple(sorted({stage % pp for stage in stages}))
                for fqn, stages in tied_parameters(programs).items() if fqn in trainable}
    made = {}
    for pp_ranks in sorted({r for r in ranks_of.values() if len(r) > 1}):
        for dp_index in range(mesh.dp):
            for tp_index in range(mesh.tp):
                members = [mesh.rank_of(dp=dp_index, pp=r, tp=tp_index) for r in pp_ranks]
                group = dist.new_group(members)
                if groups.rank in members:
                    made[pp_ranks] = group
    mine = groups.axis_index("pp")
    return [(fqn, made[r]) for fqn, r in ranks_of.items() if len(r) > 1 and mine in r]
