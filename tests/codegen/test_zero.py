"""ZeRO-1 (codegen/runtime/data_parallel/dist_optimizer.py) trains as one device, holds 1/dp of the optimizer state,
and communicates what its plan lists, collective by collective.

Default tier (the tier's one ZeRO launch, 2 ranks): the in-repo GPT at
(dp, tp, pp) = (2, 1, 1) on two CPU ranks through ``xirang.compile(zero_stage=1)``: loss every step,
gathered gradients and parameters after 3 AdamW steps within 1e-5 of one device; AdamW's state
tensors on each rank count 1/dp of the model's elements (plus the bucket padding, fewer than dp
elements per bucket); every reduce-scatter and all-gather equals ``Plan.with_zero_stage``'s list;
the global gradient norm equals torch's on one device; a checkpoint of the sharded optimizer
round-trips exactly and loads into the plain model as one device's AdamW state. Also in the matrix
tier: GPT, HF Llama and HF GPT-2 at (4, 1, 1) and (2, 2, 2), 1F1B and interleaved, plans made at seq 4096 on
A100s so tp shards (asserted), run at seq 16 on 4 and 8 CPU ranks (one launch each), with the same
checks. Also in the default tier: the plan field's round trip and refusals.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.single_device import single_device_run, worst_differences
from tests.conftest import hf_gpt2, hf_llama
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.checkpoint.save_load import load_checkpoint, save_checkpoint
from xirang.codegen.runtime.data_parallel.comm_check import calls_table, planned_calls
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.cli.verify import loss_of
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanShard
from xirang.lower import lower

STEPS, SEQ, VOCAB_USED, TOLERANCE = 3, 16, 500, 1e-5


def build(name: str):
    torch.manual_seed(0)
    return {"gpt": lambda: build_gpt("tiny", device="cpu"), "llama": lambda: hf_llama(device="cpu"),
            "gpt2": lambda: hf_gpt2(device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}[name]()


def batch(step: int, size: int = 8) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def zero_run(compiled, counter, batch_of, steps: int, checkpoint_dir) -> dict:
    """``compiled_run``'s loop (AdamW, eps 1e-3) with what ZeRO-1 must show: each step's collectives,
    the optimizer's state elements against the model's, the step-0 gradient norm, the checkpoint refusal."""
    state = compiled.full_state_dict()
    compiled.load_full_state_dict({fqn: value + 1 for fqn, value in state.items()})  # the shards must follow
    refreshed = all(torch.equal(s.param, s.mine(s.flat(s.params))) for s in compiled.zero.shards)
    compiled.load_full_state_dict(state)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    found, records, norm = [], [], None
    for step in range(steps):
        counter.reset()
        loss = compiled.train_step(**batch_of(step))
        records.append(list(counter.records))  # the previous step's all-gathers, this step's reduce-scatters
        found.append((loss.item(), compiled.full_gradients()))
        if step == 0:
            norm = compiled.clip_grad_norm_(1e9).item()  # a bound no norm reaches: nothing is scaled
        optimizer.step()
        optimizer.zero_grad()
    counter.reset()
    params = compiled.full_state_dict()  # gathers the last step's slices
    records.append(list(counter.records))
    return {"steps": found, "params": params, "records": records, "norm": norm, "refreshed": refreshed,
            "restored": checkpoint_round_trip(compiled, optimizer, params, checkpoint_dir),
            "state_elements": compiled.zero.optimizer_state_elements(optimizer),
            "model_elements": sum(p.numel() for _, p in compiled.named_model_parameters()),
            "buckets": len(compiled.zero.shards), "rank": compiled.rank}


def checkpoint_round_trip(compiled, optimizer, params: dict, folder) -> float:
    """Save, scramble the parameters and the sharded state, load: the largest difference left."""
    pieces = [piece.param for _, piece in compiled.zero.named_pieces()]  # what the optimizer holds state for
    before = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in pieces]
    save_checkpoint(compiled, optimizer, folder, step=1)
    for p in pieces:
        for value in optimizer.state[p].values():
            value.add_(1)
    compiled.load_full_state_dict({fqn: value + 1 for fqn, value in params.items()})
    load_checkpoint(compiled, optimizer, folder)
    worst = max((v - before[i][k]).abs().max().item() for i, p in enumerate(pieces)
                for k, v in optimizer.state[p].items())
    return max(worst, *((value - params[fqn]).abs().max().item() for fqn, value in compiled.full_state_dict().items()))


def check_zero(label: str, plan, results: list, want: dict) -> None:
    """Equivalence, 1/dp optimizer state and the planned collectives, for one configuration's ranks."""
    worst = worst_differences(label, results, want)
    print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
    dp = plan.mesh.dp
    for result in results:
        got = result[label]
        # AdamW keeps exp_avg and exp_avg_sq per element of this rank's pieces: 1/dp of the elements, give or
        # take a bucket's padding (fewer than dp elements a bucket, held by no piece)
        share = got["state_elements"] / 2
        assert abs(share - got["model_elements"] / dp) < got["buckets"] * dp, (label, got)
        assert got["restored"] == 0.0, (label, got["restored"])  # the checkpoint holds the sharded state exactly
        assert got["refreshed"], label  # load_full_state_dict gave every shard its slice of the new values
    for step in range(STEPS + 1):
        for dp_index in range(dp):
            for tp_index in range(plan.mesh.tp):
                pipeline = plan.mesh.group("pp", plan.mesh.rank_of(dp=dp_index, pp=0, tp=tp_index))
                rows = planned_calls(plan, {r[label]["rank"]: r[label]["records"][step] for r in results
                                            if r[label]["rank"] in pipeline})
                ran = [row for row in rows if row.ran is not None]
                # step 0 has no all-gather yet, the last entry (full_state_dict) only the all-gathers
                kinds = {"all_gather"} if step == STEPS else {"reduce_scatter", "all_reduce", "all_gather"} - (
                    {"all_gather"} if step == 0 else set())
                assert ran and all(row.equal for row in ran), calls_table(rows)
                planned = [row for row in rows if row.planned and row.planned[0] in kinds]
                assert len(planned) == len(ran) and all(row.ran for row in planned), (label, step, calls_table(rows))


