"""Token dropping with a capacity factor (``capacity_factor=``), against a one-device reference that drops
the same tokens.

The reference is the Hugging Face model itself, its experts module's routing weights multiplied by a
keep mask computed here, independently of codegen/ops/expert_capacity.py: per forward, each expert
keeps the first ceil(rows / experts x factor) (token, top-k slot) pairs routed to it in token order
(Megatron-Core's capacity with its "position" drop policy), and a dropped pair adds nothing to its
token's output (a zero weight whose gradient is zero). The compiled program instead never computes or
sends a dropped row. Equal means the loss every step, every gradient and the parameters after 3 AdamW
steps within 1e-5 (fp32), as the other MoE tests (tests/models/test_moe_families.py). Tiers: the op
against the loop in the default tier (no launch); both equivalence runs in the matrix tier.
"""
from __future__ import annotations

import math

import pytest
import torch

import xirang
from examples.hf_moe import EXPERTS, HIDDEN, TOP_K
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from tests.models.test_moe_families import PLAN_SEQ, SEQ, STEPS, TOLERANCE, batch, build
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.expert_capacity import drop_over_capacity, kept_rows, restore_dropped
from xirang.codegen.runtime.launch.launcher import launch

FACTOR = 1.0  # one sample of 16 tokens, top 2 of 8 experts: 32 rows, 4 per expert; a random router overfills some


def reference_keep(top_k_index: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """1.0 where a (token, slot) pair is kept, 0.0 where dropped: a plain loop over the pairs in order."""
    pairs = top_k_index.reshape(-1, top_k_index.shape[-1])
    limit = math.ceil(pairs.numel() / experts * factor)
    taken = [0] * experts
    keep = torch.zeros(pairs.shape, dtype=torch.float32)
    for token in range(pairs.shape[0]):
        for slot in range(pairs.shape[1]):
            expert = int(pairs[token, slot])
            if taken[expert] < limit:
                keep[token, slot] = 1.0
            taken[expert] += 1
    return keep


def dropping(model, factor: float, tally: dict):
    """``model`` with every experts module keeping only its capacity (the routing weights of the dropped
    pairs multiplied by 0); ``tally`` counts the pairs kept and routed."""
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            original = module.forward

            def forward(hidden, top_k_index, top_k_weights, original=original):
                keep = reference_keep(top_k_index, EXPERTS, factor)
                tally["kept"] = tally.get("kept", 0) + int(keep.sum())
                tally["routed"] = tally.get("routed", 0) + keep.numel()
                weights = top_k_weights * keep.to(top_k_weights.dtype).view_as(top_k_weights)
                return original(hidden, top_k_index, weights)
            module.forward = forward
    return model


def make_plan(name: str, *, dp: int, tp: int = 1, ep: int = 1, factor=FACTOR, hardware="cpu"):
    model, inputs = build(name, "meta", batch=2)
    return xirang.plan(model, world=dp * tp, example_kwargs=inputs, global_batch=8, seq=PLAN_SEQ, hardware=hardware,
                       precision="fp32", dp=dp, tp=tp, ep=ep, pp=1, micro_batch=1, schedule="1f1b", zero_stage=0,
                       capacity_factor=factor)


def reference(name: str, factor=FACTOR):
    tally = {}
    model = build(name)[0]
    if factor is not None:
        dropping(model, factor, tally)
    return single_device_run(model, batch(name), STEPS, keep_duplicates=True, micro_batch=1), tally


def test_the_kept_rows_are_the_loops_and_the_dropped_rows_come_back_zero():
    """codegen/ops/expert_capacity.py against the plain loop, on routings with and without drops (default tier)."""
    generator = torch.Generator().manual_seed(0)
    for tokens, experts, factor in ((16, 8, 1.0), (16, 8, 0.5), (5, 4, 1.25), (16, 8, 4.0)):
        index = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(tokens)])
        skewed = torch.where(torch.rand(index.shape, generator=generator) < 0.5, index % 2, index)  # crowd 0 and 1
        for top_k_index in (index, skewed):
            keep = reference_keep(top_k_index, experts, factor).reshape(-1)
            ids = top_k_index.reshape(-1)
            kept = kept_rows(ids, experts, factor)
            assert kept.tolist() == keep.nonzero().squeeze(1).tolist(), (tokens, experts, factor)
            rows = torch.randn(ids.shape[0], 3, requires_grad=True)
            kept_rows_, kept_ids, where = drop_over_capacity(rows, ids, experts, factor)
            assert torch.equal(kept_ids, ids[keep.bool()]) and torch.equal(where, kept)
            out = restore_dropped(kept_rows_ * 2, where, rows)
            assert torch.equal(out, rows.detach() * 2 * keep[:, None])  # dropped rows: zero
            out.sum().backward()
            assert torch.equal(rows.grad, 2 * keep[:, None].expand_as(rows))  # and no gradient


