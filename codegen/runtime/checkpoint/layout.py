"""How a rank's tensors sit in a checkpoint: pieces of the ORIGINAL model's tensors at global offsets.

A checkpoint (torch.distributed.checkpoint, DCP) stores every tensor under its name in the
single-device model with its global shape, as chunks (offsets, sizes); DCP's planner joins the
chunks every rank declares and, on load, reads for each destination chunk the overlapping parts of
the saved ones. So the layout never depends on the plan: this module only says which pieces of
the global tensor a rank's local tensor holds.

A tp shard (``codegen/ops/padding.shard_of``) is not always one contiguous block of the global
tensor: ``PlanShard(dim, chunks)`` holds a slice of each of ``chunks`` pieces (Megatron's fused
``[q | k | v]``), and an uneven dim is zero-padded at the end of each piece. So a local tensor is
declared as a list of ``Piece``s -- one per fused piece, cut to its real rows -- and the padding is
in none of them: it is never written, and a load zeroes it first. A DTensor cannot say this (one
block per rank), hence the planners below: DCP's default planners with the state dict's values
being ``TensorPieces`` (each piece a chunk of the global tensor) or plain objects (pickled bytes).

Keys (flat, as DCP's own ``get_state_dict`` flattens them):
    model.<name>                     a parameter, under its name in the model (a tied one once)
    optim.state.<name>.<key>         optimizer state: element-wise tensors (exp_avg...) pieced like the
                                     parameter; other tensors (Adam's scalar ``step``) whole
    optim.param_groups               the groups' hyperparameters, without their parameters
    xirang.<what>                    step, extra, rng, torch_rng, layout (bytes)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate, PlanShard, piece_blocks, shard_share

MODEL, OPTIM_STATE, PARAM_GROUPS = "model.", "optim.state.", "optim.param_groups"
STEP, EXTRA, RNG, TORCH_RNG, LAYOUT = "xirang.step", "xirang.extra", "xirang.rng", "xirang.torch_rng", "xirang.layout"


class Piece(NamedTuple):
    """A block of the global tensor that a local tensor holds: where in the local, where in the global, how big."""

    local_offsets: tuple
    global_offsets: tuple
    sizes: tuple


@dataclass
class TensorPieces:
    """A local tensor and the blocks of the global tensor (``global_shape``) it holds."""

    local: torch.Tensor
    global_shape: tuple
    pieces: tuple

    def chunks(self) -> list:
        return [ChunkStorageMetadata(offsets=torch.Size(p.global_offsets), sizes=torch.Size(p.sizes))
                for p in self.pieces]

    def view(self, global_offsets) -> torch.Tensor:
        """The local block declared at ``global_offsets`` (a view: loads copy into it in place)."""
        piece = next((p for p in self.pieces if tuple(p.global_offsets) == tuple(global_offsets)), None)
        if piece is None:
            raise XirangError(f"no local piece starts at global offsets {tuple(global_offsets)}",
                              where="checkpoint/layout.py TensorPieces.view", hint="this is a bug in xirang: report it")
        block = self.local.detach()
        for dim, (start, size) in enumerate(zip(piece.local_offsets, piece.sizes)):
            block = block.narrow(dim, start, size)
        return block

    def like(self, local: torch.Tensor) -> "TensorPieces":
        """The same pieces of another tensor of the local shape (an optimizer state of the parameter)."""
        return TensorPieces(local, self.global_shape, self.pieces)


def pieces_of(local: torch.Tensor, placement, full_shape: tuple, tp_rank: int, tp: int, name: str) -> TensorPieces:
    """The blocks of the global tensor (``full_shape``) that ``local`` -- ``shard_of(full, placement,
    tp_rank, tp)`` -- holds, padding excluded (a rank whose slice is all padding holds none)."""
    full_shape = tuple(full_shape)
    if not isinstance(placement, PlanShard) or tp == 1:
        if not isinstance(placement, (PlanShard, PlanReplicate)) or tuple(local.shape) != full_shape:
            raise XirangError(f"{name} is held as {placement} with local shape {tuple(local.shape)} (full "
                              f"{full_shape}): only tp shards and replicated tensors can be checkpointed",
                              where=f"checkpoint of {name}", hint="this is a bug in xirang: report it")
        return TensorPieces(local, full_shape, (Piece((0,) * local.dim(), (0,) * local.dim(), full_shape),))
    dim, chunks = placement.dim, placement.chunks
    if placement.pieces:  # a fused projection's pieces: each block this rank holds (whole ones on every rank)
        return TensorPieces(local, full_shape, tuple(
            Piece(tuple(at if d == dim else 0 for d in range(local.dim())),
                  tuple(start if d == dim else 0 for d in range(local.dim())),
                  tuple(length if d == dim else full_shape[d] for d in range(local.dim())))
            for start, length, at, _ in piece_blocks(placement, tp, tp_rank)))
    piece_size = full_shape[dim] // chunks
    per_rank = shard_share(piece_size, tp, placement.unit)  # as codegen/ops/padding.shard_of cuts each piece
    if local.shape[dim] != chunks * per_rank:
        raise XirangError(f"{name}: local dim {dim} has {local.shape[dim]} elements, {placement} of {full_shape} "
                          f"on {tp} tp ranks holds {chunks} x {per_rank}", where=f"checkpoint of {name}",
                          hint="this is a bug in xirang: report it")
    pieces = []
    for j in range(chunks):
        start = tp_rank * per_rank  # this rank's slice of fused piece j
        real = max(0, min(per_rank, piece_size - start))  # the rest of the slice is padding
        if real:
            local_offsets = tuple(j * per_rank if d == dim else 0 for d in range(local.dim()))
            global_offsets = tuple(j * piece_size + start if d == dim else 0 for d in range(local.dim()))
            sizes = tuple(real if d == dim else full_shape[d] for d in range(local.dim()))
            pieces.append(Piece(local_offsets, global_offsets, sizes))
    return TensorPieces(local, full_shape, tuple(pieces))


class HeldParameter(NamedTuple):
    """One parameter as a rank holds it: its name, every name it goes by (tied), its pieces."""

    name: str
    aliases: tuple
    pieces: TensorPieces


def held_by_compiled(compiled) -> list:
    """This rank's trainable parameters (``CompiledModel``), each once, with their tp pieces."""
    shards, aliases = compiled.program.shards, compiled.program.aliases
    held = []
    for name, param in compiled.named_model_parameters():
        shard = shards.get(name)
        placement, full_shape = (shard.placement, shard.full_shape) if shard else (PlanReplicate(), tuple(param.shape))
        if shard is not None and shard.experts:
            pieces = expert_pieces(param, shard, compiled.tp_rank, compiled.tp, name)
        else:
            pieces = pieces_of(param, placement, full_shape, compiled.tp_rank, compiled.tp, name)
        held.append(HeldParameter(name, tuple(aliases.get(name, (name,))), pieces))
    return held


