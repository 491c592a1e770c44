"""Context parallelism (issue 36) trains Hugging Face decoders as one device does.

Plans are made on ``meta`` at seq 4096 with every rank a dp rank (the planner keeps cp = 1), then the mesh is
replaced by one with cp > 1 (``dp * cp`` ranks, the global batch that dp's share), and the method chosen
with ``with_context_method``. They run at seq 16 on CPU ranks (gloo): each rank holds 16 / cp tokens of each
sequence in the load-balanced layout, attention runs by ring or all-to-all over the cp group; a pipeline
(pp 2) sends the local tokens' tensors between stages, and tensor parallelism (tp 2) shards the heads each
ring or all-to-all attends (and the vocabulary of the loss, which is summed per rank before the cp mean).
Equal means the loss every step, every gathered gradient and the parameters after 3 AdamW steps within
1e-5 of the same model on one device. Llama has grouped-query attention (4 query heads, 2 kv heads),
Mistral a sliding window of 6 tokens (the window is read off the mask the model builds:
passes/lowering/context_parallel.py); GPT-2 (matrix) learned positions and a tied head; Qwen2 (matrix) biased
q, k and v projections. USP (matrix) runs cp 4 as an all-to-all over 2 ranks x a ring over 2. On 8 ranks
(matrix) cp runs beside two of dp, tp and pp at once, and USP beside tp and beside pp. A padded batch
(matrix; ``padded``) adds Hugging Face's ``attention_mask`` (left padding: a sample's first rows see no key),
the pads' labels ignored; its one-device reference is a token mean per micro-batch, as the runtime's.

The attention's bytes, by kind: the ring's sends (per attention call and micro-batch, forward, each rank sends
its key/value block cp - 1 times; backward, the block cp - 1 times and its dK/dV cp times) and the all-to-alls'
send buffers (q, k, v and the output each way; USP: both, the all-to-all over 2 ranks and the ring over 2 with
the all-to-all's heads) summed over every rank equal ``context_parallel_cost``'s formulas. A checkpoint saved
at cp 2 resumes at dp 2 and back (matrix): cp ranks hold replicas, as dp ranks.
"""
from __future__ import annotations

from functools import partial

from dataclasses import replace

import pytest
import torch

import xirang
from examples.hf_families import (FFN, HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, build_from_config, gpt2,
                                   token_batch)
from tests.codegen.save_resume import save_then_resume
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.passes.lowering.context_parallel import with_context_method
from xirang.passes.planning.context_parallel_cost import AttentionCall, layer_parts

GLOBAL_BATCH, SEQ, PLAN_SEQ, STEPS, TOLERANCE = 4, 16, 4096, 3, 1e-5
KV_HEADS, WINDOW = {"llama": 2, "mistral": 2, "qwen2": 2, "gpt2": HEADS}, 6


def build(name: str, device="cpu", batch=GLOBAL_BATCH, step=0):
    """The model ``name`` ("llama", ...; "llama:left" or "llama:right" with a padded batch, ``padded``) and a
    batch of ``batch`` token sequences."""
    name, _, side = name.partition(":")
    if side:
        model, inputs = build(name, device, batch, step)
        return model, padded(inputs, side)
    import transformers
    if name == "gpt2":  # learned positions (an arange over seq read by wpe), multi-head, tied head
        return gpt2(batch, SEQ, device, step)
    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                     "mistral": ("MistralConfig", "MistralForCausalLM"),
                     "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[name]
    window = {"sliding_window": WINDOW} if name == "mistral" else {}
    made = build_from_config(getattr(transformers, config), getattr(transformers, model), device,
                             num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS[name], intermediate_size=FFN, vocab_size=VOCAB,
                             max_position_embeddings=POSITIONS, use_cache=False, **window)
    return made, token_batch(batch, SEQ, device, step=step)


PADS = (3, 5, 0, 9)  # pad tokens of samples 0..3 (a whole 4-sample batch: different counts a micro-batch)


