"""The degree search's on/off options: sequence parallelism chosen where it pays (memory or time) and
not where it only costs, explain()'s one line per option, and the sequence-parallel split's tp
collectives counted as the lowering runs them. Plans are made on meta (a small GPT, tp pinned to 2 so
both layouts are priced at one configuration); each costs well under a second."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt, gpt_config
from tests.codegen.test_3d import batch, build
from xirang.ir.device import device_spec
from xirang.ir.plan_explain import option_trades, size_text
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_splits import SplitPricer

GiB = 1024**3
PINS = dict(world=2, global_batch=8, tp=2, pp=1, micro_batch=1, recompute="none", offload="none")


@pytest.fixture(scope="module")
def long_gpt():
    """A 4-layer GPT at seq 16384: its norms' and residuals' activations are worth sharding."""
    config = GPTConfig(vocab_size=1024, seq_len=16384, hidden=512, heads=8, layers=4)
    ids = torch.zeros(1, 16384, dtype=torch.long, device="meta")
    model, kwargs = build_gpt(config, device="meta"), {"input_ids": ids, "labels": ids}
    return model, kwargs, xirang.analyze(model, example_kwargs=kwargs)


def plan(gpt, device, **pins):
    model, kwargs, report = gpt
    return xirang.plan(model, hardware=device, example_kwargs=kwargs, analysed=report, **PINS, **pins)


def test_search_takes_sequence_parallelism_when_activations_fit_only_with_it(long_gpt):
    a100 = device_spec("a100-80g")
    without = max(plan(long_gpt, a100, sequence_parallel=False).predicted.memory_bytes_per_device)
    sharded = max(plan(long_gpt, a100, sequence_parallel=True).predicted.memory_bytes_per_device)
    assert sharded < without  # 1/tp of the norms', dropouts' and adds' activations
    # usable memory (90% of the device) between the two: only the sequence-parallel plan fits
    small = dataclasses.replace(a100, memory_bytes=int((sharded + without) / 2 / 0.9))
    with pytest.raises(xirang.XirangError, match="no plan fits device memory"):
        plan(long_gpt, small, sequence_parallel=False)
    chosen = plan(long_gpt, small)
    assert chosen.sequence_parallel and chosen.mesh.tp == 2
    assert max(chosen.predicted.memory_bytes_per_device) == sharded
    lines = dict(option_trades(chosen))
    assert lines["Sequence parallelism"].startswith(f"sp saves {size_text(without - sharded)}/device, ")
    assert lines["Sequence parallelism"].endswith("; no sp does not fit).")
    assert "Sequence parallelism: sp saves" in chosen.explain()
    # a sequence tp does not divide is never sharded (the lowering would refuse the program)
    with pytest.raises(xirang.XirangError, match="no plan fits device memory"):
        plan(long_gpt, small, seq=16383)


def test_search_leaves_sequence_parallelism_off_where_it_only_costs():
    """At seq 64 each collective is latency: a reduce-scatter and an all-gather cost about twice the
    all-reduce they replace, and 1/tp of a norm over 64 tokens saves next to nothing."""
    model, kwargs = build("gpt"), batch(0, 2)
    chosen = xirang.plan(model, hardware="a100-80g", example_kwargs=kwargs, seq=64, **PINS)
    assert not chosen.sequence_parallel
    twin = [a for a in chosen.alternatives if a.sequence_parallel]
    assert twin and twin[0].step_seconds > chosen.predicted.step_seconds
    assert twin[0].breakdown["tp_comm"] > chosen.predicted.breakdown["tp_comm"]
    line = dict(option_trades(chosen))["Sequence parallelism"]
    # 1/tp of a norm over 64 tokens: within 0.5% of the memory, so "the same", not "saves 0.0 GiB"
    assert line.startswith("sp needs the same memory/device, costs ") and "of tensor-parallel collectives" in line
    assert f"(sp {twin[0].step_seconds:.4g} s vs no sp {chosen.predicted.step_seconds:.4g} s)" in line


def test_explain_has_one_line_per_option_priced_both_ways(long_gpt):
    """Options are rows of one table (``plan_explain.OPTIONS``): a winner with dp > 1 and tp > 1 is
    compared with every other ZeRO stage and with the other layout, each differing in that alone."""
    model, kwargs, report = long_gpt
    chosen = xirang.plan(model, hardware="a100-80g", example_kwargs=kwargs, analysed=report, world=4, global_batch=8,
                         tp=2, pp=1, dp=2, micro_batch=1, recompute="none", offload="none")
    titles = [title for title, _ in option_trades(chosen)]
    from xirang.passes.planning.plan_search_space import ZERO_STAGES
    assert titles.count("ZeRO") == len(ZERO_STAGES) - 1 and titles.count("Sequence parallelism") == 1
    text = chosen.explain()
    assert text.count("ZeRO: zero-") == len(ZERO_STAGES) - 1 and "Sequence parallelism: sp " in text


def test_sequence_parallel_split_counts_megatrons_collectives_at_block_edges():
    """The ILP's own sequence-parallel split of the tiny GPT on CPU ranks: per block the stream is
    all-gathered before the attention and MLP's column-parallel linears and reduce-scattered after
    their row-parallel ones (backward: the duals), plus the final norm's gather before the LM head:
    (4 layers + 1) activations each way per micro-batch. A Replicate block edge would add an
    all-gather each way per block that the lowering never runs."""
    gm = xirang.analyze(build("gpt"), example_kwargs=batch(0, 2)).graph_module
    pricer = SplitPricer(gm, parse_world(2, "cpu"), precision="fp32")
    split = pricer.price(2, (0, 1), 1, 4096, sequence_parallel=True)
    assert sum(1 for s in split.placements.values() if s.strategy.startswith("seq ")) >= 4 * gpt_config("tiny").layers
    run_seq = batch(0)["input_ids"].shape[1]
    moved = pricer.tp_bytes_per_micro_batch(2, (0, 1), 1, 4096, run_micro_batch=1, run_seq=run_seq,
                                            sequence_parallel=True)
    config = gpt_config("tiny")
    activation = 1 * run_seq * config.hidden * 4  # fp32 [micro-batch, seq, hidden]
    assert moved["all_gather"] == moved["reduce_scatter"] == (4 * config.layers + 1) * activation
