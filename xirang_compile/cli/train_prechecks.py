"""``xirang train``'s inputs checked in the parent, before any rank starts: a wrong input fails here, named.

Inside the ranks a bad input costs the steps already run and comes back as a raw torch error on one rank
while every other rank reports a lost peer. So once the plan is known (it gives the sequence length, the
global batch and the model's size) the parent checks what the ranks will read and write:

* the data (``--data``): a flat integer array (``TokenFile``), every token id below the model's vocabulary
  (the input embedding's rows; read in chunks of the memory-mapped file, the whole file up to
  ``FULL_SCAN_TOKENS`` and an even sample beyond), at least one global batch of rows, and a note when the
  steps asked read the file more than once (the batches repeat, reshuffled, per epoch);
* the checkpoint folder (``--checkpoint-dir``): a folder or creatable as one, writable (a file is made and
  removed), with free space for one checkpoint by the model's size: the fp32 parameters and AdamW's two
  moments, ``CHECKPOINT_BYTES_PER_PARAMETER`` bytes a parameter;
* resume compatibility (``--resume``): the newest complete checkpoint's tensors against the model's, the
  first missing, unexpected or differently shaped one named;
* the non-finite policy: ``rollback`` needs checkpoints to roll back to.

The model file, the plan and the World file are read before this by the command itself (model_files.py,
``verify.prepare``, ``world_spec``), each refused with its own message.
"""
from __future__ import annotations

import shutil
import uuid
import warnings
from pathlib import Path

import torch

from xirang.ir.errors import XirangError

CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weight + AdamW's exp_avg and exp_avg_sq
FULL_SCAN_TOKENS = 1 << 30  # beyond this the values are checked on an even sample (a full read would take minutes)
SAMPLE_TOKENS = 1 << 26
CHUNK_TOKENS = 1 << 24


def check_before_ranks(args, model, example_kwargs: dict, global_batch: int, say: bool = True) -> list:
    """Every check of the module docstring (raises XirangError on a wrong input); the notes, printed if ``say``."""
    from xirang.cli.train_loop import vocabulary
    notes = []
    check_policy(args)
    seq = example_kwargs["input_ids"].shape[1]
    shift = not hasattr(getattr(model, "config", None), "model_type")  # as train_loop's _batches reads
    if args.data:
        notes += check_data(args.data, vocab=vocabulary(model), seq=seq, shift=shift,
                            global_batch=global_batch, steps=args.steps)
    if args.checkpoint_dir:
        params = sum(p.numel() for p in model.parameters())
        check_checkpoint_folder(args.checkpoint_dir, params * CHECKPOINT_BYTES_PER_PARAMETER)
        if args.resume:
            notes += check_resume(args.checkpoint_dir, model,
                                  data=data_position(args, seq=seq, shift=shift, global_batch=global_batch))
    for note in notes if say else ():
        print(note, flush=True)
    return notes


def check_policy(args) -> None:
    if getattr(args, "on_nonfinite", None) == "rollback" and not args.checkpoint_dir:
        raise XirangError("--on-nonfinite rollback needs checkpoints to roll back to", where="--on-nonfinite",
                          hint="add --checkpoint-dir DIR --checkpoint-every N, or use --on-nonfinite skip")


def check_data(path, *, vocab: int, seq: int, shift: bool, global_batch: int, steps: int) -> list:
    """The token file's type (TokenFile), values against ``vocab`` and length against one global batch."""
    from xirang.codegen.runtime.data.rank_batches import TokenFile
    if Path(path).is_dir():
        raise XirangError(f"--data {path} is a folder, not a file of token ids", where=f"--data {path}",
                          hint="name the .npy file (or torch-saved tensor) of token ids inside it")
    try:
        tokens = TokenFile(path)
    except XirangError:
        raise
    except Exception as error:  # noqa: BLE001 - numpy's words for a damaged or foreign file vary
        raise XirangError(f"{path} cannot be read as token ids: {type(error).__name__}: {error}",
                          where=f"--data {path}", hint="write the token ids with numpy.save('tokens.npy', ids) "
                                                       "or torch.save(ids, 'tokens.pt')") from None
    count = len(tokens)
    if count == 0:
        raise XirangError(f"{path} holds no tokens", where=f"--data {path}",
                          hint="tokenise the text into it (the file is an empty array)")
    row = seq + 1 if shift else seq
    rows = count // row
    if rows < global_batch:
        raise XirangError(f"{path} holds {count} tokens: {rows} rows of {row} tokens (sequence {seq}"
                          f"{' + 1 for the shifted labels' if shift else ''}), fewer than one global batch of "
                          f"{global_batch}", where=f"--data {path}",
                          hint=f"tokenise at least {global_batch * row} tokens, or lower --global-batch")
    low, high, first_bad = _value_range(tokens, vocab)
    if first_bad is not None:
        position, value = first_bad
        raise XirangError(f"{path} holds token id {value} at position {position}, outside the model's vocabulary "
                          f"[0, {vocab}) (ids seen: {low} to {high})", where=f"--data {path}, token {position}",
                          hint="tokenise with the tokenizer the model was built for, or build the model with a "
                               f"vocabulary of at least {high + 1}")
    per_epoch = rows // global_batch
    if steps > per_epoch:
        return [f"data: {path} holds {per_epoch} global batches; {steps} steps read it "
                f"{-(-steps // per_epoch)} times (reshuffled each epoch)"]
    return []


