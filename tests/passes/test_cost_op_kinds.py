"""Each non-matmul op kind a calibration times apart (gelu, layer norm, softmax, cross-entropy) keeps its
own measured rate and fixed cost (``Calibration.other_kind_efficiency``, ``op_fixed_s``), fitted by
``calibrated_world`` and read by the split pricing for the nodes of that kind; older files without
them load and price every kind at the class's rate, as before. A kind timed at several sizes is priced
by size (``Calibration.other_kind_bands``): between each two neighbouring sizes timed, the line through
those two (``calibrated_world.size_bands``), a node at the band holding its local FLOPs, since these ops
slow per element as their tensors outgrow the caches, which one line through every size hides."""
from __future__ import annotations

import functools
import pickle

import pytest

from conftest import token_batch
from examples.gpt import GPTConfig, build_gpt
import xirang
from xirang.codegen.runtime.calibration.op_classes import other_samples
from xirang.codegen.runtime.calibration.calibrated_world import calibrated_world, size_bands
from xirang.ir.calibration import OTHER_KINDS, Calibration, CollectiveFit
from xirang.ir.device import DeviceSpec, Efficiency
from xirang.ir.errors import XirangError
from xirang.ir.world import LinkSpec, NodeSpec, World
from xirang.passes.analysis.flops import PER_ELEMENT
from xirang.passes.planning.plan_splits import SplitPricer

SEND = CollectiveFit("send", 2, "gloo", 1e-3, 0.0)
LINK = LinkSpec(5e8, 2e-4)
PEAK, BANDWIDTH = 2e10, 1e10


def test_kind_rates_round_trip_and_older_files_load_without_them():
    calibration = Calibration(2, "gloo", "cpu", (SEND,), other_kind_efficiency={"gelu": 0.02, "softmax": 0.05},
                              op_fixed_s={"other": 1e-5, "gelu": 3e-5})
    data = calibration.to_json()
    assert Calibration.from_json(data) == calibration and pickle.loads(pickle.dumps(calibration)) == calibration
    assert dict(Calibration.from_json(data).other_kind_efficiency) == {"gelu": 0.02, "softmax": 0.05}
    assert hash(Calibration.from_json(data)) == hash(calibration)
    older = {k: v for k, v in data.items() if k != "other_kind_efficiency"}
    assert dict(Calibration.from_json(older).other_kind_efficiency) == {}
    with pytest.raises(XirangError, match="other_kind_efficiency keys"):
        Calibration(2, "gloo", "cpu", other_kind_efficiency={"silu": 0.1})
    with pytest.raises(XirangError, match="fraction"):
        Calibration(2, "gloo", "cpu", other_kind_efficiency={"gelu": 1.5})
    with pytest.raises(XirangError, match="positive"):
        Calibration(2, "gloo", "cpu", other_kind_efficiency={"gelu": 0.0})


def test_other_samples_time_each_kind_forward_and_backward_at_the_analysis_flops():
    calls = []

    def timed(fn, device, iters):  # runs the call once (its backward must work); 1 s each
        fn()
        calls.append(fn)
        return 1.0
    samples = other_samples("cpu", True, timed, 1)
    assert set(samples) == set(OTHER_KINDS)
    for kind, rows in samples.items():
        # QUICK_OTHER_SHAPES: (64, 128) and (128, 256)
        assert [flops for flops, _ in rows] == [2.0 * PER_ELEMENT[kind] * n for n in (64 * 128, 128 * 256)], kind
    assert len(calls) == 2 * len(OTHER_KINDS)


def _results(ranks: int = 2) -> list:
    """calibrate_rank's results, made up with exact lines (10 GFLOP/s matmul, 1 GB/s adds with 30 us a
    call, each kind its own rate and intercept)."""
    sizes = (1e6, 2e6)
    kinds = {"gelu": (0.2e9, 4e-4), "layer_norm": (0.5e9, 2e-4), "softmax": (1e9, 1e-4),
             "cross_entropy": (0.25e9, 3e-4)}  # rate FLOP/s, intercept s
    compute = {
        "matmul": {"float32": [[1e9, 1e-3 + 0.1], [2e9, 1e-3 + 0.2]]},
        "elementwise": [[1e6, 3e-5 + 1e-3], [4e6, 3e-5 + 4e-3]],
        "other": {kind: [[n, c + n / rate] for n in sizes] for kind, (rate, c) in kinds.items()},
        "op_forward_s": 1e-5, "op_backward_s": 2e-5}
    return [{"threads": 1, "compute": compute, "sharing": None,
             "collectives": {"send/2": [[1e3, 1e-4], [1e6, 1e-3]]}}] * ranks


