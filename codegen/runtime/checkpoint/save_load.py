"""Save and resume training: every rank writes its own shards; any plan (or one device) reads them back.

    xirang.save_checkpoint(compiled, optimizer, "ckpt", step=1000, extra={"loader": 12, "lr": sched.state_dict()})
    found = xirang.load_checkpoint(compiled, optimizer, "ckpt")   # the latest complete step
    found["step"], found["extra"]

A checkpoint is a torch.distributed.checkpoint (DCP) folder ``ROOT/step-<8 digits>/``
(codegen/runtime/checkpoint/store.py: complete only once its marker is written last) holding the
parameters and the optimizer's per-parameter state under the single-device model's names and global
shapes (codegen/runtime/checkpoint/layout.py: each rank declares which blocks of each global tensor it
holds, padding excluded, a tied weight once; a NaN or inf in any refuses the save: finite_check.py),
the step, the randomness (``compiled.rng_state()``:
the seed and step every future draw follows; torch's own generator state of every rank), the mesh
it was saved under by named axes (codegen/runtime/checkpoint/mesh_record.py) and the caller's
``extra`` (plain data). Loading under another plan -- other dp, tp, pp, world size -- is
DCP's resharding: each rank reads the overlap of the saved blocks with the ones it holds now.
``target`` may also be a plain ``nn.Module`` (one device, no process group): the same checkpoint
loads into the single-device model (a single-device save is the same format: loading one on a mesh
takes the same path, but is not tested across processes, and restores no Xirang rng step).

Optimizer state: a state tensor of the parameter's shape is taken as element-wise (Adam's moments)
and pieced like the parameter; any other tensor (Adam's scalar ``step``) is saved whole, once; the
groups' hyperparameters by group index. So it is exact for the element-wise optimizers the runtime
supports (SGD, Adam, AdamW: compiled_model.py). Buffers are not saved: the runtime does not train them.
Under ZeRO-1 the optimizer holds state per bucket shard: saving goes through a per-parameter view
gathered over dp (codegen/runtime/data_parallel/dist_optimizer.py), loading through an empty one whose state each
shard then slices, so the files are the same as without ZeRO and load under any plan or zero stage.
Under ZeRO-3 (parameters freed between steps) both run with the parameters gathered, freed after.

``async_save=True``: the rank's tensors are copied to host memory before the call returns (that copy
blocks: the next optimizer step may change the parameters right after); DCP's planning collectives
(on a gloo group of their own, so they cannot interleave with training's), the serialisation and the
file writes run in a background thread, overlapping the training steps that follow. The call returns a
``PendingCheckpoint``: rank 0 writes the marker as soon as DCP's coordinator has finished (so a run that
dies before leaves no complete step); ``wait()`` on it (every rank) before the next save or the end of
the run, which also raises what the save raised.
"""
from __future__ import annotations

import copy
import threading
import warnings
import weakref
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from xirang.ir.errors import XirangError
from xirang.ir.renamed import renamed_keywords

from xirang.codegen.runtime.checkpoint.layout import (EXTRA, LAYOUT, MODEL, OPTIM_STATE, PARAM_GROUPS, RNG, STEP,
                                                      TORCH_RNG, PiecesLoadPlanner, PiecesSavePlanner, TensorPieces,
                                                      all_model_names, held_by_compiled, held_by_module, pieces_of,
                                                      tensor_entries)
from xirang.codegen.runtime.checkpoint.mesh_record import mesh_record, saving_rank
from xirang.codegen.runtime.checkpoint.finite_check import refuse_nonfinite
from xirang.codegen.runtime.checkpoint.write_errors import said_as_checkpoint_errors
from xirang.codegen.runtime.checkpoint.store import remove_marker, resolve_checkpoint, step_folder, write_marker
from xirang.codegen.runtime.data_parallel.dist_optimizer import PerParameterState
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanReplicate

_PLAIN = (str, int, float, bool, type(None), torch.Tensor)
_ASYNC_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # compiled -> its checkpoint gloo group