def padded(inputs: dict, side: str) -> dict:
    """``inputs`` with an ``attention_mask`` (Hugging Face's: 1 a token, 0 a pad) padding each sample by
    ``PADS`` on the ``side`` given ("left": the first tokens, whose rows then see no key at all under the
    causal mask; "right": the last), and the labels of pads ignored (-100). On meta the mask is a meta tensor
    of ones: the trace reads no values."""
    ids = inputs["input_ids"]
    if ids.device.type == "meta":
        return {**inputs, "attention_mask": torch.ones_like(ids)}
    rows, pads = torch.arange(ids.shape[1])[None, :], torch.tensor(PADS[:ids.shape[0]])[:, None]
    keep = (rows >= pads) if side == "left" else (rows < ids.shape[1] - pads)
    return {"input_ids": ids, "attention_mask": keep.long(), "labels": inputs["labels"].masked_fill(~keep, -100)}


def batch(name: str):
    return lambda step: build(name, step=step)[1]


def make_plan(name: str, *, dp: int, cp: int, method: str = "ring", pp: int = 1, tp: int = 1, precision="fp32",
              nodes: int = 1):
    """A plan made on meta for dp * cp data-parallel ranks, its mesh then (dp, cp): cp ranks share a dp
    rank's samples, so the global batch is dp's share. ``nodes`` > 1: the ranks are spread over that many
    nodes (the world ``nodes x ranks-per-node``), where the buckets' all-reduce may be hierarchical."""
    model, inputs = build(name, "meta", batch=2)
    ranks = dp * cp
    world = ranks * pp * tp if nodes == 1 else f"{nodes}x{ranks * pp * tp // nodes}"
    plan = xirang.plan(model, world=world, example_kwargs=inputs, global_batch=GLOBAL_BATCH * cp,
                       seq=PLAN_SEQ, hardware="a100-80g", precision=precision, dp=ranks, tp=tp, pp=pp, micro_batch=1,
                       schedule="1f1b", recompute="none", zero_stage=0, sequence_parallel=False)
    plan = replace(plan, mesh=Mesh(dp=dp, pp=pp, tp=tp, cp=cp), global_batch=GLOBAL_BATCH,
                   collectives=tuple(c for c in plan.collectives if dp > 1 or c.axis != "dp"),
                   buckets=plan.buckets if dp > 1 else ())
    return with_context_method(plan, method)


def _rank_main(rank, world, jobs):
    results = {}
    for label, name, plan in jobs:
        model, inputs = build(name, batch=2)
        counter = CommCounter()
        compiled = xirang.compile(model, world=plan.world, example_kwargs=inputs, plan=plan,  # its nodes too
                                  debug=xirang.DebugHooks(counter=counter))
        run = compiled_run(compiled, batch(name), STEPS)
        # the attention's transfers by kind: the ring's sends and the all-to-alls (nothing else runs either kind)
        moved = {kind: sum(r.nbytes for r in counter.records if r.kind == kind) for kind in ("send", "all_to_all")}
        results[label] = {**run, "attention_bytes": moved}
    return results