def test_calibrated_world_keeps_each_kind_rate_and_fixed_cost():
    world = calibrated_world(_results(), backend="gloo", device="cpu")
    device, calibration = world.nodes[0].device, world.calibration
    kinds = calibration.other_kind_efficiency
    assert kinds["gelu"] == pytest.approx(0.02) and kinds["layer_norm"] == pytest.approx(0.05)
    assert kinds["softmax"] == pytest.approx(0.1) and kinds["cross_entropy"] == pytest.approx(0.025)
    fixed = calibration.op_fixed_s
    assert fixed["gelu"] == pytest.approx(4e-4 - 1e-5 - 2e-5)  # less its dispatch and one gradient
    assert fixed["layer_norm"] == pytest.approx(2e-4 - 1e-5 - 3 * 2e-5)  # input, weight and bias gradients
    assert fixed["other"] == pytest.approx(3e-5 - 1e-5)  # the rest: the add's intercept less its dispatch
    # the class rate: one op of each kind a sample, 4 MFLOP in (1 ms + 4 + 2 + 1 + 8) ms more per 1 MFLOP
    assert device.efficiency.other == pytest.approx(1e6 * 4 / (1e-3 * (5 + 2 + 1 + 4)) / 1e10)
    assert device.memory_bandwidth == pytest.approx(1e9)
    assert calibration.raw["other_gelu"]["residual"] == pytest.approx(0.0, abs=1e-9)


def test_ranks_sharing_cores_slow_the_kind_rates_with_the_peak():
    # 8 ranks on 2 cores: every rate a quarter, every kind still the same fraction of the matmul's
    micro = {"alone_s": 0.1, "together_s": 0.4, "beside_waiters_s": 0.1, "alone_cpu_s": 0.1, "together_cpu_s": 0.1}
    results = [{**r, "sharing": micro, "cores": 2} for r in _results(8)]
    world = calibrated_world(results, backend="gloo", device="cpu")
    device, kinds = world.nodes[0].device, world.calibration.other_kind_efficiency
    assert device.peak("fp32") * kinds["gelu"] == pytest.approx(0.2e9 / 4)
    assert world.calibration.op_fixed_s["gelu"] == pytest.approx(4 * (4e-4 - 1e-5 - 2e-5))


@functools.cache
def _gm():
    model = build_gpt(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=2, layers=2), device="meta")
    return xirang.analyze(model, example_kwargs=token_batch()).graph_module


def _total(calibration, efficiency=None) -> float:
    device = DeviceSpec("cpu", {"fp32": PEAK}, 2**32, BANDWIDTH)  # Efficiency.other 0.1, memory 0.35
    world = World((NodeSpec(2, device),), LINK, LINK, calibration)
    split = SplitPricer(_gm(), world, precision="fp32", efficiency=efficiency).price(1, (0,), 2, 16)
    return sum(u.forward_seconds + u.backward_seconds for u in split.units)


def test_a_node_of_a_measured_kind_is_priced_at_its_rate_and_fixed_cost():
    gelus = [n for n in _gm().graph.nodes if "gelu" in str(n.target)]
    assert len(gelus) == 2  # one per block
    flops = 2 * PER_ELEMENT["gelu"] * 2 * 16 * 4 * 32  # forward and backward, (batch 2, seq 16, 4 x hidden)
    plain = _total(Calibration(2, "gloo", "cpu", (SEND,)))
    slow = _total(Calibration(2, "gloo", "cpu", (SEND,), other_kind_efficiency={"gelu": 1e-3}))
    # FLOP-bound at both rates (its 32 KB of forward traffic at 3.5 GB/s take 9 us, its FLOPs 20 us at the
    # class's 2 GFLOP/s)
    assert slow - plain == pytest.approx(2 * (flops / (PEAK * 1e-3) - flops / (PEAK * 0.1)), rel=1e-6)
    # its own fixed cost in place of the class's, once per call forward and backward
    taxed = _total(Calibration(2, "gloo", "cpu", (SEND,), op_fixed_s={"gelu": 1e-2}))
    assert taxed - plain == pytest.approx(2 * 1e-2, rel=1e-6)
    # a derating the caller gives is kept as given: the kinds were measured beside the device's own
    given = Efficiency(matmul=0.7, other=0.1, memory=0.35, attention=0.5)
    assert _total(Calibration(2, "gloo", "cpu", (SEND,), other_kind_efficiency={"gelu": 1e-3}), given) == \
        pytest.approx(_total(Calibration(2, "gloo", "cpu", (SEND,)), given))


