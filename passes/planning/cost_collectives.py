"""Alpha-beta prices of collectives on a group of ranks of a World.

Model (Hockney 1994): a message of n bytes over a link costs ``alpha + n / B``. A collective is a
sequence of steps in which every rank sends at once, so a step costs the latency and the transfer
time of its slowest link. The per-algorithm formulas are those of Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (2005), and Patarasuk & Yuan (2009)
for the bandwidth-optimal ring all-reduce.

Links a group sees:
- Intra-node: ``world.intra_node`` per rank (NVSwitch gives every GPU its full bandwidth at once).
  Its bandwidth is nccl-tests' *bus* bandwidth, which is what the ``(n-1)/n`` terms below divide.
- Inter-node: ``world.inter_node`` is per node (all its NICs together); each rank gets
  ``inter_node.bandwidth / devices on its node``. That assumes every rank of the node communicates
  at once, one NIC per GPU (rail-optimised, as in DGX A100): true for dp and pp groups, whose
  neighbours on the node run their own copy of the same collective concurrently.
- A flat algorithm whose group spans nodes runs every step at the slowest link: the per-rank
  inter-node bandwidth and the inter-node latency. The hierarchical algorithms use the fast links
  inside nodes and the k NICs of a node in parallel, which is what NCCL's multi-channel rings
  achieve in practice, so the cheapest candidate is the realistic one.

``nbytes`` is always the size of one rank's *full* buffer (nccl-tests' convention):
- all_reduce: the buffer every rank reduces; reduce_scatter: each rank's input (it keeps nbytes/n);
  all_gather: each rank's output (it contributes nbytes/n); all_to_all: each rank's send buffer
  (nbytes/n to each peer); broadcast: the root's buffer; send: the message, group = (src, dst).

Measured lines: where the World carries a calibration (``World.calibration``, written by ``xirang
calibrate``) with a fit for the collective's kind and group size, and the group lies on one node
(calibration measures one node's local ranks), the price is the measured ``alpha + beta · nbytes``
(algorithm "measured"): the backend's own algorithm and the contention of every group running at
once are in it, which no link-level formula knows. Other kinds and sizes fall back to the formulas,
whose links a calibrated World sets from its measured send.

Recursive halving-doubling all-reduce (Rabenseifner) is deliberately not offered: NCCL has no such
algorithm, and in the pure alpha-beta model it would dominate the ring, hiding the link contention
that makes it lose in practice.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional

from xirang.ir.world import LinkSpec, World
from xirang.ir.errors import InvalidValue


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds one collective takes with ``algorithm`` ("none" when nothing moves)."""

    kind: str
    algorithm: str
    seconds: float
    nbytes: float


@dataclass(frozen=True)
class GroupTopology:
    """How a group of ranks sits on the World: members per node, and the links they use."""

    size: int
    ranks_per_node: tuple[int, ...]  # members on each node the group spans, in node order
    intra: LinkSpec                  # link between two members on one node
    inter: LinkSpec                  # one rank's share of the inter-node link

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_node)

    @property
    def uniform_ranks_per_node(self) -> Optional[int]:
        """k when every spanned node holds k members, else None."""
        counts = set(self.ranks_per_node)
        return counts.pop() if len(counts) == 1 else None

    @property
    def slowest(self) -> LinkSpec:
        """The link a flat algorithm is limited by: the worse of intra/inter once nodes are crossed."""
        if self.num_nodes == 1:
            return self.intra
        return LinkSpec(min(self.intra.bandwidth, self.inter.bandwidth),
                        max(self.intra.latency, self.inter.latency))


def group_topology(group: tuple[int, ...], world: World) -> GroupTopology:
    """The topology of ``group`` (distinct global ranks of ``world``)."""
    group = tuple(group)
    if not group:
        raise InvalidValue("a collective needs a non-empty group of global ranks")
    if len(set(group)) != len(group):
        raise InvalidValue(f"group {group} names a rank more than once; a group lists distinct ranks")
    per_node = Counter(world.node_of(rank) for rank in group)  # node_of range-checks each rank
    nodes = sorted(per_node)
    devices = max(world.nodes[node].devices for node in nodes)
    inter = LinkSpec(world.inter_node.bandwidth / devices, world.inter_node.latency)
    return GroupTopology(len(group), tuple(per_node[node] for node in nodes),
                         world.intra_node, inter)


