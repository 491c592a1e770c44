"""The step's own collectives are priced as the runtime runs them: the batch agreement over every rank,
then the loss's all-reduce over dp and broadcast over pp (``plan_costs.step_sync``), each at its group's
measured line (``step_sync_costs``); and the runtime's calls have the sizes the cost model prices."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.calibration import Calibration, CollectiveFit
from xirang.ir.device import DeviceSpec
from xirang.ir.world import LinkSpec, NodeSpec, World
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.step_sync_costs import LOSS_BYTES, agreement_bytes
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

# distinct lines per kind and group size, so a term priced on the wrong group shows
FITS = (CollectiveFit("all_reduce", 8, "gloo", 10e-3, 1e-9), CollectiveFit("all_reduce", 2, "gloo", 2e-3, 1e-9),
        CollectiveFit("all_reduce", 4, "gloo", 4e-3, 1e-9), CollectiveFit("broadcast", 2, "gloo", 1e-3, 1e-9),
        CollectiveFit("broadcast", 4, "gloo", 3e-3, 1e-9))
LINK = LinkSpec(5e8, 2e-4)
WORLD = World((NodeSpec(8, DeviceSpec("cpu", {"fp32": 2e10}, 2**32, 1e10)),), LINK, LINK,
              Calibration(8, "gloo", "cpu", FITS))


def _unit(name):
    return UnitCost(name, name.split(":")[0], forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                    tp_comm_backward_seconds=0.0, params_local=0, saved_bytes=0.0, selective_saved_bytes=0.0,
                    selective_recompute_seconds=0.0, input_bytes=0.0, cut_bytes_after=0.0, model_flops=0.0,
                    model_forward_flops=0.0)


def _priced(dp, tp, pp, inputs=2):
    units = [_unit(f"block:{i}") for i in range(pp)]
    c = Candidate(tp=tp, pp=pp, dp=dp, micro_batch=1, num_micro_batches=pp, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    pricer = CandidatePricer({(tp, 1): TensorSplit(tp, 1, 8, units)}, WORLD, global_batch=dp * pp,
                             batch_inputs=inputs)
    return pricer.price(c, tuple((i, i + 1) for i in range(pp)), exact=True)


def test_the_agreement_spans_every_rank_and_the_loss_crosses_dp_then_pp():
    agreement = FITS[0].seconds(agreement_bytes(2))
    # (dp, tp, pp) -> what follows the agreement: the loss's all-reduce on dp, its broadcast on pp
    expected = {(8, 1, 1): FITS[0].seconds(LOSS_BYTES), (1, 8, 1): 0.0, (1, 2, 4): FITS[4].seconds(LOSS_BYTES),
                (2, 2, 2): FITS[1].seconds(LOSS_BYTES) + FITS[3].seconds(LOSS_BYTES),
                (4, 1, 2): FITS[2].seconds(LOSS_BYTES) + FITS[3].seconds(LOSS_BYTES)}
    for (dp, tp, pp), loss in expected.items():
        priced = _priced(dp, tp, pp)
        assert priced.breakdown["step_sync"] == pytest.approx(agreement + loss), (dp, tp, pp)
        assert sum(priced.breakdown.values()) == pytest.approx(priced.step_seconds)
    # each input adds its 64 figures (and their negations) to the agreement
    assert (_priced(8, 1, 1, inputs=3).breakdown["step_sync"] - _priced(8, 1, 1, inputs=2).breakdown["step_sync"]
            == pytest.approx(FITS[0].beta * 2 * 8 * 64))


def test_one_rank_runs_no_collective():
    world = World((NodeSpec(1, WORLD.nodes[0].device),), LINK, LINK)
    c = Candidate(tp=1, pp=1, dp=1, micro_batch=1, num_micro_batches=1, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    priced = CandidatePricer({(1, 1): TensorSplit(1, 1, 8, [_unit("block:0")])}, world, global_batch=1).price(
        c, ((0, 1),), exact=True)
    assert priced.breakdown["step_sync"] == 0.0 and priced.step_seconds == pytest.approx(1.0)


def _collectives_of_a_step(rank, world_size):
    config = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=2)
    g = torch.Generator().manual_seed(0)
    batch = {name: torch.randint(0, 128, (4, 16), generator=g) for name in ("input_ids", "labels")}
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt(config), world=world_size, example_kwargs=batch, global_batch=4, hardware="cpu",
                              dp=2, tp=1, pp=1, micro_batch=2)
    calls, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.nbytes)
        return original(tensor, *args, **kwargs)
    dist.all_reduce = counting
    try:
        compiled.train_step(**batch)
    finally:
        dist.all_reduce = original
    return calls, len(compiled.plan.buckets)


def test_the_runtime_runs_the_collectives_the_cost_model_prices():
    # dp=2: the agreement, the gradient buckets (the runtime's own calls), the loss; nothing unpriced
    calls, buckets = launch(_collectives_of_a_step, 2, timeout_s=300)[0]
    assert calls[0] == agreement_bytes(2) and calls[-1] == LOSS_BYTES
    assert len(calls) == 2 + buckets
