"""The process groups of one rank along every named mesh axis, built from a Mesh.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must call it for
every group, members or not, in the same order, or the ranks pair the wrong rendezvous and hang.
``Mesh.groups(axis)`` fixes the order within an axis (groups by lowest rank), ``AXES`` the order of
the axes (pp, dp, cp, tp, then the expert axes edp and ep folded over dp x cp: ir/mesh.py), and
``build_mesh_groups`` walks both identically on every rank, keeping the handles of the groups this
rank is in.

An axis of size 1 gets no process group: its "group" is ``None``, which the collectives in
``collectives.py`` and ``grad_sync.py`` treat as "this rank alone", i.e. identity. Note that this
is NOT ``torch.distributed``'s meaning of ``group=None`` (the default world group); never hand a
``None`` from here straight to a ``torch.distributed`` call. A world of one rank needs no
``init_process_group`` at all: every axis has size 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from xirang.ir.context_method import context_subgroups
from xirang.ir.errors import XirangError
from xirang.ir.mesh import AXES, Mesh


@dataclass(frozen=True, eq=False)  # holds live group handles: compare by identity
class MeshGroups:
    """This rank's place on the mesh and its process group along every named axis (``None`` where
    the axis has size 1). ``dp``, ``pp``, ``tp`` (and ``cp``, ``ep``, ``edp``) are the handles,
    ``dp_ranks``... the members; ``group(axis)`` and ``ranks(axis)`` take any axis by name."""

    mesh: Mesh
    rank: int
    coords: dict          # {"pp": i, "dp": j, "cp": k, "tp": l} of ``rank`` (Mesh.coords)
    dp_ranks: tuple       # global ranks of this rank's dp group, in dp order
    pp_ranks: tuple
    tp_ranks: tuple
    dp: Optional[object]  # torch.distributed.ProcessGroup, or None where the axis has size 1
    pp: Optional[object]
    tp: Optional[object]
    # messages to a lower pipeline rank travel on a group of their own (the pp ranks again), those to a higher
    # one on the default group: NCCL runs a communicator's messages between two ranks in order on one stream,
    # so one channel per direction keeps a posted receive from waiting behind the other direction's send
    pp_down: Optional[object] = None
    # the context and expert axes (ir/mesh.py): created like the others, used once their runtimes land
    cp_ranks: tuple = ()
    ep_ranks: tuple = ()
    edp_ranks: tuple = ()
    cp: Optional[object] = None
    ep: Optional[object] = None
    edp: Optional[object] = None

    def group(self, axis: str):
        """The process group along mesh axis ``axis`` (``None``: size 1, collectives are identity).
        """
        self.mesh.axis_size(axis)  # names the valid axes on a typo
        return getattr(self, axis)

    def ranks(self, axis: str) -> tuple:
        self.mesh.axis_size(axis)
        return getattr(self, f"{axis}_ranks")

    def axis_size(self, axis: str) -> int:
        return self.mesh.axis_size(axis)

    def axis_index(self, axis: str) -> int:
        """This rank's position along ``axis`` (its rank inside that axis's group)."""
        return self.mesh.index(axis, self.rank)


def build_mesh_groups(mesh: Mesh, rank: Optional[int] = None) -> MeshGroups:
    """Create the groups of every named axis of ``mesh`` whose size is over 1 (``AXES`` order; an axis
    whose groups are an earlier axis's shares its handles), then ``pp_down``; call it on every rank,
    at the same point.

    ``rank`` defaults to ``torch.distributed.get_rank()`` (0 for a one-rank mesh without a
    process group). The default process group must already be initialised with exactly
    ``mesh.size`` ranks when the mesh has more than one.
    """
    where = f"build_mesh_groups(mesh {mesh})"
    initialised = dist.is_available() and dist.is_initialized()
    if mesh.size > 1:
        if not initialised:
            raise XirangError(
                f"mesh {mesh} has {mesh.size} ranks but torch.distributed is not initialised",
                where=where,
                hint="run the program under torchrun (see xirang.codegen.runtime.launch.launcher.launch_command) "
                     "or xirang.launch, which initialise the process group")
        world = dist.get_world_size()
        if world != mesh.size:
            raise XirangError(
                f"mesh {mesh} needs {mesh.size} ranks but the process group has {world}",
                where=where,
                hint=f"launch exactly {mesh.size} ranks (--nproc-per-node times nodes), "
                     f"or plan for a mesh whose pp * dp * cp * tp is {world}")
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    coords = mesh.coords(rank)  # range-checks rank

    handles, made = {}, {}  # made: an axis's groups -> this rank's handle among them
    for axis in AXES:
        if mesh.axis_size(axis) == 1:
            continue  # every rank skips the same axes, so the new_group order still agrees
        layout = mesh.groups(axis)
        if layout in made:  # the same ranks as an earlier axis (edp is dp when ep = cp = 1): one group
            handles[axis] = made[layout]
            continue
        for members in layout:
            group = dist.new_group(list(members), group_desc=axis)
            if rank in members:
                handles[axis] = made[layout] = group
    if mesh.axis_size("pp") > 1:  # after the axes, in the same order on every rank
        for members in mesh.groups("pp"):
            group = dist.new_group(list(members), group_desc="pp_down")
            if rank in members:
                handles["pp_down"] = group
    members = {f"{axis}_ranks": mesh.group(axis, rank) for axis in AXES}
    return MeshGroups(mesh=mesh, rank=rank, coords=coords, **members,
                      **{axis: handles.get(axis) for axis in AXES}, pp_down=handles.get("pp_down"))


@dataclass(frozen=True, eq=False)  # holds live group handles: compare by identity
class ContextGroups:
    """The sub-groups of this rank's cp group that USP attention runs on (ir/context_method.py):
    ``a2a``, its all-to-all group (``a2a`` consecutive cp members), and ``ring``, its ring group (every
    a2a-th member); each of two ranks or more (1 < a2a < cp)."""

    a2a: Optional[object]
    ring: Optional[object]


def build_context_groups(mesh: Mesh, a2a: int, rank: Optional[int] = None) -> ContextGroups:
    """This rank's ``ContextGroups`` at all-to-all degree ``a2a`` (1 < a2a < cp, dividing it). Collective over
    the whole world like ``build_mesh_groups``: every rank creates every cp group's all-to-all groups, then
    their ring groups, in ``Mesh.groups("cp")`` order, keeping the handles of its own."""
    if rank is None:
        rank = dist.get_rank()
    split = [context_subgroups(members, a2a) for members in mesh.groups("cp")]
    mine = {}
    for kind, index in (("a2a", 0), ("ring", 1)):
        for layout in split:
            for members in layout[index]:
                group = dist.new_group(list(members), group_desc=f"cp_{kind}")
                if rank in members:
                    mine[kind] = group
    return ContextGroups(a2a=mine["a2a"], ring=mine["ring"])


@dataclass(frozen=True, eq=False)  # holds live group handles: compare by identity
class TwoLevelGroups:
    """The sub-groups a hierarchical all-reduce of one axis group runs on: ``intra``, this rank's
    fellow members on its node (``ranks_per_node`` of them), and ``inter``, the members at this
    rank's position on every node (one per node, ``nodes`` of them)."""

    intra: object
    inter: object
    ranks_per_node: int
    nodes: int


def build_two_level_groups(mesh: Mesh, world, axis: str, rank: int) -> Optional[TwoLevelGroups]:
    """This rank's ``TwoLevelGroups`` for its ``axis`` group on ``world`` (an ``xirang.ir.world.World``
    of ``mesh.size`` ranks), or None where its group does not span several nodes with the same
    number k > 1 of members on each (there a hierarchical all-reduce has nothing to gain).

    Collective over the whole world like ``build_mesh_groups``: every rank walks every group of the
    axis in ``Mesh.groups`` order and creates the same sub-groups in the same order.
    """
    if world.size != mesh.size:
        raise XirangError(f"the plan's world has {world.size} ranks but its mesh {mesh} has {mesh.size}",
                          where="build_two_level_groups", hint="re-plan: mesh and world must have the same size")
    mine = None
    for members in mesh.groups(axis):
        by_node: dict = {}
        for member in sorted(members):
            by_node.setdefault(world.node_of(member), []).append(member)
        per_node = [by_node[node] for node in sorted(by_node)]
        counts = {len(on_node) for on_node in per_node}
        if len(per_node) < 2 or len(counts) != 1 or counts == {1}:
            continue  # decided from mesh and world alone, so every rank skips the same groups
        k = len(per_node[0])
        intra = [dist.new_group(on_node) for on_node in per_node]
        inter = [dist.new_group([on_node[i] for on_node in per_node]) for i in range(k)]
        for node, on_node in enumerate(per_node):
            if rank in on_node:
                mine = TwoLevelGroups(intra[node], inter[on_node.index(rank)], k, len(per_node))
    return mine
