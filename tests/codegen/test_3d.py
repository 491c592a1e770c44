"""Full 3D composition (dp x tp x pp) equals the single-device model, on 8 CPU gloo ranks.

Each rank's tp-rewritten program is cut into its pipeline stages (codegen/compose_3d.py) and run by
the pipeline executor with dp buckets per stage and tied-weight sums across the first and last
stage. One launch of 8 ranks runs every configuration; each rank returns its numbers and the
parent compares them with a single-device run: the loss of every step, the gathered gradients,
and the parameters after STEPS AdamW steps, within TOLERANCE (fp32).

As in tests/codegen/test_equivalence.py, plans are made at seq 4096 on A100s so the ILP really
shards the tiny models (asserted), then run at seq 16, and AdamW uses eps=1e-3 (gradients that are
zero in exact arithmetic are rounding noise that Adam's first step would amplify to lr * sign).
HF GPT-2 traces a different graph on the meta device, so every plan is made on the CPU model.

Two configurations go through ``xirang.compile`` in the ranks (each rank traces: the slow part);
the others build the same pieces (``rank_pipeline_program``, ``PipelineRuntime``) on one trace per
model and rank.
"""
from __future__ import annotations

import torch

import xirang
from tests.conftest import hf_gpt2, hf_llama
from xirang.codegen.compose_3d import rank_pipeline_program
from tests.codegen.single_device import single_device_run
from xirang.codegen.launch import launch
from xirang.codegen.pipeline_runtime import PipelineRuntime
from xirang.codegen.process_groups import build_mesh_groups
from xirang.ir.placement import Shard

WORLD, GLOBAL_BATCH, SEQ, VOCAB_USED, STEPS, TOLERANCE = 8, 8, 16, 500, 3, 1e-5


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt2":
        return hf_gpt2(device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf_llama(device="cpu")


def batch(step: int, size: int = GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def make_plan(name: str, dp: int, tp: int, pp: int, schedule: str):
    plan = xirang.plan(build(name), world=WORLD, example_kwargs=batch(0, 2), global_batch=GLOBAL_BATCH, seq=4096,
                       device="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, schedule=schedule, micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp) and len(plan.stages) == pp
    sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp, Shard)]
    assert sharded, f"{name}: the plan shards no parameter, so tp would be vacuous"
    return plan


def reference(name: str) -> dict:
    return single_device_run(build(name), batch, STEPS, keep_duplicates=True)


# --- what each rank runs ---------------------------------------------------------------------------

def _train(compiled) -> dict:
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    steps = []
    for step in range(STEPS):
        loss = compiled.train_step(**batch(step))
        steps.append((loss.item(), compiled.full_gradients()))
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": steps, "params": compiled.full_state_dict(), "local_bytes": compiled.local_param_bytes()}


def _rank_main(rank, world, jobs):
    results, traced = {}, {}  # traced: this rank's analysed graph per model, for the direct jobs
    for label, name, plan, via_compile in jobs:
        if via_compile:  # the public API: trace, emit, split, run
            compiled = xirang.compile(build(name), world=world, example_kwargs=batch(0, 2), plan=plan,
                                      device="a100-80g")
            results[label] = _train(compiled)
            results[label]["code"] = compiled.code()
            continue
        # The pieces under it, on a graph traced once per model (a split tp program cannot be sent
        # from the parent: unpickling a GraphModule re-traces its code, and the collectives branch
        # on their tensors' shapes).
        if name not in traced:
            traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
        groups = build_mesh_groups(plan.mesh)
        program = rank_pipeline_program(traced[name], plan, rank=rank, tp_group=groups.tp)
        results[label] = _train(PipelineRuntime(build(name), plan, program=program, groups=groups))
    return results


def job(label: str, name: str, dp: int, tp: int, pp: int, schedule: str, *, via_compile: bool) -> tuple:
    return label, name, make_plan(name, dp, tp, pp, schedule), via_compile


def _compare(label: str, results: list, want: dict) -> dict:
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for rank, result in enumerate(results):
        got = result[label]
        for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got["steps"], want["steps"])):
            worst["loss"] = max(worst["loss"], abs(loss - want_loss))
            assert set(grads) == set(want_grads), (label, rank, sorted(set(grads) ^ set(want_grads)))
            for fqn, grad in want_grads.items():
                assert grads[fqn].shape == grad.shape, (label, fqn)
                worst["grad"] = max(worst["grad"], (grads[fqn] - grad).abs().max().item())
        for fqn, param in want["params"].items():
            worst["param"] = max(worst["param"], (got["params"][fqn] - param).abs().max().item())
    print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
    return worst