def expert_pieces(local: torch.Tensor, shard, tp_rank: int, tp: int, name: str) -> TensorPieces:
    """The blocks of an expert weight this ep rank holds: its experts ``first .. first + count - 1`` (dim 0),
    tp-sharded as any tensor, so a checkpoint saved at one ep loads at another (DCP reshards by block)."""
    first, count = shard.experts
    mine = pieces_of(local, shard.placement, (count,) + tuple(shard.full_shape[1:]), tp_rank, tp, name)
    moved = tuple(Piece(p.local_offsets, (p.global_offsets[0] + first,) + tuple(p.global_offsets[1:]), p.sizes)
                  for p in mine.pieces)
    return TensorPieces(local, tuple(shard.full_shape), moved)


def held_by_module(model: torch.nn.Module) -> list:
    """A single-device model's trainable parameters, each once (tied names as aliases), whole."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return [HeldParameter(found[0], tuple(found), pieces_of(param, PlanReplicate(), tuple(param.shape), 0, 1, found[0]))
            for param, found in names.items() if param.requires_grad]


def all_model_names(compiled) -> list:
    """Every trainable parameter of the whole model (every stage) as a tuple of its names."""
    program = compiled.program
    return [tuple(program.aliases.get(name, (name,))) for name in program.aliases if name in program.trainable]


# --- DCP planners: the state dict's values are TensorPieces (chunks) or plain objects (bytes) ----------

class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (dedup of blocks several ranks hold: dp replicas, tied copies) over
    a flat state dict whose tensors declare their pieces."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, TensorPieces):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            properties = TensorProperties.create_from_tensor(value.local)
            for piece in value.pieces:
                offsets = torch.Size(piece.global_offsets)
                items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.sizes)),
                                           properties=properties, size=torch.Size(value.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.view(index.offset).contiguous() if isinstance(value, TensorPieces) else value


class PiecesLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local piece, the overlapping parts of the saved chunks (DCP's resharding), in
    place into the local tensors; plain objects are unpickled into ``loaded``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.loaded = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default's _init_state_dict walks the values as tensors; ours are TensorPieces, never meta
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        reads = []
        for key, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata[key]  # present: checked before the load
            if isinstance(value, TensorPieces):
                reads += create_read_items_for_chunk_list(key, saved, value.chunks())
            else:
                index = MetadataIndex(key)
                reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                      storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(reads)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].view(index.offset)


def tensor_entries(metadata) -> dict:
    """Key -> TensorStorageMetadata of every tensor a checkpoint's ``.metadata`` lists."""
    return {key: md for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
