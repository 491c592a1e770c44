"""The race's native baseline (benchmarks/native_3d.py) reduces gradients as DDP would, checked on 2 gloo ranks.

Where dp and tp are both over 1, DDP does not take the DTensor parameters, so the baseline reduces them
itself: buckets in reverse parameter order, each all-reduced asynchronously from a post-accumulate-grad
hook once its last micro-batch's gradient is in. These tests hold it to what DDP computes (the average
of the dp ranks' accumulated gradients) and to when it starts (no bucket after the first of two
micro-batches, every bucket before ``finish`` after the last), and the weak baseline's one flat
all-reduce to the same average; and its pipeline cuts. The race itself compares the baseline's losses
with Xirang's. Default tier: one launch of 2 ranks (~7 s) and an in-process test.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from xirang.codegen.runtime.launch.launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is a folder of the repository


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model: nn.Module, rank: int, micro_batch: int) -> None:
    generator = torch.Generator().manual_seed(100 * rank + micro_batch)  # every rank and micro-batch its data
    model(torch.randn(3, 8, generator=generator)).square().sum().backward()


def _rank_main(rank, world):
    from benchmarks import native_3d
    native_3d.FIRST_BUCKET_BYTES, native_3d.BUCKET_BYTES = 200, 600  # several buckets of this tiny model
    found = {}
    for label, accumulations in (("overlapped", 2), ("flat", 0)):
        model, plain = _model(), _model()
        params = list(model.parameters())
        sync = native_3d.OverlappedGradientSync(params, dist.group.WORLD, world, accumulations)
        launched = []
        for micro_batch in range(2):
            _backward(model, rank, micro_batch)
            _backward(plain, rank, micro_batch)
            launched.append(len(sync.works))
        sync.finish()
        worst = 0.0
        for param, reference in zip(params, plain.parameters()):  # DDP's average, by a plain all-reduce
            want = reference.grad.clone()
            dist.all_reduce(want)
            worst = max(worst, (param.grad - want / world).abs().max().item())
        found[label] = {"launched": launched, "buckets": len(sync.buckets), "worst": worst,
                        "first": [tuple(p.shape) for p in sync.buckets[0]]}
    return found


def test_the_baselines_gradient_reduction_is_ddps_average_started_after_the_last_micro_batch():
    results = launch(_rank_main, 2, (), timeout_s=300)
    for found in results:
        overlapped, flat = found["overlapped"], found["flat"]
        assert overlapped["buckets"] >= 3, overlapped  # the byte caps made several buckets
        assert overlapped["first"][0] == (4,), overlapped["first"]  # reverse order: the last layer's bias first
        # none started after the first micro-batch; all of them from the hooks during the second backward
        assert overlapped["launched"] == [0, overlapped["buckets"]], overlapped
        assert flat["buckets"] == 1 and flat["launched"] == [0, 0], flat  # the weak baseline: all in finish()
        assert overlapped["worst"] <= 1e-6 and flat["worst"] <= 1e-6, found


def test_the_baseline_cuts_its_pipeline_where_the_stages_flops_balance():
    from benchmarks.native_3d import balanced_split, piece_flops
    from benchmarks.race_native import CONFIG
    costs = piece_flops(CONFIG)  # embedding, 8 layers, the head (2 h V = 1.23 layers here)
    assert costs[0] == 0 and costs[-1] == 2 * CONFIG.hidden * CONFIG.vocab_size and len(costs) == CONFIG.layers + 2
    assert balanced_split(costs, 1) == [0]
    assert balanced_split(costs, 2) == [0, 6]  # 5 layers | 3 layers and the head, not 4 | 4 and the head
    assert balanced_split(costs, 8) == [0, 2, 3, 4, 5, 6, 7, 9]  # the head alone on the last stage
    assert balanced_split([5, 1, 1, 1], 2) == [0, 1] and balanced_split([1, 1, 1, 1], 4) == [0, 1, 2, 3]
