"""Randomness under every plan (issue 15): random ops draw on streams the runtime owns
(passes/lowering/random_streams.py, codegen/ops/random_ops.py).

- Scenario: HF GPT-2 with its default dropout 0.1, each rank seeding torch with ``1234 + rank`` (a
  common habit), plans (1, 2, 1) and (2, 2, 2) made on meta at seq 4096 so tp really shards
  (asserted), 3 AdamW steps: every parameter the plan replicates over tp is bit-identical on the tp
  ranks (before, the replicated dropouts drew a different mask per tp rank and the layer norms
  drifted apart by 2.5e-3).
- Independence: keep-masks of a tp-sharded dropout on two tp ranks, and of one op on two dp ranks,
  two micro-batches or two steps, agree at chance level. Two independent masks keeping each
  element with probability q = 0.9 agree with probability a = q² + (1 - q)² = 0.82; over n elements
  the agreement rate has standard deviation sqrt(a (1 - a) / n) (a binomial), 0.003 at n = 16384.
  The test allows 6 standard deviations (a false failure once in 5e8 runs); masks drawn from one
  stream, or from correlated ones, agree at 1.0, some 60 deviations away. Where tp replicates the
  draw, the tp ranks' masks are equal.
- Exact mode: HF GPT-2 and the in-repo GPT with dropout 0.1 (embeddings, attention, residuals) at
  (2, 2, 1), (1, 2, 4) and (2, 2, 2) equal the eager model under ``ExactReference`` (the same seed)
  within 1e-5 over 3 AdamW steps: loss, every gathered gradient, the parameters after.
- A random op with no sharding rule (``torch.rand_like`` of a tensor the plan shards) is named in
  ``plan.fallbacks`` and runs replicated on a tp-shared stream (its model stays identical across
  tp and equals one device in exact mode); one exact mode cannot replay (``bernoulli`` of
  per-sample probabilities) is refused naming the node.
- Replay: recompute (plan.recompute "full" / "selective") draws the masks the forward drew: the
  gradients equal those without recompute; a checkpoint's ``rng_state()`` continues the draws.

Launches: one per world size (2, 4, 8); each rank traces each model once and lowers it per plan.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xirang
from examples.gpt import GPTConfig, build_gpt
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from tests.conftest import hf_gpt2
from xirang.codegen.ops import random_ops
from xirang.codegen.ops.random_ops import ExactReference, RngContext, check_replay, piece_of
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate, PlanShard
from xirang.lower import lower

SEED, USER_SEED = 2024, 1234
BATCH, SEQ, VOCAB_USED, STEPS, TOLERANCE = 8, 16, 500, 3, 1e-5
PLAN_SEQ = 4096  # plans are made here, on meta, so the ILP really shards the tiny models
P, AGREE, DEVIATIONS = 0.1, 0.9 ** 2 + 0.1 ** 2, 6


class NoisyMLP(nn.Module):
    """Noise drawn inside forward by ``torch.rand_like``, an op no sharding rule covers, of a tensor
    the plan shards (wide enough that the ILP splits the MLP at tp 2)."""

    WIDTH = 1024

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(self.WIDTH, 4 * self.WIDTH), nn.Linear(4 * self.WIDTH, self.WIDTH)
        self.head = nn.Linear(self.WIDTH, 10)

    def forward(self, x, y):
        h = F.gelu(self.up(x))
        h = h * (1 + 0.5 * torch.rand_like(h))
        return F.cross_entropy(self.head(self.down(h)).flatten(0, 1), y.flatten())


class CoinFlips(NoisyMLP):
    """``torch.bernoulli`` of per-sample probabilities: exact mode cannot cut it by batch."""

    def forward(self, x, y):
        h = self.up(x)
        h = h * torch.bernoulli(torch.sigmoid(h.detach()))
        return F.cross_entropy(self.head(self.down(h)).flatten(0, 1), y.flatten())


def build(name: str, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt2":
            return hf_gpt2(device=device)  # Hugging Face's defaults: every dropout 0.1
        if name == "gpt":
            return build_gpt(GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2, dropout=P),
                             device=device)
        if name == "gpt_eager":  # attention written out: a plain dropout on the probabilities
            return build_gpt(GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2, dropout=P,
                                       attention="eager"), device=device)
        return {"noisy": NoisyMLP, "coins": CoinFlips}[name]()


def batch(step: int, size: int = BATCH, seq: int = SEQ, name: str = "gpt") -> dict:
    generator = torch.Generator().manual_seed(step)
    if name in ("noisy", "coins"):
        return {"x": torch.randn(size, seq, NoisyMLP.WIDTH, generator=generator),
                "y": torch.randint(0, 10, (size, seq), generator=generator)}
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, seq), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, seq), generator=generator)}


def batches(name: str):
    return lambda step: batch(step, name=name)


def make_plan(name: str, dp: int, tp: int, pp: int, *, micro_batch: int = 1, schedule: str = "1f1b", **pins):
    meta_batch = {k: v.to("meta") for k, v in batch(0, 2, name=name).items()}
    plan = xirang.plan(build(name, "meta"), world=dp * tp * pp, example_kwargs=meta_batch, global_batch=BATCH,
                       seq=PLAN_SEQ, hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp,
                       micro_batch=micro_batch, schedule=schedule, **pins)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp)
    if tp > 1:
        sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp,
                                                                                              PlanShard)]
        assert sharded, f"{name}: the plan shards no parameter, so tp would be vacuous"
    return plan


def rank_of(plan, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
    return plan.mesh.rank_of(dp=dp, pp=pp, tp=tp)


# --- what each launched rank runs ----------------------------------------------------------------

def _replicated(compiled) -> dict:
    return {fqn: p.detach().clone() for fqn, p in compiled.named_parameters()
            if isinstance(compiled.program.shards[fqn].placement, PlanReplicate)}


def _streams_job(compiled, name: str) -> dict:
    """3 AdamW steps with the default streams; the parameters the plan replicates over tp."""
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    losses = []
    for step in range(STEPS):
        losses.append(compiled.train_step(**batch(step, name=name)).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "replicated": _replicated(compiled), "seed": compiled.rng_state()["seed"],
            "sharded": sorted(f for f, s in compiled.program.shards.items() if isinstance(s.placement, PlanShard))}


def _rank_main(rank, world, jobs):
    results, traced = {}, {}
    for label, name, plan, mode, how in jobs:
        if how != "compile" and name not in traced:
            traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2, name=name)).graph_module
        model = build(name)
        torch.manual_seed(USER_SEED + rank)  # the user's per-rank seed: must not matter
        seed = SEED if mode == "exact" else None  # streams: rank 0's torch.initial_seed(), given to all
        if how == "compile":
            compiled = xirang.compile(model, world=world, example_kwargs=batch(0, 2, name=name), plan=plan,
                                      hardware="a100-80g", runtime=xirang.RuntimeOptions(seed=seed, rng=mode))
        else:
            program = lower(traced[name], plan, rank=rank).program
            compiled = CompiledModel(model, plan, program, groups=build_mesh_groups(plan.mesh), seed=seed, rng=mode)
        if mode == "exact":
            results[label] = compiled_run(compiled, batches(name), STEPS)
        else:
            results[label] = _streams_job(compiled, name)
        results[label]["sites"] = compiled.program.random_sites
    return results


def _check_replicated_equal(label: str, plan, results: list) -> None:
    """Every tp rank holds the same bits of every parameter the plan replicates over tp."""
    compared = 0
    for rank, result in enumerate(results):
        got = result[label]
        assert got["seed"] == USER_SEED, (label, rank, got["seed"])  # rank 0's seed, on every rank
        coords = plan.mesh.coords(rank)
        if coords["tp"] == 0:
            continue
        first = results[rank_of(plan, coords["dp"], 0, coords["pp"])][label]
        assert got["replicated"].keys() == first["replicated"].keys()
        for fqn, value in got["replicated"].items():
            assert torch.equal(value, first["replicated"][fqn]), (label, rank, fqn,
                                                                  (value - first["replicated"][fqn]).abs().max())
            compared += 1
    streams = {site.stream for result in results for site in result[label]["sites"]}
    assert compared and any(result[label]["sharded"] for result in results), label
    print(f"{label}: {compared} replicated tensors bit-identical across tp; streams {sorted(streams)}; "
          f"losses {[round(x, 4) for x in results[0][label]['losses']]}")


def _compare_exact(label: str, name: str, results: list) -> dict:
    """Every rank's run in exact mode against the eager model under ExactReference."""
    reference = ExactReference(SEED)
    want = single_device_run(build(name), batches(name), STEPS, keep_duplicates=True, rng=reference)
    check_replay(reference.seen, [site for result in results for site in result[label]["sites"]])
    worst = worst_differences(label, results, want)
    print(f"{label}: {len(reference.seen)} random ops replayed; max |diff| loss {worst['loss']:.1e} "
          f"grad {worst['grad']:.1e} param {worst['param']:.1e}")
    assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
    return worst