@contextmanager
def _one_process(single: bool):
    """DCP warns that it assumes one process when none is initialised: here that is what was asked."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_module(target) -> bool:
    return isinstance(target, torch.nn.Module)


def _rank(target) -> int:
    return 0 if _is_module(target) else dist.get_rank()


def _held(target) -> list:
    return held_by_module(target) if _is_module(target) else held_by_compiled(target)


def _per_parameter(target, optimizer, *, saving: bool):
    """The optimizer as checkpoints see it: itself, or under ZeRO-1 (its state per bucket shard) a
    per-parameter view (codegen/runtime/data_parallel/dist_optimizer.py): gathered over dp to save, empty to load into.
    Saving gathers the last optimizer step's slices into the parameters first."""
    zero = getattr(target, "zero", None)
    if zero is None or optimizer is None:
        if zero is not None and saving:
            zero.gather_parameters()
        return optimizer
    if saving:
        zero.gather_parameters()
        return zero.per_parameter_view(optimizer)
    return PerParameterState(defaultdict(dict), optimizer.param_groups)


def _check_plain(value, where: str) -> None:
    """``extra`` must load with torch.load(weights_only=True): containers of numbers, strings, tensors."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise XirangError(f"save_checkpoint: {where} is a {type(value).__name__}, not plain data",
                          where=f"save_checkpoint(extra=...) at {where}",
                          hint="pass dicts, lists and tuples of numbers, strings, bools, None and tensors "
                               "(a scheduler's or data loader's state_dict(), not the object)")


def _optimizer_entries(held: list, optimizer) -> dict:
    """optim.* keys -> TensorPieces (element-wise state), whole tensors, or plain values; the groups."""
    if optimizer is None:
        return {}
    by_param = {h.pieces.local: h for h in held}
    entries = {}
    for param, state in optimizer.state.items():
        owner = by_param.get(param)
        if owner is None:
            raise XirangError(f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a trainable "
                              f"parameter of the model", where="save_checkpoint(optimizer=...)",
                              hint="build the optimizer over compiled.parameters() (model.parameters() on one device)")
        for key, value in state.items():
            name = f"{OPTIM_STATE}{owner.name}.{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
                entries[name] = owner.pieces.like(value)
            elif isinstance(value, torch.Tensor):
                entries[name] = pieces_of(value, PlanReplicate(), tuple(value.shape), 0, 1, name)
            else:
                entries[name] = value
    entries[PARAM_GROUPS] = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return entries


def _torch_rng() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _layout(target, held: list) -> dict:
    if _is_module(target):
        return {"mesh": mesh_record(Mesh(dp=1, pp=1, tp=1)), "world": 1,
                "aliases": {h.name: list(h.aliases) for h in held}}
    return {"mesh": mesh_record(target.plan.mesh), "world": dist.get_world_size(),
            "aliases": {names[0]: list(names) for names in all_model_names(target)}}


def save_checkpoint(target, optimizer, directory, *, step: int, extra=None, async_save: bool = False):
    """Write ``directory/step-<8 digits>/`` (see the module docstring): collective, every rank calls it.
    Returns the step folder, or with ``async_save=True`` a ``PendingCheckpoint`` to ``wait()`` on."""
    _check_process_group(target, "save_checkpoint")
    with _parameters_resident(target):  # an async save has copied them to host memory when it returns
        return _save_checkpoint(target, optimizer, directory, step=step, extra=extra, async_save=async_save)


def _check_process_group(target, function: str) -> None:
    """A compiled model's checkpoint is collective (every rank writes its pieces, rank 0 the layout): a
    one-rank program compiled with no process group has no world to write it in."""
    if not _is_module(target) and not (dist.is_available() and dist.is_initialized()):
        raise XirangError(f"{function} of a compiled model needs the process group it was compiled in, and "
                          f"this process has none (a one-rank program compiled outside a launcher)",
                          where=f"xirang.{function}(compiled, ...)",
                          hint="run the script under a launcher, even for one rank (`xirang launch --world 1 "
                               "train.py` or `torchrun --nproc-per-node 1 train.py`): xirang.compile then joins "
                               "its process group and the checkpoint resumes under any plan")


def _parameters_resident(target):
    """ZeRO: the parameters gathered while a checkpoint reads or writes them (ZeRO-3 frees them at rest)."""
    zero = getattr(target, "zero", None)
    return zero.parameters_resident() if zero is not None else nullcontext()


def _save_checkpoint(target, optimizer, directory, *, step: int, extra, async_save: bool):
    optimizer = _per_parameter(target, optimizer, saving=True)
    folder = step_folder(directory, step)
    extra = {} if extra is None else extra
    _check_plain(extra, "extra")
    held, distributed = _held(target), not _is_module(target)
    rng_states = [_torch_rng()]
    if distributed:
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, _torch_rng())
    state = {MODEL + h.name: h.pieces for h in held}
    state.update(_optimizer_entries(held, optimizer))
    layout = _layout(target, held)
    state.update({STEP: step, EXTRA: extra, RNG: None if _is_module(target) else target.rng_state(),
                  TORCH_RNG: rng_states, LAYOUT: layout})
    refuse_nonfinite(state, step=step, folder=folder, rank=_rank(target), distributed=distributed,
                     device=getattr(target, "device", "cpu"))  # before the folder is touched: no bad checkpoint
    coordinator = _rank(target) == 0
    if coordinator:
        folder.mkdir(parents=True, exist_ok=True)
        remove_marker(folder)  # a step saved again is incomplete until its new marker
    if distributed:
        dist.barrier()  # no rank writes into the folder before the old marker is gone
    writer = FileSystemWriter(folder)
    if async_save:
        staged = {key: TensorPieces(value.local.detach().to("cpu", copy=True), value.global_shape, value.pieces)
                  if isinstance(value, TensorPieces) else copy.deepcopy(value) for key, value in state.items()}
        with _one_process(not distributed):
            future = dcp.async_save(staged, storage_writer=writer, planner=PiecesSavePlanner(),
                                    process_group=_async_group(target) if distributed else None,
                                    async_stager=_AlreadyStaged(), no_dist=not distributed)
        return PendingCheckpoint(future, folder, step, layout, coordinator, rank=_rank(target))
    with _one_process(not distributed), said_as_checkpoint_errors(folder, step, _rank(target)):
        dcp.save(state, storage_writer=writer, planner=PiecesSavePlanner(), no_dist=not distributed)
    if coordinator:  # dcp.save returned on the coordinator: every rank's files are written
        write_marker(folder, step, layout)
    if distributed:
        dist.barrier()  # every rank returns once the step is complete
    return folder


def _async_group(compiled):
    """A gloo group of the whole world for the background thread's collectives (created once per model)."""
    if compiled not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[compiled] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[compiled]


