"""Pipeline parallelism (tp = 1): the split pass, the executor and the runtime against one device.

Single-process tests: running the split stages in sequence equals the whole graph (loss and every
gradient, tied weights included), and the executor on one pipeline rank holding all stages
(interleaved with p = 1; and with backwards split into input and weight parts) equals the
whole-graph mean over micro-batches.

Launched tests (CPU gloo ranks): each launch runs several models and schedules, and every rank
returns its numbers to the parent, which compares them with a single-device run: the loss of every
step, the gathered gradients, and the parameters after STEPS AdamW steps, within TOLERANCE (fp32).
HF GPT-2 ties its LM head to the token embedding, on the first and last stage: the tied gradient
sum between those ranks is what keeps it right. Spawning costs seconds, so there are two launches:
4 ranks ((dp, pp) = (1, 4): 1F1B and GPipe on GPT-2 and the in-repo GPT, interleaved v=2 on GPT-2
and Llama) and 8 ranks ((1, 8) and (2, 4), each with 1F1B and GPipe, on GPT-2 and Llama). Eight
stages, or four ranks of two virtual stages, need eight units: those runs use six-layer models
(embedding, six blocks, head). tests/codegen/test_3d.py covers the tp > 1 meshes.

AdamW uses eps=1e-3 for the reason given in tests/codegen/test_equivalence.py (gradients that are
zero in exact arithmetic are rounding noise, and Adam's first step would amplify it to lr * sign).
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.conftest import hf_gpt2, hf_llama
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.executor.pipeline_executor import LocalStage, PipelineExecutor
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.executor.schedule_sim import idle_fractions
from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, build_schedule
from xirang.lower import lower
from xirang.passes.lowering.split_stages import build_stage_modules, tied_parameters
from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import PARAM_NAME, ROLE

SEQ, VOCAB_USED, STEPS, TOLERANCE = 16, 500, 3, 1e-5


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return build_gpt("tiny", device="cpu")
    layers = 6 if name.endswith("_6") else 2  # "gpt2_6", "llama_6": eight units, for eight stages
    if name.startswith("gpt2"):
        return hf_gpt2(layers, device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf_llama(layers, device="cpu")


def batch(step: int, size: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


@lru_cache(maxsize=None)  # tracing is the slow part of every test here: once per model
def analysed(name: str):
    return xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module


@lru_cache(maxsize=None)
def make_plan(name: str, *, dp: int, pp: int, schedule: str, global_batch: int, v: int = 1):
    return xirang.plan(build(name), world=dp * pp, example_kwargs=batch(0, 2), global_batch=global_batch,
                       hardware="cpu", dp=dp, pp=pp, tp=1, schedule=schedule, virtual_stages=v, micro_batch=1)


def stages_at(gm, plan, symbols: dict):
    """The plan's stage modules of ``gm`` (lowered for rank 0, tp = 1), built for ``symbols``."""
    return build_stage_modules(lower(gm, plan, rank=0).run.gm, len(plan.stages), symbols)


def _loss(output):
    return output if isinstance(output, torch.Tensor) else output.loss


def reference(name: str, global_batch: int) -> dict:
    """The single-device run: loss and gradients per step, parameters after the last step."""
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    steps = []
    for step in range(STEPS):
        loss = _loss(model(**batch(step, global_batch)))
        loss.backward()
        steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"steps": steps, "params": params}


def assert_matches(got: dict, want: dict, label: str) -> dict:
    """Asserts every loss, gradient and final parameter within TOLERANCE; returns the worst of each."""
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got["steps"], want["steps"])):
        assert abs(loss - want_loss) <= TOLERANCE, f"{label} step {step}: loss {loss} != {want_loss}"
        worst["loss"] = max(worst["loss"], abs(loss - want_loss))
        assert set(grads) == set(want_grads), f"{label}: only one side has gradients of {set(want_grads) ^ set(grads)}"
        for fqn, grad in want_grads.items():
            error = (grads[fqn] - grad).abs().max().item()
            assert error <= TOLERANCE, f"{label} step {step}: gradient of {fqn} off by {error}"
            worst["grad"] = max(worst["grad"], error)
    for fqn, param in want["params"].items():
        error = (got["params"][fqn] - param).abs().max().item()
        assert error <= TOLERANCE, f"{label}: parameter {fqn} off by {error} after {STEPS} steps"
        worst["param"] = max(worst["param"], error)
    return worst


