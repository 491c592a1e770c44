"""``CompiledModel.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on the one-device model.

The default tier checks the counting by hand (padding rows of an uneven shard, fused pieces) and a
world-1 compiled GPT against torch, with a finite and a non-finite norm. The matrix test runs (2, 2, 2)
on 8 CPU ranks, where every rule of the count is exercised: the in-repo GPT with a vocabulary of 1001
(tp 2 pads one row), its embedding tied to the LM head across the two pipeline ranks, and untied
(the head held padded), with clipping active (the norm above max_norm) over 3 AdamW steps: the total
norm every step within 1e-6 (relative) of torch's, gradients and parameters within 1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.data_parallel.grad_norm import clip_grad_norm, real_elements, step_if_finite
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import XirangError
from xirang.ir.facts import ParamShard
from xirang.ir.placement import PlanReplicate, PlanShard

VOCAB, BATCH, SEQ, STEPS, MAX_NORM = 1001, 8, 16, 3, 0.5
NORM_TOLERANCE, TOLERANCE = 1e-6, 1e-5


def build(name: str = "gpt"):
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=VOCAB, seq_len=64, hidden=64, heads=4, layers=2,
                               tie_embeddings=name == "gpt"))


def batch(step: int, size=BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (size, SEQ), generator=generator)}


def reference(name: str) -> dict:
    """One device: AdamW steps with torch's clip_grad_norm_ between backward and step."""
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    norms, grads = [], []
    for step in range(STEPS):
        model(**batch(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}}


def clipped_run(compiled) -> dict:
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    optimizer.zero_grad()
    norms, grads = [], []
    for step in range(STEPS):
        compiled.train_step(**batch(step))
        norms.append(compiled.clip_grad_norm_(MAX_NORM).item())
        grads.append(compiled.full_gradients())
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "grads": grads, "params": compiled.full_state_dict()}


def worst(got: dict, want: dict) -> dict:
    found = {"norm": max(abs(a - b) / b for a, b in zip(got["norms"], want["norms"])), "grad": 0.0, "param": 0.0}
    for got_grads, want_grads in zip(got["grads"], want["grads"]):
        for fqn, grad in want_grads.items():
            found["grad"] = max(found["grad"], (got_grads[fqn] - grad).abs().max().item())
    for fqn, param in want["params"].items():
        found["param"] = max(found["param"], (got["params"][fqn] - param).abs().max().item())
    return found


# --- default tier ------------------------------------------------------------------------------------

def test_real_elements_drop_the_padding_of_each_piece():
    # 5 rows in 1 piece on 2 ranks: 3 per rank, rank 1 holds rows 3, 4 and one padding row
    shard = ParamShard("p_w", "w", ("w",), "parameter", PlanShard(0), (5, 2))
    local = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(real_elements(local, shard, 0, 2), local)
    assert torch.equal(real_elements(local, shard, 1, 2), local[:2])
    # fused [q | k] of 3 rows each on 2 ranks: 2 per piece per rank, rank 1 pads each piece by one
    fused = ParamShard("p_qk", "qk", ("qk",), "parameter", PlanShard(0, chunks=2), (6, 1))
    local = torch.tensor([[1.0], [0.0], [2.0], [0.0]])
    assert torch.equal(real_elements(local, fused, 1, 2), torch.tensor([[1.0], [2.0]]))
    replicated = ParamShard("p_b", "b", ("b",), "parameter", PlanReplicate(), (4,))
    assert real_elements(torch.ones(4), replicated, 1, 2).numel() == 4


def test_world_one_equals_torch_and_a_nonfinite_norm_skips_the_step():
    want = reference("gpt")
    assert all(norm > MAX_NORM for norm in want["norms"]), want["norms"]  # clipping is active
    compiled = xirang.compile(build("gpt"), world=1, example_kwargs=batch(0), global_batch=BATCH, hardware="cpu")
    found = worst(clipped_run(compiled), want)
    assert found["norm"] <= NORM_TOLERANCE and found["grad"] <= TOLERANCE and found["param"] <= TOLERANCE, found
    # the inf-norm, on the trained parameters: one more step's gradients against torch's
    model = build("gpt")
    model.load_state_dict(compiled.full_state_dict(), strict=False)
    model(**batch(STEPS)).backward()
    want_inf = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, math.inf).item()
    compiled.train_step(**batch(STEPS))
    got_inf = compiled.clip_grad_norm_(MAX_NORM, math.inf).item()
    assert abs(got_inf - want_inf) <= NORM_TOLERANCE * want_inf, (got_inf, want_inf)
    for param in compiled.parameters():
        param.grad = None
    # an inf gradient: the norm says so, the gradients stay, step_if_finite does not step
    param = compiled.parameters()[0]
    before = param.detach().clone()
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    compiled.train_step(**batch(0))
    param.grad[0].fill_(float("inf"))
    kept = param.grad.clone()
    total = compiled.clip_grad_norm_(MAX_NORM)
    assert not torch.isfinite(total)
    assert torch.equal(param.grad, kept)
    assert step_if_finite(optimizer, total) is False and torch.equal(param.detach(), before)
    optimizer.zero_grad()
    compiled.train_step(**batch(0))
    assert step_if_finite(optimizer, compiled.clip_grad_norm_(MAX_NORM)) is True
    assert not torch.equal(param.detach(), before)


def test_bad_max_norm_is_refused():
    with pytest.raises(XirangError, match="max_norm must be a positive number"):
        clip_grad_norm([], -1.0, shards={}, tied=[], groups=None)


# --- (2, 2, 2) on 8 ranks ------------------------------------------------------------------------------

def make_plan(name: str):
    meta_batch = {k: v.to("meta") for k, v in batch(0, 2).items()}
    with torch.device("meta"):
        model = build(name)
    plan = xirang.plan(model, world=8, example_kwargs=meta_batch, global_batch=BATCH, seq=4096, hardware="a100-80g",
                       precision="fp32", dp=2, tp=2, pp=2, micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2)
    sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard)]
    assert sharded, f"{name}: the plan shards no parameter, so tp would be vacuous"
    return plan


def _rank_main(rank, world, jobs):
    found = []
    for name, plan in jobs:
        compiled = xirang.compile(build(name), world=world, example_kwargs=batch(0, 2), plan=plan, hardware="a100-80g")
        found.append(clipped_run(compiled))
    return found


@pytest.mark.matrix
def test_clip_at_2_2_2_equals_one_device():
    names = ("gpt", "gpt_untied")
    jobs = [(name, make_plan(name)) for name in names]
    tied = [c.node for c in jobs[0][1].collectives if c.node.startswith("tied:")]
    assert tied, "the tied embedding is not summed across the pipeline ranks"  # counted once, not twice
    results = launch(_rank_main, 8, (jobs,), timeout_s=600, heartbeat_s=60)
    for index, name in enumerate(names):
        want = reference(name)
        assert all(norm > MAX_NORM for norm in want["norms"]), want["norms"]
        for rank, result in enumerate(results):
            found = worst(result[index], want)
            print(name, rank, found)
            assert found["norm"] <= NORM_TOLERANCE, (name, rank, found)
            assert found["grad"] <= TOLERANCE and found["param"] <= TOLERANCE, (name, rank, found)