class _AlreadyStaged:
    """DCP's AsyncStager protocol for a state dict save_checkpoint has already copied to host memory."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingCheckpoint:
    """An async save in flight. The coordinator writes the marker as soon as DCP has finished (from the
    background thread); ``wait()`` (every rank) returns the step folder once the step is complete and
    raises what the save raised."""

    def __init__(self, future, folder: Path, step: int, layout: dict, coordinator: bool, rank: int = 0):
        self.future, self.folder, self.step, self.rank = future, folder, step, rank
        self._layout, self._coordinator, self._lock, self._marked = layout, coordinator, threading.Lock(), False
        future.add_done_callback(lambda finished: finished.exception() is None and self._mark())

    def done(self) -> bool:
        return self.future.done()

    def _mark(self) -> None:
        with self._lock:  # once, whichever of the callback and wait() comes first
            if self._coordinator and not self._marked:
                write_marker(self.folder, self.step, self._layout)
            self._marked = True

    def wait(self) -> Path:
        with said_as_checkpoint_errors(self.folder, self.step, self.rank):  # a failed write: said, not a traceback
            self.future.result()  # DCP's coordinator finished: every rank's files and .metadata are written
        self._mark()
        return self.folder


# --- load ----------------------------------------------------------------------------------------------

def _saved_name(names: tuple, saved: dict):
    return next((name for name in names if MODEL + name in saved), None)


def _model_mismatch(target, held: list, saved: dict) -> dict:
    """What of the model the checkpoint lacks (parameters this rank trains: every one is some rank's),
    what it has that the model has not, and the shapes that differ."""
    groups = [h.aliases for h in held] if _is_module(target) else all_model_names(target)
    saved_names = {key[len(MODEL):] for key in saved if key.startswith(MODEL)}
    known = {name for names in groups for name in names}
    mismatch = {"missing": [h.name for h in held if _saved_name(h.aliases, saved) is None],
                "unexpected": sorted(saved_names - known), "shapes": []}
    for h in held:
        name = _saved_name(h.aliases, saved)
        if name is not None and tuple(saved[MODEL + name].size) != tuple(h.pieces.global_shape):
            mismatch["shapes"].append(f"{name!r} has shape {tuple(saved[MODEL + name].size)} in the checkpoint, "
                                      f"{tuple(h.pieces.global_shape)} in the model")
    for key in (STEP, EXTRA, TORCH_RNG):
        if key not in saved:
            mismatch.setdefault("format", []).append(key)
    return mismatch


def _describe_mismatch(mismatches: list) -> list:
    """One rank's or every rank's mismatches (all-gathered) as sentences, each key once."""
    def joined(kind):
        return sorted({item for mismatch in mismatches for item in mismatch.get(kind, [])})
    problems = []
    for kind, label in (("missing", "parameters missing from the checkpoint"),
                        ("unexpected", "parameters in the checkpoint but not in the model")):
        keys = joined(kind)
        if keys:
            shown = ", ".join(repr(k) for k in keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")
            problems.append(f"{label}: {shown}")
    problems += joined("shapes")[:8]
    if joined("format"):
        problems.append(f"{joined('format')} missing: not a checkpoint xirang.save_checkpoint wrote")
    return problems


def _optimizer_targets(held: list, saved: dict, metadata) -> tuple[dict, list]:
    """Fresh tensors (pieced like their parameter where element-wise) the optimizer state loads into."""
    entries, installs = {}, []
    for h in held:
        name = _saved_name(h.aliases, saved)
        prefix = f"{OPTIM_STATE}{name}."
        for key, md in metadata.state_dict_metadata.items():
            state_key = key[len(prefix):]
            if not key.startswith(prefix) or "." in state_key:
                continue
            if key not in saved:
                entries[key] = None  # a plain value: unpickled by the planner
            elif len(md.size) > 0 and tuple(md.size) == tuple(h.pieces.global_shape):
                entries[key] = h.pieces.like(torch.zeros(h.pieces.local.shape, dtype=md.properties.dtype,
                                                         device=h.pieces.local.device))
            else:
                entries[key] = pieces_of(torch.zeros(md.size, dtype=md.properties.dtype), PlanReplicate(),
                                         tuple(md.size), 0, 1, key)
            installs.append((h.pieces.local, state_key, key))
    return entries, installs


@renamed_keywords(path="directory=")
def load_checkpoint(target, optimizer, directory) -> dict:
    """Restore parameters, optimizer state and randomness from ``directory`` (a step folder, or the folder
    ``save_checkpoint`` wrote into: its
    latest complete step, newer incomplete ones skipped with a logged message) under this plan;
    returns ``{"step": int, "extra": dict}``. Collective (every rank calls it) unless ``target`` is an
    ``nn.Module``. A checkpoint of another model is refused, naming the keys, before anything changes."""
    _check_process_group(target, "load_checkpoint")
    with _parameters_resident(target):
        return _load_checkpoint(target, optimizer, directory)


def _load_checkpoint(target, optimizer, path) -> dict:
    sharded, optimizer = optimizer, _per_parameter(target, optimizer, saving=False)
    distributed = not _is_module(target)
    folder = resolve_checkpoint(path, quiet=_rank(target) != 0)
    reader = FileSystemReader(folder)
    try:
        metadata = reader.read_metadata()
    except Exception as error:  # noqa: BLE001 -- a damaged .metadata: say which folder
        raise XirangError(f"cannot read the checkpoint metadata in {str(folder)!r}: {type(error).__name__}: {error}",
                          where=f"load_checkpoint({str(path)!r})",
                          hint="load an earlier step (the root folder's next complete one) or re-save") from None
    held, saved = _held(target), tensor_entries(metadata)
    mismatches = [_model_mismatch(target, held, metadata.state_dict_metadata)]
    if distributed:  # every rank refuses together (a rank that went on to dcp.load would wait forever)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mismatches[0])
        mismatches = everyone
    problems = _describe_mismatch(mismatches)
    if problems:
        raise XirangError(f"the checkpoint {str(folder)!r} does not match this model: " + "; ".join(problems),
                          where=f"load_checkpoint({str(path)!r})",
                          hint="load a checkpoint saved from the same model configuration (names are the "
                               "single-device model's parameter names; the plan may differ)")
    state = {MODEL + _saved_name(h.aliases, saved): h.pieces for h in held}
    installs = []
    if optimizer is not None:
        optimizer_state, installs = _optimizer_targets(held, saved, metadata)
        state.update(optimizer_state)
        if PARAM_GROUPS in metadata.state_dict_metadata:
            state[PARAM_GROUPS] = None
    state.update({STEP: None, EXTRA: None, TORCH_RNG: None, RNG: None})
    if LAYOUT in metadata.state_dict_metadata:  # the saving mesh: whose torch generator state each rank takes
        state[LAYOUT] = None
    with torch.no_grad():
        for h in held:
            h.pieces.local.zero_()  # padding rows are in no piece: they load as zeros
    planner = PiecesLoadPlanner()
    with _one_process(not distributed):
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=not distributed)
    loaded = planner.loaded
    if optimizer is not None:
        _install_optimizer_state(optimizer, state, installs, loaded.get(PARAM_GROUPS), folder)
    _restore_rng(target, loaded)
    if getattr(target, "zero", None) is not None:  # ZeRO-1: the shards take their slices of what loaded
        target.zero.refresh_from_parameters()
        if sharded is not None:
            target.zero.load_per_parameter(sharded, optimizer)
    return {"step": loaded[STEP], "extra": loaded[EXTRA]}


def _install_optimizer_state(optimizer, state: dict, installs: list, groups, folder: Path) -> None:
    if groups is not None and len(groups) != len(optimizer.param_groups):
        raise XirangError(f"the checkpoint {str(folder)!r} has {len(groups)} optimizer parameter group(s), the "
                          f"optimizer {len(optimizer.param_groups)}", where="load_checkpoint(optimizer=...)",
                          hint="build the optimizer with the same parameter groups as the run that saved (the "
                               "parameters were loaded; the optimizer is left as it was)")
    optimizer.state.clear()
    for param, state_key, key in installs:
        value = state[key]
        value = value.local if isinstance(value, TensorPieces) else value
        optimizer.state[param][state_key] = value
    for group, saved in zip(optimizer.param_groups, groups or ()):
        group.update(saved)


def _restore_rng(target, loaded: dict) -> None:
    """Xirang's draws follow (seed, step): restored on every layout. Torch's generator: on the same mesh
    sizes, the state saved at this rank's coordinates, under whichever rank layout saved it
    (mesh_record.py); on another mesh rank r takes the state rank r saved (a rank beyond the saving
    world keeps its own; one device takes rank 0's)."""
    states, rank = loaded[TORCH_RNG], _rank(target)
    if not _is_module(target):
        if loaded.get(RNG) is not None:
            target.load_rng_state(loaded[RNG])
        rank = saving_rank(rank, target.plan.mesh, (loaded.get(LAYOUT) or {}).get("mesh"))
    if rank < len(states):
        torch.set_rng_state(states[rank]["cpu"])
        if "cuda" in states[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(states[rank]["cuda"])
