"""Recompute and activation offload as the compiled program enacts them, on one rank (fast).

- The passes: ``mark_recompute`` and ``mark_offload`` run between ``assign_stages`` and
  ``split_stages``; the emitted stage code calls the outlined regions and prints their code
  (``full``: each block; ``selective``: the attention core, eager ops or the fused sdpa op; tp
  collectives inside a block's region, so they run again in its recompute).
- The numbers: a training step with ``selective``, ``full``, offload and their combinations gives
  the loss and every gradient of the plain program (fp32 and bf16), also under the executor's split
  backward (BackwardInput, then BackwardWeight), which recomputes and fetches twice.
- The offload engine (codegen/runtime/memory/offload.py): what it packs (bytes, parameters left in place,
  a tensor saved twice copied once), that tensors come back exactly from separate host copies, that
  the prefetch reaches them first, and that a block's forward does not wait for its copies.

tests/codegen/test_recompute_3d.py runs the same modes on launched ranks with tp, pp and dp.
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
import threading

import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from tests.conftest import hf_gpt2, hf_llama
from xirang.codegen.ops.activations import OffloadedBlock, Recomputed
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.memory.offload import ActivationOffload
from xirang.codegen.runtime.executor.pipeline_executor import PipelineExecutor
from xirang.ir.meta_keys import OFFLOAD, RECOMPUTE
from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, with_communication
from xirang.lower import lower
from xirang.passes.lowering.offload import mark_offload
from xirang.passes.lowering.recompute import mark_recompute
from xirang.pipeline import LOWERING_PASSES

TINY = dict(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2)
BUILDERS = {
    "gpt": lambda: build_gpt(GPTConfig(**TINY), device="cpu"),
    "gpt-eager": lambda: build_gpt(GPTConfig(**TINY, attention="eager"), device="cpu"),
    "gpt2-eager": lambda: hf_gpt2(device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="eager"),
    "llama": lambda: hf_llama(device="cpu"),
}
MODES = [("selective", "none"), ("full", "none"), ("none", "blocks"), ("selective", "blocks"), ("full", "blocks")]


def build(name: str):
    torch.manual_seed(0)
    return BUILDERS[name]()


def batch(size: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 500, (size, 16), generator=generator),
            "labels": torch.randint(0, 500, (size, 16), generator=generator)}


@functools.lru_cache(maxsize=None)
def traced(name: str):
    return xirang.analyze(build(name), example_kwargs=batch()).graph_module


@functools.lru_cache(maxsize=None)
def base_plan(name: str, precision: str = "fp32", tp: int = 1):
    return xirang.plan(build(name), world=tp, example_kwargs=batch(), global_batch=4, seq=4096, hardware="a100-80g",
                       precision=precision, micro_batch=2, tp=tp, pp=1, dp=1)


def plan_for(name: str, recompute: str, offload: str, precision: str = "fp32", tp: int = 1):
    return dataclasses.replace(base_plan(name, precision, tp), recompute=recompute, offload=offload)


@functools.lru_cache(maxsize=None)
def two_stages(name: str):
    """The stages of a pp = 2 plan, for one rank running both (interleaved with p = 1, v = 2)."""
    return xirang.plan(build(name), world=2, example_kwargs=batch(), global_batch=4, seq=4096, hardware="a100-80g",
                       precision="fp32", micro_batch=2, tp=1, pp=2, dp=1, schedule="1f1b").stages


def compiled(name: str, recompute: str, offload: str, precision: str = "fp32", *, stages: int = 1) -> CompiledModel:
    plan = plan_for(name, recompute, offload, precision)
    if stages == 2:
        plan = dataclasses.replace(plan, stages=two_stages(name), schedule="interleaved", virtual_stages=2)
    return CompiledModel(build(name), plan, lower(traced(name), plan, rank=0).program)


def step(model: CompiledModel) -> tuple[float, dict]:
    loss = model.train_step(**batch())
    return loss.item(), model.full_gradients()


def worst(got, want) -> float:
    (loss, grads), (want_loss, want_grads) = got, want
    assert set(grads) == set(want_grads)
    return max([abs(loss - want_loss)] + [(grads[k] - g).abs().max().item() for k, g in want_grads.items()])


# --- the passes and the code they emit ----------------------------------------------------------

def test_passes_are_declared_between_assign_stages_and_split_stages():
    names = [p.name for p in LOWERING_PASSES]
    assert names[names.index("assign_stages") + 1:names.index("split_stages")] == ["mark_recompute", "mark_offload"]
    assert RECOMPUTE in mark_recompute.provides and OFFLOAD in mark_offload.provides
    split = LOWERING_PASSES[names.index("split_stages")]
    assert RECOMPUTE in split.requires and OFFLOAD in split.requires


def regions_of(code: str) -> tuple[str, dict]:
    """(the stage's own code, {region name: its code}) of a one-stage program's source."""
    _, stage, *parts = code.split("\n# ")  # the rank's header, "stage 0: ...", then each region
    regions = {}
    for part in parts:
        header, _, body = part.partition("\n")
        regions[header.split(" ")[0]] = body
    return stage, regions


def test_full_recompute_outlines_every_block_and_nothing_else():
    program = lower(traced("gpt-eager"), plan_for("gpt-eager", "full", "none"), rank=0).program
    stage, regions = regions_of(compiled_code(program, "gpt-eager", "full", "none"))
    assert sorted(regions) == ["recompute_0", "recompute_1"]
    assert "self.recompute_0(" in stage and "self.recompute_1(" in stage
    assert stage.count("layer_norm.default(") == 1  # the final norm stays; each block's two are recomputed
    for body in regions.values():
        assert body.count("layer_norm.default(") == 2 and "softmax" in body
    # the marks on the lowered graph: every op of a block, nothing of the segments
    gm = lower(traced("gpt-eager"), plan_for("gpt-eager", "full", "none"), rank=0).run.gm
    marked = {RECOMPUTE.get(n) for n in gm.graph.nodes if RECOMPUTE.has(n)}
    assert marked == {"full:block:layers.0", "full:block:layers.1"}


def compiled_code(program, name, recompute, offload) -> str:
    from xirang.codegen.emit import program_source
    return program_source(program, plan_for(name, recompute, offload), 0, (0,))


@pytest.mark.parametrize("name, core", [("gpt-eager", {"softmax", "masked_fill", "matmul"}),
                                        ("gpt2-eager", {"softmax", "matmul"}),
                                        ("gpt", {"scaled_dot_product_attention"})])
def test_selective_recompute_outlines_the_attention_core(name, core):
    program = lower(traced(name), plan_for(name, "selective", "none"), rank=0).program
    stage, regions = regions_of(compiled_code(program, name, "selective", "none"))
    assert sorted(regions) == ["recompute_0", "recompute_1"]
    for op in core:
        assert all(op in body for body in regions.values()), (op, regions)
        assert f".{op}." not in stage, op  # not also kept outside
    for body in regions.values():
        assert "layer_norm" not in body and "linear" not in body and "addmm" not in body  # the rest is kept
    if name == "gpt":
        assert all(body.count("torch.ops.aten.") == 1 for body in regions.values())  # the fused op alone


def test_offload_nests_the_recomputed_core_and_the_code_is_deterministic():
    plan = plan_for("gpt-eager", "selective", "blocks")
    code = compiled_code(lower(traced("gpt-eager"), plan, rank=0).program, "gpt-eager", "selective", "blocks")
    assert code == compiled_code(lower(traced("gpt-eager"), plan, rank=0).program, "gpt-eager", "selective", "blocks")
    stage, regions = regions_of(code)
    assert sorted(regions) == ["offload_0", "offload_1", "recompute_0", "recompute_1"]
    assert "self.offload_0(" in stage and "self.recompute_0(" not in stage
    assert "self.recompute_0(" in regions["offload_0"] and "self.recompute_1(" in regions["offload_1"]
    assert "# offload_0 (block:layers.0): saved activations to host memory" in code
    # the program still pickles (a rank's program can be sent); unpickling re-traces (test_3d.py), the
    # region modules come back
    again = pickle.loads(pickle.dumps(lower(traced("gpt-eager"), plan, rank=0).program)).stages[0].module
    assert isinstance(again.offload_0, OffloadedBlock) and isinstance(again.offload_0.inner.recompute_0, Recomputed)


def test_tp_collectives_sit_inside_the_recomputed_block():
    """A tp rank's full-recompute block holds its f/g collectives: they run again in the recompute."""
    plan = plan_for("gpt", "full", "none", tp=2)
    program = lower(traced("gpt"), plan, rank=0).program
    from xirang.codegen.emit import program_source
    stage, regions = regions_of(program_source(program, plan, 0, (0,)))
    for body in regions.values():
        assert "copy_to_group" in body and "reduce_from_group" in body and "tp_group" in body
    assert "self.recompute_0(" in stage and "tp_group" in stage.split("self.recompute_0(")[1].split("\n")[0]


# --- the numbers --------------------------------------------------------------------------------

# GPT-2's eager attention recomputes as the in-repo GPT's eager one does (the same core: scores, mask,
# softmax, dropout, the product with V); its run is the matrix tier's, as are its multi-rank ones
@pytest.mark.parametrize("name", ["gpt-eager", pytest.param("gpt2-eager", marks=pytest.mark.matrix), "llama"])
def test_recompute_and_offload_give_the_gradients_of_the_plain_program(name):
    want = step(compiled(name, "none", "none"))
    for recompute, offload in MODES:
        model = compiled(name, recompute, offload)
        assert worst(step(model), want) <= 1e-6, (name, recompute, offload)
        if offload == "blocks":
            stats = model.activation_offload.stats
            assert stats.packed_bytes > 0 and stats.fetched_bytes >= stats.packed_bytes and stats.waited <= \
                stats.prefetched, stats
            assert model.activation_offload.held() == []  # each backward let its blocks go
        else:
            assert model.activation_offload is None


def test_half_precision_recompute_and_offload_equal_the_plain_bf16_program():
    want = step(compiled("gpt", "none", "none", "bf16"))
    for recompute, offload in (("full", "blocks"), ("selective", "none")):
        assert worst(step(compiled("gpt", recompute, offload, "bf16")), want) <= 1e-6, (recompute, offload)


def split_backward(model: CompiledModel) -> None:
    """Run the model's steps with each Backward split into BackwardInput then BackwardWeight."""
    executor = model.executor
    m, num_stages = executor.schedule.num_micro_batches, executor.schedule.num_stages
    def split(action):
        if not isinstance(action, Backward):
            return (action,)
        return BackwardInput(action.stage, action.micro_batch), BackwardWeight(action.stage, action.micro_batch)
    orders = [[c for action in executor.actions if not hasattr(action, "peer") for c in split(action)]]
    schedule = with_communication("1f1b-split", num_stages, m, orders)
    assert any(isinstance(action, BackwardInput) for action in schedule.ranks[0])
    extra = {"rng": executor.rng} if hasattr(executor, "rng") else {}
    model.executor = PipelineExecutor(schedule, 0, executor.stages, peers=executor.peers,
                                      tensors_per_cut=executor.tensors_per_cut, offload=executor.offload, **extra)


def test_two_stages_on_one_rank_and_the_split_backward_recompute_and_fetch_again():
    """Both stages of a pp = 2 split on one rank (a cut between them: stage 1's input is a leaf), each
    Backward split into BackwardInput (the gradient of the cut) and BackwardWeight (the parameters'):
    the second pass over the graph recomputes the regions and fetches the offloaded tensors again."""
    want = step(compiled("gpt-eager", "none", "none"))
    for recompute, offload in (("none", "none"), ("full", "none"), ("selective", "blocks"), ("full", "blocks")):
        model = compiled("gpt-eager", recompute, offload, stages=2)
        assert worst(step(model), want) <= 1e-6, (recompute, offload)
        model = compiled("gpt-eager", recompute, offload, stages=2)
        split_backward(model)
        assert worst(step(model), want) <= 1e-6, (recompute, offload)
        if offload == "blocks":
            stats = model.activation_offload.stats
            # stage 1's BackwardWeight fetches again what its BackwardInput fetched; under full recompute
            # only block 0's input is offloaded (block 1's is stage 1's received leaf), and stage 0 has
            # no input gradient to compute: one fetch each
            assert stats.fetched_bytes > stats.packed_bytes if recompute != "full" else \
                stats.fetched_bytes == stats.packed_bytes, stats
            assert model.activation_offload.held() == []


# --- the offload engine -------------------------------------------------------------------------

def block_fn(x, w):
    """Saves: mm keeps x and w (both leaves: left in place), tanh its output t, mul t twice."""
    t = torch.tanh(x @ w)
    return (t * t,)


def test_offload_copies_out_and_back_exactly_with_prefetch():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    want = torch.autograd.grad(block_fn(x, w)[0].sum(), (x, w))
    offload = ActivationOffload("cpu")
    with offload.forward(0, 0):
        out, = offload.run_block("block:0", block_fn, (x, w))
    packed = offload.blocks(0, 0)[0].saved
    assert offload.stats.packed_tensors == 1 == len(packed)  # t, saved by tanh and twice by mul: one copy
    assert offload.stats.packed_bytes == 8 * 32 * 4 and offload.stats.kept == 2  # x and w stay
    host = packed[0].host.wait()
    offload.begin_backward(0, 0)
    assert all(s.incoming is not None for s in packed)  # the copies back started before the backward
    got = torch.autograd.grad(out.sum(), (x, w))
    offload.end_backward(0, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert offload.stats.prefetched == 1 and offload.stats.waited == 0, offload.stats
    assert offload.stats.fetched_bytes == offload.stats.packed_bytes and offload.held() == []
    back = packed[0].fetch()  # host copy and device copy: separate tensors, exact
    assert torch.equal(host, torch.tanh(x @ w)) and torch.equal(back, host)
    assert len({host.data_ptr(), back.data_ptr(), torch.tanh(x @ w).data_ptr()}) == 3
    assert any(thread.name.startswith("xirang-offload") for thread in threading.enumerate())


def test_offload_hooks_are_unused_outside_a_block_and_a_block_does_not_wait_for_its_copies():
    offload = ActivationOffload("cpu")
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    offload.run_block("block:0", block_fn, (x, w))  # outside an executor forward: as is
    assert offload.stats.packed_tensors == 0
    gate = threading.Event()
    offload.copier.pool.submit(gate.wait)  # hold the copy thread: every copy queues behind this
    with offload.forward(0, 0):
        out, = offload.run_block("block:0", block_fn, (x, w))  # returns although no copy has run
    pending = offload.blocks(0, 0)[0].saved
    assert pending and not any(s.host.future.done() for s in pending)
    gate.set()
    offload.begin_backward(0, 0)
    grads = torch.autograd.grad(out.sum(), (x, w))
    offload.end_backward(0, 0)
    want = torch.autograd.grad(block_fn(x, w)[0].sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
