"""No rank ever holds the whole model: a model built on ``meta`` compiles, and each rank makes only its shards,
each tensor from its own stream (codegen/runtime/state/weight_init.py), equal to the slices of
``xirang.init_weights(model, seed)`` on one device.

Single process: the streams are deterministic per (seed, FQN) and independent of order and of the caller's
generator; per-shard materialisation (``bind_state`` of the meta model) equals slicing the one-device init
for tp-sharded linears (column, row and fused [q | k | v] splits) and an embedding; a buffer computed in
``__init__`` is recovered where the model's init recomputes it (HF Llama's rotary table), kept when built
real (``parameters_on_meta``), refused by name otherwise; the compiled program keeps no reference to the
model. Multi-rank: the in-repo GPT built on meta compiles on 8 CPU ranks at (dp, tp, pp) = (2, 2, 2), planned
on meta at seq 4096 so every axis splits, and trains 3 AdamW steps as the same model initialised on one
device with ``init_weights`` (loss, gradients, parameters within 1e-5, fp32). The memory comparison with the
old path is ``benchmarks/meta_init_memory.py`` (GPT-2 medium sized; its numbers are in docs/architecture.md),
and a smaller one here (matrix tier).
"""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import xirang
from benchmarks.meta_init_memory import MiB, make_plan as make_memory_plan, measure as measure_memory
from examples.gpt import build_gpt
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from tests.conftest import hf_llama
from xirang.codegen.ops.padding import shard_of
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.state.pipeline_state import bind_state
from xirang.codegen.runtime.state.weight_init import TensorInit, stream_seed
from xirang.ir.errors import XirangError
from xirang.ir.facts import ParamShard
from xirang.ir.placement import PlanShard

SEED, WORLD, GLOBAL_BATCH, SEQ, VOCAB_USED, STEPS, TOLERANCE = 1234, 8, 8, 16, 500, 3, 1e-5


def batch(step: int, size: int = GLOBAL_BATCH, device="cpu") -> dict:
    generator = torch.Generator().manual_seed(step)
    return {name: torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator).to(device)
            for name in ("input_ids", "labels")}


# --- the streams -----------------------------------------------------------------------------------

def test_streams_are_per_seed_and_fqn_and_independent_of_order():
    assert stream_seed(0, "a.weight") == 0x4827639bf1b7aefa  # blake2b: the same in every process and release
    assert len({stream_seed(s, f) for s in (0, 1) for f in ("a.weight", "b.weight")}) == 4
    assert stream_seed(7, "layers.0.attn.qkv.weight") == stream_seed(7, "layers.0.attn.qkv.weight")
    names = [n for n, _ in build_gpt("tiny", "meta").named_parameters()]
    forward = TensorInit(build_gpt("tiny", "meta"), SEED)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    first = {n: forward.value(n) for n in names}
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is left as it was
    backward = TensorInit(build_gpt("tiny", "meta"), SEED)
    second = {n: backward.value(n) for n in reversed(names)}
    assert all(torch.equal(first[n], second[n]) for n in names)
    # each tensor its own stream: two layers' equal-shaped weights differ, another seed differs
    assert not torch.equal(first["layers.0.attn.qkv.weight"], first["layers.1.attn.qkv.weight"])
    other_seed = TensorInit(build_gpt("tiny", "meta"), SEED + 1)
    assert not torch.equal(first["tok_emb.weight"], other_seed.value("tok_emb.weight"))
    # the model's own initialisation: GPT's N(0, 0.02) weights, zero biases, LayerNorm ones
    assert abs(first["tok_emb.weight"].std().item() - 0.02) < 2e-3 and first["layers.0.attn.qkv.bias"].abs().max() == 0
    assert torch.equal(first["layers.0.ln1.weight"], torch.ones(64))
    # a tied weight is one stream under its first name, whichever name asks
    assert torch.equal(forward.value("lm_head.weight"), first["tok_emb.weight"])


def test_init_weights_on_one_device_equals_the_meta_models_values():
    real = xirang.init_weights(build_gpt("tiny", "cpu"), seed=SEED)
    meta = build_gpt("tiny", "meta")
    made = xirang.init_weights(meta, seed=SEED)  # a meta model gets real tensors, ties kept
    assert made.lm_head.weight is made.tok_emb.weight and not made.tok_emb.weight.is_meta
    for (name, a), (_, b) in zip(real.named_parameters(), made.named_parameters()):
        assert torch.equal(a, b), name