# --- default tier: (2, 1, 1) through xirang.compile, the tier's one ZeRO launch ---------------------------

def _two_ranks(rank, world, plan, folder):
    counter = CommCounter()
    compiled = xirang.compile(build("gpt"), world=world, example_kwargs=batch(0, 2), plan=plan,
                              debug=xirang.DebugHooks(counter=counter), zero_stage=1)
    return {"zero": zero_run(compiled, counter, batch, STEPS, folder), "plan": compiled.plan}


def test_zero1_at_dp2_trains_as_one_device_with_half_the_optimizer_state(tmp_path):
    plan = xirang.plan(build("gpt"), world=2, example_kwargs=batch(0, 2), global_batch=8, dp=2, tp=1, pp=1,
                       micro_batch=2, schedule="1f1b", precision="fp32")
    results = launch(_two_ranks, 2, (plan, str(tmp_path)), timeout_s=300, heartbeat_s=60)
    zero_plan = results[0]["plan"]
    assert zero_plan.zero_stage == 1 and zero_plan == plan.with_zero_stage(1)
    assert {c.kind for c in zero_plan.collectives if c.node.startswith("bucket:")} == {"reduce_scatter",
                                                                                        "all_gather"}
    check_zero("zero", zero_plan, results, single_device_run(build("gpt"), batch, STEPS, keep_duplicates=True))
    model = build("gpt")
    loss_of(model(**batch(0))).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    assert all(abs(r["zero"]["norm"] - want_norm) <= 1e-5 * want_norm for r in results), (want_norm, results[0])
    # the sharded checkpoint loads into the plain model as one device's AdamW state after 3 steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    optimizer.zero_grad()
    for step in range(STEPS):
        loss_of(model(**batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
    fresh = build("gpt")
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3, eps=1e-3)
    load_checkpoint(fresh, fresh_optimizer, str(tmp_path))
    for (name, want), got in zip(model.named_parameters(), fresh.parameters()):
        assert (want - got).abs().max() <= TOLERANCE, name
        for key, value in optimizer.state[want].items():
            assert (value - fresh_optimizer.state[got][key]).abs().max() <= TOLERANCE, (name, key)


def test_plan_zero_stage_round_trips_and_refuses_what_the_runtime_cannot_run():
    plan = xirang.plan(build_gpt("tiny", device="meta"), world=2,
                       example_kwargs={k: v.to("meta") for k, v in batch(0, 2).items()}, global_batch=8,
                       dp=2, tp=1, pp=1, micro_batch=2, schedule="1f1b", precision="fp32")
    zero = plan.with_zero_stage(1)
    assert type(plan).from_json(zero.to_json()) == zero and zero.with_zero_stage(0).zero_stage == 0
    assert "zero_stage set after planning" in " ".join(zero.predicted.notes)
    for bad in (2, 4, True, "1"):  # 3 is ZeRO-3 (tests/codegen/test_zero3.py)
        with pytest.raises(XirangError, match="zero_stage"):
            plan.with_zero_stage(bad)
    with pytest.raises(XirangError, match="has dp 1"):  # the same two ranks as tp 2: nothing to shard over
        dataclasses.replace(zero, mesh=Mesh(dp=1, pp=1, tp=2), global_batch=4)


# --- matrix tier: (4, 1, 1) and (2, 2, 2), GPT and Llama ---------------------------------------------

def _plan(name: str, dp: int, tp: int, pp: int, schedule: str, v: int = 1):
    plan = xirang.plan(build(name), world=dp * tp * pp, example_kwargs=batch(0, 2), global_batch=8, seq=4096,
                       hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v,
                       micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp)
    if tp > 1:
        assert any(n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items())
    return plan.with_zero_stage(1)


def _ranks(rank, world, jobs, folder):
    results, traced = {}, {}
    for label, name, plan in jobs:
        if name not in traced:
            traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
        counter = CommCounter()
        program = lower(traced[name], plan, rank=rank).program
        compiled = CompiledModel(build(name), plan, program, groups=build_mesh_groups(plan.mesh), counter=counter)
        results[label] = zero_run(compiled, counter, batch, STEPS, f"{folder}/{label}")
    return results


MATRIX = [("gpt 4x1x1", "gpt", 4, 1, 1, "1f1b", 1), ("llama 4x1x1", "llama", 4, 1, 1, "1f1b", 1),
          ("gpt 2x2x2 1f1b", "gpt", 2, 2, 2, "1f1b", 1), ("gpt 2x2x2 interleaved", "gpt", 2, 2, 2, "interleaved", 2),
          ("llama 2x2x2 1f1b", "llama", 2, 2, 2, "1f1b", 1),
          ("llama 2x2x2 interleaved", "llama", 2, 2, 2, "interleaved", 2),
          ("gpt2 4x1x1", "gpt2", 4, 1, 1, "1f1b", 1), ("gpt2 2x2x2 interleaved", "gpt2", 2, 2, 2, "interleaved", 2)]


@pytest.mark.matrix
@pytest.mark.parametrize("world", [4, 8])
def test_zero1_matrix_equals_one_device(tmp_path, world):
    """One launch per world size: (4, 1, 1) on 4 ranks, the (2, 2, 2) configurations on 8."""
    jobs = [(label, name, _plan(name, dp, tp, pp, schedule, v)) for label, name, dp, tp, pp, schedule, v in MATRIX
            if dp * tp * pp == world]
    results = launch(_ranks, world, (jobs, str(tmp_path)), timeout_s=1800, heartbeat_s=300)
    want = {name: single_device_run(build(name), batch, STEPS, keep_duplicates=True)
            for name in ("gpt", "llama", "gpt2")}
    for label, name, plan in jobs:
        check_zero(label, plan, results, want[name])