def job(label, name, dp, tp, pp, mode, *, how="pieces", micro_batch=1, schedule="1f1b"):
    return label, name, make_plan(name, dp, tp, pp, micro_batch=micro_batch, schedule=schedule), mode, how


def _launch_and_check(jobs: list, world: int, timeout_s: float) -> list:
    """Run ``jobs`` in one launch of ``world`` ranks; streams jobs keep tp replicas equal, exact jobs
    equal the one-device reference."""
    results = launch(_rank_main, world, (jobs,), timeout_s=timeout_s)
    for label, name, plan, mode, _ in jobs:
        if mode == "streams":
            _check_replicated_equal(label, plan, results)
        else:
            _compare_exact(label, name, results)
    return results


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_world_2_streams_keep_tp_replicas_equal_and_a_rule_less_random_op_runs_replicated():
    jobs = [job("gpt2 (1,2,1) streams", "gpt2", 1, 2, 1, "streams", how="compile", micro_batch=2),
            job("noisy (1,2,1) streams", "noisy", 1, 2, 1, "streams", micro_batch=4),
            job("noisy (1,2,1) exact", "noisy", 1, 2, 1, "exact", micro_batch=4)]
    noisy = jobs[1][2]
    rand_like = [n for n in noisy.fallbacks if n.startswith("rand_like")]
    assert rand_like, f"rand_like is not among the plan's fallbacks {noisy.fallbacks}"
    assert any(isinstance(noisy.placements[n].outputs[0].tp, PlanShard) for n in ("linear", "gelu")), \
        "the noisy model's first layer is not sharded: the rule-less op would not meet a sharded tensor"
    results = _launch_and_check(jobs, 2, timeout_s=600)
    (site,) = [s for s in results[1]["noisy (1,2,1) streams"]["sites"] if s.node in rand_like]
    assert site.stream == "tp-shared" and site.kind == "shaped", site


