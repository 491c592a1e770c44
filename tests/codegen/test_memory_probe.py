"""Memory measured against the plan: the saved-tensor probe counts each storage once and lets it go
with its graph; a one-rank GPT step measures what its plan predicts; a plan that does not fit the
device it runs on is refused before anything is built, with the numbers."""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.memory.memory_probe import MemoryProbe, check_plan_fits, measure_step
from xirang.ir.device import DeviceSpec
from xirang.ir.errors import XirangError
from xirang.ir.world import World

GPT = GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=2, dropout=0.1, attention="eager")


def test_probe_counts_a_storage_once_and_releases_it_with_the_graph():
    weight = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)
    with MemoryProbe(exclude=[weight]) as probe:
        h = torch.tanh(x @ weight)  # tanh keeps h; mm keeps x (the weight is excluded)
        q, k = h[:, :16], h[:, 16:]  # two views of h's storage, each kept by a mul
        loss = (q * k).sum() + (h * 2).sum()
        assert probe.live_bytes == x.nbytes + h.nbytes  # h once, however many views keep it
        assert probe.saved_tensors >= 4
        loss.backward()
        del loss, h, q, k
    assert probe.peak_bytes == x.nbytes + 32 * 8 * 4
    assert probe.live_bytes == 0  # the graph is freed after its backward


@pytest.fixture(scope="module")
def gpt_plan():
    tokens = {name: torch.zeros(4, 64, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    return xirang.plan(build_gpt(GPT, device="meta"), world=1, hardware="cpu", example_kwargs=tokens, global_batch=4,
                       micro_batch=2, recompute="none")


def test_a_step_measures_what_the_plan_predicts(gpt_plan):
    torch.manual_seed(0)
    batch = {name: torch.randint(0, GPT.vocab_size, (4, 64)) for name in ("input_ids", "labels")}
    compiled = xirang.compile(build_gpt(GPT), world=1, example_kwargs=batch, plan=gpt_plan)
    loss, measured = measure_step(compiled, **batch)
    assert torch.isfinite(loss)
    assert measured.predicted_activation_bytes == gpt_plan.predicted.memory_parts[0]["activations"]
    assert measured.allocated_peak_bytes is None  # CPU: no allocator figure
    assert 0.9 < measured.ratio < 1.1, measured


def test_a_plan_bigger_than_the_device_is_refused_with_the_numbers():
    """A plan for a device far bigger than this machine (a million-sample micro-batch on a 'huge'
    device) compiled on CPU ranks: refused before lowering, naming the plan field and the bytes."""
    huge = DeviceSpec("huge", {"fp32": 1e12, "bf16": 1e12}, memory_bytes=2**62, memory_bandwidth=1e12)
    tokens = {name: torch.zeros(2, 64, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    batch = 2**22
    plan = xirang.plan(build_gpt(GPT, device="meta"), world=World.uniform(1, 1, huge), example_kwargs=tokens,
                       global_batch=batch, micro_batch=batch, precision="fp32")
    need = plan.predicted.memory_bytes_per_device[0]
    assert need > 2**40  # a TiB and more: no machine running these tests has it
    with pytest.raises(XirangError) as error:
        xirang.compile(build_gpt(GPT), world=1, example_kwargs={k: torch.zeros(2, 64, dtype=torch.long)
                                                                for k in ("input_ids", "labels")}, plan=plan)
    text = str(error.value)
    assert "plan.predicted.memory_bytes_per_device[0]" in text and f"{need / 2**30:.2f} GiB" in text
    assert "this machine's memory (os.sysconf)" in text and "re-plan" in text
    # the same plan passes where the device is as big as planned
    check_plan_fits(plan, 0, "cpu", available=2**62)
    with pytest.raises(XirangError, match=r"has 80\.00 GiB \(given\)"):
        check_plan_fits(plan, 0, "cpu", available=80 * 2**30)
