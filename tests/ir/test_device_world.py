"""Device specs and presets; links, nodes and worlds; parse_world."""
import copy
import json
import pickle

import pytest

from xirang.ir.device import DEVICE_PRESETS, GiB, DeviceSpec, canonical_dtype, device_spec
from xirang.ir.world import (INTER_NODE_IB, INTRA_NODE_NVLINK, LinkSpec, NodeSpec, World,
                             parse_world)

TINY = DeviceSpec("tiny", {"fp32": 1e9}, memory_bytes=1024, memory_bandwidth=1e9)


# --- devices ------------------------------------------------------------------------------------

def test_presets_present():
    assert set(DEVICE_PRESETS) == {"a100-80g", "h100-80g", "h200", "b200", "cpu"}
    for name, spec in DEVICE_PRESETS.items():
        assert spec.name == name


def test_preset_figures():
    a100, h100, h200 = (DEVICE_PRESETS[n] for n in ("a100-80g", "h100-80g", "h200"))
    assert a100.peak("bf16") == 312e12 and a100.peak("tf32") == 156e12
    assert a100.peak("fp32") == 19.5e12
    assert a100.memory_bytes == 80 * 1024**3 and a100.memory_bandwidth == 2.039e12
    assert h100.peak("bf16") == 989e12 and h100.peak("fp8") == 1979e12
    assert h100.memory_bandwidth == 3.35e12
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bandwidth == 4.8e12 and h200.memory_bytes > h100.memory_bytes
    # B200 (HGX B200 8-GPU totals / 8, dense: half the sparse headline): 36 PF / 8 / 2 bf16, 72 / 8 / 2 fp8;
    # DGX B200: 64 TB/s of HBM3e / 8
    b200 = DEVICE_PRESETS["b200"]
    assert b200.peak("bf16") == 2250e12 and b200.peak("fp8") == 4500e12 and b200.peak("tf32") == 1125e12
    assert b200.memory_bandwidth == 8e12 and b200.memory_bytes == 179 * 1024**3


def test_device_spec_lookup():
    assert device_spec("a100-80g") is DEVICE_PRESETS["a100-80g"]
    assert device_spec("A100-80G") is DEVICE_PRESETS["a100-80g"]
    assert device_spec("a100") is DEVICE_PRESETS["a100-80g"]
    assert device_spec("H100") is DEVICE_PRESETS["h100-80g"]
    assert device_spec(" h200 ") is DEVICE_PRESETS["h200"]
    assert device_spec(TINY) is TINY


