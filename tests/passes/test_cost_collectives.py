"""cost_collectives: hand-computed alpha-beta prices on one node and across nodes, the cheapest
algorithm per regime (tree for tiny messages, ring for large ones on a node, hierarchical across
nodes), point-to-point by link level, and the degenerate and bad-input cases.

Links of the default World: intra 230 GB/s, 5 us; inter 200 GB/s per node of 8, so 25 GB/s per
rank, 10 us."""
from __future__ import annotations

import pytest

from xirang.ir.mesh import Mesh
from xirang.ir.world import World
from xirang.passes.planning.cost_collectives import (CollectiveCost, collective_cost, collective_costs,
                                            group_topology)

NODE = World.uniform(1, 8)
CLUSTER = World.uniform(16, 8)
A_I, B_I = 5e-6, 230e9      # intra-node latency, bandwidth
A_E, B_E = 1e-5, 200e9 / 8  # inter-node latency, per-rank bandwidth
GB = 1e9


def by_algorithm(kind, nbytes, group, world) -> dict[str, float]:
    return {c.algorithm: c.seconds for c in collective_costs(kind, nbytes, group, world)}


def test_topology():
    topo = group_topology(tuple(range(16, 40)), CLUSTER)  # nodes 2, 3, 4
    assert topo.size == 24 and topo.ranks_per_node == (8, 8, 8) and topo.uniform_ranks_per_node == 8
    assert topo.inter.bandwidth == B_E and topo.slowest.bandwidth == B_E
    assert topo.slowest.latency == A_E
    assert group_topology((0, 1, 9), CLUSTER).uniform_ranks_per_node is None
    assert group_topology((3, 5), CLUSTER).slowest == CLUSTER.intra_node


def test_ring_all_reduce_one_node():
    # 2(n-1)/n * S / B + 2(n-1) * alpha, n = 8
    expected = 2 * 7 / 8 * 1e9 / 230e9 + 14 * 5e-6
    cost = collective_cost("all_reduce", GB, tuple(range(8)), NODE)
    assert cost == CollectiveCost("all_reduce", "ring", pytest.approx(expected), GB)
    # tree: 2 * log2(8) * alpha + 2 S / B, more bytes: ring wins at 1 GB
    assert by_algorithm("all_reduce", GB, tuple(range(8)), NODE) == {
        "ring": pytest.approx(expected), "tree": pytest.approx(6 * 5e-6 + 2e9 / 230e9)}


def test_tree_beats_ring_for_tiny_messages():
    nbytes = 1024
    ring = 14 * A_I + 2 * 7 / 8 * nbytes / B_I  # ~70 us, latency-bound
    tree = 6 * A_I + 2 * nbytes / B_I          # ~30 us
    cost = collective_cost("all_reduce", nbytes, tuple(range(8)), NODE)
    assert cost.algorithm == "tree" and cost.seconds == pytest.approx(tree)
    assert by_algorithm("all_reduce", nbytes, tuple(range(8)), NODE)["ring"] == pytest.approx(ring)


def test_hierarchical_beats_flat_ring_across_16_nodes():
    group = tuple(range(128))
    # flat ring: 254 steps at the slowest link, 2 * 127/128 * 1 GB at 25 GB/s = 81.9 ms
    ring = 254 * A_E + 2 * 127 / 128 * GB / B_E
    # tree: 2 * 7 * alpha + 2 GB / 25 GB/s = 80.1 ms
    tree = 14 * A_E + 2 * GB / B_E
    # hierarchical: reduce-scatter in the node (7 steps of 1/8 GB at 230 GB/s), 8 concurrent ring
    # all-reduces of 1/8 GB among 16 nodes at 25 GB/s each, all-gather in the node: 17.4 ms
    intra = 7 * A_I + 7 / 8 * GB / B_I
    inter = 30 * A_E + 2 * 15 / 16 * (GB / 8) / B_E
    hierarchical = intra + inter + intra
    costs = by_algorithm("all_reduce", GB, group, CLUSTER)
    assert costs == {"ring": pytest.approx(ring), "tree": pytest.approx(tree),
                     "hierarchical": pytest.approx(hierarchical)}
    best = collective_cost("all_reduce", GB, group, CLUSTER)
    assert best.algorithm == "hierarchical" and hierarchical < ring / 4