@pytest.mark.matrix
def test_one_rank_drops_the_tokens_over_capacity_as_the_reference_does():
    plan = make_plan("qwen3_moe", dp=1)
    assert plan.capacity_factor == FACTOR and type(plan).from_json(plan.to_json()).capacity_factor == FACTOR
    model, inputs = build("qwen3_moe", batch=2)
    compiled = xirang.compile(model, world=1, example_kwargs=inputs, plan=plan)
    got = compiled_run(compiled, batch("qwen3_moe"), STEPS)
    want, tally = reference("qwen3_moe")
    assert 0 < tally["kept"] < tally["routed"], tally  # tokens were dropped: the comparison has teeth
    worst = worst_differences("qwen3_moe", [{"qwen3_moe": got}], want)
    assert all(value <= TOLERANCE for value in worst.values()), worst
    dropless, _ = reference("qwen3_moe", factor=None)
    assert abs(dropless["steps"][0][0] - want["steps"][0][0]) > 10 * TOLERANCE  # dropping changes the loss


def _rank_main(rank, world, plan, name):
    model, inputs = build(name, batch=2)
    counter = CommCounter()
    compiled = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan,
                              debug=xirang.DebugHooks(counter=counter))
    run = compiled_run(compiled, batch(name), STEPS)
    return {name: run, "dispatched": sum(r.nbytes for r in counter.records if r.label == "expert dispatch.forward")}


@pytest.mark.matrix
def test_expert_parallel_ranks_drop_and_send_only_the_kept_rows():
    """dp2 tp2 ep2 on 4 gloo ranks, priced for the CPU (the experts split over tp): equal to the reference, and
    the rows dispatched are the kept ones (the reference's count), not every routed row."""
    name = "qwen3_moe"
    plan = make_plan(name, dp=2, tp=2, ep=2)
    results = launch(_rank_main, 4, (plan, name), timeout_s=900, heartbeat_s=120)
    want, tally = reference(name)
    worst = worst_differences(name, results, want)
    print(f"\n{name} dp2 tp2 ep2, capacity factor {FACTOR}: kept {tally['kept']} of {tally['routed']} rows; max |diff| "
          f"loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), worst
    assert 0 < tally["kept"] < tally["routed"], tally
    (planned,) = {c.nbytes for c in plan.collectives if c.axis == "ep" and c.node.endswith(".dispatch")}
    row_bytes = planned / (PLAN_SEQ * TOP_K)  # the plan lists one micro-batch of PLAN_SEQ tokens, every row sent
    assert row_bytes in (HIDDEN * 4, HIDDEN * 4 / plan.mesh.tp), row_bytes
    # every tp rank of a tp group sends its share of the same kept rows
    sent_rows = sum(result["dispatched"] for result in results) / row_bytes / plan.mesh.tp
    assert sent_rows == tally["kept"], (sent_rows, tally)
    assert SEQ * TOP_K * 8 * STEPS * 2 == tally["routed"]  # 8 samples a step, 2 MoE layers
