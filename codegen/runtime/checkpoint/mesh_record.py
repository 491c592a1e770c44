"""The mesh a checkpoint was saved under, and which saved rank a loading rank takes its own state from.

A checkpoint records its mesh by named axes and rank order (``{"axes": {"pp": 2, "dp": 2, "cp": 1,
"tp": 1, "ep": 1}, "order": ["pp", "dp", "cp", "tp"]}``, ir/mesh.py). Checkpoints written before the
mesh was named recorded ``str(mesh)``, ``"dp=2 x pp=2 x tp=1"``, under the old layout: dp outermost,
then pp, then tp. Parameters and optimizer state do not care (they are saved by the single-device
model's names and resharded on load), but each rank's own torch generator state does: the state a
rank saved belongs to its place on the mesh, not to its number. On the same mesh sizes, a loading
rank takes the state saved at its own coordinates, whichever layout numbered the saving ranks (the
old layout and the new one number (dp 1, pp 0) differently). On another mesh there is no such place,
and rank r takes rank r's state, as before.
"""
from __future__ import annotations

import re
from typing import Optional

from xirang.ir.mesh import RANK_AXES, SIZE_AXES, Mesh

OLD_ORDER = ("dp", "pp", "tp")  # the rank order before the mesh was named: dp outermost, tp innermost
_OLD_TEXT = re.compile(r"^dp=(\d+) x pp=(\d+) x tp=(\d+)$")


def mesh_record(mesh: Mesh) -> dict:
    """What a checkpoint records of the mesh it was saved under."""
    return {"axes": {axis: getattr(mesh, axis) for axis in SIZE_AXES}, "order": list(mesh.order)}


def saved_mesh(record) -> Optional[tuple[dict, tuple]]:
    """(sizes by axis, rank order outermost first) of a recorded mesh, new or old form; None when the
    record says nothing usable (one device, or a form this reader does not know)."""
    if isinstance(record, dict) and isinstance(record.get("axes"), dict) and isinstance(record.get("order"), list):
        return dict(record["axes"]), tuple(record["order"])
    match = _OLD_TEXT.match(record) if isinstance(record, str) else None
    if match:
        dp, pp, tp = (int(group) for group in match.groups())
        return {"dp": dp, "pp": pp, "tp": tp, "cp": 1, "ep": 1}, OLD_ORDER
    return None


def saving_rank(rank: int, mesh: Mesh, record) -> int:
    """The saved rank whose torch generator state rank ``rank`` of ``mesh`` restores (module docstring)."""
    found = saved_mesh(record)
    if found is None:
        return rank
    sizes, order = found
    if any(sizes.get(axis, 1) != getattr(mesh, axis) for axis in SIZE_AXES) or set(order) - set(RANK_AXES):
        return rank  # another mesh: no place to match
    coords = mesh.coords(rank)
    saved = 0
    for axis in order:  # row-major over the saving layout's order; an axis it omits had size 1
        saved = saved * sizes.get(axis, 1) + coords[axis]
    return saved