class Sharded(nn.Module):
    """Column-split, row-split and fused [q | k | v] linears and a vocabulary-split embedding, uneven dims too."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.qkv = nn.Linear(8, 24)
        self.up = nn.Linear(8, 13)
        self.down = nn.Linear(13, 8)


SHARDS = {"emb.weight": PlanShard(0), "qkv.weight": PlanShard(0, 3), "qkv.bias": PlanShard(0, 3),
          "up.weight": PlanShard(0),
          "up.bias": PlanShard(0), "down.weight": PlanShard(1)}


def test_each_shard_is_the_slice_of_the_one_device_init():
    reference = dict(xirang.init_weights(Sharded(), seed=SEED).named_parameters())  # torch's defaults, per tensor
    with torch.device("meta"):
        meta = Sharded()
    program = SimpleNamespace(index=0, constants={}, parameters=[(f"p_{n}", n) for n in reference])
    shards = {n: ParamShard(f"p_{n}", n, (n,), "parameter", p, tuple(reference[n].shape)) for n, p in SHARDS.items()}
    for tp in (2, 3):
        for tp_rank in range(tp):
            bound = bind_state(meta, [program], frozenset(reference), "cpu", shards=shards, tp_rank=tp_rank, tp=tp,
                               seed=SEED)
            for name, full in reference.items():
                want = shard_of(full.detach(), SHARDS[name], tp_rank, tp) if name in SHARDS else full
                assert torch.equal(bound[name], want), (tp, tp_rank, name)
                assert isinstance(bound[name], nn.Parameter) and bound[name].requires_grad
    assert all(p.is_meta for p in meta.parameters())  # the model itself stays meta


# --- buffers made in __init__ ------------------------------------------------------------------------

class WithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4, 4).tril().bool(), persistent=False)


def test_buffers_made_in_init_are_recomputed_kept_or_refused_by_name():
    # HF Llama's rotary inv_freq, computed in __init__ (meta here), is recomputed by its _init_weights
    real, meta = hf_llama(device="cpu"), hf_llama(device="meta")
    assert meta.model.rotary_emb.inv_freq.is_meta
    assert torch.equal(TensorInit(meta, SEED).value("model.rotary_emb.inv_freq"), real.model.rotary_emb.inv_freq)
    # a mask no init writes: refused on meta, naming it and the fix ...
    with torch.device("meta"):
        model = WithMask()
    with pytest.raises(XirangError, match=r"(?s)buffer 'mask' \(4, 4\) is not wholly written.*parameters_on_meta"):
        TensorInit(model, SEED).value("mask")
    # ... and kept as computed when the model is built with its buffers real
    with xirang.parameters_on_meta():
        model = WithMask()
    assert model.proj.weight.is_meta and not model.mask.is_meta
    assert torch.equal(TensorInit(model, SEED).value("mask"), torch.ones(4, 4).tril().bool())
    assert torch.equal(TensorInit(model, SEED).value("proj.weight"),
                       xirang.init_weights(WithMask(), seed=SEED).proj.weight)


def test_compiled_model_keeps_no_reference_to_the_model():
    inputs = batch(0, 2)
    for device in ("meta", "cpu"):
        model = build_gpt("tiny", device)
        alive = weakref.ref(model)
        example = {k: v.to(device) for k, v in inputs.items()}
        compiled = xirang.compile(model, world=1, example_kwargs=example, global_batch=2, precision="fp32",
                                  runtime=xirang.RuntimeOptions(seed=SEED))
        del model
        gc.collect()
        assert alive() is None, f"{device}: something keeps the model"
        assert compiled.train_step(inputs["input_ids"], inputs["labels"]).isfinite()  # positional: the signature
        with pytest.raises(XirangError, match="train_step's inputs do not match the model's forward"):
            compiled.train_step(inputs["input_ids"], inputs["labels"], inputs["labels"])


# --- 8 ranks at (2, 2, 2), from meta -------------------------------------------------------------------

def make_plan():
    plan = xirang.plan(build_gpt("tiny", "meta"), world=WORLD, example_kwargs=batch(0, 2, "meta"),
                       global_batch=GLOBAL_BATCH, seq=4096, hardware="a100-80g", precision="fp32", dp=2, tp=2, pp=2,
                       schedule="1f1b", micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2) and len(plan.stages) == 2
    sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard)]
    assert sharded, "the plan shards no parameter, so tp would be vacuous"
    return plan


def _rank_main(rank, world, plan):
    with torch.device("meta"):
        model = build_gpt("tiny")
    compiled = xirang.compile(model, world=world, example_kwargs=batch(0, 2, "meta"), plan=plan,
                              runtime=xirang.RuntimeOptions(seed=SEED), hardware="a100-80g")
    del model
    local = {fqn: tuple(t.shape) for fqn, t in compiled.named_parameters()}
    return {"run": compiled_run(compiled, batch, STEPS), "local": local}


def test_meta_model_trains_on_8_ranks_as_init_weights_on_one_device():
    plan = make_plan()
    results = launch(_rank_main, WORLD, (plan,), timeout_s=600)
    want = single_device_run(xirang.init_weights(build_gpt("tiny", "cpu"), seed=SEED), batch, STEPS,
                             keep_duplicates=True)
    worst = worst_differences("run", results, want)
    print(f"meta (2,2,2): max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), worst
    full = dict(build_gpt("tiny", "meta").named_parameters())
    # pp: a stage's tensors only (the tied embedding on both); tp: some held at half their rows
    assert "layers.1.ln1.weight" not in results[0]["local"] and "layers.0.ln1.weight" not in results[7]["local"]
    assert any(shape != tuple(full[fqn].shape) for fqn, shape in results[0]["local"].items())


@pytest.mark.matrix
def test_meta_compile_holds_shards_not_the_model():
    """Per rank host memory (benchmarks/meta_init_memory.py; GPT-2 small's blocks, vocabulary 8192, 4 ranks at
    (1, 2, 2)): built on the CPU a rank held the whole model at its peak; built on meta it never does. After
    the script drops its model both hold the shards and the program only (nothing keeps the model)."""
    name = "gpt-small-vocab8k"
    plan = make_memory_plan(name, 4, 1, 2, 2)
    old, new = (measure_memory(name, world=4, dp=1, tp=2, pp=2, from_meta=meta, plan=plan) for meta in (False, True))
    for before, after in zip(old, new):
        model, shards = before["model_bytes"], before["shard_bytes"]
        assert after["shard_bytes"] == shards < model / 2, (shards, model)
        assert before["peak_after_dropped"] - before["rss_after_start"] >= model, before
        assert after["peak_after_dropped"] - after["rss_after_start"] < 0.6 * model, after
        for found in (before, after):  # what stays: the shards, a few MiB of constants, no model
            assert shards <= found["tensor_bytes_after_drop"] <= shards + 16 * MiB, found
        assert abs(after["rss_after_drop"] - before["rss_after_drop"]) < 64 * MiB, (before, after)