# --- building blocks: one flat algorithm on n ranks over one link ------------------------------

def _steps(count: int, link: LinkSpec, step_bytes: float) -> float:
    """``count`` steps, each sending ``step_bytes`` on every rank at once."""
    return count * (link.latency + step_bytes / link.bandwidth)


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def ring_all_reduce(nbytes: float, n: int, link: LinkSpec) -> float:
    """Reduce-scatter then all-gather round a ring: 2(n-1) steps of nbytes/n each,
    2(n-1)·alpha + 2(n-1)/n · nbytes/B (Patarasuk & Yuan 2009; bandwidth-optimal)."""
    return _steps(2 * (n - 1), link, nbytes / n)


def tree_all_reduce(nbytes: float, n: int, link: LinkSpec) -> float:
    """Pipelined (double) binary tree, reduce up then broadcast down: 2·ceil(log2 n)·alpha +
    2·nbytes/B (Sanders, Speck & Träff 2009, NCCL's tree). Fewer latency terms than the ring,
    slightly more bytes (2 vs 2(n-1)/n): it wins for small messages."""
    return 2 * _log2_ceil(n) * link.latency + 2 * nbytes / link.bandwidth


def ring_reduce_scatter(nbytes: float, n: int, link: LinkSpec) -> float:
    """(n-1) steps of nbytes/n: (n-1)·alpha + (n-1)/n · nbytes/B (Thakur et al. 2005).
    All-gather is the same ring run the other way, at the same price."""
    return _steps(n - 1, link, nbytes / n)


ring_all_gather = ring_reduce_scatter


# --- algorithms on a group: (nbytes, topology) -> seconds, or None where not applicable ---------

def _ring_all_reduce(nbytes, topo):
    return ring_all_reduce(nbytes, topo.size, topo.slowest)


def _tree_all_reduce(nbytes, topo):
    return tree_all_reduce(nbytes, topo.size, topo.slowest)


def _hierarchical_all_reduce(nbytes, topo):
    """Intra-node reduce-scatter, then k concurrent inter-node all-reduces (one per local index,
    each on nbytes/k over its own NIC; ring or tree, whichever is cheaper), then intra-node
    all-gather (the 2D scheme of NCCL / Horovod; Jia et al. 2018). Needs k > 1 members on each
    of several nodes."""
    k = topo.uniform_ranks_per_node
    if topo.num_nodes == 1 or k is None or k == 1:
        return None
    nodes, shard = topo.num_nodes, nbytes / k
    inter = min(ring_all_reduce(shard, nodes, topo.inter), tree_all_reduce(shard, nodes, topo.inter))
    return (ring_reduce_scatter(nbytes, k, topo.intra) + inter
            + ring_all_gather(nbytes, k, topo.intra))


def _ring_reduce_scatter(nbytes, topo):
    return ring_reduce_scatter(nbytes, topo.size, topo.slowest)


def _hierarchical_reduce_scatter(nbytes, topo):
    """Intra-node reduce-scatter over k, then k concurrent inter-node reduce-scatters on nbytes/k.
    All-gather runs the same two phases in reverse order, at the same price."""
    k = topo.uniform_ranks_per_node
    if topo.num_nodes == 1 or k is None or k == 1:
        return None
    return (ring_reduce_scatter(nbytes, k, topo.intra)
            + ring_reduce_scatter(nbytes / k, topo.num_nodes, topo.inter))