@pytest.mark.parametrize("bad", ["v100", "", None, 3])
def test_unknown_device_lists_presets(bad):
    with pytest.raises(ValueError) as info:
        device_spec(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in DEVICE_PRESETS:
        assert name in message


def test_peak_accepts_torch_dtype_names():
    a100 = DEVICE_PRESETS["a100-80g"]
    assert a100.peak("bfloat16") == a100.peak("torch.bfloat16") == a100.peak("BF16") == 312e12
    assert a100.peak("float32") == 19.5e12
    assert canonical_dtype("torch.float16") == "fp16"
    assert canonical_dtype("float8_e4m3fn") == "fp8"


def test_peak_unknown_dtype_lists_known():
    with pytest.raises(ValueError, match="'fp8'.*known dtypes: bf16, fp16, fp32, fp64, tf32"):
        DEVICE_PRESETS["a100-80g"].peak("fp8")


def test_device_spec_validation():
    with pytest.raises(ValueError, match="name"):
        DeviceSpec("", {"fp32": 1.0}, 1, 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        DeviceSpec("x", {}, 1, 1.0)
    with pytest.raises(ValueError, match=r"peak_flops\['fp32'\]"):
        DeviceSpec("x", {"fp32": 0}, 1, 1.0)
    with pytest.raises(ValueError, match="memory_bytes"):
        DeviceSpec("x", {"fp32": 1.0}, 1.5, 1.0)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        DeviceSpec("x", {"fp32": 1.0}, 1, -1.0)


def test_device_spec_is_frozen_hashable_picklable():
    spec = DeviceSpec("x", {"float32": 2e12}, 16 * GiB, 1e11)
    assert dict(spec.peak_flops) == {"fp32": 2e12}  # keys canonicalised
    with pytest.raises(TypeError):
        spec.peak_flops["fp32"] = 1.0
    with pytest.raises(AttributeError):
        spec.name = "y"
    same = DeviceSpec("x", {"fp32": 2e12}, 16 * GiB, 1e11)
    assert spec == same and hash(spec) == hash(same)
    assert len({spec, same, TINY}) == 2
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(DEVICE_PRESETS["h200"]) == DEVICE_PRESETS["h200"]


def test_device_spec_json_round_trip():
    for spec in list(DEVICE_PRESETS.values()) + [TINY]:
        assert DeviceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="expected an object with the keys"):
        DeviceSpec.from_json({"name": "x"})


# --- links and nodes ---------------------------------------------------------------------------

def test_default_links():
    assert INTRA_NODE_NVLINK == LinkSpec(230e9, 5e-6)
    assert INTER_NODE_IB == LinkSpec(200e9, 1e-5)  # 8 NICs x 25 GB/s


def test_link_transfer_time_alpha_beta():
    link = LinkSpec(bandwidth=100e9, latency=1e-5)
    assert link.transfer_time(0) == 1e-5
    assert link.transfer_time(1e9) == pytest.approx(1e-5 + 0.01)


def test_link_validation():
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec(0, 1e-6)
    with pytest.raises(ValueError, match="latency"):
        LinkSpec(1e9, -1.0)
    assert LinkSpec(1e9, 0).latency == 0.0


def test_node_spec_resolves_preset_names():
    assert NodeSpec(8, "a100").device is DEVICE_PRESETS["a100-80g"]
    with pytest.raises(ValueError, match="positive int"):
        NodeSpec(0, "a100")
    with pytest.raises(ValueError, match="unknown device"):
        NodeSpec(8, "tpu")


# --- worlds --------------------------------------------------------------------------------------

def test_uniform_world():
    world = World.uniform(2, 4, "h100")
    assert world.size == 8 and world.num_nodes == 2 and world.devices_per_node == 4
    assert world.uniform_nodes
    assert [world.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [world.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert world.device_of(5) is DEVICE_PRESETS["h100-80g"]
    assert world.same_node(0, 3) and not world.same_node(3, 4)
    assert world.link(1, 2) == world.intra_node and world.link(3, 4) == world.inter_node


def test_heterogeneous_world():
    world = World((NodeSpec(2, "a100"), NodeSpec(4, "h100"), NodeSpec(1, TINY)))
    assert world.size == 7 and world.num_nodes == 3 and not world.uniform_nodes
    devices = [world.device_of(r).name for r in range(7)]
    assert devices == ["a100-80g"] * 2 + ["h100-80g"] * 4 + ["tiny"]
    assert [world.node_of(r) for r in range(7)] == [0, 0, 1, 1, 1, 1, 2]
    assert world.same_node(2, 5) and not world.same_node(1, 2)
    with pytest.raises(ValueError, match=r"different device counts \[1, 2, 4\]"):
        _ = world.devices_per_node


def test_same_count_different_device_is_not_uniform():
    world = World((NodeSpec(8, "a100"), NodeSpec(8, "h100")))
    assert world.devices_per_node == 8 and not world.uniform_nodes


def test_world_rank_errors():
    world = World.uniform(2, 4)
    for bad in (8, -1):
        with pytest.raises(ValueError, match=r"valid ranks 0\.\.7"):
            world.device_of(bad)
    with pytest.raises(ValueError, match=r"valid ranks 0\.\.7"):
        world.same_node(0, 9)


def test_world_validation():
    with pytest.raises(ValueError, match="non-empty"):
        World(())
    with pytest.raises(ValueError, match="NodeSpec"):
        World((8,))
    with pytest.raises(ValueError, match="intra_node"):
        World((NodeSpec(8, "a100"),), intra_node=230e9)
    assert World([NodeSpec(8, "a100")]).nodes == (NodeSpec(8, "a100"),)  # list becomes tuple


def test_world_hashable_and_frozen():
    assert hash(World.uniform(2, 8)) == hash(World.uniform(2, 8))
    with pytest.raises(AttributeError):
        World.uniform(1, 8).nodes = ()


def test_describe():
    assert World.uniform(16, 8).describe() == \
        "16 nodes x 8 a100-80g (128 devices), intra 230 GB/s, inter 200 GB/s"
    assert World.uniform(1, 4, "cpu").describe() == \
        "1 node x 4 cpu (4 devices), intra 230 GB/s, inter 200 GB/s"
    mixed = World((NodeSpec(8, "a100"), NodeSpec(8, "a100"), NodeSpec(4, "h200")),
                  intra_node=LinkSpec(450e9, 3e-6), inter_node=LinkSpec(400e9, 1e-5))
    assert mixed.describe() == ("3 nodes: 2 x 8 a100-80g + 1 x 4 h200 (20 devices), "
                                "intra 450 GB/s, inter 400 GB/s")


def test_world_json_round_trip():
    worlds = [World.uniform(16, 8),
              World((NodeSpec(2, "a100"), NodeSpec(4, TINY)), LinkSpec(1e9, 0.0), LinkSpec(1e8, 1e-3))]
    for world in worlds:
        data = json.loads(json.dumps(world.to_json()))
        assert World.from_json(data) == world
    # A file names its links: an H100 world saved with the DGX A100 links (every world had them
    # before links followed the device kind) still reads with them, not the DGX H100 ones.
    assert World.from_json({"nodes": [{"devices": 8, "device": "h100"}],
                            "intra_node": {"bandwidth": 230e9, "latency": 5e-6},
                            "inter_node": {"bandwidth": 200e9, "latency": 1e-5}}) \
        == World.uniform(1, 8, "h100-80g", intra_node=INTRA_NODE_NVLINK, inter_node=INTER_NODE_IB)
    with pytest.raises(ValueError, match="bad world"):
        World.from_json({"nodes": []})
    with pytest.raises(ValueError, match="bad node spec"):
        World.from_json({"nodes": [{"devices": 8}], "intra_node": INTRA_NODE_NVLINK.to_json(),
                         "inter_node": INTER_NODE_IB.to_json()})


# --- parse_world -----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, nodes, per_node", [
    (1, 1, 1),
    (4, 1, 4),
    (8, 1, 8),
    (12, 1, 12),  # > 8 but not a multiple of 8: one node
    (16, 2, 8),
    (128, 16, 8),
    ("8", 1, 8),
    ("32", 4, 8),
    ("16x8", 16, 8),
    ("3x4", 3, 4),
    (" 2 X 4 ", 2, 4),
    ("1x16", 1, 16),
])
def test_parse_world_forms(spec, nodes, per_node):
    world = parse_world(spec)
    assert world == World.uniform(nodes, per_node, "a100-80g")


def test_parse_world_device():
    assert parse_world("2x8", hardware="h100").device_of(15) is DEVICE_PRESETS["h100-80g"]
    assert parse_world(4, hardware=TINY).device_of(0) is TINY


def test_parse_world_passes_world_through():
    world = World((NodeSpec(2, "a100"), NodeSpec(4, "h100")))
    assert parse_world(world) is world
    with pytest.raises(ValueError, match="hardware="):
        parse_world(world, hardware="h100")


@pytest.mark.parametrize("bad", ["abc", "0x8", "2x0", "2x", "x8", "-1", "2x4x2", "", "1.5", 0, -1,
                                 True, 2.0, None])
def test_parse_world_rejects_bad_specs(bad):
    with pytest.raises(ValueError, match=r"accepted forms: an int N > 0.*'NxM'") as info:
        parse_world(bad)
    assert repr(bad) in str(info.value)


def test_parse_world_unknown_device():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        parse_world(8, hardware="tpu")


# --- links and efficiencies per device generation (issue 14) ------------------------------------

def test_links_follow_the_device_kind():
    from xirang.ir.world import INTER_NODE_NDR, INTRA_NODE_NVLINK4, NODE_LINKS
    a100, h100, h200 = (World.uniform(2, 8, name) for name in ("a100", "h100", "h200"))
    assert (a100.intra_node, a100.inter_node) == (INTRA_NODE_NVLINK, INTER_NODE_IB)
    # DGX H100: NVLink4 450 GB/s a direction at the bus fraction NCCL reaches on DGX A100 (230/300),
    # 8 x NDR 400 Gb/s = 400 GB/s per node; DGX H200 the same
    assert h100.intra_node == LinkSpec(450e9 * 230 / 300, 5e-6) == INTRA_NODE_NVLINK4
    assert h100.inter_node == LinkSpec(400e9, 1e-5) == INTER_NODE_NDR
    assert (h200.intra_node, h200.inter_node) == (h100.intra_node, h100.inter_node)
    # DGX B200: NVLink5 900 GB/s a direction (twice NVLink4) at the same bus fraction, the same NICs
    b200 = World.uniform(2, 8, "b200")
    assert b200.intra_node == LinkSpec(900e9 * 230 / 300, 5e-6) and b200.inter_node == INTER_NODE_NDR
    assert parse_world("4x8", "h100") == h100.__class__.uniform(4, 8, "h100")
    assert parse_world(16, "h100").inter_node == INTER_NODE_NDR
    assert World((NodeSpec(8, "h100"),)).intra_node == INTRA_NODE_NVLINK4  # a World built directly too
    # devices of no known node (cpu, a custom spec) keep the DGX A100 figures every World had before
    assert "cpu" not in NODE_LINKS and parse_world(8, "cpu").inter_node == INTER_NODE_IB
    assert World((NodeSpec(2, TINY),)).intra_node == INTRA_NODE_NVLINK
    # mixed nodes: a collective spanning them runs at the slowest link
    mixed = World((NodeSpec(8, "a100"), NodeSpec(8, "h100")))
    assert (mixed.intra_node, mixed.inter_node) == (INTRA_NODE_NVLINK, INTER_NODE_IB)
    # links given explicitly win
    assert World.uniform(1, 8, "h100", inter_node=LinkSpec(1e9, 0.0)).inter_node == LinkSpec(1e9, 0.0)
    assert World.from_json(h100.to_json()) == h100


def test_presets_carry_their_generations_efficiency():
    from xirang.ir.device import Efficiency
    a100, h100, h200 = (DEVICE_PRESETS[n] for n in ("a100-80g", "h100-80g", "h200"))
    assert a100.efficiency == Efficiency(0.7, 0.1, 0.35) == Efficiency()  # fitted to 2021 A100 runs
    assert h100.efficiency == h200.efficiency == Efficiency(0.7, 0.1, 0.8)  # fused 2023-24 kernels
    assert DEVICE_PRESETS["b200"].efficiency == h100.efficiency  # kept, not fitted to a B200 run
    assert TINY.efficiency == Efficiency()
    with pytest.raises(ValueError, match="efficiency must be an Efficiency"):
        DeviceSpec("x", {"fp32": 1e9}, 1024, 1e9, efficiency=0.5)


def test_efficiency_round_trips_and_is_part_of_the_spec():
    from xirang.ir.device import Efficiency
    custom = DeviceSpec("x", {"bf16": 1e12}, 1024, 1e9, efficiency=Efficiency(0.5, 0.2, 0.6))
    data = json.loads(json.dumps(custom.to_json()))
    assert data["efficiency"] == {"matmul": 0.5, "other": 0.2, "memory": 0.6}
    assert DeviceSpec.from_json(data) == custom
    assert pickle.loads(pickle.dumps(custom)) == custom
    same_but_default = DeviceSpec("x", {"bf16": 1e12}, 1024, 1e9)
    assert same_but_default != custom and hash(same_but_default) != hash(custom)
    for spec in DEVICE_PRESETS.values():
        assert DeviceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="bad efficiency"):
        DeviceSpec.from_json({**custom.to_json(), "efficiency": {"matmul": 0.5}})
    # the old home of Efficiency still imports it (re-exported)
    from xirang.passes.planning.cost_model import Efficiency as FromCostModel
    assert FromCostModel is Efficiency