def test_3d_training_equals_single_device():
    jobs = [job("gpt2 (1,2,4) 1f1b", "gpt2", 1, 2, 4, "1f1b", via_compile=True),
            job("llama (2,2,2) 1f1b", "llama", 2, 2, 2, "1f1b", via_compile=True),
            job("gpt2 (2,2,2) gpipe", "gpt2", 2, 2, 2, "gpipe", via_compile=False),
            job("llama (1,2,4) gpipe", "llama", 1, 2, 4, "gpipe", via_compile=False),
            job("gpt2 (2,2,2) 1f1b", "gpt2", 2, 2, 2, "1f1b", via_compile=False),
            job("llama (1,2,4) 1f1b", "llama", 1, 2, 4, "1f1b", via_compile=False),
            job("gpt2 (1,2,4) gpipe", "gpt2", 1, 2, 4, "gpipe", via_compile=False),
            job("llama (2,2,2) gpipe", "llama", 2, 2, 2, "gpipe", via_compile=False)]
    results = launch(_rank_main, WORLD, (jobs,), timeout_s=600)
    references = {name: reference(name) for name in ("gpt2", "llama")}
    for label, name, _, _ in jobs:
        _compare(label, results, references[name])
    # code(rank): the stage modules of this rank only (rank 7 of (1, 2, 4): the last stage, tp 1)
    code = results[7]["gpt2 (1,2,4) 1f1b"]["code"]
    assert code.startswith("# Xirang program of rank 7: mesh dp=1 x pp=4 x tp=2"), code[:300]
    assert "# stage 3" in code and "# stage 2" not in code and "tp_group" in code, code[:2000]
    # tp shards the parameters: one tp rank of each stage (ranks 0 and 2 of (2, 2, 2): pp 0 and 1,
    # tp 0) holds less than the whole model between them
    full = sum(p.numel() * 4 for p in build("llama").parameters())
    assert sum(results[r]["llama (2,2,2) 1f1b"]["local_bytes"] for r in (0, 2)) < full


def test_rank_program_splits_at_local_shapes_deterministically():
    """Single process: each tp rank's program splits into the plan's stages; what crosses a cut is
    the replicated hidden state at full shape, and the stage code is byte-identical when rebuilt."""
    plan = make_plan("llama", 1, 2, 4, "1f1b")
    gm = xirang.analyze(build("llama"), example_kwargs=batch(0, 2)).graph_module
    for tp_rank in range(2):
        first = rank_pipeline_program(gm, plan, rank=tp_rank)
        again = rank_pipeline_program(gm, plan, rank=tp_rank)
        assert [s.module.code for s in first.stages] == [s.module.code for s in again.stages]
        assert len(first.stages) == 4 and first.stages[-1].returns_loss
        for stage in first.stages[1:]:
            assert any(c.shape == (1, SEQ, 64) and c.requires_grad for c in stage.crossing_in), stage.crossing_in
        # the sharded parameters are bound as shards: the plan's placements travel with the program
        assert any(isinstance(shard.placement, Shard) for shard in first.shards.values())
        assert "tp_group" in first.stages[1].module.code  # the block's collectives are in its stage