# --- single process: the split pass and the executor on one rank -----------------------------------

def _whole_graph(name: str):
    model, gm = build(name), analysed(name)
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    bound = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and PARAM_NAME.get(node, None):
            fqn = PARAM_NAME.get(node)
            bound[fqn] = state[fqn].detach().clone().requires_grad_(ROLE.get(node) == "parameter")
    return gm, bound


def _grads(bound: dict) -> dict:
    found = {fqn: t.grad.clone() for fqn, t in bound.items() if t.grad is not None}
    for tensor in bound.values():
        tensor.grad = None
    return found


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_stages_in_sequence_equal_the_whole_graph(name):
    gm, bound = _whole_graph(name)
    inputs = batch(1, 2)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    whole = gm(*[bound[PARAM_NAME.get(n)] if PARAM_NAME.get(n, None) else inputs[n.name] for n in placeholders])[0]
    whole.backward()
    want = _grads(bound)

    plan = make_plan(name, dp=1, pp=4, schedule="1f1b", global_batch=4)
    stages = stages_at(gm, plan, {"batch": 2, "seq": SEQ})
    carried = ()
    for stage in stages:
        carried = stage([bound[fqn] for fqn in stage.parameter_names], carried,
                        [inputs[n] for n in stage.user_inputs])
    assert stages[-1].returns_loss and not stages[-1].crossing_out
    carried[0].backward()
    got = _grads(bound)
    assert abs(carried[0].item() - whole.item()) <= 1e-6
    assert set(got) == set(want)
    for fqn in want:
        assert torch.allclose(got[fqn], want[fqn], atol=1e-6), fqn
    # Sizes are static and the hidden state (batch, seq, 64) crosses every cut with a gradient.
    for stage in stages[1:]:
        assert any(c.shape == (2, SEQ, 64) and c.requires_grad for c in stage.crossing_in)
    expected_tied = {"transformer.wte.weight": (0, 3)} if name == "gpt2" else {}
    assert tied_parameters(stages) == expected_tied


def test_executor_on_one_rank_equals_the_mean_over_micro_batches():
    """All four stages on one rank (interleaved, p = 1), then with every backward split into its
    input and weight parts, the weights deferred to the end (as a zero-bubble schedule may)."""
    gm, bound = _whole_graph("gpt2")
    m, inputs = 2, batch(2, 4)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for mb in range(m):
        part = {k: v.chunk(m)[mb] for k, v in inputs.items()}
        loss = gm(*[bound[PARAM_NAME.get(n)] if PARAM_NAME.get(n, None) else part[n.name] for n in placeholders])[0]
        (loss / m).backward()
    want = _grads(bound)

    plan = make_plan("gpt2", dp=1, pp=4, schedule="1f1b", global_batch=4)
    programs = stages_at(gm, plan, {"batch": 2, "seq": SEQ})
    stages = {p.index: LocalStage(p, [bound[fqn] for fqn in p.parameter_names]) for p in programs}
    fused = build_schedule("interleaved", 1, m, 4)
    deferred = [BackwardInput(a.stage, a.micro_batch) if isinstance(a, Backward) else a for a in fused.ranks[0]]
    deferred += [BackwardWeight(a.stage, a.micro_batch) for a in fused.ranks[0] if isinstance(a, Backward)]
    micro_batches = [{k: v.chunk(m)[mb] for k, v in inputs.items()} for mb in range(m)]
    for schedule in (fused, fused.with_rank(0, deferred)):
        executor = PipelineExecutor(schedule, 0, stages, peers=(0,), tensors_per_cut=4)
        record = executor.run(micro_batches)
        got = _grads(bound)
        assert len(record.losses) == m and len(record.timestamps) == len(schedule.ranks[0])
        for fqn in want:
            assert torch.allclose(got[fqn], want[fqn], atol=1e-6), (schedule.name, fqn)


# --- launched ranks -----------------------------------------------------------------------------------

def _train(runtime, global_batch: int) -> dict:
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-3, eps=1e-3)
    steps, in_flight = [], {}
    for step in range(STEPS):
        loss = runtime.train_step(**batch(step, global_batch))
        steps.append((loss.item(), runtime.full_gradients()))
        in_flight = dict(runtime.last_step.most_in_flight)
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": steps, "params": runtime.full_state_dict(), "in_flight": in_flight}


