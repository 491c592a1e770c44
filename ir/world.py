"""The cluster a plan runs on: nodes of devices, and the two levels of links between them.

Global ranks are numbered node by node: node 0 holds ranks 0..d0-1, node 1 the next d1, and so on
(torchrun's numbering with one process per device). Nodes may differ in device kind and count.

Collectives are priced with the alpha-beta model per link level: sending n bytes over a link
takes ``latency + n / bandwidth`` (Hockney 1994; Thakur et al. 2005 for the collective formulas).
"""
from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from xirang.ir.calibration import Calibration
from xirang.ir.device import DeviceSpec, device_spec
from xirang.ir.errors import InvalidValue
from xirang.ir.renamed import renamed_keywords

DEFAULT_DEVICE = "a100-80g"
DEVICES_PER_NODE = 8  # how an int device count is packed into nodes (see parse_world)


@dataclass(frozen=True)
class LinkSpec:
    """One link level: ``bandwidth`` in bytes/s, ``latency`` in seconds per message."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, (int, float)) \
                or self.bandwidth <= 0:
            raise InvalidValue(f"LinkSpec bandwidth must be a positive number of bytes/s, "
                             f"got {self.bandwidth!r}")
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) \
                or self.latency < 0:
            raise InvalidValue(f"LinkSpec latency must be a non-negative number of seconds, "
                             f"got {self.latency!r}")
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` point to point: alpha + n * beta."""
        return self.latency + nbytes / self.bandwidth

    def to_json(self) -> dict:
        return {"bandwidth": self.bandwidth, "latency": self.latency}

    @classmethod
    def from_json(cls, data: dict) -> "LinkSpec":
        if not isinstance(data, dict) or set(data) != {"bandwidth", "latency"}:
            raise InvalidValue(f"bad link spec {data!r}: expected an object with exactly the keys "
                             f"bandwidth (bytes/s), latency (s)")
        return cls(**data)


# The links follow the device kind: a World of H100s is built of DGX H100-class nodes, not A100
# ones (``NODE_LINKS``, chosen by World.uniform / parse_world and by World when none is given).
# Calibration replaces them with measured values.

# DGX A100 (NVIDIA DGX A100 datasheet / user guide): NVLink3, 12 links x 25 GB/s = 300 GB/s per
# direction per GPU (600 GB/s bidirectional) through six NVSwitches. The all-reduce *bus* bandwidth
# nccl-tests measures on one such node is about 230 GB/s, 77% of that peak; latency a few
# microseconds per NCCL call.
INTRA_NODE_NVLINK = LinkSpec(bandwidth=230e9, latency=5e-6)
NVLINK_BUS_FRACTION = 230e9 / 300e9  # what NCCL reaches of the per-direction NVLink peak (DGX A100)

# DGX A100: 8 single-port ConnectX-6 HDR InfiniBand NICs for compute traffic, one per GPU
# (rail-optimised), 8 x 200 Gb/s = 8 x 25 GB/s = 200 GB/s per node in each direction; each GPU's
# own share is 25 GB/s. About 10 microseconds per message across a switch, NCCL overheads included.
INTER_NODE_IB = LinkSpec(bandwidth=200e9, latency=1e-5)

# DGX H100 (NVIDIA DGX H100 datasheet): NVLink4, 18 links x 25 GB/s = 450 GB/s per direction per GPU
# (900 GB/s bidirectional) through four NVSwitch chips; bus bandwidth at the fraction NCCL reaches on
# DGX A100 (no measured DGX H100 figure is assumed here): 450 x 0.767 = 345 GB/s.
INTRA_NODE_NVLINK4 = LinkSpec(bandwidth=450e9 * NVLINK_BUS_FRACTION, latency=5e-6)

# DGX H100: 8 single-port ConnectX-7 NDR InfiniBand NICs (OSFP), one per GPU, 8 x 400 Gb/s =
# 8 x 50 GB/s = 400 GB/s per node each way (twice HDR). DGX H200 has the same NVLink4 and NICs.
INTER_NODE_NDR = LinkSpec(bandwidth=400e9, latency=1e-5)

# DGX B200 (NVIDIA DGX B200 datasheet): NVLink5, 18 links x 50 GB/s = 900 GB/s per direction per GPU
# (1.8 TB/s bidirectional; 14.4 TB/s for the node's 8 GPUs); bus bandwidth at the DGX A100
# fraction, as for the H100: 900 x 0.767 = 690 GB/s. Between nodes the same 8 single-port
# ConnectX-7 400 Gb/s NICs as DGX H100 (INTER_NODE_NDR).
INTRA_NODE_NVLINK5 = LinkSpec(bandwidth=900e9 * NVLINK_BUS_FRACTION, latency=5e-6)

