"""The planner chooses context parallelism (issue 36, item 2): cp degree and method priced with the rest of the mesh.

A small Hugging Face Llama (grouped-query: 4 query heads, 2 kv heads, head dim 16; examples/hf_families.py) is
planned on ``meta`` for 2 ranks of a device whose memory is shrunk to 33 MiB (``SMALL``): at seq 4096 no cp = 1
configuration fits (the leanest, tp 2 with full recompute, needs 37.1 MiB of 29.7 usable), and cp = 2 by ring
does; at seq 2048 on an 80 GB device everything fits and cp = 1 (dp 2) is priced faster than cp = 2. The pricing
of ``with_context_parallel`` is checked against hand-computed numbers of the formulas (context_parallel_cost.py),
and a plan the planner made with cp = 2 trains on two gloo ranks as on one device (matrix tier).
"""
from __future__ import annotations

import dataclasses

import pytest

import xirang
from xirang.analyze import analyze
from xirang.ir.device import DEVICE_PRESETS
from xirang.ir.errors import XirangError
from xirang.ir.plan import Plan
from xirang.ir.plan_explain import explain_data, plan_context_method
from xirang.passes.planning.context_parallel_cost import (AttentionCall, layer_parts, ring_attention_bytes,
                                                          with_context_parallel)
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

MiB = 2**20
SMALL = dataclasses.replace(DEVICE_PRESETS["a100-80g"], name="a100-33mib", memory_bytes=33 * MiB)


@pytest.fixture(scope="module")
def llama():
    from tests.models.test_context_parallel import build
    model, inputs = build("llama", "meta", batch=2)
    return model, inputs, analyze(model, (), inputs)


def plan_llama(llama, seq: int, hardware=SMALL, world: int = 2, **pins):
    model, inputs, report = llama
    return xirang.plan(model, world=world, example_kwargs=inputs, global_batch=4, seq=seq, hardware=hardware,
                       precision="fp32", analysed=report, **pins)


def test_the_search_takes_cp_where_a_long_sequence_does_not_fit_otherwise(llama):
    plan = plan_llama(llama, 4096)
    assert (plan.mesh.cp, plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 1, 1, 1)
    assert max(plan.predicted.memory_bytes_per_device) <= min(stage.memory_limit_bytes for stage in plan.stages)
    why = [n for n in plan.predicted.notes if n.startswith("context parallelism: ")]
    assert why and "do not fit at cp=1 at seq 4096" in why[0], plan.predicted.notes
    assert all(not row.fits for row in plan.alternatives if row.mesh.cp == 1)
    # the plan records the method where the lowering reads it, and its transfers on axis cp
    cp_rows = [c for c in plan.collectives if c.axis == "cp"]
    assert {c.node for c in cp_rows} >= {"context:attention"}
    assert len([c for c in cp_rows if c.node != "context:attention"]) == 2  # one per attention layer
    text = plan.explain()
    assert "Context: cp=2 by ring over the cp groups [0, 1]" in text and "why: the activations do not fit" in text
    data = explain_data(plan)  # xirang explain --json
    assert (data["rows"][0]["cp"], data["rows"][0]["context_method"]) == (2, "ring") and data["context"][0] in text


def test_the_search_keeps_cp_1_at_a_short_sequence(llama):
    """At seq 2048 on an 80 GB device everything fits: cp 2 (1024 tokens a rank, the fewest it is offered at) is
    priced, and dp 2 is faster (no transfers; the same tokens and attention per rank)."""
    plan = plan_llama(llama, 2048, hardware="a100-80g")
    assert plan.mesh.cp == 1
    priced = [row for row in plan.alternatives if row.mesh.cp == 2]
    assert priced and all(row.fits and row.step_seconds > plan.predicted.step_seconds for row in priced)
    assert not any(c.axis == "cp" for c in plan.collectives)
    assert "Context:" not in plan.explain()


