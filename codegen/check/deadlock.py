"""Proof (c): no deadlock, as no cycle among the call instances of every rank, built on a quotient.

The graph. Nodes are call instances: the k-th call on a process group G (every member's k-th call on G is
the same instance: proof (a) holds them equal), and the k-th message s -> t on a communicator. A call is
reached once the calls it waits behind on its rank completed, and completes once every party reached it:
behind the previous call on its channel where the backend runs a channel in order (NCCL: one stream per
communicator, so every group, and every pair of ranks' sends and receives, which NCCL documents as
blocking for the GPU unless fused in one group), and behind the rank's last call the host waited for (a
synchronous collective). Gloo posts sends and receives without ordering them (matched by tag). Each
such wait is an edge; a cycle is a deadlock.

The quotient. Let H be the translations of the mesh along the axes Q along which every class of ranks is
closed (rank r and r shifted by one along the axis are in one class; ``closed_axes``). Every member runs
its class's log moved by its coordinate difference, so for h in H the log of h(r) is h applied to the log
of r: h maps the graph onto itself. The graph is built once per orbit: on the ranks with coordinate 0 on
every axis of Q, each instance named by a canonical member of its orbit (``Orbits``). A cycle in the world
maps to a closed walk in the quotient, which holds a cycle; a cycle in the quotient lifts: following its
edges from any lift of its first node returns to that node's orbit moved by some h, and repeating the walk
at most |H| times closes a cycle in the world. So the quotient has a cycle if and only if the world does.
A rank whose class is not closed (a fault injected in one rank, uneven dp shares) keeps that axis out of
Q: the graph is then built over more ranks, never over fewer than the proof needs.

Acyclicity is decided by Kahn's topological sort on integer node ids (linear in nodes and edges); where
nodes are left, each has a predecessor left, and walking predecessors from one of them closes a cycle,
which the violation names with its calls.
"""
from __future__ import annotations

import numpy as np

from xirang.codegen.check.records import P2P_KINDS


def closed_axes(mesh, class_of: dict) -> tuple:
    """The mesh axes (size > 1) along which every class of ranks is closed: ``class_of[r]`` equals the class
    of r shifted by one along the axis, for every rank (a rank with no class counts as a class of its own kind)."""
    grid = np.array([class_of.get(rank, -1) for rank in range(mesh.size)]).reshape(mesh.shape)
    return tuple(axis for position, axis in enumerate(mesh.order)
                 if mesh.shape[position] > 1 and (np.roll(grid, 1, axis=position) == grid).all())


class Orbits:
    """Ranks, groups and messages up to the translations along ``axes`` (module docstring): each named by a
    canonical member of its orbit."""

    def __init__(self, mesh, axes: tuple):
        self.mesh = mesh
        self.sizes = np.array(mesh.shape)
        self.shifted = np.array([axis in axes for axis in mesh.order])  # the quotiented positions
        self.coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.shape), axis=1)  # rank -> coordinates
        self._groups: dict = {}

    def _ranks(self, coords: np.ndarray) -> np.ndarray:
        return np.ravel_multi_index(tuple(coords.T), self.mesh.shape)

    def base(self, rank: int) -> int:
        """The member of ``rank``'s orbit with coordinate 0 along every quotiented axis."""
        coords = self.coords[rank] * ~self.shifted
        return int(self._ranks(coords[None])[0])

    def message(self, sender: int, receiver: int) -> tuple:
        """The pair moved so that its sender has coordinate 0 along every quotiented axis (translations act
        freely on ranks: that member is unique)."""
        shift = self.coords[sender] * self.shifted
        moved = self._ranks((self.coords[[sender, receiver]] - shift) % self.sizes)
        return int(moved[0]), int(moved[1])

    def group(self, group: tuple) -> tuple:
        """A canonical member of the group's orbit: the least (as a sorted tuple) of the group moved so that one
        of its members' projections on the quotiented axes it is not invariant along is 0. That set of
        candidates is the same for every member of the orbit, so its least is too."""
        found = self._groups.get(group)
        if found is not None:
            return found
        coords = self.coords[list(group)]
        members = set(group)
        moving = self.shifted.copy()
        for position in np.flatnonzero(self.shifted):  # an axis the group is invariant along moves nothing
            step = coords.copy()
            step[:, position] = (step[:, position] + 1) % self.sizes[position]
            if set(self._ranks(step).tolist()) == members:
                moving[position] = False
        found = tuple(group)
        if moving.any():
            candidates = {tuple(row) for row in (coords * moving).tolist()}
            found = min(tuple(sorted(self._ranks((coords - np.array(shift)) % self.sizes).tolist()))
                        for shift in candidates)
        self._groups[group] = found
        return found