@pytest.mark.matrix
def test_world_4_exact_mode_equals_one_device():
    jobs = [job("gpt2 (2,2,1) exact", "gpt2", 2, 2, 1, "exact", micro_batch=2),
            job("gpt (2,2,1) exact", "gpt", 2, 2, 1, "exact", micro_batch=2)]
    _launch_and_check(jobs, 4, timeout_s=600)


@pytest.mark.matrix
def test_world_8_streams_and_exact_mode():
    jobs = [job("gpt2 (2,2,2) streams", "gpt2", 2, 2, 2, "streams"),
            job("gpt2 (1,2,4) exact", "gpt2", 1, 2, 4, "exact"),
            job("gpt (1,2,4) exact", "gpt", 1, 2, 4, "exact", schedule="gpipe"),
            job("gpt2 (2,2,2) exact", "gpt2", 2, 2, 2, "exact"),
            job("gpt (2,2,2) exact", "gpt", 2, 2, 2, "exact")]
    _launch_and_check(jobs, 8, timeout_s=900)


# --- single process: the streams themselves --------------------------------------------------------

def _sites(name: str, plan, seq: int) -> dict:
    """rank -> its program's random sites, lowered from a trace on meta at ``seq``."""
    meta = {k: v.to("meta") for k, v in batch(0, 2, seq, name=name).items()}
    gm = xirang.analyze(build(name, "meta"), example_kwargs=meta).graph_module
    return {rank: lower(gm, plan, rank=rank).program.random_sites for rank in range(plan.mesh.size)}


