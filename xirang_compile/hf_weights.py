"""Hugging Face weights in and out: start from a ``save_pretrained`` folder, each rank reading only its pieces,
and write the trained model back as a folder ``from_pretrained`` loads.

    model = xirang.empty_pretrained("llama-dir")              # structure only: no weights held
    compiled = xirang.compile(model, world=8, example_kwargs=batch, plan=plan)
    xirang.load_pretrained(compiled, "llama-dir")             # this rank's shards, read slice by slice
    ... train ...
    xirang.save_pretrained(compiled, "out-dir", source="llama-dir")   # rank 0 writes; collective

``empty_pretrained`` builds the model class of the folder's config with every parameter a placeholder:
one zero element expanded to the parameter's shape (stride 0), so the model costs no memory, traces,
plans and compiles like a real one, and the runtime's ``bind_state`` cuts from it a local tensor of
the rank's shard size only (a padded vocabulary piece is padded at its full size for a moment, no
more). Buffers (rotary tables) are real: they are computed, not stored, and the checkpoint lacks
them. ``load_pretrained`` then fills each local parameter in place from the checkpoint's safetensors
file(s) with ``safe_open(...).get_slice``: a tp-sharded tensor reads only this rank's rows of each
fused piece (padding stays zero), a replicated one the whole tensor, and a rank reads only the
tensors its pipeline stages hold; a tied weight (embedding and LM head) reads whichever of its names
the checkpoint has. ``save_pretrained`` gathers the full parameters (``full_state_dict``, a collective)
and rank 0 writes ``model.safetensors`` under the source checkpoint's own tensor names (a tied weight
once, as ``save_pretrained`` does) with the source's ``config.json`` and generation config.

safetensors and transformers are the optional extra ``hf`` (``pip install xirang[hf]``), imported here
only when called.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from xirang.codegen.runtime.state.weight_init import parameters_on_meta
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard, shard_share

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def _require(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise XirangError(f"reading Hugging Face checkpoints needs the package {module.split('.')[0]!r}, which is "
                          f"not installed", where="xirang.hf_weights",
                          hint="pip install 'xirang[hf]' (transformers and safetensors)") from None


def _checkpoint_files(directory) -> dict:
    """Tensor name -> the safetensors file holding it, from a save_pretrained folder (one file or an index)."""
    folder = Path(directory)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / WEIGHTS).is_file():
        safetensors = _require("safetensors")
        with safetensors.safe_open(folder / WEIGHTS, framework="pt") as handle:
            return {name: folder / WEIGHTS for name in handle.keys()}
    raise XirangError(f"{folder} holds no {WEIGHTS} nor {INDEX}", where=str(folder),
                      hint="pass a folder written by save_pretrained(..., safe_serialization=True)")


def empty_pretrained(directory, dtype=torch.float32) -> torch.nn.Module:
    """The model of the folder's config (its ``architectures[0]``), every parameter a zero-memory
    placeholder of its shape, buffers real (see the module docstring)."""
    transformers = _require("transformers")
    config = transformers.AutoConfig.from_pretrained(directory)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise XirangError(f"the config in {directory} names no model class transformers has ({architectures})",
                          where=f"{directory}/config.json", hint="save the model with save_pretrained")
    with parameters_on_meta():
        model = model_class(config)
    placeholders = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in placeholders:  # a tied parameter stays one object
                zero = torch.zeros((), dtype=dtype).expand(param.shape)
                placeholders[id(param)] = torch.nn.Parameter(zero, requires_grad=param.requires_grad)
            module._parameters[name] = placeholders[id(param)]
    return model.train()


def local_piece(handle, name: str, shard, tp_rank: int, tp: int, dtype) -> torch.Tensor:
    """This tp rank's local tensor of checkpoint tensor ``name``: only its rows of each piece read."""
    view = handle.get_slice(name)
    shape = tuple(view.get_shape())
    placement = getattr(shard, "placement", None)
    if not isinstance(placement, PlanShard) or tp == 1:
        return view[tuple(slice(None) for _ in shape)].to(dtype)
    dim = placement.dim
    piece = shape[dim] // placement.chunks
    per_rank = shard_share(piece, tp, placement.unit)
    parts = []
    for j in range(placement.chunks):
        start = j * piece + min(piece, tp_rank * per_rank)
        stop = j * piece + min(piece, (tp_rank + 1) * per_rank)
        part = view[tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))].to(dtype)
        if stop - start < per_rank:  # the padding of an uneven piece: zeros, as shard_of pads
            pad = list(part.shape)
            pad[dim] = per_rank - (stop - start)
            part = torch.cat([part, torch.zeros(pad, dtype=dtype)], dim=dim)
        parts.append(part)
    return torch.cat(parts, dim=dim)


def load_pretrained(compiled, directory) -> dict:
    """Fill this rank's parameters of ``compiled`` in place from the checkpoint folder, reading only its
    pieces. Returns ``{"tensors": n, "elements": n}`` read by this rank. Under ZeRO the optimizer's
    shards take their slices of what was loaded (ZeRO-3: the parameters are gathered for the load,
    a collective over dp, as every rank calls this)."""
    with compiled.parameters_resident():
        read = _load_pieces(compiled, directory)
        if compiled.zero:
            compiled.zero.refresh_from_parameters()
    return read


def _load_pieces(compiled, directory) -> dict:
    safetensors = _require("safetensors")
    files = _checkpoint_files(directory)
    shards, aliases = compiled.program.shards, compiled.program.aliases
    wanted = {}
    for fqn, local in compiled.named_model_parameters():
        key = next((n for n in (fqn, *aliases.get(fqn, ())) if n in files), None)
        if key is None:
            raise XirangError(f"the checkpoint has no tensor for {fqn} (names tried: {(fqn, *aliases.get(fqn, ()))})",
                              where=f"{directory}, rank {compiled.rank}",
                              hint="load the checkpoint of the model the folder's config describes")
        wanted.setdefault(files[key], []).append((fqn, key, local))
    read = {"tensors": 0, "elements": 0}
    for path, entries in wanted.items():
        with safetensors.safe_open(path, framework="pt") as handle:
            for fqn, key, local in entries:
                piece = local_piece(handle, key, shards.get(fqn), compiled.tp_rank, compiled.tp, local.dtype)
                if piece.shape != local.shape:
                    raise XirangError(f"{key} gives this rank a piece of shape {tuple(piece.shape)}, the model holds "
                                      f"{tuple(local.shape)}", where=f"{path}[{key!r}], rank {compiled.rank}",
                                      hint="the checkpoint was saved from another configuration of the model")
                with torch.no_grad():
                    local.copy_(piece)
                read["tensors"] += 1
                read["elements"] += piece.numel()
    return read


def save_pretrained(compiled, directory, *, source) -> Path | None:
    """Gather the trained parameters and, on rank 0, write a ``from_pretrained`` folder: the source
    checkpoint's tensor names, its config and generation config. Collective: every rank calls it;
    returns the folder on rank 0, None elsewhere."""
    safetensors_torch = _require("safetensors.torch")
    names = set(_checkpoint_files(source))
    full = compiled.full_state_dict()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return None
    missing = sorted(names - set(full))
    if missing:
        raise XirangError(f"the compiled model has no parameter for the checkpoint's {missing[:5]}",
                          where=f"save_pretrained({directory})", hint="export the model the source folder holds")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: full[name].detach().contiguous().clone() for name in sorted(names)}
    safetensors_torch.save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    for extra in ("config.json", "generation_config.json"):
        if (Path(source) / extra).is_file():
            shutil.copyfile(Path(source) / extra, out / extra)
    return out
