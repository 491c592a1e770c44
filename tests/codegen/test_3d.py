"""Full 3D composition (dp x tp x pp) equals the single-device model, on 8 CPU gloo ranks.

Each rank's program, lowered by the lowering passes (tp rewrite, then the stage split), is run by
the pipeline executor with dp buckets per stage and tied-weight sums across the first and last
stage. One launch of 8 ranks runs every configuration; each rank returns its numbers and the
parent compares them with a single-device run: the loss of every step, the gathered gradients,
and the parameters after STEPS AdamW steps, within TOLERANCE (fp32).

As in tests/codegen/test_equivalence.py, plans are made at seq 4096 on A100s so the ILP really
shards the tiny models (asserted), then run at seq 16, and AdamW uses eps=1e-3 (gradients that are
zero in exact arithmetic are rounding noise that Adam's first step would amplify to lr * sign).
Plans here are made on the CPU model (test_equivalence.py plans on meta: the traces agree).

Three configurations go through ``xirang.compile`` in the ranks (each rank traces: the slow part);
the others build the same pieces (``lower`` then ``CompiledModel``, from the model or from its state
dict alone) on one trace per model and rank. Interleaved 1F1B runs with v = 2 on
the two-layer models: pp 2 x v 2 virtual stages take the four units (embedding, two blocks, head).

Half precision: bf16 plans of the in-repo GPT and Llama at (2, 2, 2) and GPT-2 at (1, 2, 4) run
close to the fp32 model, as tests/codegen/test_precision.py checks them on one rank: the loss
within 2%, every gradient at cosine > 0.99 (the HF models cast to fp32 on their own: see
passes/lowering/precision.py).

One job also checks the API the launch is the only place to exercise: ``load_full_state_dict``
(each rank loads its stages' shards, tied copies both; the errors name the FQN and the shapes)
and ``train_step(pre_sharded=True)``, which equals the step on the global batch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.conftest import hf_gpt2, hf_llama
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.passes.lowering.compute_dtypes import compute_dtypes
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from xirang.codegen.runtime.launch.launcher import launch
from xirang.lower import lower
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard

WORLD, GLOBAL_BATCH, SEQ, VOCAB_USED, STEPS, TOLERANCE = 8, 8, 16, 500, 3, 1e-5
HALF_LOSS, HALF_COSINE = 0.02, 0.99  # bf16 against fp32: relative loss, gradient direction


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return build_gpt("tiny", device="cpu")
    if name == "gpt2":
        return hf_gpt2(device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf_llama(device="cpu")


def batch(step: int, size: int = GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def make_plan(name: str, dp: int, tp: int, pp: int, schedule: str, *, v: int = 1, precision: str = "fp32",
              order=None):
    # bf16 halves the bytes of every tensor: at seq 4096 the ILP then shards attention by heads but no
    # weight; at 16384 it shards the qkv projections too
    seq = 4096 if precision == "fp32" else 16384
    plan = xirang.plan(build(name), world=WORLD, example_kwargs=batch(0, 2), global_batch=GLOBAL_BATCH, seq=seq,
                       hardware="a100-80g", precision=precision, dp=dp, tp=tp, pp=pp, schedule=schedule,
                       virtual_stages=v, micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp) and len(plan.stages) == pp * v
    sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard)]
    assert sharded, f"{name}: the plan shards no parameter, so tp would be vacuous"
    if order is not None:  # on one node both orders price alike and the planner keeps pp outermost
        plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, order=order))
    return plan


def reference(name: str) -> dict:
    return single_device_run(build(name), batch, STEPS, keep_duplicates=True)


# --- what each rank runs ---------------------------------------------------------------------------

def _train(compiled) -> dict:
    return {**compiled_run(compiled, batch, STEPS), "local_bytes": compiled.local_param_bytes()}


UNTIED = {"gpt2": "transformer.wpe.weight"}  # read by the first stage only: a key other stages ignore


def _api_checks(compiled, name: str, dp_rank: int, dp: int) -> dict:
    """load_full_state_dict and pre_sharded on a fresh model; leaves its parameters as they were."""
    found = {}
    state = compiled.full_state_dict()
    before = {fqn: p.detach().clone() for fqn, p in compiled.named_parameters()}
    compiled.load_full_state_dict({fqn: value + 1 for fqn, value in state.items()})
    # every local tensor, tied copies on both pp ranks included, took its piece (the dims divide by tp)
    found["load"] = max((p - (before[fqn] + 1)).abs().max().item() for fqn, p in compiled.named_parameters())
    found["gathered"] = max((value - (state[fqn] + 1)).abs().max().item()
                            for fqn, value in compiled.full_state_dict().items())
    compiled.load_full_state_dict(state)
    found["restored"] = max((p - before[fqn]).abs().max().item() for fqn, p in compiled.named_parameters())
    fqn = UNTIED[name]
    found["fqn"], found["shape"], found["errors"] = fqn, tuple(state[fqn].shape), []
    for broken in ({k: v for k, v in state.items() if k != fqn}, {**state, fqn: state[fqn][:1]}):
        try:
            compiled.load_full_state_dict(broken)
        except XirangError as error:
            found["errors"].append(str(error))
    whole = compiled.train_step(**batch(0)).item(), compiled.full_gradients()
    share = {key: value.chunk(dp)[dp_rank] for key, value in batch(0).items()}
    for param in compiled.parameters():  # gradients accumulate over train_steps, as with backward()
        param.grad = None
    mine = compiled.train_step(pre_sharded=True, **share).item(), compiled.full_gradients()
    found["pre_sharded"] = max([abs(whole[0] - mine[0])] + [(whole[1][k] - g).abs().max().item()
                                                             for k, g in mine[1].items()])
    try:  # the global batch where a share is due: refused before any communication
        compiled.train_step(pre_sharded=True, **batch(0))
    except XirangError as error:
        found["errors"].append(str(error))
    for param in compiled.parameters():  # the training after starts from no gradients, as a fresh model
        param.grad = None
    return found


def _rank_main(rank, world, jobs):
    results, traced = {}, {}  # traced: this rank's analysed graph per model, for the direct jobs
    for label, name, plan, how, api_checks in jobs:
        if how == "compile":  # the public API: trace, emit, split, run
            compiled = xirang.compile(build(name), world=world, example_kwargs=batch(0, 2), plan=plan,
                                      hardware="a100-80g")
        else:
            # The pieces under it, on a graph traced once per model (a split tp program cannot be sent
            # from the parent: unpickling a GraphModule re-traces its code, and the collectives branch
            # on their tensors' shapes).
            if name not in traced:
                traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
            groups = build_mesh_groups(plan.mesh)
            program = lower(traced[name], plan, rank=rank).program  # what compile does, on the shared trace
            if how == "model":
                compiled = CompiledModel(build(name), plan, program, groups=groups)
            else:  # from the model's tensors alone (non-persistent buffers too): no model class, no trace
                model = build(name)
                state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
                compiled = CompiledModel(state, plan, program, groups=groups)
        checks = _api_checks(compiled, name, plan.mesh.coords(rank)["dp"], plan.mesh.dp) if api_checks else None
        results[label] = _train(compiled)
        results[label]["checks"] = checks
        if how != "pieces":
            results[label]["code"] = compiled.code()
            results[label]["dtypes"] = {str(p.dtype) for p in compiled.parameters()}
    return results


def job(label: str, name: str, dp: int, tp: int, pp: int, schedule: str, *, how: str, v: int = 1,
        precision: str = "fp32", api_checks: bool = False, order=None) -> tuple:
    """``how``: "compile" (xirang.compile), "model" (CompiledModel of a lowered program), "pieces"
    (the same from the model's state dict alone); ``order``: the mesh's rank order, if not the planner's."""
    return label, name, make_plan(name, dp, tp, pp, schedule, v=v, precision=precision, order=order), how, api_checks


def _compare(label: str, results: list, want: dict) -> dict:
    worst = worst_differences(label, results, want)
    print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
    return worst


def _compare_half(label: str, results: list, want: dict) -> None:
    """A half-precision run against the fp32 model: close, not equal (see the module docstring)."""
    worst_loss, worst_cosine = 0.0, 1.0
    for rank, result in enumerate(results):
        got = result[label]
        assert got["dtypes"] == {"torch.float32"} and "torch.bfloat16" in got["code"], (label, rank)
        for (loss, grads), (want_loss, want_grads) in zip(got["steps"], want["steps"]):
            worst_loss = max(worst_loss, abs(loss - want_loss) / abs(want_loss))
            assert set(grads) == set(want_grads), (label, rank, sorted(set(grads) ^ set(want_grads)))
            for fqn, grad in want_grads.items():
                assert grads[fqn].dtype == torch.float32 and grads[fqn].shape == grad.shape, (label, fqn)
                if grad.abs().max() > 0:
                    cosine = torch.nn.functional.cosine_similarity(grads[fqn].flatten(), grad.flatten(), dim=0)
                    worst_cosine = min(worst_cosine, cosine.item())
    print(f"{label}: max relative loss diff {worst_loss:.1e}, min gradient cosine {worst_cosine:.6f}")
    assert worst_loss <= HALF_LOSS and worst_cosine > HALF_COSINE, (label, worst_loss, worst_cosine)


def _check_api(label: str, plan, results: list) -> None:
    for rank, result in enumerate(results):
        checks = result[label]["checks"]
        assert checks["load"] == checks["gathered"] == checks["restored"] == 0.0, (label, rank, checks)
        assert checks["pre_sharded"] == 0.0, (label, rank, checks)
        *errors, whole_batch = checks["errors"]
        share = GLOBAL_BATCH // plan.mesh.dp
        assert f"has {GLOBAL_BATCH} samples on its batch dim 0; with pre_sharded=True each dp rank passes its " \
               f"share of exactly {share}" in whole_batch, whole_batch
        fqn, shape = checks["fqn"], checks["shape"]
        missing, *rest = errors  # strict, as torch: every rank refuses a state dict missing a model key
        assert f"missing keys: '{fqn}'" in missing, missing
        if plan.mesh.coords(rank)["pp"] != 0:
            assert rest == [], (label, rank, rest)  # a shape of another stage's tensor: that stage checks it
            continue
        (wrong_shape,) = rest
        assert f"{fqn} has shape {(1,) + shape[1:]} in the state dict, the model's is {shape}" in wrong_shape, \
            wrong_shape
    print(f"{label}: load_full_state_dict and the pre_sharded step exact on every rank; errors name the key")


# The default tier runs one launch of the 3D grid's corners (both HF models, both meshes, the three schedules,
# the API checks); the matrix tier (-m matrix) the rest of the grid, bf16 included.
DEFAULT_JOBS = (("gpt2 (1,2,4) 1f1b", "gpt2", 1, 2, 4, "1f1b", {"how": "compile"}),
                ("llama (2,2,2) gpipe dp outermost", "llama", 2, 2, 2, "gpipe",
                 {"how": "pieces", "order": ("dp", "pp", "cp", "tp")}),
                ("gpt2 (2,2,2) interleaved v=2", "gpt2", 2, 2, 2, "interleaved", {"v": 2, "how": "model",
                                                                                    "api_checks": True}))
MATRIX_JOBS = (("gpt (2,2,2) 1f1b bf16", "gpt", 2, 2, 2, "1f1b", {"precision": "bf16", "how": "compile"}),
               ("llama (2,2,2) 1f1b", "llama", 2, 2, 2, "1f1b", {"how": "compile"}),
               ("gpt2 (2,2,2) gpipe", "gpt2", 2, 2, 2, "gpipe", {"how": "pieces"}),
               ("llama (1,2,4) gpipe", "llama", 1, 2, 4, "gpipe", {"how": "pieces"}),
               ("gpt2 (2,2,2) 1f1b", "gpt2", 2, 2, 2, "1f1b", {"how": "pieces"}),
               ("llama (1,2,4) 1f1b", "llama", 1, 2, 4, "1f1b", {"how": "pieces"}),
               ("gpt2 (1,2,4) gpipe", "gpt2", 1, 2, 4, "gpipe", {"how": "pieces"}),
               ("llama (2,2,2) interleaved v=2", "llama", 2, 2, 2, "interleaved", {"v": 2, "how": "pieces"}),
               ("llama (2,2,2) 1f1b bf16", "llama", 2, 2, 2, "1f1b", {"precision": "bf16", "how": "model"}),
               ("gpt2 (1,2,4) gpipe bf16", "gpt2", 1, 2, 4, "gpipe", {"precision": "bf16", "how": "model"}))


@pytest.mark.parametrize("tier", [
    "default", pytest.param("matrix", marks=pytest.mark.matrix)])
def test_3d_training_equals_single_device(tier):
    jobs = [job(label, name, dp, tp, pp, schedule, **options)
            for label, name, dp, tp, pp, schedule, options in (DEFAULT_JOBS if tier == "default" else MATRIX_JOBS)]
    results = launch(_rank_main, WORLD, (jobs,), timeout_s=600)
    references = {name: reference(name) for name in ("gpt", "gpt2", "llama")}
    for label, name, plan, _, api_checks in jobs:
        if plan.precision == "fp32":
            _compare(label, results, references[name])
        else:
            _compare_half(label, results, references[name])
        if api_checks:
            _check_api(label, plan, results)
    if tier != "default":
        return
    # code(rank): the stage modules of this rank only (rank 7 of (1, 2, 4): the last stage, tp 1)
    code = results[7]["gpt2 (1,2,4) 1f1b"]["code"]
    assert code.startswith("# Xirang program of rank 7: mesh dp=1 x pp=4 x tp=2"), code[:300]
    assert "# stage 3" in code and "# stage 2" not in code and "tp_group" in code, code[:2000]
    # tp shards the parameters: one tp rank of each stage (ranks 0 and 2 of (2, 2, 2) laid out dp outermost:
    # pp 0 and 1, tp 0) holds less than the whole model between them
    full = sum(p.numel() * 4 for p in build("llama").parameters())
    assert sum(results[r]["llama (2,2,2) gpipe dp outermost"]["local_bytes"] for r in (0, 2)) < full


def test_rank_program_splits_at_local_shapes_deterministically():
    """Single process: each tp rank's program splits into the plan's stages; what crosses a cut is
    the replicated hidden state at full shape, and the stage code is byte-identical when rebuilt."""
    plan = make_plan("llama", 1, 2, 4, "1f1b")
    gm = xirang.analyze(build("llama"), example_kwargs=batch(0, 2)).graph_module
    for tp_rank in range(2):
        first = lower(gm, plan, rank=tp_rank).program
        again = lower(gm, plan, rank=tp_rank).program
        assert [s.module.code for s in first.stages] == [s.module.code for s in again.stages]
        assert len(first.stages) == 4 and first.stages[-1].returns_loss
        for stage in first.stages[1:]:
            assert any(c.shape == (1, SEQ, 64) and c.requires_grad for c in stage.crossing_in), stage.crossing_in
        # the sharded parameters are bound as shards: the plan's placements travel with the program
        assert any(isinstance(shard.placement, PlanShard) for shard in first.shards.values())
        assert "tp_group" in first.stages[1].module.code  # the block's collectives are in its stage


def test_half_precision_cuts_carry_run_time_dtypes():
    """Single process: a bf16 program's cuts carry each tensor in the dtype it has at run time, not
    the fp32 of the trace: the in-repo GPT's hidden state in bf16 (at tp 2: emitted, then split),
    while Llama's rotary cos/sin, computed from an fp32 buffer, stay fp32 (compute_dtypes)."""
    plan = make_plan("gpt", 2, 2, 2, "1f1b", precision="bf16")
    program = lower(xirang.analyze(build("gpt"), example_kwargs=batch(0, 2)).graph_module, plan, rank=0).program
    # only the hidden state crosses, in bf16: the tied embedding's bf16 cast is made on both stages
    # from each stage's copy of the fp32 weight, not sent from the first to the last
    crossing = program.stages[1].crossing_in
    assert [(c.shape, c.dtype) for c in crossing] == [((1, SEQ, 64), torch.bfloat16)], crossing
    assert "tok_emb.weight" in program.stages[0].parameter_names and "tok_emb.weight" in \
        program.stages[1].parameter_names
    gm = xirang.analyze(build("llama"), example_kwargs=batch(0, 2)).graph_module
    dtypes = compute_dtypes(gm, torch.bfloat16)
    of = {target: {dtypes[n.name] for n in gm.graph.nodes if n.target is target}
          for target in (torch.ops.aten.embedding.default, torch.ops.aten.cos.default)}
    assert of == {torch.ops.aten.embedding.default: {torch.bfloat16}, torch.ops.aten.cos.default: {torch.float32}}