def test_each_band_is_the_line_through_its_two_neighbouring_sizes():
    # 1 and 2 MFLOP on one line (1 ms + 1 ms per MFLOP), 4 MFLOP much slower (12 ms: out of cache); two
    # samples at 2 MFLOP count as their median
    samples = [[1e6, 2e-3], [2e6, 2.9e-3], [2e6, 3e-3], [2e6, 3.1e-3], [4e6, 12e-3]]
    bands = size_bands(samples, peak=1e10, dispatch_s=1e-4)
    assert len(bands) == 2
    (upper, rate, fixed), (last, rate2, fixed2) = bands
    assert upper == 2e6 and last is None
    assert rate == pytest.approx(1e9 / 1e10) and fixed == pytest.approx(1e-3 - 1e-4)
    # 2 -> 4 MFLOP: 9 ms more per 2 MFLOP; its intercept would be negative, so the line through the origin
    # that fits the two samples best (both terms kept non-negative) and no fixed cost
    assert fixed2 == 0.0 and 1 / (rate2 * 1e10) == pytest.approx((3e-3 / 2e6 + 12e-3 / 4e6) / 2, rel=0.2)
    assert size_bands([[1e6, 1e-3]], peak=1e10, dispatch_s=0.0) == []  # one size: no band


def test_bands_round_trip_look_up_by_flops_and_refuse_bad_orders():
    bands = {"gelu": [[2e6, 0.01, 1e-4], [None, 0.005, 0.0]]}
    calibration = Calibration(2, "gloo", "cpu", (SEND,), other_kind_bands=bands)
    data = calibration.to_json()
    assert Calibration.from_json(data) == calibration and pickle.loads(pickle.dumps(calibration)) == calibration
    assert hash(Calibration.from_json(data)) == hash(calibration)
    assert calibration.other_kind_line("gelu", 1e6) == (0.01, 1e-4)
    assert calibration.other_kind_line("gelu", 2e6) == (0.01, 1e-4)  # a band holds its upper end
    assert calibration.other_kind_line("gelu", 3e9) == (0.005, 0.0)
    assert calibration.other_kind_line("softmax", 1e6) is None and calibration.other_kind_line(None, 1e6) is None
    older = {k: v for k, v in data.items() if k != "other_kind_bands"}
    assert dict(Calibration.from_json(older).other_kind_bands) == {}
    for bad, match in (({"silu": [[None, 0.1, 0.0]]}, "kind"), ({"gelu": [[2e6, 0.1, 0.0]]}, "only the last"),
                       ({"gelu": [[2e6, 0.1, 0.0], [1e6, 0.1, 0.0], [None, 0.1, 0.0]]}, "increase"),
                       ({"gelu": [[None, 1.5, 0.0]]}, "fraction"), ({"gelu": []}, "at least one")):
        with pytest.raises(XirangError, match=match):
            Calibration(2, "gloo", "cpu", other_kind_bands=bad)


def test_calibrated_world_gives_each_kind_bands_with_fixed_costs_scaled_as_the_kind_s():
    results = _results()  # two sizes a kind: one band, the kind's own line
    calibration = calibrated_world(results, backend="gloo", device="cpu").calibration
    (upper, rate, fixed), = calibration.other_kind_bands["gelu"]
    assert upper is None and rate == pytest.approx(calibration.other_kind_efficiency["gelu"])
    assert fixed == pytest.approx(calibration.op_fixed_s["gelu"])
    micro = {"alone_s": 0.1, "together_s": 0.4, "beside_waiters_s": 0.1, "alone_cpu_s": 0.1, "together_cpu_s": 0.1}
    shared = calibrated_world([{**r, "sharing": micro, "cores": 2} for r in _results(8)], backend="gloo",
                              device="cpu").calibration  # 8 ranks on 2 cores: fixed costs 4x, fractions kept
    assert shared.other_kind_bands["gelu"][0][2] == pytest.approx(4 * fixed)
    assert shared.other_kind_bands["gelu"][0][1] == pytest.approx(rate)


def test_a_node_is_priced_at_the_band_of_its_local_flops():
    gelu_flops = 2 * PER_ELEMENT["gelu"] * 2 * 16 * 4 * 32  # forward and backward, (batch 2, seq 16, 4 x hidden)
    assert sum(1 for n in _gm().graph.nodes if "gelu" in str(n.target)) == 2

    def priced(bands=None, kinds=None, fixed=None):
        return _total(Calibration(2, "gloo", "cpu", (SEND,), other_kind_bands=bands or {},
                                  other_kind_efficiency=kinds or {}, op_fixed_s=fixed or {}))
    small, large = [gelu_flops * 2, 1e-3, 0.0], [None, 1e-2, 0.0]
    # the node's FLOPs below the first band's upper end: that band's rate, whatever the kind's own line
    assert priced({"gelu": [small, large]}, {"gelu": 0.05}) == pytest.approx(priced(kinds={"gelu": 1e-3}))
    # above it: the open band's
    above = [gelu_flops / 2, 1e-3, 0.0]
    assert priced({"gelu": [above, large]}, {"gelu": 0.05}) == pytest.approx(priced(kinds={"gelu": 1e-2}))
    # the band's fixed cost in place of the kind's, once per call forward and backward
    assert priced({"gelu": [[None, 1e-2, 5e-3]]}, fixed={"gelu": 1.0}) == \
        pytest.approx(priced(kinds={"gelu": 1e-2}, fixed={"gelu": 5e-3}))