def test_the_method_follows_the_priced_transfers_and_round_trips(llama, tmp_path):
    """At cp 2 both methods run (cp divides the 4 query heads); each is priced and the cheaper one wins, its
    twin shown beside it (no USP at cp 2: it needs a degree strictly between 1 and cp)."""
    plan = plan_llama(llama, 4096, hardware="a100-80g", cp=2, dp=1, tp=1, pp=1)
    twin = [row for row in plan.alternatives if row.mesh == plan.mesh and row.micro_batch == plan.micro_batch
            and row.recompute == plan.recompute and row.schedule == plan.schedule]
    methods = {row.context_method for row in twin}
    chosen = "all_to_all" if any(c.axis == "cp" and c.kind == "all_to_all" for c in plan.collectives) else "ring"
    assert methods == {"ring", "all_to_all"} - {chosen}, methods
    other = next(row for row in twin if row.context_method != chosen)
    assert plan.predicted.breakdown["cp_comm"] < other.breakdown["cp_comm"]
    assert plan.predicted.step_seconds <= other.step_seconds
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.collectives == plan.collectives and loaded.alternatives == plan.alternatives
    assert {row.context_method for row in loaded.alternatives if row.mesh.cp > 1} == \
        {row.context_method for row in plan.alternatives if row.mesh.cp > 1}



def test_usp_is_offered_where_the_heads_are_too_few_for_a_whole_all_to_all(llama):
    """cp 8 over 4 query heads: a whole all-to-all is not offered (8 does not divide 4), USP's all-to-all over 2 or
    4 ranks x a ring over 4 or 2 is, beside the ring; the winner's method is recorded and its transfers listed
    per kind; a pinned usp:4 plans and explains its groups; at tp 4 (one head a tp rank) only the ring is left."""
    eight = plan_llama(llama, 4096, hardware="a100-80g", world=8, cp=8, tp=1, pp=1)
    chosen = plan_context_method(eight)
    twins = {row.context_method for row in eight.alternatives if row.mesh == eight.mesh}
    assert twins | {chosen} == {"ring", "usp:2", "usp:4"}, (chosen, twins)
    assert any("priced fastest of ring, usp:2, usp:4" in n for n in eight.predicted.notes), eight.predicted.notes
    for method, needle in (("all_to_all", "context_method='all_to_all' .all-to-all needs cp"),
                           ("usp:3", "usp:A needs A to divide cp"), ("usp:1", "'usp:1' is not a context-parallel")):
        with pytest.raises(XirangError, match=needle):
            plan_llama(llama, 4096, hardware="a100-80g", world=8, cp=8, tp=1, pp=1, context_method=method)
    pinned = plan_llama(llama, 4096, hardware="a100-80g", world=8, cp=8, tp=1, pp=1, context_method="usp:4")
    assert plan_context_method(pinned) == "usp:4"
    rows = [c for c in pinned.collectives if c.axis == "cp" and not c.node.startswith("context:attention")]
    call = AttentionCall(unit="", q_heads=4, kv_heads=2, head_dim=16)
    parts = layer_parts(call, seq=4096, batch=pinned.micro_batch, tp=1, cp=8, method="usp:4", dtype_bytes=4)
    assert sorted((c.kind, c.nbytes) for c in rows) == sorted(
        (kind, int(traffic.forward)) for kind, traffic in parts.items() for _ in range(2))  # 2 layers
    assert "by usp:4" in pinned.explain() and "groups of 4 ([0, 1, 2, 3], [4, 5, 6, 7]" in pinned.explain()
    ring_only = plan_llama(llama, 4096, hardware="a100-80g", world=8, cp=2, tp=4, pp=1)
    assert any("ring, as all-to-all is not offered here (all_to_all needs its all-to-all degree 2 to divide the "
               "query heads per tp rank: 4 heads / tp 4 = 1)" in n for n in ring_only.predicted.notes)


def _unit(name: str) -> UnitCost:
    return UnitCost(name=name, kind=name, forward_seconds=1e-3, backward_seconds=2e-3, tp_comm_forward_seconds=0,
                    tp_comm_backward_seconds=0, params_local=10, saved_bytes=1000.0, selective_saved_bytes=1000.0,
                    selective_recompute_seconds=0.0, input_bytes=10.0, cut_bytes_after=10.0, model_flops=1e9,
                    model_forward_flops=1e9 / 3)