def _pairwise_all_to_all(nbytes, topo):
    """Pairwise exchange, n-1 steps of nbytes/n (Thakur et al. 2005, long messages). Across nodes
    the NVLink and NIC shares move at once, so the bandwidth term is the larger of the two; the
    rank with the fewest neighbours on its node sends the most across nodes."""
    n, k = topo.size, min(topo.ranks_per_node)
    near, far = k - 1, n - k  # peers on the same node, peers on other nodes
    latency = near * topo.intra.latency + far * topo.inter.latency
    transfer = max(near * nbytes / n / topo.intra.bandwidth,
                   far * nbytes / n / topo.inter.bandwidth if far else 0.0)
    return latency + transfer


def _binomial_broadcast(nbytes, topo):
    """Binomial tree: ceil(log2 n) rounds of the full message (Thakur et al. 2005, short)."""
    return _steps(_log2_ceil(topo.size), topo.slowest, nbytes)


def _scatter_allgather_broadcast(nbytes, topo):
    """Binomial scatter then ring all-gather (van de Geijn; Thakur et al. 2005, long messages):
    (ceil(log2 n) + n - 1)·alpha + 2(n-1)/n · nbytes/B."""
    n, link = topo.size, topo.slowest
    return (_log2_ceil(n) * link.latency + (n - 1) / n * nbytes / link.bandwidth
            + ring_all_gather(nbytes, n, link))


def _direct_send(nbytes, topo):
    """alpha + nbytes/B on the link between the two ranks (per-rank NIC share across nodes)."""
    return topo.slowest.transfer_time(nbytes)


AlgorithmCost = Callable[[float, GroupTopology], Optional[float]]

# kind -> its algorithms, in the order explain tables list them (ties go to the first)
ALGORITHMS: Mapping[str, tuple[tuple[str, AlgorithmCost], ...]] = MappingProxyType({
    "all_reduce": (("ring", _ring_all_reduce), ("tree", _tree_all_reduce),
                   ("hierarchical", _hierarchical_all_reduce)),
    "reduce_scatter": (("ring", _ring_reduce_scatter), ("hierarchical", _hierarchical_reduce_scatter)),
    "all_gather": (("ring", _ring_reduce_scatter), ("hierarchical", _hierarchical_reduce_scatter)),
    "all_to_all": (("pairwise", _pairwise_all_to_all),),
    "broadcast": (("binomial_tree", _binomial_broadcast),
                  ("scatter_allgather", _scatter_allgather_broadcast)),
    "send": (("direct", _direct_send),),
})


def collective_costs(kind: str, nbytes: float, group: tuple[int, ...],
                     world: World) -> tuple[CollectiveCost, ...]:
    """Every applicable algorithm's price for ``kind`` of ``nbytes`` on ``group``, in table order.

    A group of one rank, or zero bytes, costs nothing (algorithm "none"): no call is made.
    """
    if kind not in ALGORITHMS:
        raise InvalidValue(f"unknown collective {kind!r}; known: {', '.join(ALGORITHMS)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise InvalidValue(f"{kind}: nbytes must be a non-negative number of bytes, got {nbytes!r}")
    topo = group_topology(group, world)
    if kind == "send" and topo.size > 2:
        raise InvalidValue(f"send: group must be (src, dst), got {tuple(group)}")
    if topo.size == 1 or nbytes == 0:
        return (CollectiveCost(kind, "none", 0.0, nbytes),)
    calibration = world.calibration
    fit = calibration.fit(kind, topo.size) if calibration is not None and topo.num_nodes == 1 else None
    if fit is not None:
        return (CollectiveCost(kind, "measured", fit.seconds(nbytes), nbytes),)
    candidates = ((name, price(nbytes, topo)) for name, price in ALGORITHMS[kind])
    return tuple(CollectiveCost(kind, name, seconds, nbytes)
                 for name, seconds in candidates if seconds is not None)


def collective_cost(kind: str, nbytes: float, group: tuple[int, ...],
                    world: World) -> CollectiveCost:
    """The cheapest algorithm for ``kind`` of ``nbytes`` on ``group`` (see ``collective_costs``)."""
    return min(collective_costs(kind, nbytes, group, world), key=lambda cost: cost.seconds)
