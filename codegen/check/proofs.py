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
(c) deadlock: nodes are call instances (the k-th call on group G; the k-th message s -> t). A call is
    reached once the calls it waits behind on its rank completed, and completes once every party reached
    it: behind the previous call on its channel where the backend runs a channel in order (NCCL: one
    stream per communicator, so every group, and every pair of ranks' sends and receives, which NCCL
    documents as blocking for the GPU unless fused in one group), and behind the rank's last call the
    host waited for (a synchronous collective). Gloo posts sends and receives without ordering them
    (matched by tag). Each such wait is an edge; a cycle is a deadlock. The graph is built on the ranks
    of dp index 0 with every instance
    taken up to a dp shift (the quotient by the dp translation, which every rank's program commutes
    with when dp ranks share classes); a cycle exists in the quotient if and only if it exists in the
    whole world (a quotient cycle lifts, repeated at most dp times, to a cycle). With uneven dp shares
    the whole world's graph is built;
(d) memory: every class's measured peak fits its device at the plan's usable fraction.
Every violation names the ranks, the group, the schedule action, the op and the source line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

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


@dataclass
class Move:
    """Global rank -> global rank: the coordinate shift taking a class's representative to one member."""

    mesh: object
    delta: dict
    memo: dict = field(default_factory=dict)

    def __call__(self, rank: int) -> int:
        coords = self.mesh.coords(rank)  # a shift that names no cp (or any axis) leaves that index as it is
        return self.mesh.rank_of(**{axis: (coords[axis] + self.delta.get(axis, 0)) % self.mesh.axis_size(axis)
                                    for axis in coords})

    def group(self, group: tuple) -> tuple:
        found = self.memo.get(group)
        if found is None:
            found = self.memo[group] = tuple(sorted(self(rank) for rank in group))
        return found


def move_between(mesh, source: int, target: int) -> Move:
    a, b = mesh.coords(source), mesh.coords(target)
    return Move(mesh, {axis: b[axis] - a[axis] for axis in a})


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
    return size > 1 and len({mesh.coords(rank)[axis] for rank in group}) == size


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
        move = move_between(mesh, representatives[index], member)
        translated = [call.translated(move) for call in calls]
        return tuple(call.signature for call in translated), translated

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


def prove_no_deadlock(mesh, classes: list, *, symmetric_dp: bool, ordered_pairs: bool) -> list:
    """(c): no cycle among the call instances (module docstring)."""
    class_of = {member: index for index, klass in enumerate(classes) for member in klass.members}
    ranks = [r for r in range(mesh.size) if not symmetric_dp or mesh.coords(r)["dp"] == 0]
    dp = mesh.axis_size("dp")

    def orbit(group: tuple) -> tuple:  # a group up to a dp shift (the whole group when dp is not quotiented)
        if not symmetric_dp or dp == 1:
            return group
        shifted = [tuple(sorted(Move(mesh, {"dp": s, "pp": 0, "tp": 0})(r) for r in group)) for s in range(dp)] \
            if not _spans(mesh, group, "dp") else [group]
        return min(shifted)

    def to_slice(rank: int) -> int:
        return mesh.rank_of(dp=0, pp=mesh.coords(rank)["pp"], tp=mesh.coords(rank)["tp"]) if symmetric_dp else rank

    graph = nx.DiGraph()
    where: dict = {}
    orbits: dict = {}
    for rank in ranks:
        if rank not in class_of:  # its class's step failed: that is reported apart
            continue
        klass = classes[class_of[rank]]
        move = move_between(mesh, klass.log.rank, rank)
        seen: dict = {}
        on_channel: dict = {}  # channel -> the rank's last instance on it
        waited = None  # the rank's last instance the host waited for
        for call in klass.log.calls:
            if call.kind in P2P_KINDS:
                peer = move(call.peer)
                pair = (rank, peer) if call.kind == "send" else (peer, rank)
                shift = mesh.coords(pair[0])["dp"] if symmetric_dp else 0
                pair = (to_slice(pair[0]), Move(mesh, {"dp": -shift, "pp": 0, "tp": 0})(pair[1]))
                key = ("p2p", pair, call.channel)
            else:
                group = move.group(tuple(sorted(call.group)))
                if group not in orbits:
                    orbits[group] = orbit(group)
                key = ("group", orbits[group], call.channel)
            seen[key] = seen.get(key, 0) + 1
            node = (*key, seen[key])
            parties = where.setdefault(node, [])
            if len(parties) < 2:
                parties.append(f"rank {rank}: {call.describe()}")
            graph.add_node(node)
            channel = ("p2p", frozenset(key[1]), key[2]) if key[0] == "p2p" else key
            behind = [waited]
            if key[0] != "p2p" or ordered_pairs:
                behind.append(on_channel.get(channel))
                on_channel[channel] = node
            for earlier in {b for b in behind if b is not None}:
                graph.add_edge(earlier, node)
            if call.blocking:
                waited = node
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return []
    calls = tuple(party for edge in cycle[:6] for party in where[edge[0]])
    return [Violation("deadlock", f"the calls wait on each other in a cycle of {len(cycle)} (each waits for a "
                                  f"party that is blocked in an earlier call of the cycle"
                                  + (", NCCL running each pair's sends and receives in order)" if ordered_pairs
                                     else ")"),
                      ranks=tuple(sorted({int(c.split(':')[0].split()[1]) for c in calls})), calls=calls,
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