def _context(plan, dp: int, step: int = 0, micro_batch: int = 0, seed: int = SEED) -> RngContext:
    rng = RngContext(seed, "streams", dp_rank=dp, micro_batches=plan.num_micro_batches,
                     micro_batch_size=plan.micro_batch)
    rng.step, rng.micro_batch = step, micro_batch
    return rng


def _keep(site, rng) -> torch.Tensor:
    """The keep-mask ``site`` draws on ``rng``'s stream, at the rank's local shape."""
    shape = piece_of(torch.empty(site.shape, device="meta"), rng, site).shape
    if site.kind == "dropout":
        return random_ops.dropout(rng, site, torch.ones(shape), P, True) != 0
    # attention: q = k = 0 make every score equal, v = I reads the kept probabilities back out
    batch_, heads, queries, keys = shape
    q, k = torch.zeros(batch_, heads, queries, keys), torch.zeros(batch_, heads, keys, keys)
    v = torch.eye(keys).expand(batch_, heads, keys, keys)
    return random_ops.attention(rng, site, q, k, v, None, P, False) != 0


def _agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(rate at which two masks agree, its standard deviation were they independent)."""
    assert a.shape == b.shape and a.numel() > 1000
    return (a == b).float().mean().item(), (AGREE * (1 - AGREE) / a.numel()) ** 0.5


def _independent(what: str, a, b) -> float:
    rate, sd = _agreement(a, b)
    print(f"{what}: agreement {rate:.4f} (independent: {AGREE:.2f} +- {sd:.4f}, n = {a.numel()})")
    assert abs(rate - AGREE) <= DEVIATIONS * sd, (what, rate, sd)
    return rate


def test_dropout_streams_shared_where_tp_replicates_independent_where_it_shards():
    plan = make_plan("gpt_eager", 2, 2, 1, micro_batch=2)  # dp 2 x 2 micro-batches of 2
    sites = _sites("gpt_eager", plan, 64)
    r00, r01, r10 = rank_of(plan, 0, 0), rank_of(plan, 0, 1), rank_of(plan, 1, 0)
    sharded = [i for i, s in enumerate(sites[r00]) if s.stream == "tp-rank" and s.kind == "dropout"]
    shared = [i for i, s in enumerate(sites[r00]) if s.stream == "tp-shared" and s.kind == "dropout"]
    assert sharded and shared, [(s.node, s.stream) for s in sites[r00]]
    i = sharded[0]
    site0, site1 = sites[r00][i], sites[r01][i]
    assert site0.shard[:2] == site1.shard[:2] and (site0.shard[2], site1.shard[2]) == (0, 1)
    mask = _keep(site0, _context(plan, 0))
    rate, sd = mask.float().mean().item(), (0.9 * 0.1 / mask.numel()) ** 0.5
    assert abs(rate - 0.9) <= DEVIATIONS * sd, rate
    _independent("tp-sharded dropout, tp rank 0 vs 1", mask, _keep(site1, _context(plan, 0)))
    _independent("same op, dp rank 0 vs 1", mask, _keep(sites[r10][i], _context(plan, 1)))
    _independent("same op, micro-batch 0 vs 1", mask, _keep(site0, _context(plan, 0, micro_batch=1)))
    _independent("same op, step 0 vs 1", mask, _keep(site0, _context(plan, 0, step=1)))
    j = shared[0]
    replicated = _keep(sites[r00][j], _context(plan, 0))
    assert torch.equal(replicated, _keep(sites[r01][j], _context(plan, 0))), "tp-shared masks differ across tp"
    _independent("tp-shared dropout, dp rank 0 vs 1", replicated, _keep(sites[r10][j], _context(plan, 1)))
    torch.manual_seed(1)
    again = _keep(site0, _context(plan, 0))
    torch.manual_seed(2)
    assert torch.equal(again, _keep(site0, _context(plan, 0))) and torch.equal(again, mask), \
        "the user's torch seed changed a draw"


def test_attention_dropout_of_gpt2_draws_per_tp_rank_and_the_rest_shared():
    plan = make_plan("gpt2", 1, 2, 1, micro_batch=2)
    sites = _sites("gpt2", plan, 64)
    kinds = {(s.kind, s.stream) for s in sites[0]}
    assert kinds == {("dropout", "tp-shared"), ("attention", "tp-rank")}, kinds
    (i, *_) = [i for i, s in enumerate(sites[0]) if s.kind == "attention"]
    assert sites[0][i].shard == (1, 1, 0, 2) and sites[1][i].shard == (1, 1, 1, 2)  # split by heads
    mask = _keep(sites[0][i], _context(plan, 0))
    _independent("sdpa dropout, tp rank 0 vs 1", mask, _keep(sites[1][i], _context(plan, 0)))
    _independent("sdpa dropout, micro-batch 0 vs 1", mask, _keep(sites[0][i], _context(plan, 0, micro_batch=1)))
    assert torch.equal(mask, _keep(sites[0][i], _context(plan, 0)))  # a re-run draws the same


def _world_1(name: str, *, rng: str = "streams", **pins):
    plan = xirang.plan(build(name), world=1, example_kwargs=batch(0, 2, name=name), global_batch=BATCH,
                       precision="fp32", micro_batch=2, **pins)
    return xirang.compile(build(name), world=1, example_kwargs=batch(0, 2, name=name), plan=plan,
                          runtime=xirang.RuntimeOptions(seed=SEED, rng=rng))


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_recompute_draws_the_masks_the_forward_drew():
    """Full and selective recompute re-run forwards holding dropout and attention dropout in the
    backward: the gradients equal those of the plan without recompute."""
    runs = {mode: compiled_run(_world_1("gpt2", recompute=mode), batches("gpt2"), 2)
            for mode in ("none", "full", "selective")}
    for mode in ("full", "selective"):
        for (loss, grads), (want_loss, want) in zip(runs[mode]["steps"], runs["none"]["steps"]):
            worst = max((grads[k] - g).abs().max().item() for k, g in want.items())
            print(f"recompute {mode}: loss {loss:.6f} vs {want_loss:.6f}, max |grad diff| {worst:.1e}")
            assert loss == want_loss and worst <= 1e-6, (mode, worst)


def test_rng_state_continues_the_draws():
    """Draws are counter-based: (seed, step) is all a checkpoint needs to continue them."""
    first = _world_1("gpt")
    losses = [first.train_step(**batch(step)).item() for step in range(2)]  # no optimizer: masks change it
    assert losses[0] != first.train_step(**batch(0)).item()  # step 2 draws anew on the same batch
    resumed = _world_1("gpt")
    resumed.load_rng_state({"seed": SEED, "step": 1, "mode": "streams"})
    assert resumed.train_step(**batch(1)).item() == losses[1]
    assert resumed.rng_state() == {"seed": SEED, "step": 2, "mode": "streams"}


def test_exact_mode_refuses_a_draw_it_cannot_cut_and_names_it():
    assert _world_1("coins").train_step(**batch(0, name="coins")).isfinite()  # streams: fine
    with pytest.raises(XirangError, match=r"cannot replay 1 random op\(s\).*bernoulli.*aten.bernoulli.default"):
        _world_1("coins", rng="exact")
    with pytest.raises(XirangError, match="unknown rng mode 'exactly'"):
        _world_1("coins", rng="exactly")


def test_verify_passes_on_a_model_with_dropout():
    """``xirang verify`` compiles in exact mode and draws the reference under ExactReference (run in this
    process, which starts the ranks as the command does: what is checked is verify, not an interpreter)."""
    from tests.bad_input.probe import cli
    code, out, err = cli("verify", "examples/catalog.py:gpt_tiny_dropout", "--world", "2", "--tp", "2")
    assert code == 0, out + err[-3000:]
    assert "random ops: 7 drawn as one device draws them" in out, out
    assert "verify: PASS" in out