def _rank_main(rank, world, configs):
    results = {}
    for label, _name, plan, program, state, global_batch in configs:
        # Split in the parent and sent with the model's tensors: no rank imports transformers or traces.
        runtime = CompiledModel(state, plan, program)
        results[label] = _train(runtime, global_batch)
        results[label]["receive buffer sets"] = max(runtime.executor.buffers.allocated.values(), default=0)
        if label == "gpt2 1f1b":
            # Every pp rank's compute timestamps of the last step reach every rank, in one clock.
            report = idle_fractions(runtime.gather_timestamps(), pipeline_ranks=plan.mesh.pp)
            results["idle"] = (len(runtime.gather_timestamps()), report.per_rank)
            # A batch that does not split into the plan's micro-batches.
            try:
                runtime.train_step(**batch(0, global_batch + 2))
                results["bad batch"] = "no error"
            except XirangError as error:
                results["bad batch"] = str(error)
    return results


def _check_launch(results: list, configs: list) -> None:
    references = {}
    for label, name, plan, _, _, global_batch in configs:
        key = (name, global_batch)
        if key not in references:
            references[key] = reference(name, global_batch)
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for rank, result in enumerate(results):
            where = f"{label} (dp={plan.mesh.dp}, pp={plan.mesh.pp}) rank {rank}"
            for kind, value in assert_matches(result[label], references[key], where).items():
                worst[kind] = max(worst[kind], value)
            # Receives are posted one compute ahead of their consumer: two buffer sets suffice.
            assert result[label]["receive buffer sets"] == 2, (label, rank)
        print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
        if plan.schedule == "1f1b":  # 1F1B: stage s holds at most p - s micro-batches
            pp = plan.mesh.pp
            for result in results:
                for stage, held in result[label]["in_flight"].items():
                    assert held <= pp - stage, f"{label}: stage {stage} held {held} micro-batches (> {pp - stage})"
                assert max(result[label]["in_flight"].values()) >= 1


def config(label: str, name: str, **plan_choices) -> tuple:
    plan = make_plan(name, global_batch=8, **plan_choices)
    model = build(name)
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    state = {fqn: tensor.detach() for fqn, tensor in state.items()}
    return label, name, plan, lower(analysed(name), plan, rank=0).program, state, 8


@pytest.mark.matrix  # 25 s: pipelines are also checked in the default tier by tests/codegen/test_3d.py
def test_pipeline_4_ranks_matches_single_device():
    configs = [config("gpt2 1f1b", "gpt2", dp=1, pp=4, schedule="1f1b"),
               config("gpt2 gpipe", "gpt2", dp=1, pp=4, schedule="gpipe"),
               config("gpt 1f1b", "gpt", dp=1, pp=4, schedule="1f1b"),
               config("gpt2 interleaved v2", "gpt2_6", dp=1, pp=4, schedule="interleaved", v=2),
               config("llama interleaved v2", "llama_6", dp=1, pp=4, schedule="interleaved", v=2)]
    results = launch(_rank_main, 4, (configs,), timeout_s=600)
    _check_launch(results, configs)
    # GPipe keeps all m micro-batches of stage 0 in flight; 1F1B at most p.
    assert results[0]["gpt2 gpipe"]["in_flight"][0] == 8 and results[0]["gpt2 1f1b"]["in_flight"][0] == 4
    records, idle = results[0]["idle"]
    assert records == 2 * 8 * 4 and len(idle) == 4 and all(0 <= x < 1 for x in idle)
    error = results[0]["bad batch"]
    assert "global batch of 10 samples" in error and "pass 8 samples per step" in error, error


@pytest.mark.matrix
def test_pipeline_8_ranks_dp_and_deep_pipeline_match_single_device():
    configs = [config(f"{model} ({dp},1,{pp}) {schedule}", model if pp == 4 else f"{model}_6",
                      dp=dp, pp=pp, schedule=schedule)
               for model in ("gpt2", "llama") for dp, pp in ((1, 8), (2, 4)) for schedule in ("1f1b", "gpipe")]
    results = launch(_rank_main, 8, (configs,), timeout_s=600)
    _check_launch(results, configs)
    # a plan stage per pipeline rank; the interleaved runs above hold two each
    assert {len(plan.stages) for _, _, plan, _, _, _ in configs} == {8, 4}
