"""The proofs over every rank's recorded step, run on one log per class of ranks.

Formulation. Rank m of a class runs its representative r's program with its own coordinates, so its
calls are r's with every rank moved by m's coordinate difference d (``Move``: modulo each axis's size, so
a group along an axis maps onto itself, since torch sorts a group's ranks, groups compare as sorted tuples).
Given the logs L(r) of the representatives:
(a) collectives: for every process group G that any rank issues a call on, the members issuing calls on
    G are exactly G's ranks, and their sequences of calls on G have equal (kind, dtype, count, op, root)
    call for call (NCCL pairs calls by order alone);
(b) sends: for every ordered pair (s, t), the sends s -> t in issue order equal the receives at t from s
    in issue order (shape, dtype, tag): NCCL matches a pair's messages in order, gloo by tag;
(c) deadlock: nodes are call instances (the k-th call on group G; the k-th message s -> t), edges the
    waits each backend's ordering makes (NCCL: each communicator's calls in order, sends and receives
    included; gloo: messages matched by tag; a call the host waits for orders everything after it); a
    cycle is a deadlock. Built once per orbit of the mesh translations every class is closed under (dp
    and tp when dp ranks share classes), which has a cycle if and only if the world's graph does
    (deadlock.py states the graph, the quotient and why it is exact);
(d) memory: every class's measured peak fits its device at the plan's usable fraction.
Every violation names the ranks, the group, the schedule action, the op and the source line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xirang.codegen.check.deadlock import call_graph, find_cycle
from xirang.codegen.check.records import P2P_KINDS

GiB = 1024 ** 3


@dataclass(frozen=True)
class Violation:
    """One broken proof: which (``proof``), what, on which ranks and group, and the calls behind it."""

    proof: str  # "collectives", "sends", "deadlock", "memory", "device", "classes"
    what: str
    ranks: tuple = ()
    group: tuple = ()
    calls: tuple = ()  # descriptions of the calls involved (rank: call)
    hint: str = ""

    def describe(self) -> str:
        lines = [f"[{self.proof}] {self.what}"]
        if self.ranks:
            lines.append(f"  ranks: {_short(self.ranks)}")
        if self.group:
            lines.append(f"  group: {_short(self.group)}")
        lines += [f"  {call}" for call in self.calls]
        if self.hint:
            lines.append(f"  what to do: {self.hint}")
        return "\n".join(lines)


def _short(ranks) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 12 else f"{ranks[:6]} ... {ranks[-3:]} ({len(ranks)} ranks)"


def _layout(mesh) -> tuple:
    """(axis, size, stride) of every rank axis, outermost first: rank = sum of coordinate x stride (ir/mesh.py
    ``rank_of``); the proofs move hundreds of thousands of ranks, so by arithmetic, not through coords dicts."""
    found = _LAYOUTS.get(mesh)
    if found is None:
        strides, stride = [], 1
        for axis in reversed(mesh.order):
            strides.append((axis, getattr(mesh, axis), stride))
            stride *= getattr(mesh, axis)
        found = _LAYOUTS[mesh] = tuple(reversed(strides))
    return found


_LAYOUTS: dict = {}


@dataclass
class Move:
    """Global rank -> global rank: the coordinate shift taking a class's representative to one member."""

    mesh: object
    delta: dict
    memo: dict = field(default_factory=dict)

    def __post_init__(self):  # a shift that names no cp (or any axis) leaves that index as it is
        self._terms = tuple((size, stride, self.delta.get(axis, 0) % size) for axis, size, stride in _layout(self.mesh))

    def __call__(self, rank: int) -> int:
        moved = 0
        for size, stride, shift in self._terms:
            moved += (rank // stride + shift) % size * stride
        return moved

    def group(self, group: tuple) -> tuple:
        found = self.memo.get(group)
        if found is None:
            if len(group) > 64:  # a dp or world group: the same arithmetic on an array
                ranks, moved = np.asarray(group), 0
                for size, stride, shift in self._terms:
                    moved = moved + (ranks // stride + shift) % size * stride
                found = tuple(sorted(moved.tolist()))
            else:
                found = tuple(sorted(self(rank) for rank in group))
            self.memo[group] = found
        return found


def move_between(mesh, source: int, target: int) -> Move:
    return Move(mesh, {axis: target // stride % size - source // stride % size
                       for axis, size, stride in _layout(mesh)})


@dataclass
class ClassLog:
    """A class of ranks: the representative's log and the members (the representative among them)."""

    log: object  # RankLog
    members: tuple


def _collectives_by_group(log) -> dict:
    """(channel, sorted group) -> [call]: two process groups over the same ranks (a pipeline group and a tied
    weight's) are two communicators, each pairing its own calls."""
    by_group: dict = {}
    for call in log.calls:
        if call.kind not in P2P_KINDS:
            by_group.setdefault((call.channel, tuple(sorted(call.group))), []).append(call)
    return by_group


def prove_collectives(mesh, classes: list) -> list:
    """(a): every group's members issue equal sequences of calls on it (module docstring)."""
    issued: dict = {}  # moved group's id -> [(member, class index, the representative's group's position)]
    ids: dict = {}  # (channel, group) -> a small id: a world group is thousands of ranks, hashed once
    groups_of: dict = {}  # id -> (channel, group)
    for index, klass in enumerate(classes):
        rep = klass.log.rank
        groups = list(_collectives_by_group(klass.log))
        spanned = [{axis for axis in mesh.coords(rep) if _spans(mesh, key[1], axis)} for key in groups]
        moves: dict = {}
        for member in klass.members:
            move = move_between(mesh, rep, member)
            for position, own in enumerate(groups):  # the moved group depends only on the shift along axes
                shift = (position, tuple(0 if axis in spanned[position]  # it does not span
                                         else move.delta[axis] % mesh.axis_size(axis) for axis in move.delta))
                moved = moves.get(shift)
                if moved is None:
                    key = (own[0], move.group(own[1]))
                    moved = moves[shift] = ids.setdefault(key, len(ids))
                    groups_of[moved] = key
                issued.setdefault(moved, []).append((member, index, position))
    violations, cache = [], {}
    by_class = [list(_collectives_by_group(klass.log).values()) for klass in classes]
    representatives = [klass.log.rank for klass in classes]
    for moved, members in issued.items():
        group = groups_of[moved][1]
        missing = sorted(set(group) - {member for member, _, _ in members})
        if missing:
            member, index, position = members[0]
            calls = by_class[index][position]
            first = calls[0]
            violations.append(Violation(
                "collectives", f"{len(missing)} member(s) of the group never call on it, while rank {member} issues "
                f"{len(calls)} call(s) on it", ranks=tuple(missing),
                group=group, calls=(f"rank {member}: {first.describe()}",),
                hint="every member of a process group must issue the same collectives on it"))
        sequences: dict = {}
        for member, index, position in members:
            sequences.setdefault((index, position), []).append(member)
        if len(sequences) > 1:
            violations += _compare_sequences(mesh, by_class, representatives, group, sequences, cache)
    return violations


def _spans(mesh, group: tuple, axis: str) -> bool:
    """Whether ``group`` holds a whole line of ``axis`` (then a shift along it maps the group onto itself)."""
    size = mesh.axis_size(axis)
    if size == 1:
        return False
    stride = next(stride for name, _, stride in _layout(mesh) if name == axis)
    if len(group) > 64:
        return np.unique(np.asarray(group) // stride % size).size == size
    return len({rank // stride % size for rank in group}) == size


def _compare_sequences(mesh, by_class: list, representatives: list, group, sequences: dict, cache: dict) -> list:
    """Each (class, representative's group)'s calls on ``group``, moved to its first member (so a broadcast's
    root is a rank of ``group``), against the first one's. ``by_class[i]``: class i's calls per group, in
    ``_collectives_by_group``'s order; ``cache`` keeps each sequence's signatures (a pipeline or tied group
    is compared once per group, hundreds of times, on the same logs)."""
    def moved(key, member):
        index, position = key
        calls = by_class[index][position]
        if not any(call.root is not None for call in calls):  # nothing rank-dependent: one tuple per sequence
            if key not in cache:
                cache[key] = (tuple(call.signature for call in calls), calls)
            return cache[key]
        # a broadcast's root is the signature's one rank: moved alone (the whole call, group and all, only where
        # it is described: a pipeline group's broadcasts are compared for each of a thousand groups)
        move = move_between(mesh, representatives[index], member)
        signatures = tuple(call.signature if call.root is None else (*call.signature[:4], move(call.root))
                           for call in calls)
        return signatures, _Translated(calls, move)

    (first_key, first_members), *others = sequences.items()
    reference, reference_calls = moved(first_key, first_members[0])
    found = []
    for key, members in others:
        mine, my_calls = moved(key, members[0])
        if mine == reference:
            continue
        k = next(k for k in range(max(len(reference), len(mine)))
                 if k >= len(reference) or k >= len(mine) or reference[k] != mine[k])
        a = reference_calls[k] if k < len(reference_calls) else None
        b = my_calls[k] if k < len(my_calls) else None
        found.append(Violation(
            "collectives", f"the members of the group disagree at their call #{k} on it"
            + (" (one has no such call)" if a is None or b is None else ""),
            ranks=(first_members[0], members[0]), group=group,
            calls=(f"rank {first_members[0]}: {a.describe() if a else 'no call'}",
                   f"rank {members[0]}: {b.describe() if b else 'no call'}"),
            hint="the ranks would pair different collectives (NCCL hangs or reduces the wrong buffers)"))
    return found


class _Translated:
    """A sequence of calls as another rank of the class issues them, each translated when it is read."""

    def __init__(self, calls: list, move):
        self.calls, self.move = calls, move

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, k: int):
        return self.calls[k].translated(self.move)


def _messages(log) -> dict:
    """(kind, peer, channel) -> [call] of one log's sends and receives, in issue order (each process group is
    its own communicator: messages match within it)."""
    found: dict = {}
    for call in log.calls:
        if call.kind in P2P_KINDS:
            found.setdefault((call.kind, call.peer, call.channel), []).append(call)
    return found


def prove_sends(mesh, classes: list) -> list:
    """(b): every send has its receive, in order, with equal shape, dtype and tag (module docstring)."""
    class_of = {member: index for index, klass in enumerate(classes) for member in klass.members}
    messages = [_messages(klass.log) for klass in classes]
    violations, checked = [], set()
    for index, klass in enumerate(classes):
        rep = klass.log.rank
        for member in klass.members:
            move = move_between(mesh, rep, member)
            for (kind, peer0, channel), calls in messages[index].items():
                peer = move(peer0)
                sender, receiver = (member, peer) if kind == "send" else (peer, member)
                other = class_of.get(peer)
                if other is None:
                    violations.append(Violation("sends", f"rank {member} {kind}s with rank {peer}, outside the world",
                                                ranks=(member,), calls=(f"rank {member}: {calls[0].describe()}",)))
                    continue
                back = move_between(mesh, peer, classes[other].log.rank)
                mirror = "recv" if kind == "send" else "send"
                theirs = messages[other].get((mirror, back(member), channel), [])
                key = (index, kind, peer0, channel, other, back(member))
                if key in checked:
                    continue
                checked.add(key)
                sends, recvs = (calls, theirs) if kind == "send" else (theirs, calls)
                problem = _pair_problem(sends, recvs)
                if problem is not None:
                    k, a, b = problem
                    violations.append(Violation(
                        "sends", f"message #{k} from rank {sender} to rank {receiver} does not meet its receive",
                        ranks=(sender, receiver),
                        calls=(f"rank {sender}: {a.describe() if a else 'no send'}",
                               f"rank {receiver}: {b.describe() if b else 'no receive'}"),
                        hint="a send must meet a receive of the same shape, dtype and tag, in the same order"))
    return violations


def _pair_problem(sends: list, recvs: list):
    for k in range(max(len(sends), len(recvs))):
        a = sends[k] if k < len(sends) else None
        b = recvs[k] if k < len(recvs) else None
        if a is None or b is None or (a.shape, a.dtype, a.tag) != (b.shape, b.dtype, b.tag):
            return k, a, b
    return None


def prove_no_deadlock(mesh, classes: list, *, ordered_pairs: bool, quotient: bool = True) -> list:
    """(c): no cycle among the call instances (module docstring; the graph and its quotient: deadlock.py).
    ``quotient``: build it once per orbit of the translations every class is closed under (False: on every
    rank, for tests that compare the two)."""
    parties, sources, targets, _, _ = call_graph(mesh, classes, move_between, ordered_pairs=ordered_pairs,
                                                 quotient=quotient)
    cycle = find_cycle(len(parties), sources, targets)
    if not cycle:
        return []
    calls = tuple(f"rank {rank}: {call.describe()}" for node in cycle[:6] for rank, call in parties[node])
    ranks = tuple(sorted({rank for node in cycle[:6] for rank, _ in parties[node]}))
    return [Violation("deadlock", f"the calls wait on each other in a cycle of {len(cycle)} (each waits for a "
                                  f"party that is blocked in an earlier call of the cycle"
                                  + (", NCCL running each pair's sends and receives in order)" if ordered_pairs
                                     else ")"),
                      ranks=ranks, calls=calls,
                      hint="reorder the calls so every rank reaches them in one order, or fuse sends and receives "
                           "that must progress together into one group (torch.distributed.batch_isend_irecv)")]


def prove_memory(plan, classes: list, memory_bytes=None) -> list:
    """(d): each class's measured peak fits its device at the plan's usable fraction (of ``memory_bytes``
    where given, else of the plan's device)."""
    violations = []
    for klass in classes:
        rank = klass.log.rank
        device = plan.world.device_of(rank)
        fraction = min(stage.memory_limit_bytes for stage in plan.stages) / device.memory_bytes
        usable = fraction * (memory_bytes or device.memory_bytes)
        peak = klass.log.memory.peak
        if peak > usable:
            parts = ", ".join(f"{name} {size / GiB:.2f}" for name, size in klass.log.memory.parts.items())
            violations.append(Violation(
                "memory", f"pipeline rank {klass.log.coords['pp']} peaks at {peak / GiB:.2f} GiB, over the "
                f"{usable / GiB:.2f} GiB the plan may use of its {device.name} ({fraction:.0%} of "
                f"{(memory_bytes or device.memory_bytes) / GiB:.1f} GiB); at the peak (GiB): {parts}",
                ranks=klass.members, calls=(f"peak during {klass.log.memory.peak_action or 'the step'}",),
                hint="re-plan with more pipeline stages, recompute, ZeRO or a smaller micro-batch"))
    return violations


def prove_devices(classes: list) -> list:
    """Tensors on the wrong device for the rank's backend (a CPU tensor handed to NCCL)."""
    return [Violation("device", problem, ranks=klass.members,
                      hint="make the tensor on the rank's device (the runtime's device, cuda:LOCAL_RANK under NCCL)")
            for klass in classes for problem in klass.log.device_problems]