def test_old_device_json_without_efficiency_still_loads():
    # A plan saved before efficiencies were per device: a preset's fields match the preset, which
    # comes back whole (its efficiency and host link); a custom spec gets the default Efficiency().
    for name in ("a100-80g", "h100-80g"):
        old = DEVICE_PRESETS[name].to_json()
        del old["efficiency"]
        assert DeviceSpec.from_json(old) is DEVICE_PRESETS[name]
        del old["host_link_bytes_per_s"]
        assert DeviceSpec.from_json(old) is DEVICE_PRESETS[name]
    from xirang.ir.device import Efficiency
    assert DeviceSpec.from_json({"name": "x", "peak_flops": {"fp32": 1e9}, "memory_bytes": 1024,
                                 "memory_bandwidth": 1e9}).efficiency == Efficiency()


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d["nodes"][1].__setitem__("device", "a1000"), "nodes[1].device", "unknown device 'a1000'"),
    (lambda d: d["nodes"][1]["device"].__setitem__("memory_bandwidth", -1), "nodes[1].device",
     "memory_bandwidth must be a positive number"),
    (lambda d: d["nodes"][0].__setitem__("devices", 0), "nodes[0].devices", "devices must be a positive int"),
    (lambda d: d["inter_node"].__setitem__("bandwidth", -5), "inter_node", "bandwidth must be a positive number"),
])
def test_a_bad_world_file_is_refused_naming_the_file_and_the_field(tmp_path, edit, field, words):
    data = World.uniform(2, 8, "a100-80g").to_json()
    data["nodes"][1]["device"] = DeviceSpec.to_json(device_spec("h100-80g"))  # a mixed world, written out
    edit(data)
    path = tmp_path / "world.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as caught:
        World.load(path)
    assert words in caught.value.what and caught.value.where == f"world file {str(path)!r}, field {field}", \
        str(caught.value)