def attention_bytes_per_step(name: str, plan, method: str) -> dict:
    """Every rank's attention transfers in one step by kind ("send", "all_to_all") by the cost formulas
    (context_parallel_cost.py ``layer_parts``), per attention call and micro-batch of one (1, heads, SEQ, head
    dim) fp32 sequence split over cp, at the heads of one tp rank."""
    call = AttentionCall(unit="", q_heads=HEADS, kv_heads=KV_HEADS[name.partition(":")[0]], head_dim=HIDDEN // HEADS)
    parts = layer_parts(call, seq=SEQ, batch=1, tp=plan.mesh.tp, cp=plan.mesh.cp, method=method, dtype_bytes=4)
    layers_per_rank = LAYERS // plan.mesh.pp
    return {kind: int(plan.mesh.size * plan.num_micro_batches * layers_per_rank
                      * (parts[kind].forward + parts[kind].backward)) if kind in parts else 0
            for kind in ("send", "all_to_all")}


def check(label: str, name: str, plan, method: str, results: list) -> dict:
    # GPT-2 ties lm_head; a padded batch's loss is a token mean per micro-batch, as the runtime's (one device
    # accumulating gradients over micro-batches of the plan's size), each over its tokens on every cp rank
    want = single_device_run(build(name)[0], batch(name), STEPS, keep_duplicates=True,
                             micro_batch=plan.micro_batch if ":" in name else None)
    worst = worst_differences(label, results, want)
    worst["bytes"] = {kind: sum(result[label]["attention_bytes"][kind] for result in results)
                      for kind in ("send", "all_to_all")}
    worst["formula"] = {kind: STEPS * nbytes for kind, nbytes in attention_bytes_per_step(name, plan, method).items()}
    return worst


def test_context_parallel_trains_llama_as_on_one_device():
    """Default tier: one 2-rank launch, Llama (grouped-query) at cp = 2 by ring."""
    plan = make_plan("llama", dp=1, cp=2)
    results = launch(_rank_main, 2, ([("llama ring", "llama", plan)],), timeout_s=600, heartbeat_s=120)
    worst = check("llama ring", "llama", plan, "ring", results)
    assert worst["bytes"] == worst["formula"], worst
    assert all(worst[key] <= TOLERANCE for key in ("loss", "grad", "param")), worst


GRID = [(name, method, mesh) for name in ("llama", "mistral") for method in ("ring", "all_to_all")
        for mesh in (dict(dp=1, cp=4), dict(dp=2, cp=2))] + [
    ("gpt2", method, dict(dp=2, cp=2)) for method in ("ring", "all_to_all")] + [
    ("qwen2", method, dict(dp=1, cp=2, tp=2)) for method in ("ring", "all_to_all")] + [
    (name, "usp:2", dict(dp=1, cp=4)) for name in ("llama", "mistral")] + [  # all-to-all over 2 x ring over 2
    (f"llama:{side}", method, dict(dp=2, cp=2)) for side in ("left", "right") for method in ("ring", "all_to_all")] + [
    ("llama:left", "usp:2", dict(dp=1, cp=4)), ("llama:left", "ring", dict(dp=1, cp=2, pp=2)),
    ("mistral:right", "all_to_all", dict(dp=1, cp=2, tp=2)),  # padding beside USP, pp, a window and tp
    ("llama", "ring", dict(dp=2, cp=2, nodes=2))]  # on 2 nodes: the buckets' all-reduce over dp x cp hierarchical


@pytest.mark.matrix
def test_context_parallel_grid_trains_as_on_one_device():
    """Llama and Mistral, ring and all-to-all, cp 4 alone and cp 2 beside dp 2, on 4 ranks (beside tp and pp:
    the 8-rank grid below);
    GPT-2 (learned positions, tied head) at dp 2 x cp 2; Qwen2 (biased q, k, v projections, split with their
    heads) at cp 2 x tp 2; Llama and Mistral at cp 4 by USP (all-to-all over 2 ranks x ring over 2); padded
    batches (an attention_mask input, left and right): Llama at dp 2 x cp 2 by ring and all-to-all, at cp 4 by
    USP and at cp 2 x pp 2, Mistral (window and padding) at cp 2 x tp 2 by all-to-all; Llama at dp 2 x cp 2 on 2
    nodes of 2 ranks, its gradient buckets all-reduced hierarchically over dp x cp."""
    jobs = labelled(GRID)
    # the 2-node job's buckets reduce-scatter in a node, all-reduce across nodes, gather in the node, over dp x cp
    # (its sub-groups were once built over dp alone, which summed half the gradients)
    assert any(c.algorithm == "hierarchical" for c in jobs[-1][2].collectives if c.axis == "dp")
    results = launch(_rank_main, 4, ([job[:3] for job in jobs],), timeout_s=1200, heartbeat_s=120)
    assert not failures(jobs, GRID, results)


def failures(jobs, grid, results) -> dict:
    """Each job's worst differences and attention bytes against the formula, printed; those that fail."""
    failed = {}
    for (label, name, plan), (_, method, _) in zip(jobs, grid):
        worst = check(label, name, plan, method, results)
        print(f"\n{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}"
              f" attention bytes {worst['bytes']} (formula {worst['formula']})")
        if worst["bytes"] != worst["formula"] or not all(
                worst[key] <= TOLERANCE for key in ("loss", "grad", "param")):
            failed[label] = worst
    return failed


def labelled(grid) -> list:
    """(label, name, plan) of each (name, method, mesh) of ``grid``, its plan made on meta at PLAN_SEQ."""
    return [(f"{name} {method} " + " ".join(f"{axis}{size}" for axis, size in mesh.items()), name,
             make_plan(name, method=method, **mesh)) for name, method, mesh in grid]


# On 8 ranks: every pair of dp, tp and pp beside cp 2, and USP (cp 4 as an all-to-all over 2 x a ring over 2)
# beside tp and beside pp; each of Llama (grouped-query) and Mistral (sliding window) by each method, Qwen2
# (biased q, k, v) at cp 4 beside tp
GRID_8 = [("llama", "ring", dict(dp=2, cp=2, tp=2)), ("llama", "all_to_all", dict(dp=1, cp=2, tp=2, pp=2)),
          ("mistral", "ring", dict(dp=1, cp=2, tp=2, pp=2)), ("mistral", "all_to_all", dict(dp=2, cp=2, pp=2)),
          ("llama", "usp:2", dict(dp=1, cp=4, tp=2)), ("mistral", "usp:2", dict(dp=1, cp=4, pp=2)),
          ("qwen2", "usp:2", dict(dp=1, cp=4, tp=2))]


@pytest.mark.matrix
def test_context_parallel_beside_tp_pp_and_dp_on_8_ranks_trains_as_on_one_device():
    """cp beside two other axes at once on 8 ranks (``GRID_8``): every axis of each plan really splits (the
    planner's mesh is the one asked for), and each trains as one device with its attention bytes the formula's."""
    jobs = labelled(GRID_8)
    for (_, _, plan), (_, _, mesh) in zip(jobs, GRID_8):
        assert plan.mesh.size == 8 and all(getattr(plan.mesh, axis) == size for axis, size in mesh.items())
    results = launch(_rank_main, 8, ([job[:3] for job in jobs],), timeout_s=1200, heartbeat_s=120)
    assert not failures(jobs, GRID_8, results)


@pytest.mark.parametrize("change,where,needle", [
    (lambda plan: replace(plan, zero_stage=1), "plan.zero_stage", "context parallelism (cp=2) with ZeRO-1"),
    (lambda plan: replace(plan, sequence_parallel=True), "plan.sequence_parallel",
     "context parallelism (cp=2) with sequence parallelism")], ids=["zero", "sequence-parallel"])
def test_context_parallel_refuses_what_it_does_not_run_with(change, where, needle):
    plan = change(make_plan("llama", dp=2, cp=2))
    model, inputs = build("llama", batch=2)
    with pytest.raises(XirangError, match=needle.replace("(", r"\(").replace(")", r"\)")) as error:
        xirang.compile(model, world=4, example_kwargs=inputs, plan=plan)
    assert error.value.where == where and "cp=1" in error.value.hint


def test_context_parallel_refuses_weights_tied_across_pipeline_ranks():
    """Qwen2 ties its embedding to its LM head: at pp 2 the two copies' gradient sum has no cp group yet."""
    from examples.hf_families import qwen2
    from xirang.codegen.emit import check_context_parallel_program
    from xirang.lower import lower
    model, inputs = qwen2(2, SEQ, "meta")
    plan = xirang.plan(model, world=4, example_kwargs=inputs, global_batch=GLOBAL_BATCH * 2, seq=PLAN_SEQ,
                       hardware="a100-80g", precision="fp32", dp=2, tp=1, pp=2, micro_batch=1, schedule="1f1b")
    plan = replace(plan, mesh=Mesh(dp=1, pp=2, tp=1, cp=2), global_batch=GLOBAL_BATCH, buckets=(),
                   collectives=tuple(c for c in plan.collectives if c.axis != "dp"))
    program = lower(xirang.analyze(model, example_kwargs=inputs).graph_module, plan, rank=0).program
    with pytest.raises(XirangError, match=r"weights tied across pipeline ranks \(model.embed_tokens.weight") as error:
        check_context_parallel_program(program, plan)
    assert "pp=1" in error.value.hint


def test_context_parallel_refuses_random_ops():
    """GPT-2 with dropout 0.1: the runtime's streams are drawn per dp and tp rank, not per sequence chunk."""
    import transformers

    from xirang.codegen.emit import check_context_parallel_program
    from xirang.lower import lower
    model = build_from_config(transformers.GPT2Config, transformers.GPT2LMHeadModel, "meta", n_layer=LAYERS,
                              n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS, use_cache=False,
                              resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    inputs = token_batch(2, SEQ, "meta")
    plan = xirang.plan(model, world=2, example_kwargs=inputs, global_batch=GLOBAL_BATCH * 2, seq=PLAN_SEQ,
                       hardware="a100-80g", precision="fp32", dp=2, tp=1, pp=1, micro_batch=1)
    plan = replace(plan, mesh=Mesh(dp=1, pp=1, tp=1, cp=2), global_batch=GLOBAL_BATCH, buckets=(),
                   collectives=tuple(c for c in plan.collectives if c.axis != "dp"))
    program = lower(xirang.analyze(model, example_kwargs=inputs).graph_module, plan, rank=0).program
    with pytest.raises(XirangError, match=r"context parallelism \(cp=2\) with random ops \(dropout") as error:
        check_context_parallel_program(program, plan)
    assert "dropout probabilities to 0" in error.value.hint


def _save_then_resume(rank, world, save_plan, load_plan, directory):
    """``save_then_resume`` on Llama: the second plan at another cp."""
    return save_then_resume(world, partial(build, "llama", batch=2), batch("llama"), save_plan, load_plan,
                            directory)


@pytest.mark.matrix
@pytest.mark.parametrize("save_cp,load_cp", [(2, 1), (1, 2)], ids=["cp2-to-dp2", "dp2-to-cp2"])
def test_a_checkpoint_saved_at_one_cp_resumes_at_another(tmp_path, save_cp, load_cp):
    plans = {cp: make_plan("llama", dp=2 // cp, cp=cp) for cp in (1, 2)}  # 2 ranks: dp 2, or cp 2
    results = launch(_save_then_resume, 2, (plans[save_cp], plans[load_cp], str(tmp_path)), timeout_s=600,
                     heartbeat_s=120)
    for loaded_at, want, got in results:
        assert loaded_at == 1 and set(want) == set(got)
        worst = max((want[k] - got[k]).abs().max().item() for k in want)
        assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("method, precision", [("ring", "bf16"), pytest.param("ring", "fp32", marks=pytest.mark.matrix),
                                               pytest.param("all_to_all", "fp32", marks=pytest.mark.matrix),
                                               pytest.param("usp:2", "fp32", marks=pytest.mark.matrix)])
def test_the_full_scale_check_proves_context_parallel_plans(method, precision):
    """xirang.check dry-runs every rank's program of a dp 2 x cp 2 plan (USP: cp 4 on a padded batch, its
    all-to-all and ring sub-groups made on the fake world) on fake tensors: the cp ranks' sends meet their
    receives, every group's members issue the same collectives, no deadlock, memory fits. In bf16 the attention
    reads its inputs through the precision pass's dtype unification (no traced shape there): split_sequence
    failed on it."""
    name = "llama:left" if method.startswith("usp") else "llama"  # USP with a padding mask: its bits' gathers too
    model, inputs = build(name, "meta", batch=2)
    dp, cp = (1, 4) if method.startswith("usp") else (2, 2)
    plan = make_plan(name, dp=dp, cp=cp, method=method, precision=precision)
    report = xirang.check(plan, model, example_kwargs=inputs, device="cpu", workers=1)
    assert report.ok and not report.violations, report.violations
