"""Uneven (end-padded) vocabulary shards give the single-device results: a vocabulary of 1001 on
tp = 4 (251 rows per rank, 3 padding rows on the last) and on tp = 2 (501, 1 padding row).

The planner offers a padded shard only along the vocabulary chain (sharding_rules_fused): the
vocabulary-parallel embedding and cross-entropy and the LM head's out-features. This file checks
that a plan really takes it (with a tied head the table stays replicated and the head reads its
padded slice; untied, the head's weight is held padded: 251 rows per rank, the last 3 zero), and
that the compiled program then trains exactly like the model on one device: loss per step, gathered
gradients and parameters after AdamW steps, within 1e-5 fp32.

As in test_equivalence, the plans are made for seq 4096 on A100s (where the ILP splits the model)
and run at seq 16; AdamW uses eps=1e-3 because some gradients are exactly zero in exact arithmetic
(the bias of k in attention), so their computed values are rounding noise, and with a tiny eps
Adam's first step is lr * sign(noise), which no two summation orders agree on. Spawning ranks
costs seconds, so every model and configuration runs in one launch of 4 ranks.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.state import shard_params
from tests.codegen.single_device import compiled_run, single_device_run
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.ops.padding import shard_of, unshard
from xirang.ir.facts import ParamShard
from xirang.ir.placement import PlanShard

VOCAB, BATCH, SEQ, STEPS, TOLERANCE = 1001, 8, 16, 3, 1e-5
PLAN_SEQ = 4096
CONFIGS = ((1, 4), (2, 2))
MODELS = ("gpt", "gpt2", "gpt_untied")


def build(name: str):
    torch.manual_seed(0)
    if name.startswith("gpt") and name != "gpt2":  # the in-repo GPT: tok_emb tied to lm_head, or not
        return build_gpt(GPTConfig(vocab_size=VOCAB, seq_len=64, hidden=64, heads=4, layers=2,
                                   tie_embeddings=name == "gpt"))
    from transformers import GPT2Config, GPT2LMHeadModel  # wte tied to lm_head
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, use_cache=False,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batch(step: int, size=BATCH, seq=SEQ) -> dict:
    # ids and labels over the whole vocabulary, so the last rank's real rows are read too
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB, (size, seq), generator=generator),
            "labels": torch.randint(0, VOCAB, (size, seq), generator=generator)}


def make_plan(name: str, dp: int, tp: int):
    return xirang.plan(build(name), world=dp * tp, example_kwargs=batch(0, 2), global_batch=BATCH, seq=PLAN_SEQ,
                       hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=1, micro_batch=BATCH // dp)


def _train(name, plan):
    compiled = xirang.compile(build(name), world=plan.mesh.dp * plan.mesh.tp, example_kwargs=batch(0),
                              plan=plan, hardware="a100-80g")
    local = {n: tuple(p.shape) for n, p in compiled.named_parameters()}
    return {**compiled_run(compiled, batch, STEPS), "local": local}


def _rank_main(rank, world, jobs):
    return [_train(name, plan) for name, plan in jobs]


def _reference(name):
    return single_device_run(build(name), batch, STEPS)


def _check_vocab_sharded(plan, name):
    """The vocabulary is split although tp does not divide it: vocabulary-parallel cross-entropy fed
    by a column-parallel LM head on the padded out-features."""
    strategies = {n: s.strategy for n, s in plan.placements.items()}
    assert "vocab_parallel" in strategies.values(), (name, sorted(set(strategies.values())))
    padded = [n for n, s in plan.placements.items() if s.strategy == "column"
              and any(isinstance(o.tp, PlanShard) and o.tp.dim == 2 for o in s.outputs)
              and VOCAB % plan.mesh.tp]
    assert padded, f"{name}: the LM head is not column-parallel on the padded vocabulary"
    if name == "gpt_untied":  # held padded: shard_params pads it, full_state_dict strips it
        assert plan.placements["p_lm_head_weight"].outputs[0].tp == PlanShard(0)


def _compare(name, dp, tp, results, reference):
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for rank, result in enumerate(results):
        for (loss, grads), (ref_loss, ref_grads) in zip(result["steps"], reference["steps"]):
            worst["loss"] = max(worst["loss"], abs(loss - ref_loss))
            assert set(grads) >= set(ref_grads), (name, rank, sorted(set(ref_grads) - set(grads)))
            for param, expected in ref_grads.items():
                assert grads[param].shape == expected.shape, (name, param, grads[param].shape)
                worst["grad"] = max(worst["grad"], (grads[param] - expected).abs().max().item())
        for param, expected in reference["params"].items():
            assert result["params"][param].shape == expected.shape, (name, param)
            worst["param"] = max(worst["param"], (result["params"][param] - expected).abs().max().item())
    print(f"{name:5s} dp={dp} tp={tp} vocab {VOCAB}: max |diff| loss {worst['loss']:.1e} "
          f"grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (name, dp, tp, worst)


@pytest.mark.matrix
def test_padded_vocabulary_trains_like_single_device():
    jobs, plans = [], []
    for dp, tp in CONFIGS:
        for name in MODELS:
            plan = make_plan(name, dp, tp)
            _check_vocab_sharded(plan, name)
            plans.append((name, dp, tp))
            jobs.append((name, plan))
    results = launch(_rank_main, 4, (jobs,), timeout_s=300)
    references = {name: _reference(name) for name in MODELS}
    for index, (name, dp, tp) in enumerate(plans):
        _compare(name, dp, tp, [results[rank][index] for rank in range(4)], references[name])
        if name == "gpt_untied":  # every rank holds ceil(1001 / tp) rows of the head
            rows = {shape[0] for r in range(4) for n, shape in results[r][index]["local"].items() if "lm_head" in n}
            assert rows == {-(-VOCAB // tp)}, (dp, tp, rows)


def test_gpt2_vocabulary_on_eight_ranks_pads_the_last(monkeypatch):
    """50257 rows on tp = 8: 6283 per rank, the last holding 6276 real rows and 7 zero rows;
    full_tensor (what full_state_dict calls per parameter) gives back exactly the 50257 rows (the
    all-gather played in one process; the matrix tier runs it on 8 real ranks, below)."""
    tp, vocab, hidden = 8, 50257, 4
    full = torch.randn(vocab, hidden)
    model = torch.nn.Module()
    model.wte = torch.nn.Parameter(full.clone())
    shard = ParamShard("p_wte", "wte", ("wte",), "parameter", PlanShard(0), (vocab, hidden))
    locals_ = [shard_of(model.wte.detach(), shard.placement, r, tp) for r in range(tp)]
    assert {tuple(t.shape) for t in locals_} == {(6283, hidden)}
    assert torch.equal(locals_[-1][6276:], torch.zeros(7, hidden))
    assert torch.equal(locals_[-1][:6276], full[7 * 6283:])
    # eight ranks' all-gather, played in one process
    monkeypatch.setattr(shard_params, "group_size", lambda group: tp)
    monkeypatch.setattr(shard_params.dist, "all_gather",
                        lambda parts, local, group=None: [p.copy_(t) for p, t in zip(parts, locals_)])
    gathered = shard_params.full_tensor(locals_[0], shard, tp_group=object())
    assert tuple(gathered.shape) == (vocab, hidden) and torch.equal(gathered, full)
    assert torch.equal(unshard(locals_, PlanShard(0), vocab), full)


def _gpt2_vocabulary_rank(rank, world):
    """One of 8 real ranks: its padded shard of a 50257-row table, the table gathered back by gloo's
    all_gather, and the vocabulary-parallel embedding and cross-entropy on ids and targets in every
    rank's slice, the last rank's 7 padding rows included."""
    import torch.distributed as dist
    from xirang.codegen.ops.vocab_parallel import (vocab_parallel_cross_entropy, vocab_parallel_embedding,
                                                  vocab_shard_range)
    vocab, hidden = 50257, 4
    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    shard = ParamShard("p_wte", "wte", ("wte",), "parameter", PlanShard(0), (vocab, hidden))
    local = shard_of(full, shard.placement, rank, world)
    group = dist.group.WORLD
    gathered = shard_params.full_tensor(local, shard, tp_group=group)
    start, rows = vocab_shard_range(vocab, group)
    ids = torch.tensor([[0, 6282, 6283, 50256], [44000, 43980, 12345, 50250]])  # both ends of ranks 0, 1, 7
    partial = vocab_parallel_embedding(ids, local, vocab_start=start, vocab_size=vocab, group=group)
    dist.all_reduce(partial, group=group)  # the Partial(sum) the lowering completes with one all-reduce
    logits = ids.flatten().float().unsqueeze(1) * 1e-5 * full.sum(1)  # [8, vocab], a different row per target
    local_logits = logits.detach()[:, start:start + rows].clone().requires_grad_(True)
    if local_logits.shape[1] < rows:  # the last rank's columns past the vocabulary: padding
        pad = torch.zeros(logits.shape[0], rows - local_logits.shape[1])
        local_logits = torch.cat([local_logits.detach(), pad], 1).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local_logits, ids.flatten(), vocab_start=start, vocab_size=vocab,
                                        group=group)
    loss.backward()
    return {"rows": tuple(local.shape), "gathered": torch.equal(gathered, full),
            "embedding": (partial - full[ids]).abs().max().item(), "loss": loss.item(),
            "grad": local_logits.grad[:, :max(0, min(rows, vocab - start))].clone(), "start": start}


@pytest.mark.matrix  # 8 ranks for one table: the one-process stand-in above runs by default
def test_gpt2_vocabulary_on_eight_real_ranks_gathers_looks_up_and_scores_as_one_device():
    results = launch(_gpt2_vocabulary_rank, 8, (), timeout_s=300)
    assert {r["rows"] for r in results} == {(6283, 4)} and all(r["gathered"] for r in results)
    assert max(r["embedding"] for r in results) == 0.0  # one rank holds each row: the sum is that row
    full = torch.randn(50257, 4, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 6282, 6283, 50256], [44000, 43980, 12345, 50250]]).flatten()
    logits = (ids.float().unsqueeze(1) * 1e-5 * full.sum(1)).requires_grad_(True)
    want = torch.nn.functional.cross_entropy(logits, ids)
    want.backward()
    assert all(abs(r["loss"] - want.item()) <= 1e-6 for r in results), ([r["loss"] for r in results], want.item())
    grad = torch.cat([r["grad"] for r in results], 1)  # every rank's real columns, in rank order
    assert grad.shape == logits.shape and (grad - logits.grad).abs().max().item() <= 1e-6


@pytest.mark.parametrize("tp", (2, 4, 8))
def test_plan_offers_the_padded_vocabulary(tp):
    """A replicated weight is not the only choice any more: the rules offer the padded split."""
    from xirang.passes.planning.sharding_rules import strategies_for
    gm = xirang.analyze(build("gpt"), example_kwargs=batch(0, 2)).graph_module
    loss = next(n for n in gm.graph.nodes if "cross_entropy" in str(n.target))
    fractions = {s.name: s.compute_fraction for s in strategies_for(loss, tp)}
    assert fractions["vocab_parallel"] == pytest.approx(-(-VOCAB // tp) / VOCAB)


def test_planned_parameter_memory_counts_the_padding():
    """The plan's per-rank parameter count (what its memory prediction and dp buckets use) is the
    padded local shape: the untied head of 1001 x 64 on tp = 4 is 251 x 64 per rank, not 1001*64/4."""
    from xirang.ir.meta_keys import PARAM_NAME
    from xirang.plan_assemble import local_elements
    plan = make_plan("gpt_untied", 1, 4)
    gm = xirang.analyze(build("gpt_untied"), example_kwargs=batch(0)).graph_module
    head = next(n for n in gm.graph.nodes if PARAM_NAME.get(n, None) == "lm_head.weight")
    assert plan.placements[head.name].outputs[0].tp == PlanShard(0)
    assert local_elements(head, plan.placements, 4) == 251 * 64 == 16064
