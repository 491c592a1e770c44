"""Mixture-of-Experts families (examples/hf_moe.py) planned on ``meta`` and trained with expert
parallelism on CPU ranks, equal to one device.

Plans are made on meta at seq 4096 on A100s, then run at seq 16. The one-device reference averages
the loss over micro-batches of one sample (``single_device_run(micro_batch=1)``): each family's
auxiliary load-balancing loss is computed over the tokens of one forward, so the parallel run, whose
forwards are its micro-batches, is compared with the same micro-batches on one device. Equal means
the loss every step, every gathered gradient and the parameters after 3 AdamW steps within 1e-5.

What is checked beside equality: each rank holds ``experts / ep`` of every expert weight, and the
program exchanges rows by all-to-all, as many bytes per experts call as it has rows (every row leaves
its rank's send buffer once forward and its gradient once backward, whatever the routing).
"""
from __future__ import annotations

from functools import partial

import pytest

import xirang
from examples.hf_moe import FAMILIES, HIDDEN, TOP_K
from tests.codegen.save_resume import save_then_resume
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.placement import PlanShard
from xirang.passes.analysis.fingerprint import graph_fingerprint

GLOBAL_BATCH, SEQ, PLAN_SEQ, STEPS, TOLERANCE = 8, 16, 4096, 3, 1e-5


def build(name: str, device="cpu", batch=GLOBAL_BATCH, step=0, experts=None):
    return FAMILIES[name][0](batch, SEQ, device, step, experts=experts)


def batch(name: str):
    return lambda step: build(name, step=step)[1]


def make_plan(name: str, *, dp: int, tp: int = 1, pp: int = 1, ep: int = 1, precision: str = "fp32",
              hardware: str = "a100-80g"):
    model, inputs = build(name, "meta", batch=2)
    plan = xirang.plan(model, world=dp * tp * pp, example_kwargs=inputs, global_batch=GLOBAL_BATCH, seq=PLAN_SEQ,
                       hardware=hardware, precision=precision, dp=dp, tp=tp, pp=pp, ep=ep, micro_batch=1,
                       schedule="1f1b", zero_stage=0)
    assert plan.mesh.ep == ep, (name, plan.mesh)
    return plan


def fingerprint(name: str, device: str, experts=None) -> str:
    model, inputs = build(name, device, batch=2, experts=experts)
    return graph_fingerprint(xirang.analyze(model, example_kwargs=inputs).graph_module)


def test_experts_trace_to_one_graph_on_meta_and_cpu_whatever_the_implementation():
    """Before the capture, Mixtral on meta traced to another graph than on the CPU (its experts pick
    kernels and dtypes by device), so a plan made on meta was refused as another model."""
    on_meta = fingerprint("mixtral", "meta")
    assert fingerprint("mixtral", "cpu") == on_meta
    assert fingerprint("mixtral", "cpu", experts="batched_mm") == on_meta


def _rank_main(rank, world, jobs):
    results = {}
    for name, plan in jobs:
        model, inputs = build(name, batch=2)
        counter = CommCounter()
        compiled = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan,
                                  debug=xirang.DebugHooks(counter=counter))
        shapes = {fqn: tuple(t.shape) for fqn, t in compiled.named_parameters() if ".experts." in fqn}
        run = compiled_run(compiled, batch(name), STEPS)
        exchanged = [r for r in counter.records if r.label.startswith("expert dispatch")
                     or r.label.startswith("expert combine")]
        results[name] = {**run, "expert_shapes": shapes, "exchanged": [(r.label, r.nbytes) for r in exchanged]}
    return results