def test_pricing_equals_the_formulas_by_hand():
    """seq 1024, micro-batch 1, 8 query heads, 2 kv heads, head dim 64, 2-byte elements, cp 4, tp 1; links of 1e9
    B/s (send and all-to-all alike: seconds = bytes / 1e9), attention at 1e12 FLOP/s.

    One step of attention: 4·1·8·256²·64 = 134,217,728 FLOPs = 1.34217728e-4 s, 3 more steps forward
    (+4.02653184e-4 s), twice that backward. Ring: a key+value block 2·1·2·256·64·2 = 131,072 B = 1.31072e-4 s,
    less than a step: hidden forward; backward steps 1..2 carry 2t = 2.62144e-4 s against 2a = 2.68435456e-4 s
    (hidden), the last gradient's hop home t exposed: 1.31072e-4 s. All-to-all: rows 256·1·64·2 = 32,768 B a
    head; q and the output 8 heads (262,144 B), k and v lcm(2, 4) = 4 heads (131,072 B):
    2·2.62144e-4 + 2·1.31072e-4 = 7.86432e-4 s each way; it keeps 2·(4 − 2) more kv heads of 256 rows:
    2·2·256·64·2 = 131,072 B more. The loss unit adds an all-reduce and an all-gather per micro-batch (1e-5 s
    each here)."""
    split = TensorSplit(tp=1, micro_batch=1, seq=256, units=(_unit("segment:0"), _unit("block:a"), _unit("segment:1")))
    call = AttentionCall(unit="block:a", q_heads=8, kv_heads=2, head_dim=64)
    seen = []  # (kind, ranks) of every collective priced

    def cost(kind, n, ranks, per_byte=1e-9):
        seen.append((kind, tuple(ranks)))
        return n * per_byte if kind in ("send", "all_to_all") else 1e-5
    common = dict(cp=4, calls=(call,), seq=1024, dtype_bytes=2, group=(0, 1, 2, 3), cost=cost,
                  attention_seconds=lambda flops: flops / 1e12)
    ring = with_context_parallel(split, method="ring", **common)
    assert ring.units[0] == split.units[0]  # no attention there
    # the loss: the token mean's all-reduce and the label shift's all-gather, 1e-5 s each here
    assert ring.units[2].cp_comm_forward_seconds == pytest.approx(2e-5)
    assert ring.units[2].forward_seconds == split.units[2].forward_seconds
    block = ring.units[1]
    assert block.forward_seconds == pytest.approx(1e-3 + 4.02653184e-4)
    assert block.backward_seconds == pytest.approx(2e-3 + 8.05306368e-4)
    assert block.cp_comm_forward_seconds == pytest.approx(0.0)
    assert block.cp_comm_backward_seconds == pytest.approx(1.31072e-4)
    # model FLOPs: this rank's share of the whole sequence's attention, 12·8·1024²·64·(1/4 − 1/16) more
    assert block.model_flops == pytest.approx(1e9 + 12 * 8 * 1024**2 * 64 * (1 / 4 - 1 / 16))
    a2a = with_context_parallel(split, method="all_to_all", **common).units[1]
    assert a2a.cp_comm_forward_seconds == pytest.approx(7.86432e-4)
    assert a2a.cp_comm_backward_seconds == pytest.approx(7.86432e-4)
    assert a2a.saved_bytes == pytest.approx(1000.0 + 131072)
    # a slow link: the ring's transfers outlast the attention (t = 1.31072e-3 s per block at 1e8 B/s)
    slow = with_context_parallel(split, method="ring", **{**common, "cost": lambda kind, n, ranks: cost(
        kind, n, ranks, per_byte=1e-8)}).units[1]
    t, a = 1.31072e-3, 1.34217728e-4
    assert slow.cp_comm_forward_seconds == pytest.approx(3 * (t - a))
    assert slow.cp_comm_backward_seconds == pytest.approx((t - 2 * a) + 2 * (2 * t - 2 * a) + (t - 2 * a) + t)
    # USP, all-to-all over 2 x ring over 2 (usp:2): the all-to-alls on ranks (0, 1), q and the output 8 heads
    # (262,144 B), k and v lcm(2, 2) = 2 heads (65,536 B): 2·2.62144e-4 + 2·6.5536e-5 = 6.5536e-4 s each way;
    # the ring on ranks (0, 2): a key+value block of 1 kv head (2 / 2) x 512 tokens x 64 x 2 B, twice, 131,072 B,
    # t = 1.31072e-4 s against a ring step's attention of 2 cp steps (2.68435456e-4 s): hidden forward, the last
    # hop home exposed
    seen.clear()
    usp = with_context_parallel(split, method="usp:2", **common).units[1]
    assert usp.cp_comm_forward_seconds == pytest.approx(6.5536e-4)
    assert usp.cp_comm_backward_seconds == pytest.approx(6.5536e-4 + 1.31072e-4)
    assert usp.forward_seconds == block.forward_seconds and usp.saved_bytes == pytest.approx(1000.0)
    assert {ranks for kind, ranks in seen if kind == "all_to_all"} == {(0, 1)}
    assert {ranks for kind, ranks in seen if kind == "send"} == {(0, 2)}


