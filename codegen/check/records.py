"""What the dry run records of one rank's training step: its calls and its memory.

A ``Call`` is one collective, send or receive as the rank issued it, in issue order. Groups and peers
are stored as global ranks of the rank that ran; ``translated`` gives the same call as another rank of
its class would issue it (every rank is placed by its mesh coordinates, so a call of rank r on the group
G is the call of rank r + d on G + d, d the coordinate difference).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")
P2P_KINDS = ("send", "recv")


@dataclass(frozen=True)
class Call:
    """One communication call of one rank (``kind`` in COLLECTIVE_KINDS or P2P_KINDS).

    ``group``: the group's global ranks in group order (for a send or receive, the pair (self, peer));
    ``count``: elements of this rank's buffer (the input of a reduce-scatter, the output of an all-gather's
    share, the tensor sent or received); ``op``: the reduce op ("" where none); ``root``: a broadcast's
    global source; ``peer``: the other rank of a send or receive, ``tag`` its tag, ``shape`` its tensor's.
    ``label``: the runtime's label of the call (its CommCounter record: "bucket:3", "tied:wte.weight"),
    ``action``: the schedule action running when it was issued ("" outside the schedule), ``node``: the
    stage module node that issued it and ``source`` that node's model source line ("" for runtime calls).
    """

    index: int
    kind: str
    group: tuple
    dtype: str
    count: int
    op: str = ""
    root: Optional[int] = None
    peer: Optional[int] = None
    tag: Optional[int] = None
    shape: tuple = ()
    label: str = ""
    action: str = ""
    node: str = ""
    source: str = ""
    where: str = ""  # the runtime's own file:line that issued it
    blocking: bool = False  # the host waits for it before going on (a synchronous collective, an object collective)
    channel: str = ""  # the process group's description ("default_pg", "dp", "pp_down"): its communicator

    @property
    def signature(self) -> tuple:
        """What every member of a collective must agree on (NCCL pairs calls by order alone)."""
        return (self.kind, self.dtype, self.count, self.op, self.root)

    def describe(self) -> str:
        what = f"{self.kind} {self.dtype} x{self.count}" + (f" op={self.op}" if self.op else "") \
            + (f" root {self.root}" if self.root is not None else "")
        if self.kind in P2P_KINDS:
            what = f"{self.kind} {self.dtype}{list(self.shape)} {'to' if self.kind == 'send' else 'from'} " \
                   f"rank {self.peer} (tag {self.tag})"
        context = ", ".join(part for part in (
            f"label {self.label}" if self.label else "", f"action {self.action}" if self.action else "",
            f"node {self.node}" if self.node else "", f"source {self.source}" if self.source else "",
            f"at {self.where}" if self.where and not self.source else "") if part)
        return f"#{self.index} {what}" + (f" ({context})" if context else "")

    @property
    def fields(self) -> tuple:
        """What a real run's call must equal: kind, group, dtype, count, op, root, peer, tag."""
        return (self.kind, tuple(self.group), self.dtype, self.count, self.op, self.root, self.peer, self.tag)

    def translated(self, move) -> "Call":
        """This call as issued by the rank ``move`` maps this one's rank to (``move``: global rank -> global rank;
        a group's ranks stay sorted, as torch keeps them; a message's pair stays (self, peer))."""
        moved = [move(r) for r in self.group]
        return replace(self, group=tuple(moved) if self.kind in P2P_KINDS else tuple(sorted(moved)),
                       root=None if self.root is None else move(self.root),
                       peer=None if self.peer is None else move(self.peer))


@dataclass(frozen=True)
class HostRead:
    """A device value read back to the host inside the step (a GPU synchronisation): the op and where."""

    op: str
    where: str
    action: str = ""


@dataclass
class MemoryReport:
    """Bytes one rank's device held: ``peak`` over the step (the allocator's rounding applied where the
    device has one), its split ``parts`` at the peak (MEMORY_PARTS of the plan and "communication"),
    what stayed held between steps (``resting``) and the allocations made."""

    peak: int = 0
    parts: dict = field(default_factory=dict)
    resting: int = 0
    allocations: int = 0
    peak_action: str = ""
    host_peak: int = 0  # a GPU rank's host memory its step's tensors held at most (offloaded activations)
    largest: tuple = ()  # (bytes, part, site) live at the peak, by where it was made, largest first


@dataclass
class RankLog:
    """Everything the dry run recorded of one rank's step."""

    rank: int
    coords: dict
    calls: list = field(default_factory=list)
    host_reads: list = field(default_factory=list)
    memory: MemoryReport = field(default_factory=MemoryReport)
    device_problems: list = field(default_factory=list)  # a CPU tensor met on a GPU rank, with where
    counter_records: list = field(default_factory=list)  # the runtime's CommCounter records of the step
    failure: str = ""  # the error the step raised ("" when it completed); the calls are those before it
    failed_in: str = ""  # the schedule action that raised it
    seconds: float = 0.0
