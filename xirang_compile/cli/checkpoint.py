"""``xirang checkpoint convert DIR --out FILE.pt``: a distributed checkpoint as one torch.save file of full tensors.

DIR is a step folder or a root (its latest complete step). The file holds

    {"model": {name: tensor}, "optimizer": {"state": {name: {key: value}}, "param_groups": [...]},
     "step": int, "extra": dict, "rng": dict, "layout": dict}

so ``model.load_state_dict(torch.load(FILE)["model"])`` works on the single-device model: a tied
weight, saved once, is written under each of its names (one storage). DCP's own
``format_utils.dcp_to_torch_save`` reads the same folder but writes its flat keys ("model.x",
"optim.state.x.exp_avg") and the tied weight under one name only, which ``load_state_dict`` refuses.
Reading goes through the same DCP planner as a load (each tensor one whole piece: DCP assembles it
from the saved blocks), in one process.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from xirang.codegen.runtime.checkpoint.layout import (EXTRA, LAYOUT, MODEL, OPTIM_STATE, PARAM_GROUPS, RNG, STEP,
                                                      PiecesLoadPlanner, pieces_of, tensor_entries)
from xirang.codegen.runtime.checkpoint.store import resolve_checkpoint
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate


def add_checkpoint_parser(commands) -> None:
    """The ``checkpoint`` subcommand group (``convert``)."""
    checkpoint = commands.add_parser("checkpoint", help="work with distributed checkpoints (save_checkpoint's folders)")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    convert = actions.add_parser("convert", help="write one torch.save file of full tensors from a checkpoint folder")
    convert.add_argument("directory", metavar="DIR", help="a step-<8 digits>/ folder, or the root holding them "
                                                          "(its latest complete step)")
    convert.add_argument("--out", required=True, metavar="FILE.pt", help="the file to write")
    convert.set_defaults(run=cmd_convert)


def cmd_convert(args) -> int:
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise XirangError(f"--out {str(out)!r} is a folder" if out.is_dir() else
                          f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist",
                          where="xirang checkpoint convert --out", hint="pass a file path in an existing folder")
    folder = resolve_checkpoint(args.directory, caller="xirang checkpoint convert")
    full = full_checkpoint(folder)
    torch.save(full, out)
    count = sum(t.numel() for t in {id(t): t for t in full["model"].values()}.values())
    print(f"{folder}: step {full['step']}, {len(full['model'])} model tensors ({count:,} parameters), optimizer "
          f"state of {len(full['optimizer']['state'])} parameters -> {out} ({out.stat().st_size:,} bytes)")
    return 0


def full_checkpoint(folder) -> dict:
    """Every tensor of a complete step folder at its full shape, nested as the module docstring says."""
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata()
    state = {key: pieces_of(torch.empty(md.size, dtype=md.properties.dtype), PlanReplicate(), tuple(md.size), 0, 1, key)
             for key, md in tensor_entries(metadata).items()}
    state.update({key: None for key in metadata.state_dict_metadata if key not in state})
    planner = PiecesLoadPlanner()
    with warnings.catch_warnings():  # one process is what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    loaded = planner.loaded
    layout = loaded.get(LAYOUT) or {}
    aliases = layout.get("aliases", {})
    model, optimizer_state = {}, {}
    for key, value in state.items():
        if key.startswith(MODEL):
            name = key[len(MODEL):]
            for alias in aliases.get(name, [name]):
                model[alias] = value.local
    names = sorted({key[len(MODEL):] for key in state if key.startswith(MODEL)}, key=len, reverse=True)
    for key in metadata.state_dict_metadata:
        if key.startswith(OPTIM_STATE):
            rest = key[len(OPTIM_STATE):]
            name = next(n for n in names if rest.startswith(n + ".") and "." not in rest[len(n) + 1:])
            value = state[key].local if state.get(key) is not None else loaded[key]
            optimizer_state.setdefault(name, {})[rest[len(name) + 1:]] = value
    return {"model": model, "optimizer": {"state": optimizer_state, "param_groups": loaded.get(PARAM_GROUPS, [])},
            "step": loaded[STEP], "extra": loaded[EXTRA], "rng": loaded.get(RNG), "layout": layout}