def call_graph(mesh, classes: list, move_between, *, ordered_pairs: bool, quotient: bool = True):
    """The wait graph's nodes (instance -> id), edges (two int arrays) and, per node, up to two of the
    (rank, call) parties that reach it; the ranks it was built on and the quotiented axes."""
    class_of = {member: index for index, klass in enumerate(classes) for member in klass.members}
    axes = closed_axes(mesh, class_of) if quotient else ()
    orbits = Orbits(mesh, axes)
    ranks = sorted({orbits.base(rank) for rank in class_of})
    ids: dict = {}
    parties: list = []
    sources: list = []
    targets: list = []
    for rank in ranks:
        klass = classes[class_of[rank]]
        move = move_between(mesh, klass.log.rank, rank)
        keys: dict = {}  # the call's (kind, peer or group, channel) -> its instance key, for this rank
        seen: dict = {}
        on_channel: dict = {}  # channel -> the rank's last instance on it
        waited = -1  # the rank's last instance the host waited for
        for call in klass.log.calls:
            raw = (call.kind, call.peer, call.group, call.channel)
            key = keys.get(raw)
            if key is None:
                if call.kind in P2P_KINDS:
                    peer = move(call.peer)
                    pair = orbits.message(rank, peer) if call.kind == "send" else orbits.message(peer, rank)
                    key = ("p2p", pair, call.channel)
                    channel = ("p2p", frozenset(pair), call.channel) if ordered_pairs else None
                else:
                    key = ("group", orbits.group(move.group(tuple(sorted(call.group)))), call.channel)
                    channel = key
                keys[raw] = key = (key, channel)
            key, channel = key
            count = seen[key] = seen.get(key, 0) + 1
            node = ids.get((key, count))
            if node is None:
                node = ids[(key, count)] = len(parties)
                parties.append([])
            if len(parties[node]) < 2:
                parties[node].append((rank, call))
            if waited >= 0:
                sources.append(waited)
                targets.append(node)
            if channel is not None:
                earlier = on_channel.get(channel, -1)
                if earlier >= 0 and earlier != waited:
                    sources.append(earlier)
                    targets.append(node)
                on_channel[channel] = node
            if call.blocking:
                waited = node
    return parties, np.array(sources, dtype=np.int64), np.array(targets, dtype=np.int64), ranks, axes


def find_cycle(count: int, sources: np.ndarray, targets: np.ndarray) -> list:
    """Node ids of one cycle of the graph, in edge order ([] when it is acyclic): Kahn's topological sort,
    then a walk back along predecessors among the nodes it could not order."""
    indegree = np.bincount(targets, minlength=count)
    order = np.argsort(sources, kind="stable")
    starts = np.searchsorted(sources[order], np.arange(count + 1))
    successors = targets[order].tolist()
    starts = starts.tolist()
    left = indegree.tolist()
    ready = [node for node in range(count) if left[node] == 0]
    done = 0
    while ready:
        node = ready.pop()
        done += 1
        for successor in successors[starts[node]:starts[node + 1]]:
            left[successor] -= 1
            if left[successor] == 0:
                ready.append(successor)
    if done == count:
        return []
    stuck = np.array([value > 0 for value in left])
    predecessor = {}
    for source, target in zip(sources.tolist(), targets.tolist()):
        if stuck[source] and stuck[target]:
            predecessor.setdefault(target, source)  # every stuck node has a stuck predecessor
    node, visited = int(np.flatnonzero(stuck)[0]), {}
    while node not in visited:
        visited[node] = len(visited)
        node = predecessor[node]
    walk = list(visited)[visited[node]:]  # node ... back along predecessors to node
    return walk[::-1]