# device preset name -> (intra-node, inter-node) links of the node it ships in. A device not listed
# (the cpu preset, a custom DeviceSpec) keeps the DGX A100 figures, as every World had before.
NODE_LINKS = {
    "a100-80g": (INTRA_NODE_NVLINK, INTER_NODE_IB),
    "h100-80g": (INTRA_NODE_NVLINK4, INTER_NODE_NDR),
    "h200": (INTRA_NODE_NVLINK4, INTER_NODE_NDR),
    "b200": (INTRA_NODE_NVLINK5, INTER_NODE_NDR),
}


def node_links(*devices: DeviceSpec) -> tuple[LinkSpec, LinkSpec]:
    """(intra-node, inter-node) links for nodes of ``devices``: each device's node's, and where
    nodes differ the slowest of them (a collective spanning them runs at its slowest link)."""
    pairs = [NODE_LINKS.get(device.name, (INTRA_NODE_NVLINK, INTER_NODE_IB)) for device in devices] \
        or [(INTRA_NODE_NVLINK, INTER_NODE_IB)]
    return (min((intra for intra, _ in pairs), key=lambda link: (link.bandwidth, -link.latency)),
            min((inter for _, inter in pairs), key=lambda link: (link.bandwidth, -link.latency)))


@dataclass(frozen=True)
class NodeSpec:
    """One node: ``devices`` identical accelerators (a preset name is accepted for ``device``)."""

    devices: int
    device: DeviceSpec

    def __post_init__(self):
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise InvalidValue(f"NodeSpec devices must be a positive int, got {self.devices!r}")
        object.__setattr__(self, "device", device_spec(self.device))

    def to_json(self) -> dict:
        return {"devices": self.devices, "device": self.device.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "NodeSpec":
        if not isinstance(data, dict) or set(data) != {"devices", "device"}:
            raise InvalidValue(f"bad node spec {data!r}: expected an object with exactly the keys "
                             f"devices (int), device (preset name or device spec object)")
        device = data["device"]
        device = at_field("device", DeviceSpec.from_json if isinstance(device, dict) else device_spec, device)
        return at_field("devices", cls, data["devices"], device)


@dataclass(frozen=True)
class World:
    """All nodes of the job (in rank order) and the intra-/inter-node links.

    ``calibration``: what ``xirang calibrate`` measured on this machine (collective lines per kind and
    group size, backward per-op overhead, whether communication overlaps compute); None for a World
    of datasheet figures. The cost model prefers its measurements where it has them.
    """

    nodes: tuple[NodeSpec, ...]
    intra_node: Optional[LinkSpec] = None  # None: the nodes' own (node_links of their devices)
    inter_node: Optional[LinkSpec] = None
    calibration: Optional[Calibration] = None

    def __post_init__(self):
        nodes = tuple(self.nodes)
        if not nodes or not all(isinstance(node, NodeSpec) for node in nodes):
            raise InvalidValue(f"World nodes must be a non-empty sequence of NodeSpec, got {self.nodes!r}")
        object.__setattr__(self, "nodes", nodes)
        defaults = node_links(*(node.device for node in nodes))
        for name, default in zip(("intra_node", "inter_node"), defaults):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, name), LinkSpec):
                raise InvalidValue(f"World {name} must be a LinkSpec, got {getattr(self, name)!r}")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise InvalidValue(f"World calibration must be a Calibration or None, got {self.calibration!r}")
        # first rank of each node, plus the total: node_of is a search in this table
        starts = [0]
        for node in nodes:
            starts.append(starts[-1] + node.devices)
        object.__setattr__(self, "_starts", tuple(starts))

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int, device: Union[str, DeviceSpec] = DEFAULT_DEVICE,
                *, intra_node: Optional[LinkSpec] = None,
                inter_node: Optional[LinkSpec] = None) -> "World":
        """``nodes`` identical nodes of ``devices_per_node`` devices each; the links default to those of
        the device's node (``NODE_LINKS``: DGX A100 for an A100, DGX H100 for an H100 or H200,
        DGX B200 for a B200)."""
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise InvalidValue(f"World.uniform nodes must be a positive int, got {nodes!r}")
        node = NodeSpec(devices_per_node, device_spec(device))
        return cls((node,) * nodes, intra_node, inter_node)

    @property
    def size(self) -> int:
        """Total devices, which is also the number of ranks."""
        return self._starts[-1]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def uniform_nodes(self) -> bool:
        """Whether every node has the same device kind and count."""
        return all(node == self.nodes[0] for node in self.nodes)

    @property
    def devices_per_node(self) -> int:
        counts = sorted({node.devices for node in self.nodes})
        if len(counts) > 1:
            raise InvalidValue(f"nodes of this world have different device counts {counts}; "
                             f"use world.nodes[i].devices for one node")
        return counts[0]

    def _check_rank(self, rank) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise InvalidValue(f"rank {rank!r} is out of range for a world of {self.size} devices "
                             f"(valid ranks 0..{self.size - 1})")

    def node_of(self, rank: int) -> int:
        """Index of the node holding global ``rank``."""
        self._check_rank(rank)
        # the last node whose first rank is <= rank (every node holds at least one device)
        return bisect.bisect_right(self._starts, rank) - 1

    def local_rank(self, rank: int) -> int:
        """Position of ``rank`` among the devices of its node (torchrun's LOCAL_RANK)."""
        return rank - self._starts[self.node_of(rank)]

    def device_of(self, rank: int) -> DeviceSpec:
        return self.nodes[self.node_of(rank)].device

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def link(self, a: int, b: int) -> LinkSpec:
        """The link level traffic between ranks ``a`` and ``b`` crosses."""
        return self.intra_node if self.same_node(a, b) else self.inter_node

    def describe(self) -> str:
        """One line, e.g. '16 nodes x 8 a100-80g (128 devices), intra 230 GB/s, inter 200 GB/s'."""
        links = (f"intra {self.intra_node.bandwidth / 1e9:g} GB/s, "
                 f"inter {self.inter_node.bandwidth / 1e9:g} GB/s")
        if self.calibration is not None:
            links += f", calibrated on {self.calibration.ranks} {self.calibration.backend} ranks"
        if self.uniform_nodes:
            node = self.nodes[0]
            noun = "node" if self.num_nodes == 1 else "nodes"
            return (f"{self.num_nodes} {noun} x {node.devices} {node.device.name} "
                    f"({self.size} devices), {links}")
        runs: list[list] = []  # [count, node] for each run of identical consecutive nodes
        for node in self.nodes:
            if runs and runs[-1][1] == node:
                runs[-1][0] += 1
            else:
                runs.append([1, node])
        parts = " + ".join(f"{count} x {node.devices} {node.device.name}" for count, node in runs)
        return f"{self.num_nodes} nodes: {parts} ({self.size} devices), {links}"

    def to_json(self) -> dict:
        data = {"nodes": [node.to_json() for node in self.nodes],
                "intra_node": self.intra_node.to_json(), "inter_node": self.inter_node.to_json()}
        if self.calibration is not None:  # absent otherwise, so older files and plans read unchanged
            data["calibration"] = self.calibration.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "World":
        keys = {"nodes", "intra_node", "inter_node"}
        if not isinstance(data, dict) or not keys <= set(data) or not set(data) <= keys | {"calibration"} \
                or not isinstance(data["nodes"], list):
            raise InvalidValue(f"bad world {str(data)[:300]!r}: expected an object with the keys "
                             f"nodes (list of node specs), intra_node, inter_node (link specs) and "
                             f"optionally calibration")
        calibration = data.get("calibration")
        return cls(tuple(at_field(f"nodes[{i}]", NodeSpec.from_json, node) for i, node in enumerate(data["nodes"])),
                   at_field("intra_node", LinkSpec.from_json, data["intra_node"]),
                   at_field("inter_node", LinkSpec.from_json, data["inter_node"]),
                   None if calibration is None else at_field("calibration", Calibration.from_json, calibration))

    def save(self, path) -> None:
        """Write ``to_json`` to ``path`` (what ``xirang calibrate`` writes)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path) -> "World":
        """The World in JSON file ``path`` (``xirang calibrate``'s output, or ``save``'s)."""
        if not Path(path).is_file():
            raise InvalidValue(f"world file {str(path)!r} does not exist; write one with "
                               f"`xirang calibrate --out {path}` or World.save")
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise InvalidValue(f"world file {str(path)!r} is not JSON ({error}); write it with "
                               f"`xirang calibrate` or World.save") from error
        try:
            return cls.from_json(data)
        except InvalidValue as error:
            raise InvalidValue(error.what, where=f"world file {str(path)!r}" + (f", field {error.where}" if error.where
                                                                                else ""),
                               hint=error.hint or "fix that field, or write the file again with `xirang calibrate` "
                                                  "or World.save") from None


def at_field(path: str, parse, *args):
    """``parse(*args)``, its InvalidValue located at ``path`` within the JSON being read (nested calls
    build paths such as nodes[1].device)."""
    try:
        return parse(*args)
    except InvalidValue as error:
        inner = error.where
        where = path if not inner else f"{path}{inner}" if inner.startswith("[") else f"{path}.{inner}"
        raise InvalidValue(error.what, where=where, hint=error.hint) from None


_NODES_X_DEVICES = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_GROUP_OF_NODES = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*:\s*([^\s+:]+)\s*$")  # "2x8:h100-80g"
_COUNT = re.compile(r"^\s*(\d+)\s*$")


@renamed_keywords(device="hardware=")
def parse_world(spec: Union[int, str, World], hardware: Union[str, DeviceSpec, None] = None) -> World:
    """A World from a short user spelling (command line, ``xirang.compile(world=...)``).

    Accepted forms:
      * a World, returned as is (``hardware`` must then be None);
      * an int N, or the string "N": N devices, packed ``DEVICES_PER_NODE`` (8) per node when N > 8
        and divisible by 8, else one node of N (so 4 is one node of 4, 16 is 2 x 8, 12 is one
        node of 12; write "3x4" for anything else);
      * a string "NxM": N nodes of M devices each;
      * a mixed World: groups of nodes joined by "+", each "NxM:device" (a preset name), e.g.
        "2x8:a100-80g+2x8:h100-80g" (ranks 0-15 on the A100 nodes); a group without ":device" gets
        ``hardware``.
    ``hardware`` is a device preset name or DeviceSpec for every node (default "a100-80g").
    """
    if isinstance(spec, World):
        if hardware is not None:
            raise InvalidValue("parse_world: hardware= applies only when building a world from a count "
                             "or an 'NxM' string; this World already names its devices")
        return spec
    device = device_spec(DEFAULT_DEVICE if hardware is None else hardware)
    forms = ("accepted forms: an int N > 0, a string 'N' (N devices), "
             "a string 'NxM' (N nodes of M devices, both > 0), node groups 'NxM:device+NxM:device' "
             "(device a preset name), or a World")
    if isinstance(spec, str) and ("+" in spec or ":" in spec):
        return _mixed_world(spec, device, forms)
    if isinstance(spec, int) and not isinstance(spec, bool):
        count = spec
    elif isinstance(spec, str) and _COUNT.match(spec):
        count = int(spec)
    elif isinstance(spec, str) and _NODES_X_DEVICES.match(spec):
        nodes, per_node = (int(g) for g in _NODES_X_DEVICES.match(spec).groups())
        if nodes < 1 or per_node < 1:
            raise InvalidValue(f"bad world {spec!r}: node and device counts must be > 0; {forms}")
        return World.uniform(nodes, per_node, device)
    else:
        raise InvalidValue(f"bad world {spec!r}; {forms}")
    if count < 1:
        raise InvalidValue(f"bad world {spec!r}: the device count must be > 0; {forms}")
    if count > DEVICES_PER_NODE and count % DEVICES_PER_NODE == 0:
        return World.uniform(count // DEVICES_PER_NODE, DEVICES_PER_NODE, device)
    return World.uniform(1, count, device)


def _mixed_world(spec: str, device: DeviceSpec, forms: str) -> World:
    """A World of node groups "NxM:device+NxM:device" (``parse_world``)."""
    nodes = []
    for part in spec.split("+"):
        found = _GROUP_OF_NODES.match(part) or _NODES_X_DEVICES.match(part)
        if not found:
            raise InvalidValue(f"bad world {spec!r}: the group {part.strip()!r} is not 'NxM' or 'NxM:device'; {forms}")
        count, per_node = int(found.group(1)), int(found.group(2))
        if count < 1 or per_node < 1:
            raise InvalidValue(f"bad world {spec!r}: node and device counts must be > 0 in {part.strip()!r}; {forms}")
        kind = device_spec(found.group(3)) if found.lastindex == 3 else device
        nodes += [NodeSpec(per_node, kind)] * count
    return World(tuple(nodes))