def check_family(name: str, plan, results: list) -> dict:
    want = single_device_run(build(name)[0], batch(name), STEPS, keep_duplicates=True, micro_batch=1)
    worst = worst_differences(name, results, want)
    ep, tp = plan.mesh.ep, plan.mesh.tp
    full = {fqn: tuple(p.shape) for fqn, p in build(name, "meta")[0].named_parameters() if ".experts." in fqn}
    placement = {fqn: plan.placements["p_" + fqn.replace(".", "_")].outputs[0].tp for fqn in full}
    for result in results:
        for fqn, shape in result[name]["expert_shapes"].items():
            want = list(full[fqn])
            want[0] //= ep  # this ep rank's experts
            if isinstance(placement[fqn], PlanShard):  # expert tensor parallelism: the tp split of each expert
                want[placement[fqn].dim] //= tp
            assert shape == tuple(want), (name, fqn, shape, full[fqn], placement[fqn])
    if ep > 1:
        # a rank sends all its rows to their experts (dispatch forward) and takes all their gradients back
        # (combine backward): one micro-batch of one sample is seq tokens, each to top_k experts
        own_rows = SEQ * TOP_K * HIDDEN * 4
        exchanges = [c for c in plan.collectives if c.axis == "ep" and c.kind == "all_to_all"]
        planned = {c.nbytes * SEQ // PLAN_SEQ for c in exchanges if c.node.endswith(".dispatch")}
        back = {c.nbytes * SEQ // PLAN_SEQ for c in exchanges if c.node.endswith(".combine")}
        # the rows as a rank holds them: whole, or their hidden dim split over tp where the first matmul is row-parallel
        assert len(planned) == 1 and planned <= {own_rows, own_rows // tp}, (name, planned)
        assert len(back) == 1 and back <= {own_rows, own_rows // tp}, (name, back)
        sent = {"expert dispatch.forward": 0, "expert combine.forward": 0}
        exchanging = 0
        for result in results:
            sizes = {}
            for label, nbytes in result[name]["exchanged"]:
                sizes.setdefault(label, set()).add(nbytes)
                sent[label] = sent.get(label, 0) + nbytes
            if sizes:  # a pipeline rank whose stages hold no experts (DeepSeek's dense first layer) sends none
                exchanging += 1
                assert sizes["expert dispatch.forward"] == planned and sizes["expert combine.backward"] == back, \
                    (name, sizes, planned, back)
        assert exchanging >= len(results) // plan.mesh.pp, (name, exchanging)
        # what the experts' ranks received they send back: over all ranks, as many rows go back as came
        (row_out,) = {size // (SEQ * TOP_K) for size in planned}
        (row_back,) = {size // (SEQ * TOP_K) for size in back}
        assert sent["expert combine.forward"] // row_back == sent["expert dispatch.forward"] // row_out, (name, sent)
    return worst


@pytest.mark.parametrize("name", ["mixtral"])
def test_expert_parallel_trains_as_on_one_device(name):
    plan = make_plan(name, dp=2, ep=2)
    results = launch(_rank_main, 2, ([(name, plan)],), timeout_s=600, heartbeat_s=120)
    worst = check_family(name, plan, results)
    assert all(value <= TOLERANCE for value in worst.values()), worst


MESHES = {"dp4 ep4 tp2": dict(dp=4, tp=2, ep=4), "dp2 pp2 tp2 ep2": dict(dp=2, pp=2, tp=2, ep=2),
          "dp4 pp2 ep2": dict(dp=4, pp=2, ep=2)}


@pytest.mark.matrix
@pytest.mark.parametrize("mesh", [mesh for mesh in MESHES if mesh != "dp4 ep4 tp2"])  # that one: the test below
def test_every_moe_family_trains_as_on_one_device_with_experts_parallel(mesh):
    # planned for an a100, where the split ILP keeps these tiny experts (ffn 32) whole since their matmuls are
    # priced as matmuls (the experts' own tp split, at dp4 ep4 tp2, is the test below: that mesh runs there only)
    jobs = [(name, make_plan(name, **MESHES[mesh])) for name in FAMILIES]
    results = launch(_rank_main, 8, (jobs,), timeout_s=1200, heartbeat_s=120)
    failed = {}
    for name, plan in jobs:
        worst = check_family(name, plan, results)
        print(f"\n{name} at {mesh}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} "
              f"param {worst['param']:.1e}")
        if not all(value <= TOLERANCE for value in worst.values()):
            failed[name] = worst
    assert not failed, failed


@pytest.mark.matrix
def test_expert_tensor_parallelism_as_the_cpu_pricing_lays_it_out():
    """Every family's experts split over tp (asserted), at dp4 ep4 tp2, planned for the CPU ranks it runs on.
    Before the routed rows' dim was refused a tp shard (sharding_rules), Qwen3-MoE's row-parallel first matmul
    had its partial sums reduce-scattered over the rows a rank was routed, which tp need not divide: rows were
    lost and the combine's all-to-all failed on every rank."""
    jobs = [(name, make_plan(name, hardware="cpu", **MESHES["dp4 ep4 tp2"])) for name in FAMILIES]
    for name, plan in jobs:
        assert any(isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items()
                   if n.startswith("p_") and "_experts_" in n and "shared" not in n), name
    results = launch(_rank_main, 8, (jobs,), timeout_s=1200, heartbeat_s=120)
    for name, plan in jobs:
        worst = check_family(name, plan, results)
        print(f"\n{name} at dp4 ep4 tp2 (cpu-priced): max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} "
              f"param {worst['param']:.1e}")
        assert all(value <= TOLERANCE for value in worst.values()), (name, worst)


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_moe_family_plan_on_meta_fits_its_cpu_trace(name):
    assert fingerprint(name, "cpu") == fingerprint(name, "meta")
    assert fingerprint(name, "cpu", experts="grouped_mm") == fingerprint(name, "meta")


def _save_then_resume(rank, world, save_plan, load_plan, directory):
    """``save_then_resume`` on Mixtral: the second plan at another ep."""
    return save_then_resume(world, partial(build, "mixtral", batch=2), batch("mixtral"), save_plan, load_plan,
                            directory)


@pytest.mark.matrix  # a launch of its own (~20 s on 2 cores): the default tier's budget keeps one MoE launch
def test_a_checkpoint_saved_at_one_ep_resumes_at_another(tmp_path):
    saved, loaded = make_plan("mixtral", dp=2, ep=2), make_plan("mixtral", dp=2)
    results = launch(_save_then_resume, 2, (saved, loaded, str(tmp_path)), timeout_s=600, heartbeat_s=120)
    for loaded_at, want, got in results:
        assert loaded_at == 1
        assert set(want) == set(got)
        worst = max((want[k] - got[k]).abs().max().item() for k in want)
        assert worst <= TOLERANCE, worst


def _one_rank_router(batch=GLOBAL_BATCH, step=0, device="cpu"):
    """DeepSeek-V3 whose routers send every token to experts 0 and 1 (a correction bias of 10 on them, which
    only the choice reads): under ep=2 both live on ep rank 0, and ep rank 1 receives no row."""
    model, inputs = build("deepseek_v3", device, batch=batch, step=step)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data[:2] = 10.0
    return model, inputs


def _skewed_rank(rank, world, plan):
    model, inputs = _one_rank_router(batch=2)
    counter = CommCounter()
    compiled = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan,
                              debug=xirang.DebugHooks(counter=counter))
    run = compiled_run(compiled, lambda step: _one_rank_router(step=step)[1], STEPS)
    received = [r.nbytes for r in counter.records if r.label == "expert combine.forward"]
    return {**run, "received": received}


@pytest.mark.matrix
def test_a_router_sending_every_token_to_one_rank_trains_as_on_one_device():
    plan = make_plan("deepseek_v3", dp=2, ep=2)
    results = launch(_skewed_rank, 2, (plan,), timeout_s=600, heartbeat_s=120)
    want = single_device_run(_one_rank_router()[0], lambda step: _one_rank_router(step=step)[1], STEPS,
                             keep_duplicates=True, micro_batch=1)
    worst = worst_differences("skewed", [{"skewed": r} for r in results], want)
    assert all(value <= TOLERANCE for value in worst.values()), worst
    # ep rank 0 holds experts 0-3 and gets every row of both ranks; ep rank 1 gets none and sends none back
    assert set(results[1]["received"]) == {0} and min(results[0]["received"]) > 0


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.matrix)])
def test_a_bf16_moe_program_keeps_its_hidden_states_bf16(name):
    """The experts' weighted sum is cast back to the hidden states' dtype (the fp32 trace recorded that cast
    as one to float32, and the router's weights are fp32): before, every MoE layer after the first sent and
    computed fp32 rows in a bf16 program, and on real tensors its expert matmul refused fp32 rows against
    bf16 weights. The dry run runs the real op's dtype check on fake tensors; every dispatch sends the bf16
    rows the plan lists (2 bytes an element)."""
    model, inputs = build(name, "meta", batch=2)
    plan = make_plan(name, dp=2, ep=2, pp=2, precision="bf16")
    report = xirang.check(plan, model, example_kwargs=inputs, device="cpu", workers=1)
    assert report.ok, report.violations
    planned = {c.nbytes for c in plan.collectives if c.axis == "ep" and c.node.endswith(".dispatch")}
    sent = {r.nbytes for klass in report.classes for r in klass.log.counter_records
            if r.label == "expert dispatch.forward"}
    # the plan prices seq PLAN_SEQ; the check runs the example's SEQ tokens a sample
    assert len(planned) == 1 and {size * (PLAN_SEQ // SEQ) for size in sent} == planned, (planned, sent)