def _run_rank(rank, world, plan):
    """One gloo rank: the plan compiled for the Llama on CPU, 3 AdamW steps, its ring's sent bytes counted."""
    from tests.codegen.single_device import compiled_run
    from tests.models.test_context_parallel import STEPS, batch, build
    from xirang.codegen.ops.comm_counter import CommCounter
    model, inputs = build("llama", batch=2)
    counter = CommCounter()
    compiled = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan,
                              debug=xirang.DebugHooks(counter=counter))
    run = compiled_run(compiled, batch("llama"), STEPS)
    moved = {kind: sum(r.nbytes for r in counter.records if r.kind == kind) for kind in ("send", "all_to_all")}
    return {"planned": {**run, "attention_bytes": moved}}  # by kind, as test_context_parallel.check reads them


@pytest.mark.matrix
def test_a_plan_the_planner_gave_cp_2_trains_as_on_one_device(llama):
    """The plan of the first test (cp 2 by ring, chosen because nothing else fits at seq 4096; full recompute),
    run at seq 16 on two gloo ranks: loss, gradients and parameters after 3 AdamW steps equal one device's within
    1e-5, and the ring's bytes equal the formulas, full recompute's second forward sending its blocks again (as
    the planner prices it: ``cp_comm`` forward twice). Matrix tier: 75 s at load 6 (a launch and a compile)."""
    from tests.models.test_context_parallel import HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, STEPS, TOLERANCE, check
    from xirang.codegen.runtime.launch.launcher import launch
    plan = plan_llama(llama, 4096)
    assert plan.mesh.cp == 2 and plan.recompute == "full"
    results = launch(_run_rank, 2, (plan,), timeout_s=600, heartbeat_s=120)
    worst = check("planned", "llama", plan, "ring", results)
    again = ring_attention_bytes(seq=SEQ, batch=1, kv_heads=KV_HEADS["llama"], head_dim=HIDDEN // HEADS, dtype_bytes=4,
                                 cp=2).forward * LAYERS * plan.num_micro_batches * plan.mesh.size * STEPS
    assert worst["bytes"] == {"send": worst["formula"]["send"] + again, "all_to_all": 0}, worst
    assert all(worst[key] <= TOLERANCE for key in ("loss", "grad", "param")), worst


def test_cp_is_not_offered_where_the_runtime_would_refuse_it(llama):
    """A Llama with attention dropout (random ops, which the runtime refuses beside cp): the search stays at cp = 1
    where cp is the only fit without it, and a pinned cp says why; nothing is offered beside what the runtime
    refuses (ZeRO with cp pinned leaves no configuration). Fails if context_facts or the search ignore them."""
    import transformers
    from examples.hf_families import FFN, HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, build_from_config, token_batch
    model = build_from_config(transformers.LlamaConfig, transformers.LlamaForCausalLM, "meta", num_hidden_layers=LAYERS,
                              hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                              intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                              use_cache=False, attention_dropout=0.1)
    inputs = token_batch(2, 16, "meta")
    dropout = (model, inputs, analyze(model, (), inputs))
    with pytest.raises(XirangError, match="cp=2 was pinned, but .*random ops"):
        plan_llama(dropout, 4096, cp=2)
    with pytest.raises(XirangError, match="no plan fits device memory"):
        plan_llama(dropout, 4096)  # the Llama without dropout takes cp 2 here (the first test)
    with pytest.raises(XirangError, match="zero_stage=1"):
        plan_llama(llama, 4096, cp=2, zero_stage=1)
    # nor does explain compare the winner with a ZeRO twin it could not run (dp 2 x cp 2)
    four = plan_llama(llama, 4096, hardware="a100-80g", world=4, cp=2, dp=2, tp=1, pp=1)
    assert four.mesh.cp == 2 and not any(row.mesh.cp > 1 and row.zero_stage for row in four.alternatives)


def test_the_full_scale_check_proves_a_planned_dp2_cp2_plan(llama):
    """xirang.check dry-runs every rank of a plan the planner made at dp 2 x cp 2 (its gradient buckets listed on
    the dp x cp group, its ring on cp): sends matched, collectives equal per group, no deadlock, memory fits."""
    model, inputs, _ = llama
    plan = plan_llama(llama, 4096, hardware="a100-80g", world=4, cp=2, dp=2, tp=1, pp=1)
    assert (plan.mesh.dp, plan.mesh.cp) == (2, 2)
    report = xirang.check(plan, model, example_kwargs=inputs, device="cpu", workers=1)
    assert report.ok and not report.violations, report.violations