def _value_range(tokens, vocab: int) -> tuple:
    """(lowest, highest, first (position, value) outside [0, vocab) or None) over the file, chunk by chunk."""
    count = len(tokens)
    if count <= FULL_SCAN_TOKENS:
        starts = range(0, count, CHUNK_TOKENS)
        size = CHUNK_TOKENS
    else:  # an even sample: SAMPLE_TOKENS in chunks spread over the file
        pieces = SAMPLE_TOKENS // CHUNK_TOKENS
        starts = [i * (count - CHUNK_TOKENS) // (pieces - 1) for i in range(pieces)]
        size = CHUNK_TOKENS
    low, high = None, None
    for start in starts:
        chunk = tokens.read(start, min(size, count - start))
        lo, hi = int(chunk.min()), int(chunk.max())
        low, high = lo if low is None else min(low, lo), hi if high is None else max(high, hi)
        if lo < 0 or hi >= vocab:
            bad = int(torch.nonzero((chunk < 0) | (chunk >= vocab))[0])
            return low, high, (start + bad, int(chunk[bad]))
    return low, high, None


def check_checkpoint_folder(folder, need_bytes: int) -> None:
    """A folder (made if missing), writable, with ``need_bytes`` free for one checkpoint."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise XirangError(f"--checkpoint-dir {folder} is a file, not a folder", where=f"--checkpoint-dir {folder}",
                          hint="name a folder (it is made if missing), or move the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".xirang-write-check-{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as error:
        raise XirangError(f"--checkpoint-dir {folder} cannot be written: {error.strerror or error}",
                          where=f"--checkpoint-dir {folder}",
                          hint="pick a folder this user can write, or fix its permissions") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise XirangError(f"--checkpoint-dir {folder} has {_size(free)} free, less than one checkpoint of this model "
                          f"({_size(need_bytes)}: fp32 weights and AdamW's two moments)",
                          where=f"--checkpoint-dir {folder}",
                          hint="free space there or pick a folder on a larger disk; a run that cannot save loses "
                               "every step since its last checkpoint")


def data_position(args, *, seq: int, shift: bool, global_batch: int) -> dict:
    """What this run's ``RankBatches.state_dict()`` will hold but its step: a checkpoint's must match it."""
    from xirang.codegen.runtime.data.rank_batches import SyntheticTokens, TokenFile
    row = seq + 1 if shift else seq
    tokens = len(TokenFile(args.data)) if args.data else len(SyntheticTokens(1))
    return {"seed": args.seed, "rows": tokens // row, "row_tokens": row, "global_batch": global_batch,
            "shuffle": True}


def check_resume(folder, model, data=None) -> list:
    """The newest complete checkpoint's tensors against ``model``'s, the first difference named; and, given
    ``data`` (``data_position``), its saved data position against this run's (another file, sequence length,
    global batch or seed would continue on other batches, refused in every rank otherwise)."""
    from torch.distributed.checkpoint import FileSystemReader

    from xirang.codegen.runtime.checkpoint.layout import MODEL
    from xirang.codegen.runtime.checkpoint.store import latest_checkpoint
    found = latest_checkpoint(folder, quiet=True)
    if found is None:
        return [f"resume: no complete checkpoint in {folder} yet; the run starts at step 0"]
    try:
        metadata = FileSystemReader(str(found)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable metadata is the same refusal
        raise XirangError(f"{found} cannot be read as a checkpoint: {error}", where=f"--resume, {found}",
                          hint="remove that step folder to resume from the one before it") from None
    saved = {key[len(MODEL):]: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(MODEL) and hasattr(meta, "size")}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append((name, tuple(param.shape)))
    for aliases in names.values():
        hit = next((name for name, _ in aliases if name in saved), None)
        name, shape = aliases[0]
        if hit is None:
            raise _mismatch(found, f"the model's {name!r} {shape} is not in it", saved)
        if saved[hit] != shape:
            raise _mismatch(found, f"{hit!r} has shape {saved[hit]} there and {shape} in the model", saved)
    known = {name for aliases in names.values() for name, _ in aliases}
    extra = sorted(set(saved) - known)
    if extra:
        raise _mismatch(found, f"it holds {extra[0]!r}, which the model does not have", saved)
    if data is not None:
        _check_data_position(found, data)
    return []


def _check_data_position(found, data: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from xirang.codegen.runtime.checkpoint.layout import EXTRA
    state = {EXTRA: {}}
    try:
        with warnings.catch_warnings():  # DCP warns that one process reads alone: that is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(str(found)), no_dist=True)
    except Exception:  # noqa: BLE001 - no readable extra: the ranks' own load says more
        return
    saved = state[EXTRA].get("data") if isinstance(state[EXTRA], dict) else None
    if not isinstance(saved, dict):
        return  # not a checkpoint of xirang train: nothing to compare
    differ = [key for key in ("global_batch", "row_tokens", "rows", "seed", "shuffle") if saved.get(key) != data[key]]
    if differ:
        said = "; ".join(f"{key} {saved.get(key)!r} there, {data[key]!r} now" for key in differ)
        raise XirangError(f"--resume: the checkpoint {found} was saved reading other data: {said}",
                          where=f"--resume, {found}, extra['data']",
                          hint="resume with the same --data file, sequence length, --global-batch and --seed, or "
                               "point --checkpoint-dir at a new folder to start afresh")


def _mismatch(found, what: str, saved: dict) -> XirangError:
    return XirangError(f"--resume: the checkpoint {found} is for another model: {what} ({len(saved)} tensors saved)",
                       where=f"--resume, {found}",
                       hint="resume with the model that wrote it, or point --checkpoint-dir at a new folder to "
                            "start afresh")


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"