def test_dp_group_one_rank_per_node_has_no_hierarchical():
    mesh = Mesh(dp=16, pp=1, tp=8)
    group = mesh.group("dp", 0)  # ranks 0, 8, ..., 120: one per node
    assert group == tuple(range(0, 128, 8))
    costs = by_algorithm("all_reduce", GB, group, CLUSTER)
    assert set(costs) == {"ring", "tree"}
    assert costs["ring"] == pytest.approx(30 * A_E + 2 * 15 / 16 * GB / B_E)


def test_reduce_scatter_and_all_gather():
    # one node: (n-1) alpha + (n-1)/n S / B
    expected = 7 * A_I + 7 / 8 * GB / B_I
    for kind in ("reduce_scatter", "all_gather"):
        assert collective_cost(kind, GB, tuple(range(8)), NODE).seconds == pytest.approx(expected)
    # 2 nodes x 8: hierarchical = the intra phase, then 8 concurrent 2-rank phases on S/8
    group = tuple(range(16))
    hierarchical = 7 * A_I + 7 / 8 * GB / B_I + 1 * A_E + 1 / 2 * (GB / 8) / B_E
    ring = 15 * A_E + 15 / 16 * GB / B_E
    costs = by_algorithm("reduce_scatter", GB, group, CLUSTER)
    assert costs == {"ring": pytest.approx(ring), "hierarchical": pytest.approx(hierarchical)}
    assert by_algorithm("all_gather", GB, group, CLUSTER) == costs


def test_all_to_all():
    # one node: 7 pairwise steps of S/8
    assert collective_cost("all_to_all", GB, tuple(range(8)), NODE).seconds == pytest.approx(
        7 * A_I + 7 / 8 * GB / B_I)
    # 2 nodes x 8: each rank sends 7/16 of S over NVLink and 8/16 over its NIC, at once
    expected = 7 * A_I + 8 * A_E + max(7 / 16 * GB / B_I, 8 / 16 * GB / B_E)
    cost = collective_cost("all_to_all", GB, tuple(range(16)), CLUSTER)
    assert cost.algorithm == "pairwise" and cost.seconds == pytest.approx(expected)


def test_broadcast():
    group = tuple(range(8))
    small, large = 1024, GB
    assert collective_cost("broadcast", small, group, NODE) == CollectiveCost(
        "broadcast", "binomial_tree", pytest.approx(3 * (A_I + small / B_I)), small)
    # scatter + all-gather: (3 + 7) alpha + 2 * 7/8 S / B, against 3 full copies
    assert collective_cost("broadcast", large, group, NODE) == CollectiveCost(
        "broadcast", "scatter_allgather", pytest.approx(10 * A_I + 2 * 7 / 8 * large / B_I), large)


def test_send_inside_and_across_nodes():
    nbytes = 100e6
    inside = collective_cost("send", nbytes, (0, 1), CLUSTER)
    across = collective_cost("send", nbytes, (7, 8), CLUSTER)
    assert inside.seconds == pytest.approx(5e-6 + 100e6 / 230e9)  # 0.44 ms
    assert across.seconds == pytest.approx(1e-5 + 100e6 / 25e9)   # 4.01 ms
    assert inside.algorithm == across.algorithm == "direct"


def test_trivial_groups_and_messages_cost_nothing():
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send"):
        assert collective_cost(kind, GB, (3,), CLUSTER) == CollectiveCost(kind, "none", 0.0, GB)
    assert collective_cost("all_reduce", 0, (0, 1), NODE).seconds == 0.0


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        collective_cost("allreduce", GB, (0, 1), NODE)
    with pytest.raises(ValueError, match="more than once"):
        collective_cost("all_reduce", GB, (0, 0), NODE)
    with pytest.raises(ValueError, match="out of range"):
        collective_cost("all_reduce", GB, (0, 8), NODE)
    with pytest.raises(ValueError, match="non-empty"):
        collective_cost("all_reduce", GB, (), NODE)
    with pytest.raises(ValueError, match=r"\(src, dst\)"):
        collective_cost("send", GB, (0, 1, 2), NODE)
    with pytest.raises(ValueError, match="non-negative"):
        collective_cost("all_reduce", -1, (0, 1), NODE)
