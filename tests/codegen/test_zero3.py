"""ZeRO-3 (codegen/runtime/data_parallel/param_shards.py) trains as one device, holds 1/dp of the parameters between
steps and 1/dp of the optimizer state, gathers each bucket before its first use with the next one
prefetched, communicates what its plan lists, and saves and resumes.

Matrix tier (multi-rank): one launch of 4 ranks for (dp, tp, pp) = (4, 1, 1) and one of 8 for
(2, 2, 2), 1F1B and interleaved, on the in-repo GPT, HF Llama and HF GPT-2 (its embedding tied to the
LM head across pipeline ranks at (2, 2, 2)), plans made at seq 4096 on A100s so tp shards (asserted),
run at seq 16. Per configuration and rank: loss every step, gathered gradients and parameters after 3
AdamW steps within 1e-5 of one device; the parameter storage the rank holds between steps (counted
storage by storage: shard parameters plus the flat buffers, freed) is 1/dp of its parameters plus
the bucket padding, before the first step, after each step and after a checkpoint, the parameters
reading NaN then and their values inside ``parameters_resident()``; AdamW's state
storage 2 x the shards' (1/dp); every collective of every step (all-gathers included) equal to the
plan's; a checkpoint restores the sharded state exactly and the step after a resume equals the step
after the save. One configuration per launch re-buckets by size (``bucket_bytes``), so several buckets
show the prefetch order (bucket k+1's gather issued before bucket k is waited on), and one runs ZeRO-1
to measure its optimizer state the same way. Default tier: the gate rewrite and the plan field.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

import xirang
from examples.gpt import build_gpt
from tests.codegen.single_device import single_device_run, worst_differences
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.checkpoint.save_load import load_checkpoint, save_checkpoint
from xirang.codegen.runtime.data_parallel.comm_check import calls_table, planned_calls
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.data_parallel.param_shards import GATE_PREFIX, gate_stage, storage_bytes
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard
from xirang.lower import lower

from tests.codegen.test_zero import STEPS, TOLERANCE, batch, build  # the same models and batches as ZeRO-1's
SMALL_BUCKETS = 64 * 1024  # bytes: several buckets per stage, so the prefetch has something to do


def held(compiled) -> dict:
    """Parameter bytes this rank holds now (storage counted), its parameters' full bytes, the shards' bytes."""
    shards = [s.param for s in compiled.zero.shards]
    return {"held": storage_bytes(shards + [t for _, t in compiled.named_model_parameters()]),
            "nan": all(torch.isnan(t).all().item() for _, t in compiled.named_model_parameters()),
            "full": sum(t.numel() * t.element_size() for _, t in compiled.named_model_parameters()),
            "shards": storage_bytes(shards)}


def zero3_run(compiled, counter, steps: int, folder: str) -> dict:
    """AdamW (eps 1e-3) for ``steps`` steps with what ZeRO-3 must show, then a save, one more step, a
    resume and that step again."""
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    at_rest, records, found, events = [held(compiled)], [], [], []
    for step in range(steps):
        counter.reset()
        loss = compiled.train_step(**batch(step))
        records.append(list(counter.records))
        events.append(list(getattr(compiled.zero, "last_events", [])))
        at_rest.append(held(compiled))
        found.append((loss.item(), compiled.full_gradients()))
        optimizer.step()
        optimizer.zero_grad()
    params = compiled.full_state_dict()
    with compiled.parameters_resident():  # the values, for code that reads named_parameters() between steps
        compiled.load_full_state_dict(params)  # its own resident context inside: the caller's stays resident
        again = compiled.full_state_dict()  # and another
        resident = (not any(torch.isnan(t).any().item() for _, t in compiled.named_model_parameters())
                    and all(torch.equal(again[fqn], value) for fqn, value in params.items()))
    state = [value for s in optimizer.state.values() for value in s.values() if value.dim() > 0]
    save_checkpoint(compiled, optimizer, folder, step=steps)
    at_rest.append(held(compiled))
    shards = [s.param.detach().clone() for s in compiled.zero.shards]
    pieces = [piece.param for _, piece in compiled.zero.named_pieces()]  # what the optimizer holds state for
    before = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in pieces]
    next_loss = compiled.train_step(**batch(steps)).item()
    optimizer.step()
    optimizer.zero_grad()
    next_params = compiled.full_state_dict()
    load_checkpoint(compiled, optimizer, folder)
    restored = max([(s.param - shards[i]).abs().max().item() for i, s in enumerate(compiled.zero.shards)]
                   + [(v - before[i][k]).abs().max().item() for i, p in enumerate(pieces)
                      for k, v in optimizer.state[p].items()])
    resumed_loss = compiled.train_step(**batch(steps)).item()
    optimizer.step()
    resumed = max(abs(resumed_loss - next_loss), *((v - next_params[k]).abs().max().item()
                                                  for k, v in compiled.full_state_dict().items()))
    return {"steps": found, "params": params, "records": records, "events": events, "at_rest": at_rest,
            "state_bytes": storage_bytes(state), "restored": restored, "resumed": resumed, "resident": resident,
            "buckets": len(compiled.zero.shards), "rank": compiled.rank}


def check_zero3(label: str, plan, results: list, want: dict, *, planned_buckets: bool) -> None:
    worst = worst_differences(label, results, want)
    print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
    dp = plan.mesh.dp
    for result in results:
        got = result[label]
        padding = 4 * (dp - 1) * got["buckets"]  # fewer than dp fp32 elements per bucket
        for rest in got["at_rest"][:1] if plan.zero_stage == 1 else got["at_rest"]:
            share = rest["full"] / dp
            if plan.zero_stage == 3:  # the shards and nothing of the full parameters (but the NaN they expand)
                assert share <= rest["held"] - 4 <= share + padding and rest["nan"], (label, got["rank"], rest)
            assert share <= rest["shards"] <= share + padding, (label, got["rank"], rest)
        # AdamW's exp_avg and exp_avg_sq: twice the shards' bytes, 1/dp of the full state
        assert got["state_bytes"] == 2 * got["at_rest"][0]["shards"], (label, got["rank"], got["state_bytes"])
        assert got["restored"] == 0.0 and got["resumed"] <= TOLERANCE, (label, got["restored"], got["resumed"])
        assert got["resident"], label
        for events in got["events"]:  # each bucket's gather issued before it is waited on, the next one too
            issued = [k for kind, k in events if kind == "issue"]
            for position, (kind, k) in enumerate(events):
                if kind == "wait" and issued.index(k) + 1 < len(issued):
                    assert ("issue", issued[issued.index(k) + 1]) in events[:position], (label, events)
    if not planned_buckets:
        return
    for step in range(STEPS):
        for dp_index in range(dp):
            for tp_index in range(plan.mesh.tp):
                pipeline = plan.mesh.group("pp", plan.mesh.rank_of(dp=dp_index, pp=0, tp=tp_index))
                rows = planned_calls(plan, {r[label]["rank"]: r[label]["records"][step] for r in results
                                            if r[label]["rank"] in pipeline})
                kinds = {"reduce_scatter", "all_reduce", "all_gather"} - (
                    {"all_gather"} if step == 0 and plan.zero_stage == 1 else set())
                ran = [row for row in rows if row.ran is not None]
                planned = [row for row in rows if row.planned and row.planned[0] in kinds]
                assert ran and all(row.equal for row in ran), calls_table(rows)
                assert len(planned) == len(ran) and all(row.ran for row in planned), (label, step, calls_table(rows))


# --- default tier ---------------------------------------------------------------------------------

def test_gate_stage_waits_for_each_bucket_before_its_first_reader():
    class Owner:
        def __init__(self):
            self.calls = []

        def ensure(self, shard):
            self.calls.append(shard)

    class Stage(torch.nn.Module):
        def forward(self, w0, w1, w2, x):
            return ((x * w0) @ w1 + w2 * w0).sum()

    traced = fx.symbolic_trace(Stage())
    program = type("Program", (), {"module": traced, "parameters": (("w0", "a"), ("w1", "b"), ("w2", "c"))})
    owner = Owner()
    module, order = gate_stage(program, [0, 1, 0], owner)
    assert order == [0, 1]  # bucket 0 (w0, w2) at x * w0, bucket 1 (w1) at the matmul
    names = [n.target if n.op == "call_module" else n.name for n in module.graph.nodes if n.op != "placeholder"]
    assert names.index(f"{GATE_PREFIX}0") < names.index("mul") < names.index(f"{GATE_PREFIX}1") < names.index("matmul")
    assert not any(n.op == "call_module" for n in traced.graph.nodes)  # the program's module is untouched
    w = [torch.randn(4, 4) for _ in range(3)]
    x = torch.randn(4, 4)
    assert torch.equal(module(*w, x), traced(*w, x)) and owner.calls == [0, 1]


def test_a_pinned_zero3_plan_lists_notes_and_round_trips_it_and_bad_stages_name_the_field():
    plan = xirang.plan(build_gpt("tiny", device="meta"), world=2,
                       example_kwargs={k: v.to("meta") for k, v in batch(0, 2).items()}, global_batch=8,
                       dp=2, tp=1, pp=1, micro_batch=2, schedule="1f1b", precision="fp32", zero_stage=3)
    assert plan.zero_stage == 3 and type(plan).from_json(plan.to_json()) == plan
    assert [c.kind for c in plan.collectives if c.node == "bucket:0"] == ["reduce_scatter", "all_gather"]
    assert plan.collectives == plan.with_zero_stage(1).collectives  # one gather per bucket per step either way
    assert any("zero-3, kept until the backward" in note for note in plan.predicted.notes), plan.predicted.notes
    for bad in (2, 4, True):
        with pytest.raises(XirangError, match="zero_stage"):
            plan.with_zero_stage(bad)
    with pytest.raises(XirangError, match="zero_stage"):
        dataclasses.replace(plan, zero_stage=-1)


# --- matrix tier ----------------------------------------------------------------------------------

def _plan(name: str, dp: int, tp: int, pp: int, schedule: str, v: int, zero: int):
    plan = xirang.plan(build(name), world=dp * tp * pp, example_kwargs=batch(0, 2), global_batch=8, seq=4096,
                       hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v,
                       micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp)
    if tp > 1:
        assert any(n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items())
    return plan.with_zero_stage(zero)


def _ranks(rank, world, jobs, folder):
    results, traced = {}, {}
    for label, name, plan, bucket_bytes in jobs:
        if name not in traced:
            traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
        counter = CommCounter()
        program = lower(traced[name], plan, rank=rank).program
        compiled = CompiledModel(build(name), plan, program, groups=build_mesh_groups(plan.mesh), counter=counter,
                                 bucket_bytes=bucket_bytes)
        results[label] = zero3_run(compiled, counter, STEPS, f"{folder}/{label.replace(' ', '_')}")
    return results


# (label, model, dp, tp, pp, schedule, virtual stages, zero stage, bucket_bytes or None: the plan's)
MATRIX = [("gpt 4x1x1", "gpt", 4, 1, 1, "1f1b", 1, 3, None), ("llama 4x1x1", "llama", 4, 1, 1, "1f1b", 1, 3, None),
          ("gpt2 4x1x1", "gpt2", 4, 1, 1, "1f1b", 1, 3, None),
          ("gpt 4x1x1 small buckets", "gpt", 4, 1, 1, "1f1b", 1, 3, SMALL_BUCKETS),
          ("gpt 4x1x1 zero1", "gpt", 4, 1, 1, "1f1b", 1, 1, None),
          ("gpt 2x2x2 1f1b", "gpt", 2, 2, 2, "1f1b", 1, 3, None),
          ("llama 2x2x2 interleaved", "llama", 2, 2, 2, "interleaved", 2, 3, None),
          ("gpt2 2x2x2 1f1b", "gpt2", 2, 2, 2, "1f1b", 1, 3, None),
          ("gpt 2x2x2 interleaved small buckets", "gpt", 2, 2, 2, "interleaved", 2, 3, SMALL_BUCKETS),
          ("llama 2x2x2 1f1b zero1", "llama", 2, 2, 2, "1f1b", 1, 1, None)]


@pytest.mark.matrix
@pytest.mark.parametrize("world", [4, 8])
def test_zero3_matrix_equals_one_device(tmp_path, world):
    """One launch per world size: the (4, 1, 1) configurations on 4 ranks, the (2, 2, 2) ones on 8."""
    rows = [row for row in MATRIX if row[2] * row[3] * row[4] == world]
    jobs = [(label, name, _plan(name, dp, tp, pp, schedule, v, zero), bucket_bytes)
            for label, name, dp, tp, pp, schedule, v, zero, bucket_bytes in rows]
    results = launch(_ranks, world, (jobs, str(tmp_path)), timeout_s=3000, heartbeat_s=600)
    want = {name: single_device_run(build(name), batch, STEPS, keep_duplicates=True) for name in {r[1] for r in rows}}
    for label, name, plan, bucket_bytes in jobs:
        check_zero3(label, plan, results, want[name], planned_buckets=bucket_bytes is None)
    small = [results[0][label]["buckets"] for label, *_, bucket_bytes in jobs if bucket_bytes]
    assert small and min(small) > 2, small  # the re-bucketed runs did have several buckets to prefetch
