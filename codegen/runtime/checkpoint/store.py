"""Checkpoint folders on disk: ``ROOT/step-<8 digits>/``, complete only once its marker is written.

A save writes DCP's files (one ``.distcp`` per rank, ``.metadata`` by the coordinator) into the step
folder, then the coordinator writes ``COMPLETE`` last: a JSON of the step and the byte size of every
file, written to a temporary name, fsynced and renamed (a rename is atomic on POSIX), the folder
fsynced after. A crash at any moment before the rename leaves a folder without a marker; a file
truncated after (a full disk, a copy cut short) no longer matches its recorded size. Either way the
step is incomplete: ``latest_checkpoint`` skips it with a logged message naming it, and picks the
newest complete step.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

from xirang.ir.errors import XirangError
from xirang.ir.renamed import renamed_keywords

MARKER = "COMPLETE"
STEP_FOLDER = re.compile(r"^step-(\d{8})$")
log = logging.getLogger("xirang.checkpoint")


def step_folder(root, step: int) -> Path:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**8:
        raise XirangError(f"save_checkpoint: step must be an int in 0..99999999, got {step!r}",
                          where="save_checkpoint(step=...)", hint="pass the number of optimizer steps taken")
    return Path(root) / f"step-{step:08d}"


def remove_marker(folder: Path) -> None:
    """Before (re)writing a step: the folder is incomplete until the new marker is written."""
    (folder / MARKER).unlink(missing_ok=True)


def write_marker(folder: Path, step: int, layout: dict) -> None:
    """The last write of a save (see the module docstring)."""
    files = {entry.name: entry.stat().st_size for entry in sorted(folder.iterdir())
             if entry.is_file() and entry.name != MARKER and not entry.name.startswith(".tmp")}
    temporary = folder / f".tmp.{MARKER}.{os.getpid()}"
    with open(temporary, "w") as stream:
        json.dump({"step": step, "files": files, "layout": layout}, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, folder / MARKER)
    descriptor = os.open(folder, os.O_RDONLY)  # the rename itself survives a crash once the folder is synced
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def incomplete_reason(folder: Path) -> Optional[str]:
    """Why ``folder`` is not a complete checkpoint, or None when it is."""
    marker = folder / MARKER
    if not marker.is_file():
        return f"no {MARKER} marker (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        return f"its {MARKER} marker is unreadable ({error})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker recorded {size} (truncated or rewritten)"
    return None


def step_folders(root: Path) -> list:
    """(step, folder) of every step folder under ``root``, newest first."""
    found = [(int(match.group(1)), entry) for entry in root.iterdir()
             if entry.is_dir() and (match := STEP_FOLDER.match(entry.name))]
    return sorted(found, reverse=True)


@renamed_keywords(root="directory=")
def latest_checkpoint(directory, *, quiet: bool = False) -> Optional[Path]:
    """The newest complete step folder under ``directory`` (the folder ``save_checkpoint`` wrote into;
    None when there is none, or no such folder yet: a run's first start); each newer incomplete one is
    skipped with a logged warning naming it and why (``quiet``: no log, for the other ranks)."""
    root = Path(directory)
    if not root.exists():
        return None
    if not root.is_dir():
        raise XirangError(f"{str(root)!r} is a file, not a checkpoint folder",
                          where=f"latest_checkpoint({str(root)!r})",
                          hint="pass the folder save_checkpoint wrote into (it holds step-<8 digits>/ folders)")
    for _, folder in step_folders(root):
        reason = incomplete_reason(folder)
        if reason is None:
            return folder
        if not quiet:
            log.warning("xirang: skipping incomplete checkpoint %s: %s", folder, reason)
    return None


def resolve_checkpoint(path, *, quiet: bool = False, caller: str = "load_checkpoint") -> Path:
    """The complete step folder ``path`` names: itself (a step folder), or the latest one under it (a root)."""
    path = Path(path)
    where = f"{caller}({str(path)!r})"
    if not path.exists():
        raise XirangError(f"checkpoint path {str(path)!r} does not exist", where=where,
                          hint="pass a folder save_checkpoint wrote into, or one of its step-<8 digits>/ folders")
    if STEP_FOLDER.match(path.name) or (path / MARKER).exists() or (path / ".metadata").exists():
        reason = incomplete_reason(path)
        if reason is not None:
            raise XirangError(f"checkpoint {str(path)!r} is incomplete: {reason}", where=where,
                              hint="load an earlier step, or pass the root folder to take the latest complete one")
        return path
    latest = latest_checkpoint(path, quiet=quiet)
    if latest is None:
        seen = [folder.name for _, folder in step_folders(path)]
        found = f": the step folders {seen} are all incomplete" if seen else ": it has no step-<8 digits>/ folder"
        raise XirangError(f"no complete checkpoint under {str(path)!r}{found}",
                          where=where, hint="start from scratch, or pass the folder a save_checkpoint wrote into")
    return latest
